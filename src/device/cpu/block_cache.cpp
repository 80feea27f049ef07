// src/device/cpu/block_cache.cpp - see block_cache.h.
#include "block_cache.h"

#include <algorithm>
#include <cstdlib>

namespace fsdp::device {
namespace {

constexpr size_t kAlign = 64;

size_t rounded(size_t nbytes) { return nbytes == 0 ? kAlign : (nbytes + kAlign - 1) / kAlign * kAlign; }

}  // namespace

void* BlockCache::system_alloc(size_t nbytes) { return std::aligned_alloc(kAlign, nbytes); }

BlockCache::~BlockCache() {
  for (auto& kv : free_) std::free(kv.second);
  // Blocks still in use belong to buffers that outlive the device: a bug the
  // owners' destructors would show; they are not freed here twice.
}

void* BlockCache::alloc(size_t nbytes) {
  size_t n = rounded(nbytes);
  if (!enabled_) return system_alloc(n);
  std::lock_guard<std::mutex> lock(mu_);
  void* p = nullptr;
  auto it = free_.find(n);
  if (it != free_.end()) {
    p = it->second;
    free_.erase(it);
    cached_ -= n;
  } else {
    // A new block: make room under the peak first, so that the footprint
    // grows only when the bytes in use do.
    trim_locked(std::max(peak_, used_ + n) - n);
    p = system_alloc(n);
    if (p == nullptr && cached_ > 0) {
      trim_locked(used_);  // out of memory: give every cached block back and retry
      p = system_alloc(n);
    }
    if (p == nullptr) return nullptr;
  }
  in_use_.emplace(p, n);
  used_ += n;
  peak_ = std::max(peak_, used_);
  return p;
}

void BlockCache::free(void* ptr) noexcept {
  if (ptr == nullptr) return;
  if (!enabled_) {
    std::free(ptr);
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = in_use_.find(ptr);
  if (it == in_use_.end()) {
    std::free(ptr);  // not ours (cannot happen through CpuDevice); the system's then
    return;
  }
  size_t n = it->second;
  in_use_.erase(it);
  used_ -= n;
  free_.emplace(n, ptr);
  cached_ += n;
}

void BlockCache::trim_locked(size_t limit) {
  while (!free_.empty() && cached_ + used_ > limit) {
    auto last = std::prev(free_.end());  // the largest block
    cached_ -= last->first;
    std::free(last->second);
    free_.erase(last);
  }
}

size_t BlockCache::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cached_;
}

size_t BlockCache::in_use_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_;
}

}  // namespace fsdp::device
