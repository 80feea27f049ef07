// src/device/cpu/block_cache.cpp - see block_cache.h.
#include "block_cache.h"

#include <algorithm>
#include <cstdlib>

namespace fsdp::device {
namespace {

constexpr size_t kAlign = 64;

size_t rounded(size_t nbytes) { return nbytes == 0 ? kAlign : (nbytes + kAlign - 1) / kAlign * kAlign; }

void* aligned(size_t nbytes) { return std::aligned_alloc(kAlign, nbytes); }

}  // namespace

HostMemory plain_host_memory() { return {aligned, std::free}; }

BlockCache::~BlockCache() {
  for (auto& kv : free_) system_.free(kv.second);
  for (auto& kv : zero_) system_.free(kv.second);
  // Blocks still in use belong to buffers that outlive the device: a bug the
  // owners' destructors would show; they are not freed here twice.
}

void* BlockCache::take_locked(std::multimap<size_t, void*>& from, size_t n) {
  auto it = from.find(n);
  if (it == from.end()) return nullptr;
  void* p = it->second;
  from.erase(it);
  cached_ -= n;
  return p;
}

void* BlockCache::alloc(size_t nbytes, bool want_zero, bool* is_zero) {
  size_t n = rounded(nbytes);
  if (is_zero != nullptr) *is_zero = false;
  if (!enabled_) return system_.alloc(n);
  std::lock_guard<std::mutex> lock(mu_);
  void* p = take_locked(want_zero ? zero_ : free_, n);
  if (p != nullptr) {
    if (is_zero != nullptr) *is_zero = want_zero;
  } else if ((p = take_locked(want_zero ? free_ : zero_, n)) != nullptr) {
    if (is_zero != nullptr) *is_zero = !want_zero;
  } else {
    // A new block: make room under the peak first, so that the footprint
    // grows only when the bytes in use do.
    trim_locked(std::max(peak_, used_ + n) - n);
    p = system_.alloc(n);
    if (p == nullptr && cached_ > 0) {
      trim_locked(used_);  // out of memory: give every cached block back and retry
      p = system_.alloc(n);
    }
    if (p == nullptr) return nullptr;
  }
  in_use_.emplace(p, n);
  used_ += n;
  peak_ = std::max(peak_, used_);
  return p;
}

void BlockCache::free(void* ptr) noexcept { release(ptr, false); }
void BlockCache::free_zeroed(void* ptr) noexcept { release(ptr, true); }

void BlockCache::release(void* ptr, bool zero) noexcept {
  if (ptr == nullptr) return;
  if (!enabled_) {
    system_.free(ptr);
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = in_use_.find(ptr);
  if (it == in_use_.end()) {
    system_.free(ptr);  // not ours (cannot happen through CpuDevice); the system's then
    return;
  }
  size_t n = it->second;
  in_use_.erase(it);
  used_ -= n;
  (zero ? zero_ : free_).emplace(n, ptr);
  cached_ += n;
}

void BlockCache::trim_locked(size_t limit) {
  for (auto* from : {&free_, &zero_}) {
    while (!from->empty() && cached_ + used_ > limit) {
      auto last = std::prev(from->end());  // the largest block
      cached_ -= last->first;
      system_.free(last->second);
      from->erase(last);
    }
  }
}

}  // namespace fsdp::device
