// src/device/cuda/cuda_stream.h - the CUDA device's streams and events. A
// CudaStream is a CUDA stream (one of the engine's own, or the host's
// cudaStream_t wrapped); submit runs the task on the calling thread at once,
// with this stream as the thread's current stream, so the device's kernels
// and copies that the task issues are queued on it; the event it returns is a
// CUDA event recorded after them. So a task "completes" when its GPU work
// does, and Stream::wait is cudaStreamWaitEvent: no host blocks.
//
// Per submit or record nothing is allocated once warm: the cudaEvent_t comes
// from a pool of the device's events (made with cudaEventDisableTiming, given
// back when the CudaEvent goes), the CudaEvent object from base::make_pooled,
// and the names are Labels made once; a message is built only when something
// fails or times out.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "../device.h"
#include "../stream.h"

namespace fsdp::device::cuda {

// The cudaEvent_t of one device that CudaEvents take and give back (never
// destroyed: events may go during static destruction).
class EventPool {
 public:
  static EventPool& of(int ordinal);
  // An event of the device (which the caller has made current).
  cudaEvent_t take();
  // `ev` may still be pending: recording it again later is what CUDA allows
  // (waits already queued keep the state they captured).
  void give(cudaEvent_t ev) noexcept;

 private:
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
  size_t created_ = 0;
};

// An event recorded into a CUDA graph being captured (the stream it was
// recorded on was capturing) stands for that work as the graph runs it: while
// the capture is open, streams of the capture wait for it, and nothing may
// query or wait for it on the host; once the capture ended, the graph's runs
// are queued on the stream the capture began on (its origin), so the event
// becomes "all that origin stream has queued until now" (recorded there
// anew): a wait after the capture waits for every run launched so far.
class CudaEvent final : public Event {
 public:
  // Owns `ev` (recorded by the caller) until it goes back to `pool`; `what`
  // (may be null: the stream's queued work) and `stream` name the work in a
  // timeout's message; `capture` (0: none) is the capture it was recorded
  // into, whose graph runs on `origin`.
  CudaEvent(int ordinal, EventPool* pool, cudaEvent_t ev, Label what, Label stream, unsigned long long capture = 0,
            cudaStream_t origin = nullptr);
  // An event that failed before any GPU work was queued for it.
  CudaEvent(fsdp_status_t status, std::string message);
  ~CudaEvent() override;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  // Polls cudaEventQuery: spins for a few microseconds, then sleeps with a
  // growing period (at most 1 ms), so a waiting host thread takes no core.
  void wait(double timeout_s) override;
  bool done() const override;
  fsdp_status_t status() const override;
  cudaEvent_t native() const { return ev_; }
  // The event a stream `waiter` (capturing or not) waits for in its place,
  // or null where no wait is needed: one recorded before a capture that a
  // stream of the capture would wait for (a dependency no graph can hold)
  // must be done already, else this throws, saying to synchronize before
  // capturing.
  cudaEvent_t for_wait(bool waiter_capturing) const;

 private:
  // Turns the query's answer into done/failed (under mu_).
  bool poll() const;
  std::string describe() const;
  // Whether the capture this event was recorded into is still open; once it
  // is not, the event is recorded anew on the origin stream (under mu_).
  bool capture_open() const;

  int ordinal_ = -1;
  EventPool* pool_ = nullptr;
  cudaEvent_t ev_ = nullptr;
  Label what_, stream_;
  mutable std::mutex mu_;
  mutable std::atomic<bool> done_{false};
  mutable fsdp_status_t status_ = FSDP_OK;
  mutable std::string message_;
  mutable unsigned long long capture_ = 0;  // under mu_: the open capture it belongs to (0: none)
  cudaStream_t origin_ = nullptr;           // where that capture's graph runs
};

class CudaStream final : public Stream {
 public:
  // A stream of the engine's own: non-blocking with respect to the legacy
  // default stream; `priority` > 0 asks for the device's highest priority.
  CudaStream(int ordinal, std::string name, int priority, StreamHooks hooks);
  // The host's stream (not owned; null is the legacy default stream).
  CudaStream(int ordinal, cudaStream_t wrapped, std::string name);
  // Never waits for other ranks (as the CPU's WorkerStream): a stream of the
  // engine's own destroyed with work still queued calls hooks.abort, so that
  // a collective waiting for a peer that is gone quits instead of holding the
  // frees that follow until the watchdog's timeout.
  ~CudaStream() override;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  using Stream::submit;
  EventPtr submit(const Label& name, Task task) override;
  // A CUDA event: cudaStreamWaitEvent (the host does not block). Another
  // device's event (a CPU stream's) is waited for on the host.
  void wait(const EventPtr& ev) override;
  EventPtr record() override;
  bool synchronous() const override { return false; }
  // The first failure of a task queued here; for a stream of the engine's
  // own also a fault on the GPU (an illegal address, a kernel that failed),
  // which CUDA makes sticky: found by a query, without waiting for an event.
  fsdp_status_t failure() const override;
  void rethrow_failure() const override;
  void synchronize(double timeout_s) override;
  uint64_t capture_id() const override;

  cudaStream_t native() const { return stream_; }
  // The stream whose task runs on the calling thread (null outside tasks).
  static CudaStream* current();

 private:
  void fail_with(fsdp_status_t status, const std::string& message) const;
  // An event recorded now on this stream; `what` (may be null) names it.
  EventPtr recorded(const Label& what);

  int ordinal_;
  Label name_;
  StreamHooks hooks_;
  EventPool* events_;
  cudaStream_t stream_ = nullptr;
  bool owned_ = false;
  mutable std::atomic<fsdp_status_t> failure_{FSDP_OK};
  mutable std::mutex mu_;
  mutable std::string failure_message_;  // the first failure's, under mu_
  EventPtr failed_wait_;                 // a waited-for event that failed: fails the next task, under mu_
  std::atomic<bool> has_failed_wait_{false};
};

}  // namespace fsdp::device::cuda
