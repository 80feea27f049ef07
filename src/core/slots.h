// src/core/slots.h - SlotPool: the fixed buffers that hold units' full params
// (gather slots) and full grads (grad slots). A slot is kept for the
// context's life; handed back, it carries the event after which its last user
// (a stream) is done with it, and the next taker makes its own stream wait for
// that event instead of the host waiting or allocating. Which slot is taken,
// and when one is made, depends only on the order of the host's calls, never
// on timing: so the slots made are the same on every run, nothing is
// allocated after the second step (the first that runs the recorded
// schedule), and the memory is bounded by the schedule (docs/architecture.md,
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
  // kFreeSlots while free. `grow_to`: how many slots of one size may be made
  // rather than reuse the slot handed back last (1 for gathers; 2 for grads,
  // so that the host writes one unit's grads while the previous unit's are
  // reduced, rather than wait for that reduction).
  SlotPool(device::Device* dev, MemoryTracker* mem, MemCategory cat, DType dtype, size_t grow_to)
      : dev_(dev), mem_(mem), cat_(cat), dtype_(dtype), grow_to_(grow_to) {}
  SlotPool(const SlotPool&) = delete;
  SlotPool& operator=(const SlotPool&) = delete;

  // A slot of `numel` elements for work on `s`: a new one when none of that
  // size is free, or when the only free one is the slot handed back last and
  // fewer than `grow_to` of that size exist; else the free one freed first,
  // and `s` starts only once its last user is done. With
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
  size_t grow_to_;
  std::map<size_t, std::vector<Free>> free_;  // by numel, the most recently freed last
  std::map<size_t, size_t> made_of_;          // by numel
  size_t made_ = 0;
  const void* last_released_ = nullptr;  // compared, never dereferenced
};

}  // namespace fsdp::core
