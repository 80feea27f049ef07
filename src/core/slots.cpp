// src/core/slots.cpp - see slots.h.
#include "slots.h"

#include <algorithm>

namespace fsdp::core {

Buffer SlotPool::acquire(size_t numel, device::Stream& s, bool zeroed) {
  std::vector<Free>& free = free_[numel];
  auto pick = std::find_if(free.begin(), free.end(), [](const Free& f) { return !f.after || f.after->done(); });
  if (pick == free.end()) {
    if (free.empty() || made_of_[numel] < overlap_) {
      ++made_;
      ++made_of_[numel];
      return Buffer(dev_, mem_, cat_, dtype_, numel, zeroed);
    }
    pick = free.begin();  // freed first: its last user is the likeliest to be done
  }
  Free f = std::move(*pick);
  free.erase(pick);
  if (f.after && f.after->done()) {
    if (f.after->status() != FSDP_OK) f.zero = false;
  }
  f.slot.recount(cat_);
  if (f.after) s.wait(f.after);  // a failed `after` fails what `s` runs next (throws on a synchronous stream)
  if (zeroed && !f.zero) {
    if (s.synchronous()) {
      dev_->zero(f.slot.data(), f.slot.nbytes());
    } else {
      device::Device* dev = dev_;
      void* p = f.slot.data();
      size_t n = f.slot.nbytes();
      s.submit("zero a grad slot", [dev, p, n] { dev->zero(p, n); });
    }
  }
  return std::move(f.slot);
}

void SlotPool::release(Buffer slot, device::EventPtr after, bool zero) {
  if (slot.empty()) return;
  if (after && after->done()) {
    if (after->status() != FSDP_OK) zero = false;
    after.reset();
  }
  slot.recount(MemCategory::kFreeSlots);
  size_t n = slot.numel();
  free_[n].push_back({std::move(slot), std::move(after), zero});
}

}  // namespace fsdp::core
