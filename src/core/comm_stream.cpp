// src/core/comm_stream.cpp - see comm_stream.h.
#include "comm_stream.h"

#include "../base/error.h"
#include "../base/spin.h"

namespace fsdp::core {
namespace {

// How long a waiter spins before it sleeps: about a futex wake-up's latency.
constexpr std::chrono::microseconds kSpinFor{20};

}  // namespace

void Event::wait() {
  base::spin_until([this] { return done(); }, kSpinFor);
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return done_.load(std::memory_order_relaxed); });
  if (status_ != FSDP_OK) fail(status_, message_);
}

void Event::complete(fsdp_status_t status, std::string message) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = status;
    message_ = std::move(message);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

CommStream::CommStream(Observer observer, Abort abort)
    : observer_(std::move(observer)), abort_(std::move(abort)), worker_([this] { loop(); }) {}

CommStream::~CommStream() {
  bool pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    pending = busy_ || !queue_.empty();
  }
  if (pending && abort_) abort_("a rank destroyed its context while collectives were queued or running");
  cv_.notify_all();
  worker_.join();
}

EventPtr CommStream::submit(std::string name, Task task) {
  auto ev = std::make_shared<Event>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back({std::move(name), std::move(task), ev});
  }
  cv_.notify_all();
  return ev;
}

void CommStream::loop() {
  for (;;) {
    Item item;
    bool stopping;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and nothing left
      item = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      stopping = stop_;
    }
    fsdp_status_t status = FSDP_OK;
    std::string message;
    if (stopping) {
      status = FSDP_ERR_INVALID_STATE;
      message = item.name + ": not run, the context is being destroyed";
    } else {
      try {
        if (observer_) observer_(item.name, true);
        item.task();
      } catch (const Error& e) {
        status = e.status();
        message = e.what();
      } catch (const std::bad_alloc&) {
        status = FSDP_ERR_OUT_OF_MEMORY;
        message = item.name + ": out of memory";
      } catch (const std::exception& e) {
        status = FSDP_ERR_INTERNAL;
        message = item.name + ": " + e.what();
      }
      if (observer_) observer_(item.name, false);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
    }
    item.event->complete(status, std::move(message));
  }
}

template <typename Fn>
void SyncComm::run(const std::string& label, const Fn& fn) {
  if (alone_) {
    fn();
  } else {
    stream_.run(label, fn);
  }
}

void SyncComm::all_gather(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) {
  run(label, [&] { inner_.all_gather(send, recv, nbytes_per_rank, label); });
}
void SyncComm::reduce_scatter(const void* send, void* recv, size_t numel_per_rank, DType dtype, comm::RedOp op,
                              const std::string& label) {
  run(label, [&] { inner_.reduce_scatter(send, recv, numel_per_rank, dtype, op, label); });
}
void SyncComm::reduce_scatter_clear(void* send, void* recv, size_t numel_per_rank, DType dtype, comm::RedOp op,
                                    const std::string& label) {
  run(label, [&] { inner_.reduce_scatter_clear(send, recv, numel_per_rank, dtype, op, label); });
}
void SyncComm::all_reduce(const void* send, void* recv, size_t numel, DType dtype, comm::RedOp op,
                          const std::string& label) {
  run(label, [&] { inner_.all_reduce(send, recv, numel, dtype, op, label); });
}
void SyncComm::all_reduce_f64(double* values, size_t n, comm::RedOp op, const std::string& label) {
  run(label, [&] { inner_.all_reduce_f64(values, n, op, label); });
}
void SyncComm::broadcast(void* buf, size_t nbytes, int root, const std::string& label) {
  run(label, [&] { inner_.broadcast(buf, nbytes, root, label); });
}
void SyncComm::barrier(const std::string& label) {
  run(label, [&] { inner_.barrier(label); });
}
std::unique_ptr<comm::Communicator> SyncComm::split(int color, int key, const std::string& label) {
  std::unique_ptr<comm::Communicator> out;
  run(label, [&] { out = inner_.split(color, key, label); });
  return out;
}

}  // namespace fsdp::core
