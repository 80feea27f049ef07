// src/comm/data_plane.h - DataPlane: how a communicator moves memory that the
// host cannot read (a GPU's), when its ranks share that memory's address
// space (threads of one process on one GPU). Core supplies it from the
// context's device, so a communicator never sees a device: copies and
// reductions are queued on the stream that runs the collective, and marks
// (points in that stream) order one rank's stream after another's, so no
// host thread waits for the data itself.
#pragma once

#include <cstddef>
#include <memory>

#include "../base/dtype.h"

namespace fsdp::comm {

class DataPlane {
 public:
  // A point in the calling rank's stream; opaque to the communicator.
  using Mark = std::shared_ptr<void>;

  virtual ~DataPlane() = default;
  // Whether `ptr` is memory of this plane (host memory takes the host's way).
  virtual bool owns(const void* ptr) const = 0;
  // A point after everything queued so far on the calling rank's stream.
  virtual Mark mark() = 0;
  // What is queued from now on on the calling rank's stream starts after `m`
  // (a mark of any rank).
  virtual void wait(const Mark& m) = 0;
  virtual void copy(void* dst, const void* src, size_t nbytes) = 0;
  // out[i] = scale * the sum over k of ins[k][i] (kernels/reduce.h's order);
  // with `clear`, each input element is zeroed once read.
  virtual void reduce(void* out, void* const* ins, size_t n_ins, size_t numel, DType dtype, float scale,
                      bool clear) = 0;
  // out[i] = the sum over k of ins[k][i] in double, in rank order.
  virtual void reduce_f64(double* out, const double* const* ins, size_t n_ins, size_t n) = 0;
  // The calling rank's stream as the device's own handle (a cudaStream_t),
  // where a communicator that queues its own work (NCCL) puts it; null where
  // the device has none.
  virtual void* native_stream() = 0;
};

}  // namespace fsdp::comm
