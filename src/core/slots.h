// src/core/slots.h - SlotPool: the fixed buffers that hold units' full params
// (gather slots) and full grads (grad slots). A slot is made the first time a
// unit of its size needs one and no free slot of that size is left, and is
// kept for the context's life; handed back, it carries the event after which
// its last user (a stream) is done with it, and the next taker makes its own
// stream wait for that event instead of the host waiting or allocating. So
// nothing is allocated per step once every size has been used, and the memory
// is the slots made: at most as many of a size as units of that size held
// params (grads) at once, which the scheduler bounds (docs/architecture.md,
// "Slots"). Used on the host thread only (the API's caller).
#pragma once

#include <cstddef>
#include <map>
#include <vector>

#include "../device/stream.h"
#include "memory.h"

namespace fsdp::core {

class SlotPool {
 public:
  // Slots of `dtype` on `dev`, counted under `cat` while taken and under
  // kFreeSlots while free. `overlap`: how many slots of one size may exist
  // before a taker waits for a free slot whose last user is not done yet,
  // rather than making one (the work that may overlap: limit_all_gathers + 1
  // gathers, two units' grads).
  SlotPool(device::Device* dev, MemoryTracker* mem, MemCategory cat, DType dtype, size_t overlap)
      : dev_(dev), mem_(mem), cat_(cat), dtype_(dtype), overlap_(overlap) {}
  SlotPool(const SlotPool&) = delete;
  SlotPool& operator=(const SlotPool&) = delete;

  // A slot of `numel` elements for work on `s`: a free one whose last user
  // is done; else, while fewer than `overlap` slots of that size exist, a new
  // one; else the free one freed first, after which `s` starts only once its
  // last user is done; a new one when none is free. With
  // `zeroed` it reads as zeros on `s`: a slot handed back as zero needs no
  // pass, another is zeroed on `s`.
  Buffer acquire(size_t numel, device::Stream& s, bool zeroed);
  // Hands `slot` back, free once `after` completes (null: now). `zero`: its
  // bytes are all zero by then (a failed `after` voids that).
  void release(Buffer slot, device::EventPtr after, bool zero);
  // Slots made so far (taken and free).
  size_t made() const { return made_; }

 private:
  struct Free {
    Buffer slot;
    device::EventPtr after;
    bool zero;
  };
  device::Device* dev_;
  MemoryTracker* mem_;
  MemCategory cat_;
  DType dtype_;
  size_t overlap_;
  std::map<size_t, std::vector<Free>> free_;  // by numel, the most recently freed last
  std::map<size_t, size_t> made_of_;          // by numel
  size_t made_ = 0;
};

}  // namespace fsdp::core
