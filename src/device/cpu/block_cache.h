// src/device/cpu/block_cache.h - BlockCache: keeps freed blocks of the CPU
// device for reuse, as a GPU caching allocator does. A fresh multi-megabyte
// allocation is an mmap whose every page faults on first touch (about 1.5 ms
// per 4 MB, against 0.2 ms to zero it), and the engine frees and allocates the
// same sizes every step (gathered params, full grads, scratch). Blocks are
// reused only at their exact size; the cache never holds more than keeps the
// device's footprint (in use + cached) at its peak in-use bytes plus its
// largest block, so it costs at most one block beyond the peak a run reaches
// anyway (and scratch blocks of different sizes do not evict each other).
#pragma once

#include <cstddef>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "../device.h"

namespace fsdp::device {

class BlockCache {
 public:
  // `enabled` false: every alloc and free goes to the system (sanitizer
  // builds, so that AddressSanitizer sees each use after free).
  // Blocks come from and go back to `system` (a GPU's pinned memory for the
  // host half of offload=cpu).
  BlockCache(bool enabled, HostMemory system);
  ~BlockCache();
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  // A 64-byte aligned block of at least `nbytes`; null when the system has no
  // memory left (after giving back every cached block). With `want_zero`, a
  // block released by free_zeroed is preferred, and *is_zero says whether the
  // block is known to be all zero.
  void* alloc(size_t nbytes, bool want_zero = false, bool* is_zero = nullptr);
  void free(void* ptr) noexcept;
  // Releases a block whose bytes the caller knows to be all zero (a grad
  // buffer a clearing reduce-scatter has read), so that alloc can hand it out
  // as zeroed without a pass over it.
  void free_zeroed(void* ptr) noexcept;

 private:
  // Frees cached blocks, largest first (those not known zero first), until
  // cached + in use <= limit.
  void trim_locked(size_t limit);
  void release(void* ptr, bool zero) noexcept;
  // Takes a cached block of exactly n bytes from `from`; null if none.
  void* take_locked(std::multimap<size_t, void*>& from, size_t n);

  const bool enabled_;
  const HostMemory system_;
  mutable std::mutex mu_;
  using Cached = std::multimap<size_t, void*>;
  using InUse = std::unordered_map<void*, size_t>;
  Cached free_;   // rounded size -> block
  Cached zero_;   // the same, for blocks known to be all zero
  InUse in_use_;  // block -> rounded size
  // The containers' nodes, kept when an entry leaves and reused by the next
  // entry (C++17 node handles): moving a block between the maps allocates
  // nothing once the cache holds its peak number of blocks (test_alloc).
  std::vector<Cached::node_type> spare_cached_;
  std::vector<InUse::node_type> spare_in_use_;
  size_t cached_ = 0;
  size_t used_ = 0;
  size_t peak_ = 0;
  size_t largest_ = 0;  // the largest block made
};

}  // namespace fsdp::device
