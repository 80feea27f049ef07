// src/core/slots.cpp - see slots.h.
#include "slots.h"

namespace fsdp::core {

Buffer SlotPool::acquire(size_t numel, device::Stream& s, bool zeroed) {
  auto it = free_.find(numel);
  if (it == free_.end() || it->second.empty()) {
    ++made_;
    return Buffer(dev_, mem_, cat_, dtype_, numel, zeroed);
  }
  // The oldest free slot: its last user is the likeliest to be done.
  Free f = std::move(it->second.front());
  it->second.erase(it->second.begin());
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
