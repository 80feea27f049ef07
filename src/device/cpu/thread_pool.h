// src/device/cpu/thread_pool.h - a fixed set of worker threads that split a
// range of elements into contiguous chunks, one per thread (the caller runs the
// first). Kernels on the CPU device are loops over such chunks.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <thread>
#include <vector>

#include "../../base/function_ref.h"

namespace fsdp::device {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }
  // Calls fn(begin, end) on disjoint chunks covering [0, n); chunk bounds are
  // multiples of `grain` so vector loops stay aligned. Returns when all are done.
  void parallel_for(size_t n, size_t grain, base::FunctionRef<void(size_t, size_t)> fn);
  // The chunk length parallel_for uses for (n, grain): chunk k starts at k * chunk.
  size_t chunk_size(size_t n, size_t grain) const;

 private:
  void worker_loop(int index);

  std::vector<std::thread> workers_;
  std::mutex job_mu_;  // one parallel_for at a time: the caller and the comm stream share the pool
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  const base::FunctionRef<void(size_t, size_t)>* fn_ = nullptr;
  size_t n_ = 0;
  size_t chunk_ = 0;
  unsigned long generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

}  // namespace fsdp::device
