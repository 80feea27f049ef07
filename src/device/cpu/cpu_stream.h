// src/device/cpu/cpu_stream.h - the CPU device's streams and events. A
// WorkerStream is a thread running its tasks in FIFO order (the comm and copy
// streams, and the late-running host stream that tests use); the
// InlineStream is the caller's NULL stream: its work runs on the calling
// thread at once. A CpuEvent is a flag with a status, waited for by spinning
// briefly and then sleeping.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../../base/error.h"
#include "../device.h"
#include "../stream.h"

namespace fsdp::device {

class CpuEvent final : public Event {
 public:
  // Spins for about a wake-up's latency, then sleeps: a waiting rank takes no
  // CPU from the others.
  // `what` and `stream` name the work in a timeout's message; the message is
  // built only then.
  CpuEvent() = default;
  CpuEvent(Label what, Label stream) : what_(std::move(what)), stream_(std::move(stream)) {}
  void wait(double timeout_s) override;
  bool done() const override { return done_.load(std::memory_order_acquire); }
  fsdp_status_t status() const override;
  // `message` is read only when `status` is a failure.
  void complete(fsdp_status_t status, std::string message);
  void complete_ok();
  // An event that has completed (what a synchronous stream records).
  static EventPtr completed();

 private:
  std::string describe() const;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> done_{false};
  fsdp_status_t status_ = FSDP_OK;
  std::string message_;
  Label what_, stream_;
};

class WorkerStream final : public Stream {
 public:
  // `delay`: the worker sleeps that long before each task (a host stream
  // that runs late, for tests of the ordering).
  WorkerStream(std::string name, StreamHooks hooks, std::chrono::microseconds delay = std::chrono::microseconds(0));
  // Never waits for other ranks: if work is queued or running, `abort` is
  // called so that the running collective fails at once; what is still
  // queued fails without running.
  ~WorkerStream() override;
  WorkerStream(const WorkerStream&) = delete;
  WorkerStream& operator=(const WorkerStream&) = delete;

  using Stream::submit;
  EventPtr submit(const Label& name, Task task) override;
  void wait(const EventPtr& ev) override;
  EventPtr record() override;
  bool synchronous() const override { return false; }
  fsdp_status_t failure() const override { return failure_.load(std::memory_order_acquire); }
  void rethrow_failure() const override;
  void synchronize(double timeout_s) override;

 private:
  struct Item {
    Label name;
    Task task;  // empty for a marker (record() after a wait)
    std::vector<EventPtr> after;
    std::shared_ptr<CpuEvent> event;
  };
  void loop();
  Outcome run(Item& item);
  // The queue is a ring of Items whose vectors keep their capacity as they
  // are swapped in and out: queueing allocates nothing once it is warm.
  Item& push_slot();  // the slot of a new last item (under mu_)
  static constexpr size_t kWaitsReserved = 8;
  // Deeper than the engine's streams get in a step (the host's own stream
  // holds about three tasks per unit), so that the ring rarely grows after
  // the first steps; when it does, it doubles and stays.
  static constexpr size_t kRingInitial = 64;
  static Item reserved_item();
  static std::vector<Item> ring_of(size_t n);

  Label name_;
  StreamHooks hooks_;
  std::chrono::microseconds delay_;
  std::atomic<fsdp_status_t> failure_{FSDP_OK};
  std::string failure_message_;  // the first failure's, under mu_
  Label running_;                // the task now running (for a timeout's message), under mu_
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Item> ring_;  // queue_size_ items from ring_head_, wrapping
  size_t ring_head_ = 0, queue_size_ = 0;
  std::vector<EventPtr> waits_;  // for the next item queued
  EventPtr last_;                // the last item's event
  bool busy_ = false;
  bool stop_ = false;
  // The worker's item, made (its wait list reserved) before the thread starts:
  // a thread that starts late allocates nothing then.
  Item worker_item_;
  std::thread worker_;
};

// The caller's NULL stream on the CPU: submit runs the task on the calling
// thread and throws what it throws; wait blocks the host on the event.
class InlineStream final : public Stream {
 public:
  using Stream::submit;
  EventPtr submit(const Label& name, Task task) override;
  // `timeout_s` bounds each wait (0: no limit).
  explicit InlineStream(double timeout_s = 0) : timeout_s_(timeout_s) {}
  void wait(const EventPtr& ev) override;
  EventPtr record() override { return CpuEvent::completed(); }
  bool synchronous() const override { return true; }
  fsdp_status_t failure() const override { return FSDP_OK; }  // its failures are thrown at once
  void rethrow_failure() const override {}

 private:
  double timeout_s_;
};

}  // namespace fsdp::device
