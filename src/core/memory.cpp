// src/core/memory.cpp - byte accounting and RAII buffers (see memory.h).
#include "memory.h"

#include <algorithm>

#include "../device/device.h"

namespace fsdp::core {

void MemoryTracker::add(MemCategory c, device::Pool p, size_t nbytes) {
  std::lock_guard<std::mutex> lock(mu_);
  size_t i = static_cast<size_t>(c);
  size_t k = static_cast<size_t>(p);
  s_.current[i] += nbytes;
  s_.peak[i] = std::max(s_.peak[i], s_.current[i]);
  s_.total += nbytes;
  s_.total_peak = std::max(s_.total_peak, s_.total);
  s_.pool[k] += nbytes;
  s_.pool_peak[k] = std::max(s_.pool_peak[k], s_.pool[k]);
}

void MemoryTracker::sub(MemCategory c, device::Pool p, size_t nbytes) {
  std::lock_guard<std::mutex> lock(mu_);
  s_.current[static_cast<size_t>(c)] -= nbytes;
  s_.total -= nbytes;
  s_.pool[static_cast<size_t>(p)] -= nbytes;
}

MemoryTracker::Snapshot MemoryTracker::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return s_;
}

void MemoryTracker::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  s_.peak = s_.current;
  s_.total_peak = s_.total;
  s_.pool_peak = s_.pool;
}

Buffer::Buffer(device::Device* dev, MemoryTracker* tracker, MemCategory cat, DType dtype, size_t numel, bool zeroed)
    : dev_(dev), tracker_(tracker), cat_(cat), dtype_(dtype), numel_(numel) {
  ptr_ = dev_->alloc(nbytes());  // throws Error(OUT_OF_MEMORY)
  if (zeroed) dev_->zero(ptr_, nbytes());
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

void Buffer::reset() {
  if (ptr_ == nullptr) return;
  if (tracker_ != nullptr) tracker_->sub(cat_, dev_->pool(), nbytes());
  dev_->free(ptr_);
  ptr_ = nullptr;
  numel_ = 0;
}

}  // namespace fsdp::core
