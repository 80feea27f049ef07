// src/core/slots.cpp - see slots.h.
#include "slots.h"

namespace fsdp::core {

Buffer SlotPool::acquire(size_t numel, device::Stream& s, bool zeroed) {
  std::vector<Free>& free = free_[numel];
  // The slot handed back last is the one whose last user is the least likely
  // to be done (e.g. the previous unit's grads, under reduction): while the
  // size may still grow, make a slot rather than wait for it.
  bool only_the_last = free.size() == 1 && free.front().slot.data() == last_released_;
  if (free.empty() || (only_the_last && made_of_[numel] < grow_to_)) {
    ++made_;
    ++made_of_[numel];
    return Buffer(dev_, mem_, cat_, dtype_, numel, zeroed);
  }
  auto pick = free.begin();  // freed first: its last user is the likeliest to be done
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
      static const device::Label kZero = device::make_label("zero a grad slot");
      s.submit(kZero, [dev, p, n] { dev->zero(p, n); });
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
  last_released_ = slot.data();
  size_t n = slot.numel();
  free_[n].push_back({std::move(slot), std::move(after), zero});
}

}  // namespace fsdp::core
