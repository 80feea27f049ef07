// src/device/cuda/cuda_stream.h - the CUDA device's streams and events. A
// CudaStream is a CUDA stream (one of the engine's own, or the host's
// cudaStream_t wrapped); submit runs the task on the calling thread at once,
// with this stream as the thread's current stream, so the device's kernels
// and copies that the task issues are queued on it; the event it returns is a
// CUDA event recorded after them. So a task "completes" when its GPU work
// does, and Stream::wait is cudaStreamWaitEvent: no host blocks.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <mutex>
#include <string>

#include "../device.h"
#include "../stream.h"

namespace fsdp::device::cuda {

class CudaEvent final : public Event {
 public:
  // Owns `ev` (recorded by the caller); `what` names the work in a timeout's
  // message.
  CudaEvent(int ordinal, cudaEvent_t ev, std::string what);
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

 private:
  // Turns the query's answer into done/failed (under mu_).
  bool poll() const;

  int ordinal_ = -1;
  cudaEvent_t ev_ = nullptr;
  std::string what_;
  mutable std::mutex mu_;
  mutable bool done_ = false;
  mutable fsdp_status_t status_ = FSDP_OK;
  mutable std::string message_;
};

class CudaStream final : public Stream {
 public:
  // A stream of the engine's own: non-blocking with respect to the legacy
  // default stream; `priority` > 0 asks for the device's highest priority.
  CudaStream(int ordinal, std::string name, int priority, StreamHooks hooks);
  // The host's stream (not owned; null is the legacy default stream).
  CudaStream(int ordinal, cudaStream_t wrapped, std::string name);
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
  fsdp_status_t failure() const override { return failure_.load(std::memory_order_acquire); }
  void synchronize(double timeout_s) override;

  cudaStream_t native() const { return stream_; }
  // The stream whose task runs on the calling thread (null outside tasks).
  static CudaStream* current();

 private:
  void fail_with(fsdp_status_t status, const std::string& message);
  // An event recorded now on this stream; `what` names it in a timeout.
  EventPtr recorded(std::string what);

  int ordinal_;
  std::string name_;
  StreamHooks hooks_;
  cudaStream_t stream_ = nullptr;
  bool owned_ = false;
  std::atomic<fsdp_status_t> failure_{FSDP_OK};
  mutable std::mutex mu_;
  std::string failure_message_;  // the first failure's, under mu_
  EventPtr failed_wait_;         // a waited-for event that failed: fails the next task, under mu_
};

}  // namespace fsdp::device::cuda
