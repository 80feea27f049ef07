// src/device/cuda/cuda_stream.cpp - see cuda_stream.h.
#include "cuda_stream.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "../../base/spin.h"
#include "../../base/text.h"
#include "cuda_check.h"

namespace fsdp::device::cuda {
namespace {

constexpr std::chrono::microseconds kSpinFor{20};
constexpr std::chrono::microseconds kMaxSleep{1000};

thread_local CudaStream* tls_current = nullptr;

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

cudaEvent_t new_event(int ordinal) {
  bind(ordinal);
  cudaEvent_t ev = nullptr;
  check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  return ev;
}

}  // namespace

CudaEvent::CudaEvent(int ordinal, cudaEvent_t ev, std::string what)
    : ordinal_(ordinal), ev_(ev), what_(std::move(what)) {}

CudaEvent::CudaEvent(fsdp_status_t status, std::string message)
    : done_(true), status_(status), message_(std::move(message)) {}

CudaEvent::~CudaEvent() {
  if (ev_ != nullptr) cudaEventDestroy(ev_);  // legal while pending: CUDA releases it once it completes
}

bool CudaEvent::poll() const {
  if (done_) return true;
  cudaError_t e = cudaEventQuery(ev_);
  if (e == cudaErrorNotReady) return false;
  done_ = true;
  if (e != cudaSuccess) {
    status_ = status_of(e);
    message_ = "cuda device: " + what_ + " failed on the GPU (" + describe(e) + ")";
  }
  return true;
}

bool CudaEvent::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return poll();
}

fsdp_status_t CudaEvent::status() const {
  std::lock_guard<std::mutex> lock(mu_);
  poll();
  return done_ ? status_ : FSDP_OK;
}

void CudaEvent::wait(double timeout_s) {
  if (ev_ != nullptr) bind(ordinal_);
  auto start = std::chrono::steady_clock::now();
  if (!base::spin_until([this] { return done(); }, kSpinFor)) {
    auto sleep = std::chrono::microseconds(10);
    while (!done()) {
      if (timeout_s > 0 && std::chrono::steady_clock::now() - start > std::chrono::duration<double>(timeout_s)) {
        fail(FSDP_ERR_TIMEOUT, what_ + " did not finish within timeout_s = " + base::format_double(timeout_s) +
                                   " s; it is still queued or running on the GPU");
      }
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, kMaxSleep);
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (status_ != FSDP_OK) fail(status_, message_);
}

CudaStream* CudaStream::current() { return tls_current; }

CudaStream::CudaStream(int ordinal, std::string name, int priority, StreamHooks hooks)
    : ordinal_(ordinal), name_(std::move(name)), hooks_(std::move(hooks)), owned_(true) {
  bind(ordinal_);
  int least = 0, greatest = 0;  // CUDA's "greatest" priority is its most negative number
  check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
  check(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, priority > 0 ? greatest : least),
        "creating the " + name_ + " stream");
}

CudaStream::CudaStream(int ordinal, cudaStream_t wrapped, std::string name)
    : ordinal_(ordinal), name_(std::move(name)), stream_(wrapped) {}

CudaStream::~CudaStream() {
  if (!owned_) return;
  // Destroying a stream with work queued lets that work finish; the engine
  // synchronizes its streams before it frees what they use.
  cudaStreamDestroy(stream_);
}

void CudaStream::fail_with(fsdp_status_t status, const std::string& message) {
  std::lock_guard<std::mutex> lock(mu_);
  fsdp_status_t ok = FSDP_OK;
  if (failure_.compare_exchange_strong(ok, status, std::memory_order_acq_rel)) failure_message_ = message;
}

EventPtr CudaStream::submit(const Label& label, Task task) {
  const std::string& name = *label;
  EventPtr failed_wait;
  {
    std::lock_guard<std::mutex> lock(mu_);
    failed_wait = std::move(failed_wait_);
    failed_wait_.reset();
  }
  // As on a CPU stream: a failed wait fails the task without running it, and
  // either failure sticks to the stream.
  Outcome o = capture([&] {
    if (failed_wait) failed_wait->wait(0);  // throws its failure
    bind(ordinal_);
    CurrentStream scope(this);
    if (hooks_.observer) hooks_.observer(name, true);
    Outcome ran = capture([&] { task(); });
    if (hooks_.observer) hooks_.observer(name, false);
    if (!ran.ok()) fail(ran.status, ran.message);
  });
  if (!o.ok()) {
    fail_with(o.status, o.message);
    return std::make_shared<CudaEvent>(o.status, o.message);
  }
  return recorded("'" + name + "' on the " + name_ + " stream");
}

void CudaStream::wait(const EventPtr& ev) {
  if (!ev) return;
  if (auto* ce = dynamic_cast<CudaEvent*>(ev.get()); ce != nullptr && ce->native() != nullptr) {
    bind(ordinal_);
    check(cudaStreamWaitEvent(stream_, ce->native(), 0), "cudaStreamWaitEvent on the " + name_ + " stream");
    return;
  }
  // An event with no GPU work behind it (failed at submit, or another
  // device's): wait on the host; a failure fails the next task queued here.
  Outcome o = capture([&] { ev->wait(hooks_.timeout_s); });
  if (!o.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_wait_) failed_wait_ = ev;
  }
}

EventPtr CudaStream::record() { return recorded("the work queued on the " + name_ + " stream"); }

EventPtr CudaStream::recorded(std::string what) {
  cudaEvent_t ev = new_event(ordinal_);
  cudaError_t e = cudaEventRecord(ev, stream_);
  if (e != cudaSuccess) cudaEventDestroy(ev);
  check(e, "recording an event on the " + name_ + " stream");
  return std::make_shared<CudaEvent>(ordinal_, ev, std::move(what));
}

void CudaStream::synchronize(double timeout_s) {
  record()->wait(timeout_s);
  if (failure() != FSDP_OK) {
    std::lock_guard<std::mutex> lock(mu_);
    fail(failure(), failure_message_);
  }
}

}  // namespace fsdp::device::cuda
