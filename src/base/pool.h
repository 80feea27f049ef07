// src/base/pool.h - PoolAllocator: an allocator whose single-object blocks go
// back to a free list of their size when released and are handed out again,
// so that objects made and dropped at a steady rate (a stream's events, made
// per submit through std::allocate_shared) cost no heap allocation once the
// most ever alive at once exist. Blocks are never returned to the heap; they
// number at most that peak. Thread-safe: an event is made on the host's
// thread and often dropped on a worker's.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <new>
#include <vector>

namespace fsdp::base {

// The free list of blocks of `Size` bytes (aligned for any scalar type).
template <size_t Size>
class BlockPool {
 public:
  static BlockPool& instance() {
    static BlockPool* pool = new BlockPool;  // never destroyed: blocks may be released during static destruction
    return *pool;
  }
  void* take() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        void* p = free_.back();
        free_.pop_back();
        return p;
      }
    }
    return ::operator new(Size);
  }
  void give(void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(p);  // grows only while the peak grows
  }

 private:
  // Made with room for more than the events a few contexts keep alive at
  // once (queued tasks, slots, units), so that the pool rarely grows after
  // the first steps; a backlog deeper than that grows it once more.
  static constexpr size_t kPrefill = 256;
  BlockPool() {
    free_.reserve(2 * kPrefill);
    for (size_t i = 0; i < kPrefill; ++i) free_.push_back(::operator new(Size));
  }
  std::mutex mu_;
  std::vector<void*> free_;
};

template <typename T>
struct PoolAllocator {
  using value_type = T;
  PoolAllocator() = default;
  template <typename U>
  PoolAllocator(const PoolAllocator<U>&) noexcept {}  // NOLINT(google-explicit-constructor): rebinding
  T* allocate(size_t n) {
    if (n != 1) return static_cast<T*>(::operator new(n * sizeof(T)));
    return static_cast<T*>(BlockPool<sizeof(T)>::instance().take());
  }
  void deallocate(T* p, size_t n) noexcept {
    if (n != 1) {
      ::operator delete(p);
      return;
    }
    BlockPool<sizeof(T)>::instance().give(p);
  }
  template <typename U>
  bool operator==(const PoolAllocator<U>&) const noexcept {
    return true;
  }
  template <typename U>
  bool operator!=(const PoolAllocator<U>&) const noexcept {
    return false;
  }
};

// std::make_shared, with the object and its count in one pooled block.
template <typename T, typename... Args>
std::shared_ptr<T> make_pooled(Args&&... args) {
  return std::allocate_shared<T>(PoolAllocator<T>(), std::forward<Args>(args)...);
}

}  // namespace fsdp::base
