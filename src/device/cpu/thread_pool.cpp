// src/device/cpu/thread_pool.cpp - see thread_pool.h.
#include "thread_pool.h"

#include <algorithm>

namespace fsdp::device {

ThreadPool::ThreadPool(int n_threads) {
  for (int i = 1; i < n_threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

size_t ThreadPool::chunk_size(size_t n, size_t grain) const {
  size_t threads = static_cast<size_t>(size());
  size_t chunk = (n + threads - 1) / threads;
  return (chunk + grain - 1) / grain * grain;
}

void ThreadPool::parallel_for(size_t n, size_t grain, base::FunctionRef<void(size_t, size_t)> fn) {
  if (n == 0) return;
  std::lock_guard<std::mutex> job(job_mu_);
  size_t chunk = chunk_size(n, grain);
  if (workers_.empty() || chunk >= n) {
    fn(0, n);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    chunk_ = chunk;
    pending_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  work_cv_.notify_all();
  fn(0, std::min(chunk, n));
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [this] { return pending_ == 0; });
  fn_ = nullptr;
}

void ThreadPool::worker_loop(int index) {
  unsigned long seen = 0;
  for (;;) {
    const base::FunctionRef<void(size_t, size_t)>* fn;
    size_t begin, end;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      fn = fn_;
      begin = std::min(n_, chunk_ * static_cast<size_t>(index));
      end = std::min(n_, begin + chunk_);
    }
    if (begin < end) (*fn)(begin, end);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

}  // namespace fsdp::device
