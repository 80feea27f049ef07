// src/core/comm_stream.h - CommStream: the context's comm stream. On the CPU it
// is a worker thread running collectives from a FIFO; the caller gets an Event
// per submission and waits only for the one it needs. Every collective of a
// context goes through it (synchronous ones too, via SyncComm), so all of them
// leave in program order, which is what keeps the ranks matched.
#pragma once

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
  // Blocks until done; rethrows the task's error.
  void wait();
  bool done() const;
  void complete(fsdp_status_t status, std::string message);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  fsdp_status_t status_ = FSDP_OK;
  std::string message_;
};
using EventPtr = std::shared_ptr<Event>;

class CommStream {
 public:
  using Task = std::function<void(comm::Communicator&)>;
  // Called on the worker when a task starts and ends (for the trace).
  using Observer = std::function<void(const std::string& name, bool begin)>;

  CommStream(comm::Communicator& comm, Observer observer);
  // Never waits for other ranks: if work is queued or running, the
  // communicator is aborted so the running collective fails at once.
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

  comm::Communicator& comm_;
  Observer observer_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool busy_ = false;
  bool stop_ = false;
  std::thread worker_;
};

// A Communicator whose every call runs synchronously on the comm stream.
class SyncComm final : public comm::Communicator {
 public:
  SyncComm(CommStream& stream, comm::Communicator& inner) : stream_(stream), inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  void all_gather(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) override;
  void reduce_scatter(const void* send, void* recv, size_t numel_per_rank, DType dtype, comm::RedOp op,
                      const std::string& label) override;
  void all_reduce(const void* send, void* recv, size_t numel, DType dtype, comm::RedOp op,
                  const std::string& label) override;
  void all_reduce_f64(double* values, size_t n, comm::RedOp op, const std::string& label) override;
  void broadcast(void* buf, size_t nbytes, int root, const std::string& label) override;
  void barrier(const std::string& label) override;
  fsdp_status_t failure() const override { return inner_.failure(); }
  void abort(const std::string& reason) override { inner_.abort(reason); }

 private:
  CommStream& stream_;
  comm::Communicator& inner_;
};

}  // namespace fsdp::core
