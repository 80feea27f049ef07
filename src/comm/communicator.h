// src/comm/communicator.h - Communicator: the collectives the engine needs, with
// the same argument order everywhere (send, recv, numel, dtype, op, label).
// Implementations: local (threads of one process; host memory, or a GPU's
// through a DataPlane) and mpi (processes; host memory); later nccl. The
// engine only ever sees this interface.
#pragma once

#include <cstddef>
#include <cstring>
#include <memory>
#include <string>

#include "../base/dtype.h"
#include "data_plane.h"
#include "fsdp.h"

namespace fsdp::comm {

enum class RedOp { kSum, kAvg, kMax, kMin };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // `label` names the collective for error messages ("all_gather of unit 'h1'").
  // Every rank passes the same `label`; implementations that can check it do.

  // recv (world * nbytes_per_rank) = concatenation of every rank's send.
  virtual void all_gather(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) = 0;
  // recv (numel_per_rank) = op over ranks of their send[rank * numel_per_rank ...].
  virtual void reduce_scatter(const void* send, void* recv, size_t numel_per_rank, DType dtype, RedOp op,
                              const std::string& label) = 0;
  // reduce_scatter that also leaves every element of `send` zero, written as
  // the collective reads it: the grads' buffer is ready for the next backward
  // with no zeroing pass of its own.
  virtual void reduce_scatter_clear(void* send, void* recv, size_t numel_per_rank, DType dtype, RedOp op,
                                    const std::string& label) = 0;
  // recv[j * nbytes_per_rank ...] = rank j's send[rank * nbytes_per_rank ...]:
  // each rank sends a part to every rank (its own included) and receives one
  // from each, in rank order. send and recv do not overlap.
  virtual void all_to_all(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) = 0;
  // recv (numel) = op over ranks of send; recv may equal send.
  virtual void all_reduce(const void* send, void* recv, size_t numel, DType dtype, RedOp op,
                          const std::string& label) = 0;
  // Small double reductions for norms, flags and consensus checks.
  virtual void all_reduce_f64(double* values, size_t n, RedOp op, const std::string& label) = 0;
  // recv[i] = the sum over ranks of send[i] (n small: the step's grad norm),
  // where `send` and `recv` are host memory or memory of the attached
  // DataPlane (a GPU's), which a communicator that can moves without the
  // host (the local communicator in rank order, NCCL); host memory goes the
  // way of all_reduce_f64 (rank order), which is what this does by default.
  virtual void sum_f64(const double* send, double* recv, size_t n, const std::string& label) {
    if (recv != send) std::memcpy(recv, send, n * sizeof(double));
    all_reduce_f64(recv, n, RedOp::kSum, label);
  }
  virtual void broadcast(void* buf, size_t nbytes, int root, const std::string& label) = 0;
  virtual void barrier(const std::string& label) = 0;
  // Collective: the ranks passing the same `color` form a new communicator,
  // ordered by `key` (ties by rank). Every rank gets its own group's.
  virtual std::unique_ptr<Communicator> split(int color, int key, const std::string& label) = 0;
  // How many ranks of this communicator share this rank's host (the default
  // shard group size of HYBRID_SHARD).
  virtual int local_world_size() const = 0;

  // From now on, collectives over memory that `plane` owns move it through
  // the plane (and so do the communicators split from this one). Returns
  // false when this communicator cannot move such memory (its ranks do not
  // share an address space); it then stays as it was.
  virtual bool attach_data_plane(std::shared_ptr<DataPlane> plane) {
    (void)plane;
    return false;
  }

  // Whether its collectives can be captured into a CUDA graph with the rest
  // of a step (docs/gpu.md, "The step on the device and CUDA graphs").
  virtual bool capturable() const { return true; }

  // FSDP_OK, or the status of the failure that made this communicator unusable
  // (a timeout, an abort, ranks out of step).
  virtual fsdp_status_t failure() const = 0;
  // Fails every current and future collective of this communicator, on every
  // rank, with FSDP_ERR_COMM and `reason`. Local: does not wait for anyone.
  virtual void abort(const std::string& reason) = 0;
};

}  // namespace fsdp::comm
