// src/core/async_save.h - AsyncSave: what fsdp_save_async keeps between
// calls: the host copy of the rank's state that the background save writes
// from (pinned on a GPU, kept and reused by the next save), the thread that
// writes it, the communicator that thread agrees on the commit over (split
// from the world, so that it never interleaves with training's collectives),
// and the outcome until a call reports it. Private to src/core.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "../base/error.h"
#include "../base/log.h"
#include "../comm/communicator.h"
#include "../device/device.h"
#include "memory.h"

namespace fsdp::core {

struct AsyncSave {
  AsyncSave(device::HostMemory host, MemoryTracker* counted_in, int of_rank)
      : mem(host), tracker(counted_in), rank(of_rank) {}
  ~AsyncSave() {
    join();
    if (!outcome.ok()) {
      base::log(
          FSDP_LOG_WARN, rank,
          "the context was destroyed before fsdp_save_wait reported that " + what + " failed: " + outcome.message);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
    release();
  }
  AsyncSave(const AsyncSave&) = delete;
  AsyncSave& operator=(const AsyncSave&) = delete;

  // Runs `job` on the worker thread (started at the first job and kept: a
  // save's call does not pay for a thread's start). One job at a time: the
  // caller joins the previous one first.
  void start(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = std::move(job);
      busy_ = true;
    }
    if (!worker_.joinable()) worker_ = std::thread([this] { work(); });
    cv_.notify_all();
  }
  // Waits for the job (what it wrote, `outcome`, is then visible here).
  void join() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !busy_; });
  }
  // Waits for the job and hands over its outcome (reported once: reset here).
  Outcome take_outcome() {
    join();
    return std::exchange(outcome, Outcome{});
  }
  // At least `nbytes` of host memory for the copy (contents not kept when it grows).
  char* copy_buffer(size_t nbytes) {
    if (nbytes > cap) {
      release();
      buf = static_cast<char*>(mem.alloc(nbytes));
      if (buf == nullptr) {
        fail(FSDP_ERR_OUT_OF_MEMORY, "fsdp_save_async: could not allocate " + std::to_string(nbytes) +
                                         " bytes of host memory for the copy of the state");
      }
      cap = nbytes;
      tracker->add(MemCategory::kScratch, device::Pool::kHost, cap);
    }
    return buf;
  }

  device::HostMemory mem;
  MemoryTracker* tracker;
  int rank;
  std::unique_ptr<comm::Communicator> comm;  // the background thread's
  std::string what;                          // "fsdp_save_async to DIR" of the last save
  Outcome outcome;                           // of the last save, once joined; reset when reported

 private:
  void work() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || job_; });
      if (!job_) return;  // stopped, nothing left
      std::function<void()> job = std::move(job_);
      job_ = nullptr;
      lock.unlock();
      job();
      lock.lock();
      busy_ = false;
      cv_.notify_all();
    }
  }
  void release() {
    if (buf == nullptr) return;
    mem.free(buf);
    tracker->sub(MemCategory::kScratch, device::Pool::kHost, cap);
    buf = nullptr;
    cap = 0;
  }
  char* buf = nullptr;
  size_t cap = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  std::function<void()> job_;
  bool busy_ = false, stop_ = false;
  std::thread worker_;
};

}  // namespace fsdp::core
