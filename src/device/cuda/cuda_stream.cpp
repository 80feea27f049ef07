// src/device/cuda/cuda_stream.cpp - see cuda_stream.h.
#include "cuda_stream.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <thread>
#include <vector>

#include "../../base/host_waits.h"
#include "../../base/pool.h"
#include "../../base/spin.h"
#include "../../base/text.h"
#include "../../base/timer_slack.h"
#include "cuda_check.h"

namespace fsdp::device::cuda {
namespace {

constexpr std::chrono::microseconds kSpinFor{20};
// A wait polls every kPoll (with a fine timer slack, so that it wakes at most
// about that late) for its first kFinePolling, then backs off to kMaxSleep
// (a wait that long is a stall or a hang, and its timeout matters more).
constexpr std::chrono::microseconds kPoll{20};
constexpr std::chrono::milliseconds kFinePolling{50};
constexpr std::chrono::microseconds kMaxSleep{1000};

thread_local CudaStream* tls_current = nullptr;

// The stream each CUDA graph capture began on, as far as libfsdp saw: the
// host's stream its calls got while it was capturing (the engine's streams
// join a capture only by waiting for an event of that stream). Never shrinks:
// a handful of captures per process.
class CaptureOrigins {
 public:
  static void note(unsigned long long id, cudaStream_t origin) {
    std::lock_guard<std::mutex> lock(mu());
    map().emplace(id, origin);
  }
  static cudaStream_t of(unsigned long long id) {
    std::lock_guard<std::mutex> lock(mu());
    auto it = map().find(id);
    return it == map().end() ? nullptr : it->second;
  }

 private:
  static std::mutex& mu() {
    static auto* m = new std::mutex;  // never destroyed: events may go during static destruction
    return *m;
  }
  static std::map<unsigned long long, cudaStream_t>& map() {
    static auto* m = new std::map<unsigned long long, cudaStream_t>;
    return *m;
  }
};

// The capture `s` is part of (0: none). A stream in an invalidated capture
// still counts: its work belongs to no graph and must not run as if eager.
unsigned long long capture_of(cudaStream_t s) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  if (cudaStreamGetCaptureInfo(s, &status, &id) != cudaSuccess) {
    cudaGetLastError();  // (the legacy stream beside a capturing blocking stream): not sticky
    return 0;
  }
  return status == cudaStreamCaptureStatusNone ? 0 : id;
}

// Makes `s` the thread's current stream for the life of the scope.
class CurrentStream {
 public:
  explicit CurrentStream(CudaStream* s) : prev_(tls_current) { tls_current = s; }
  ~CurrentStream() { tls_current = prev_; }
  CurrentStream(const CurrentStream&) = delete;
  CurrentStream& operator=(const CurrentStream&) = delete;

 private:
  CudaStream* prev_;
};

}  // namespace

EventPool& EventPool::of(int ordinal) {
  static auto* mu = new std::mutex;
  static auto* pools = new std::map<int, EventPool*>;
  std::lock_guard<std::mutex> lock(*mu);
  EventPool*& p = (*pools)[ordinal];
  if (p == nullptr) p = new EventPool;  // never destroyed (see the header)
  return *p;
}

cudaEvent_t EventPool::take() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty()) {
      cudaEvent_t ev = free_.back();
      free_.pop_back();
      return ev;
    }
  }
  cudaEvent_t ev = nullptr;
  check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  std::lock_guard<std::mutex> lock(mu_);
  // Room for every event there is: give() never allocates.
  if (free_.capacity() < ++created_) free_.reserve(2 * created_);
  return ev;
}

void EventPool::give(cudaEvent_t ev) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(ev);
}

CudaEvent::CudaEvent(int ordinal, EventPool* pool, cudaEvent_t ev, Label what, Label stream, unsigned long long capture,
                     cudaStream_t origin)
    : ordinal_(ordinal),
      pool_(pool),
      ev_(ev),
      what_(std::move(what)),
      stream_(std::move(stream)),
      capture_(capture),
      origin_(origin) {}

CudaEvent::CudaEvent(fsdp_status_t status, std::string message)
    : done_(true), status_(status), message_(std::move(message)) {}

CudaEvent::~CudaEvent() {
  if (ev_ != nullptr) pool_->give(ev_);
}

std::string CudaEvent::describe() const {
  std::string stream = stream_ ? *stream_ : std::string("?");
  if (!what_) return "the work queued on the " + stream + " stream";
  return "'" + *what_ + "' on the " + stream + " stream";
}

bool CudaEvent::capture_open() const {
  if (capture_ == 0) return false;
  if (capture_of(origin_) == capture_) return true;
  // The capture ended: the graph's runs are queued on the origin stream.
  bind(ordinal_);
  check(cudaEventRecord(ev_, origin_), "recording an event anew after its CUDA graph capture ended");
  capture_ = 0;
  return false;
}

cudaEvent_t CudaEvent::for_wait(bool waiter_capturing) const {
  if (ev_ == nullptr) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  if (capture_open()) return ev_;  // the waiter joins (or is in) that capture
  if (!waiter_capturing) return ev_;
  // Work queued before the capture, which a graph cannot wait for: it must
  // have run already (the capture's own stream's earlier work is ordered
  // before the graph anyway).
  if (poll() && status_ == FSDP_OK) return nullptr;
  fail(FSDP_ERR_INVALID_STATE, "cuda device: " + describe() +
                                   " still runs on the GPU while a CUDA graph is captured that depends on it; "
                                   "synchronize (cudaDeviceSynchronize) before cudaStreamBeginCapture");
}

bool CudaEvent::poll() const {
  if (done_.load(std::memory_order_relaxed)) return true;
  if (capture_open()) return false;  // runs only as part of the graph: nothing to query yet
  cudaError_t e = cudaErrorNotReady;
  {
    RelaxedCaptureMode outside;  // a host's capture may be open: this event is not in it
    e = cudaEventQuery(ev_);
  }
  if (e == cudaErrorNotReady) return false;
  if (e != cudaSuccess) {
    status_ = status_of(e);
    message_ = "cuda device: " + describe() + " failed on the GPU (" + cuda::describe(e) + ")";
  }
  done_.store(true, std::memory_order_release);
  return true;
}

bool CudaEvent::done() const {
  if (done_.load(std::memory_order_acquire)) return true;
  std::lock_guard<std::mutex> lock(mu_);
  return poll();
}

fsdp_status_t CudaEvent::status() const {
  std::lock_guard<std::mutex> lock(mu_);
  poll();
  return done_.load(std::memory_order_relaxed) ? status_ : FSDP_OK;
}

void CudaEvent::wait(double timeout_s) {
  base::note_host_wait();
  if (ev_ != nullptr) bind(ordinal_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (capture_open()) {
      fail(FSDP_ERR_INVALID_STATE, "cuda device: " + describe() +
                                       " is being captured into a CUDA graph: it runs when the graph is launched, so "
                                       "nothing may wait for it on the host before cudaStreamEndCapture");
    }
  }
  auto start = std::chrono::steady_clock::now();
  if (!base::spin_until([this] { return done(); }, kSpinFor)) {
    // A poll, not cudaEventSynchronize: the wait is bounded by timeout_s. It
    // overshoots the event by at most about kPoll while the wait is short
    // (the step's, a read's), where an exponential back-off overshot by up
    // to 0.7 ms (docs/gpu.md).
    base::FineTimerSlack slack;
    slack.engage();
    auto sleep = kPoll;
    while (!done()) {
      auto waited = std::chrono::steady_clock::now() - start;
      if (timeout_s > 0 && waited > std::chrono::duration<double>(timeout_s)) {
        fail(FSDP_ERR_TIMEOUT, describe() + " did not finish within timeout_s = " + base::format_double(timeout_s) +
                                   " s; it is still queued or running on the GPU");
      }
      std::this_thread::sleep_for(sleep);
      if (waited > kFinePolling) sleep = std::min(sleep * 2, kMaxSleep);
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (status_ != FSDP_OK) fail(status_, message_);
}

CudaStream* CudaStream::current() { return tls_current; }

CudaStream::CudaStream(int ordinal, std::string name, int priority, StreamHooks hooks)
    : ordinal_(ordinal),
      name_(make_label(std::move(name))),
      hooks_(std::move(hooks)),
      events_(&EventPool::of(ordinal)),
      owned_(true) {
  bind(ordinal_);
  int least = 0, greatest = 0;  // CUDA's "greatest" priority is its most negative number
  check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
  check(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, priority > 0 ? greatest : least),
        "creating the " + *name_ + " stream");
}

CudaStream::CudaStream(int ordinal, cudaStream_t wrapped, std::string name)
    : ordinal_(ordinal), name_(make_label(std::move(name))), events_(&EventPool::of(ordinal)), stream_(wrapped) {}

CudaStream::~CudaStream() {
  if (!owned_) return;
  RelaxedCaptureMode outside;
  if (try_bind(ordinal_) && hooks_.abort && cudaStreamQuery(stream_) == cudaErrorNotReady) {
    // Destroy is local: what is queued may wait for ranks that will not come.
    (void)capture([&] { hooks_.abort("a rank destroyed its context while collectives were queued or running"); });
  }
  // Work still queued finishes (or, aborted, quits) on the device; the engine
  // frees what it uses after this, in order after it.
  cudaStreamDestroy(stream_);
}

void CudaStream::fail_with(fsdp_status_t status, const std::string& message) const {
  std::lock_guard<std::mutex> lock(mu_);
  fsdp_status_t ok = FSDP_OK;
  if (failure_.compare_exchange_strong(ok, status, std::memory_order_acq_rel)) failure_message_ = message;
}

uint64_t CudaStream::capture_id() const {
  if (!try_bind(ordinal_)) return 0;
  return capture_of(stream_);
}

fsdp_status_t CudaStream::failure() const {
  fsdp_status_t f = failure_.load(std::memory_order_acquire);
  if (f != FSDP_OK || !owned_ || !try_bind(ordinal_)) return f;
  if (capture_of(stream_) != 0) return f;  // a query would end the capture; its work has not run anyway
  // A wrapped host stream is not queried: the host may have destroyed it.
  cudaError_t e = cudaErrorNotReady;
  {
    RelaxedCaptureMode outside;  // another stream may be capturing
    e = cudaStreamQuery(stream_);
  }
  if (e == cudaSuccess || e == cudaErrorNotReady) return FSDP_OK;
  fail_with(status_of(e), "cuda device: the GPU failed while running the " + *name_ + " stream's work (" + describe(e) +
                              "); the CUDA context cannot be used any more");
  return failure_.load(std::memory_order_acquire);
}

EventPtr CudaStream::submit(const Label& label, Task task) {
  EventPtr failed_wait;
  if (has_failed_wait_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(mu_);
    failed_wait = std::move(failed_wait_);
    failed_wait_.reset();
    has_failed_wait_.store(false, std::memory_order_release);
  }
  // As on a CPU stream: a failed wait fails the task without running it, and
  // either failure sticks to the stream.
  Outcome o = capture([&] {
    if (failed_wait) failed_wait->wait(0);  // throws its failure
    bind(ordinal_);
    CurrentStream scope(this);
    if (hooks_.observer) hooks_.observer(*label, true);
    Outcome ran = capture([&] { task(); });
    if (hooks_.observer) hooks_.observer(*label, false);
    if (!ran.ok()) fail(ran.status, ran.message);
  });
  if (!o.ok()) {
    fail_with(o.status, o.message);
    return std::make_shared<CudaEvent>(o.status, o.message);
  }
  return recorded(label);
}

void CudaStream::wait(const EventPtr& ev) {
  if (!ev) return;
  if (auto* ce = dynamic_cast<CudaEvent*>(ev.get()); ce != nullptr && ce->native() != nullptr) {
    bind(ordinal_);
    cudaEvent_t native = ce->for_wait(capture_of(stream_) != 0);
    if (native == nullptr) return;  // done before the capture this stream is in
    cudaError_t e = cudaStreamWaitEvent(stream_, native, 0);
    if (e != cudaSuccess) fail_cuda(e, "cudaStreamWaitEvent on the " + *name_ + " stream");
    return;
  }
  // An event with no GPU work behind it (failed at submit, or another
  // device's): wait on the host; a failure fails the next task queued here.
  Outcome o = capture([&] { ev->wait(hooks_.timeout_s); });
  if (!o.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_wait_) failed_wait_ = ev;
    has_failed_wait_.store(true, std::memory_order_release);
  }
}

EventPtr CudaStream::record() { return recorded(nullptr); }

EventPtr CudaStream::recorded(const Label& what) {
  bind(ordinal_);  // the pool's events are made in the device's context
  cudaEvent_t ev = events_->take();
  cudaError_t e = cudaEventRecord(ev, stream_);
  if (e != cudaSuccess) {
    events_->give(ev);
    fail_cuda(e, "recording an event on the " + *name_ + " stream");
  }
  const unsigned long long capture = capture_of(stream_);
  if (capture == 0) return base::make_pooled<CudaEvent>(ordinal_, events_, ev, what, name_);
  // Recorded into a capture. The host's stream libfsdp records on first in
  // a capture is where it began: the engine's streams join it through that.
  if (!owned_) CaptureOrigins::note(capture, stream_);
  cudaStream_t origin = CaptureOrigins::of(capture);
  return base::make_pooled<CudaEvent>(ordinal_, events_, ev, what, name_, capture,
                                      origin != nullptr ? origin : stream_);
}

void CudaStream::rethrow_failure() const {
  if (failure() == FSDP_OK) return;
  std::lock_guard<std::mutex> lock(mu_);
  fail(failure_.load(), failure_message_);
}

void CudaStream::synchronize(double timeout_s) {
  record()->wait(timeout_s);
  if (failure() != FSDP_OK) {
    std::lock_guard<std::mutex> lock(mu_);
    fail(failure_.load(), failure_message_);
  }
}

}  // namespace fsdp::device::cuda
