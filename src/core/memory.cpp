// src/core/memory.cpp - byte accounting and RAII buffers (see memory.h).
#include "memory.h"

#include <algorithm>

#include "../device/device.h"

namespace fsdp::core {

void MemoryTracker::Counter::add(size_t n) {
  size_t now = current.fetch_add(n, std::memory_order_relaxed) + n;
  size_t seen = peak.load(std::memory_order_relaxed);
  while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
  }
}

void MemoryTracker::add(MemCategory c, device::Pool p, size_t nbytes) {
  category_[static_cast<size_t>(c)].add(nbytes);
  total_.add(nbytes);
  pool_[static_cast<size_t>(p)].add(nbytes);
}

void MemoryTracker::sub(MemCategory c, device::Pool p, size_t nbytes) {
  category_[static_cast<size_t>(c)].sub(nbytes);
  total_.sub(nbytes);
  pool_[static_cast<size_t>(p)].sub(nbytes);
}

MemoryTracker::Snapshot MemoryTracker::snapshot() const {
  Snapshot s;
  auto get = [](const std::atomic<size_t>& a) { return a.load(std::memory_order_relaxed); };
  for (size_t i = 0; i < kN; ++i) {
    s.current[i] = get(category_[i].current);
    s.peak[i] = get(category_[i].peak);
  }
  s.total = get(total_.current);
  s.total_peak = get(total_.peak);
  for (size_t k = 0; k < 2; ++k) {
    s.pool[k] = get(pool_[k].current);
    s.pool_peak[k] = get(pool_[k].peak);
  }
  return s;
}

void MemoryTracker::reset_peak() {
  for (Counter& c : category_) c.reset_peak();
  total_.reset_peak();
  for (Counter& c : pool_) c.reset_peak();
}

Buffer::Buffer(device::Device* dev, MemoryTracker* tracker, MemCategory cat, DType dtype, size_t numel, bool zeroed)
    : dev_(dev), tracker_(tracker), cat_(cat), dtype_(dtype), numel_(numel) {
  ptr_ = zeroed ? dev_->alloc_zeroed(nbytes()) : dev_->alloc(nbytes());  // throw Error(OUT_OF_MEMORY)
  if (tracker_ != nullptr) tracker_->add(cat_, dev_->pool(), nbytes());
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    reset();
    dev_ = o.dev_;
    tracker_ = o.tracker_;
    cat_ = o.cat_;
    dtype_ = o.dtype_;
    numel_ = o.numel_;
    ptr_ = o.ptr_;
    o.ptr_ = nullptr;
    o.numel_ = 0;
  }
  return *this;
}

void Buffer::reset() { release(false); }

void Buffer::recount(MemCategory cat) {
  if (ptr_ != nullptr && tracker_ != nullptr && cat != cat_) {
    tracker_->add(cat, dev_->pool(), nbytes());
    tracker_->sub(cat_, dev_->pool(), nbytes());
  }
  cat_ = cat;
}
void Buffer::reset_zeroed() { release(true); }

void Buffer::release(bool zero) {
  if (ptr_ == nullptr) return;
  if (tracker_ != nullptr) tracker_->sub(cat_, dev_->pool(), nbytes());
  if (zero) {
    dev_->free_zeroed(ptr_);
  } else {
    dev_->free(ptr_);
  }
  ptr_ = nullptr;
  numel_ = 0;
}

}  // namespace fsdp::core
