// src/device/cpu/cpu_stream.cpp - see cpu_stream.h.
#include "cpu_stream.h"

#include "../../base/error.h"
#include "../../base/host_waits.h"
#include "../../base/pool.h"
#include "../../base/spin.h"
#include "../../base/text.h"

namespace fsdp::device {
namespace {

// How long a waiter spins before it sleeps: about a futex wake-up's latency.
constexpr std::chrono::microseconds kSpinFor{20};

// A marker's name, made when the library loads: a record() after a wait,
// whenever it first happens, allocates nothing.
const Label marker_label = make_label("wait for events");

}  // namespace

std::string CpuEvent::describe() const {
  std::string s = "'" + (what_ ? *what_ : std::string("work")) + "'";
  if (stream_) s += " on the " + *stream_ + " stream";
  return s;
}

void CpuEvent::wait(double timeout_s) {
  base::note_host_wait();
  base::spin_until([this] { return done(); }, kSpinFor);
  std::unique_lock<std::mutex> lock(mu_);
  auto is_done = [this] { return done_.load(std::memory_order_relaxed); };
  if (timeout_s > 0) {
    if (!cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), is_done)) {
      fail(FSDP_ERR_TIMEOUT, describe() + " did not finish within timeout_s = " + base::format_double(timeout_s) +
                                 " s; it is still queued or running");
    }
  } else {
    cv_.wait(lock, is_done);
  }
  if (status_ != FSDP_OK) fail(status_, message_);
}

fsdp_status_t CpuEvent::status() const {
  if (!done()) return FSDP_OK;
  std::lock_guard<std::mutex> lock(mu_);
  return status_;
}

void CpuEvent::complete(fsdp_status_t status, std::string message) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = status;
    message_ = std::move(message);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

void CpuEvent::complete_ok() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

EventPtr CpuEvent::completed() {
  static const EventPtr done = [] {
    auto e = std::make_shared<CpuEvent>();
    e->complete_ok();
    return e;
  }();
  return done;
}

// Items whose wait vectors have room for a few events: the vectors circulate
// (the ring's, waits_ and the worker's), so a task that waits allocates
// nothing once the ring is warm.
WorkerStream::Item WorkerStream::reserved_item() {
  Item item;
  item.after.reserve(kWaitsReserved);
  return item;
}

std::vector<WorkerStream::Item> WorkerStream::ring_of(size_t n) {
  std::vector<Item> ring(n);
  for (Item& item : ring) item = reserved_item();
  return ring;
}

WorkerStream::WorkerStream(std::string name, StreamHooks hooks, std::chrono::microseconds delay)
    : name_(make_label(std::move(name))),
      hooks_(std::move(hooks)),
      delay_(delay),
      ring_(ring_of(kRingInitial)),
      worker_item_(reserved_item()),
      worker_([this] { loop(); }) {
  std::lock_guard<std::mutex> lock(mu_);
  waits_.reserve(kWaitsReserved);
}

WorkerStream::~WorkerStream() {
  bool pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    pending = busy_ || queue_size_ > 0;
  }
  if (pending && hooks_.abort) hooks_.abort("a rank destroyed its context while collectives were queued or running");
  cv_.notify_all();
  worker_.join();
}

WorkerStream::Item& WorkerStream::push_slot() {
  if (queue_size_ == ring_.size()) {  // full: unwrap into a ring twice the size
    std::vector<Item> bigger = ring_of(ring_.size() * 2);
    for (size_t i = 0; i < queue_size_; ++i) std::swap(bigger[i], ring_[(ring_head_ + i) % ring_.size()]);
    ring_.swap(bigger);
    ring_head_ = 0;
  }
  return ring_[(ring_head_ + queue_size_++) % ring_.size()];
}

EventPtr WorkerStream::submit(const Label& name, Task task) {
  auto ev = base::make_pooled<CpuEvent>(name, name_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    Item& item = push_slot();
    item.name = name;
    item.task = std::move(task);
    item.after.swap(waits_);  // waits_ takes the slot's emptied vector, its capacity kept
    waits_.clear();
    item.event = ev;
    last_ = ev;
  }
  cv_.notify_all();
  return ev;
}

void WorkerStream::wait(const EventPtr& ev) {
  if (!ev || (ev->done() && ev->status() == FSDP_OK)) return;
  std::lock_guard<std::mutex> lock(mu_);
  waits_.push_back(ev);
}

EventPtr WorkerStream::record() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (waits_.empty()) return last_ ? last_ : CpuEvent::completed();
  }
  return submit(marker_label, Task());  // a marker that completes once the waits have
}

void WorkerStream::synchronize(double timeout_s) {
  EventPtr ev = record();
  try {
    ev->wait(timeout_s);
  } catch (const Error& e) {
    if (ev->done()) throw;  // the work failed (perhaps with a timeout of its own), rather than the wait
    std::lock_guard<std::mutex> lock(mu_);
    fail(FSDP_ERR_TIMEOUT, "the work queued on the " + *name_ +
                               " stream did not finish within timeout_s = " + base::format_double(timeout_s) + " s" +
                               (running_ ? "; '" + *running_ + "' is still running" : std::string()));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (failure_.load(std::memory_order_relaxed) != FSDP_OK) fail(failure_.load(), failure_message_);
}

void WorkerStream::rethrow_failure() const {
  if (failure_.load(std::memory_order_acquire) == FSDP_OK) return;
  std::lock_guard<std::mutex> lock(mu_);
  fail(failure_.load(), failure_message_);
}

void WorkerStream::loop() {
  Item& item = worker_item_;  // swapped with the ring's oldest: the vectors' capacity goes round
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || queue_size_ > 0; });
      if (queue_size_ == 0) return;  // stop_ and nothing left
      std::swap(item, ring_[ring_head_]);
      ring_head_ = (ring_head_ + 1) % ring_.size();
      --queue_size_;
      busy_ = true;
      running_ = item.name;
      if (stop_) {
        busy_ = false;
        lock.unlock();
        item.event->complete(FSDP_ERR_INVALID_STATE, (item.name ? *item.name : std::string("a task")) +
                                                         ": not run, the context is being destroyed");
        item.after.clear();
        item.task.reset();
        item.event.reset();
        continue;
      }
    }
    Outcome o = run(item);
    std::shared_ptr<CpuEvent> ev = std::move(item.event);
    item.after.clear();
    item.task.reset();  // its captures go before its event completes, as they did before
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!o.ok() && failure_.load(std::memory_order_relaxed) == FSDP_OK) {
        failure_message_ = o.message;
        failure_.store(o.status, std::memory_order_release);
      }
      busy_ = false;  // before the event: its waiter may destroy the stream next
      running_.reset();
      item.name.reset();
    }
    if (o.ok()) {
      ev->complete_ok();
    } else {
      ev->complete(o.status, std::move(o.message));
    }
  }
}

Outcome WorkerStream::run(Item& item) {
  if (delay_.count() > 0) std::this_thread::sleep_for(delay_);
  Outcome o = capture([&] {
    // Throws the failure of what this task waits for, or a timeout naming it.
    for (const EventPtr& dep : item.after) dep->wait(hooks_.timeout_s);
    if (!item.task) return;
    if (hooks_.observer) hooks_.observer(*item.name, true);
    Outcome ran = capture([&] { item.task(); });
    if (hooks_.observer) hooks_.observer(*item.name, false);
    if (!ran.ok()) fail(ran.status, ran.message);
  });
  return o;
}

EventPtr InlineStream::submit(const Label&, Task task) {
  task();
  return CpuEvent::completed();
}

void InlineStream::wait(const EventPtr& ev) {
  base::StreamWaitScope stream_wait;  // the NULL stream is the calling thread: this is the stream's own wait
  if (ev) ev->wait(timeout_s_);
}

}  // namespace fsdp::device
