// src/core/memory.h - MemoryTracker (bytes per category, current and peak) and
// Buffer, the RAII owner of every allocation the engine makes on a Device.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>

#include "../base/dtype.h"
#include "../device/device.h"

namespace fsdp::core {

enum class MemCategory {
  kShardedParams,
  kShardedGrads,
  kOptimizerState,
  kGatheredParams,
  kUnshardedGrads,
  kScratch,
  kSecondaryParams,  // secondary_shard: the slices of gathered params kept for backward's gather
  kFreeSlots,        // gather and grad slots between users (core/slots.h): in the total only
  kCount
};

class MemoryTracker {
 public:
  static constexpr size_t kN = static_cast<size_t>(MemCategory::kCount);
  struct Snapshot {
    std::array<size_t, kN> current{};
    std::array<size_t, kN> peak{};
    size_t total = 0;
    size_t total_peak = 0;
    std::array<size_t, 2> pool{};  // by device::Pool
    std::array<size_t, 2> pool_peak{};
  };

  // Lock-free: buffers come and go on the caller and on the comm stream's
  // worker, and a shared lock there would make each wait for the other.
  void add(MemCategory c, device::Pool p, size_t nbytes);
  void sub(MemCategory c, device::Pool p, size_t nbytes);
  // Each figure is exact; figures taken while buffers change on another
  // thread may be from slightly different moments.
  Snapshot snapshot() const;
  void reset_peak();

 private:
  struct Counter {
    std::atomic<size_t> current{0};
    std::atomic<size_t> peak{0};
    void add(size_t n);
    void sub(size_t n) { current.fetch_sub(n, std::memory_order_relaxed); }
    void reset_peak() { peak.store(current.load(std::memory_order_relaxed), std::memory_order_relaxed); }
  };
  std::array<Counter, kN> category_;
  Counter total_;
  std::array<Counter, 2> pool_;
};

// Owns `numel` elements of `dtype` on a device, counted under a category.
class Buffer {
 public:
  Buffer() = default;
  // Zero-filled unless `zeroed` is false (for buffers a collective overwrites).
  Buffer(device::Device* dev, MemoryTracker* tracker, MemCategory cat, DType dtype, size_t numel, bool zeroed = true);
  ~Buffer() { reset(); }
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void reset();
  // Counts the buffer under `cat` from now on.
  void recount(MemCategory cat);
  // Releases a buffer whose bytes the caller knows to be all zero: a later
  // zeroed Buffer of the same size may take it without a pass over it.
  void reset_zeroed();
  bool empty() const { return ptr_ == nullptr; }
  void* data() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t numel() const { return numel_; }
  MemCategory category() const { return cat_; }
  size_t nbytes() const { return numel_ * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }

 private:
  void release(bool zero);
  device::Device* dev_ = nullptr;
  MemoryTracker* tracker_ = nullptr;
  MemCategory cat_ = MemCategory::kScratch;
  DType dtype_ = DType::kFp32;
  size_t numel_ = 0;
  void* ptr_ = nullptr;
};

}  // namespace fsdp::core
