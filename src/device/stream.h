// src/device/stream.h - Stream and Event: the ordering contract between the
// engine and a device. A Stream runs what is queued on it in order; an Event
// marks a point in a stream (record) that other streams wait for without
// blocking the host (Stream::wait), or that the host waits for (Event::wait).
// All ordering in the engine goes through them: the comm stream waits for the
// caller's event before it reads grads, the caller's stream waits for a
// gather's event before compute reads the params, a buffer is reused only
// after the event that says its last reader is done. The CPU device runs a
// stream on a worker thread (or, for the caller's NULL stream, on the calling
// thread at once); a CUDA device maps both onto CUDA streams and events.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "../base/task.h"
#include "fsdp.h"

namespace fsdp::device {

// Completion of the work a stream had queued when the event was recorded:
// pending, done, or failed with a status and a sentence.
class Event {
 public:
  virtual ~Event() = default;
  // Blocks the host until the event completes; throws its Error if it failed,
  // and FSDP_ERR_TIMEOUT naming the work when it has not completed within
  // `timeout_s` (0: no limit), which it then leaves running.
  virtual void wait(double timeout_s) = 0;
  // Whether it has completed (done or failed), without blocking.
  virtual bool done() const = 0;
  // FSDP_OK while pending or done; the failure's status once failed.
  virtual fsdp_status_t status() const = 0;
};
using EventPtr = std::shared_ptr<Event>;

// A task's name, made once (a unit makes its labels when it is registered)
// and shared by every event of that work: naming a task builds no string, and
// an event keeps its name alive for a timeout's message.
using Label = std::shared_ptr<const std::string>;
inline Label make_label(std::string s) { return std::make_shared<const std::string>(std::move(s)); }

class Stream {
 public:
  // Host work for the stream: on the CPU it is the work itself (a collective,
  // a copy, a kernel loop); on a GPU it issues the stream's kernels.
  // Captures of up to base::Task::kInline bytes are kept without a heap allocation.
  using Task = base::Task;

  virtual ~Stream() = default;
  // Queues `task` after everything queued before it and after every event
  // this stream was told to wait for. Returns the event of its completion;
  // when a task throws, or an event it had to wait for failed, its event fails
  // with that error (a task after a failed wait does not run).
  virtual EventPtr submit(const Label& name, Task task) = 0;
  // The same with a name built for this call (cold paths: it allocates).
  EventPtr submit(std::string name, Task task) { return submit(make_label(std::move(name)), std::move(task)); }
  // Work queued from now on starts only after `ev` completes. Never blocks
  // the host, except on a synchronous stream, which waits (and throws) here.
  virtual void wait(const EventPtr& ev) = 0;
  // An event that completes when everything queued so far has.
  virtual EventPtr record() = 0;
  // Whether work runs on the caller's thread at submit (the CPU's NULL stream).
  virtual bool synchronous() const = 0;
  // The status of the first task on this stream that failed (FSDP_OK if
  // none): fsdp_ctx_async_error reports it without waiting.
  virtual fsdp_status_t failure() const = 0;
  // Throws the first failure (its status and message) if there is one;
  // never waits.
  virtual void rethrow_failure() const = 0;
  // The CUDA graph capture this stream is part of now (cudaStreamGetCaptureInfo's
  // id), 0 when it is not capturing (always, on the CPU).
  virtual uint64_t capture_id() const { return 0; }
  // Blocks the host until everything queued so far is done; throws the
  // stream's first failure (failures stick to the stream, as a CUDA error
  // sticks to its context), or FSDP_ERR_TIMEOUT after `timeout_s` (0: no limit).
  virtual void synchronize(double timeout_s) { record()->wait(timeout_s); }
};

}  // namespace fsdp::device
