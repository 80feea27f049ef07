// src/core/comm_stream.h - CommStream: the context's comm stream. On the CPU it
// is a worker thread running collectives from a FIFO; the caller gets an Event
// per submission and waits only for the one it needs. Every collective of a
// context goes through it (synchronous ones too, via SyncComm), so all of them
// leave in program order, which is what keeps the ranks matched.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "../comm/communicator.h"
#include "fsdp.h"

namespace fsdp::core {

// Completion of one submission: done, or failed with a status and a message.
class Event {
 public:
  // Blocks until done; rethrows the task's error. Spins for a few
  // microseconds first (a task about to finish costs no sleep and wake-up),
  // then sleeps: a waiting rank takes no CPU from the others.
  void wait();
  bool done() const { return done_.load(std::memory_order_acquire); }
  void complete(fsdp_status_t status, std::string message);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> done_{false};
  fsdp_status_t status_ = FSDP_OK;
  std::string message_;
};
using EventPtr = std::shared_ptr<Event>;

class CommStream {
 public:
  // A task calls the communicators it needs (captured) on the worker thread.
  using Task = std::function<void()>;
  // Called on the worker when a task starts and ends (for the trace).
  using Observer = std::function<void(const std::string& name, bool begin)>;
  // Makes a running task fail at once (aborts the communicators it may wait on).
  using Abort = std::function<void(const std::string& reason)>;

  CommStream(Observer observer, Abort abort);
  // Never waits for other ranks: if work is queued or running, `abort` is
  // called so that the running collective fails at once.
  ~CommStream();
  CommStream(const CommStream&) = delete;
  CommStream& operator=(const CommStream&) = delete;

  EventPtr submit(std::string name, Task task);
  void run(std::string name, const Task& task) { submit(std::move(name), task)->wait(); }

 private:
  struct Item {
    std::string name;
    Task task;
    EventPtr event;
  };
  void loop();

  Observer observer_;
  Abort abort_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool busy_ = false;
  bool stop_ = false;
  std::thread worker_;
};

// A Communicator whose every call runs synchronously on the comm stream, so
// that it leaves in program order with the asynchronous ones. Alone (a world
// of one) nothing needs ordering against other ranks: calls run on the caller.
class SyncComm final : public comm::Communicator {
 public:
  SyncComm(CommStream& stream, comm::Communicator& inner)
      : stream_(stream), inner_(inner), alone_(inner.world_size() == 1) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  void all_gather(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) override;
  void reduce_scatter(const void* send, void* recv, size_t numel_per_rank, DType dtype, comm::RedOp op,
                      const std::string& label) override;
  void reduce_scatter_clear(void* send, void* recv, size_t numel_per_rank, DType dtype, comm::RedOp op,
                            const std::string& label) override;
  void all_reduce(const void* send, void* recv, size_t numel, DType dtype, comm::RedOp op,
                  const std::string& label) override;
  void all_reduce_f64(double* values, size_t n, comm::RedOp op, const std::string& label) override;
  void broadcast(void* buf, size_t nbytes, int root, const std::string& label) override;
  void barrier(const std::string& label) override;
  // The new communicator is the inner kind: use it on the stream or wrap it.
  std::unique_ptr<comm::Communicator> split(int color, int key, const std::string& label) override;
  int local_world_size() const override { return inner_.local_world_size(); }
  fsdp_status_t failure() const override { return inner_.failure(); }
  void abort(const std::string& reason) override { inner_.abort(reason); }

 private:
  template <typename Fn>
  void run(const std::string& label, const Fn& fn);

  CommStream& stream_;
  comm::Communicator& inner_;
  bool alone_;
};

}  // namespace fsdp::core
