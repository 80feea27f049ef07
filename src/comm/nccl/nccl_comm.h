// src/comm/nccl/nccl_comm.h - the `nccl` Communicator: ranks are GPUs of one
// or many processes and hosts. Collectives over GPU memory are NCCL calls
// queued on the stream that runs the collective (the comm stream's task,
// which the attached DataPlane names), so they are ordered with the engine's
// other work by its events and no host thread waits for them. Host memory
// (the consensus checks, norms, metrics) is staged through a device buffer on
// the same stream, so that every rank queues its NCCL calls in one order.
//
// Faults: the communicator is non-blocking (NCCL's `blocking = 0`), so no
// NCCL call can hold the host; a watchdog thread polls each queued
// collective's completion event and NCCL's asynchronous error, and aborts the
// communicator (ncclCommAbort) when a collective runs past timeout_s (naming
// it, its sequence number and its unit) or NCCL reports an error; the failure
// then reaches the engine through failure() (fsdp_ctx_async_error) and the
// event waits that time out.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../communicator.h"
#include "../options.h"

namespace fsdp::comm {

class NcclComm final : public Communicator {
 public:
  // Takes `comm` (initialized, on GPU `ordinal`); `world_ranks[i]` names rank
  // i in messages; `local_world`: the ranks on this host.
  NcclComm(ncclComm_t comm, int ordinal, std::vector<int> world_ranks, int local_world, double timeout_s);
  ~NcclComm() override;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return static_cast<int>(world_ranks_.size()); }
  int local_world_size() const override { return local_world_; }

  void all_gather(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) override;
  void reduce_scatter(const void* send, void* recv, size_t numel_per_rank, DType dtype, RedOp op,
                      const std::string& label) override;
  // NCCL cannot write its input: the clear is a memset queued after it.
  void reduce_scatter_clear(void* send, void* recv, size_t numel_per_rank, DType dtype, RedOp op,
                            const std::string& label) override;
  void all_reduce(const void* send, void* recv, size_t numel, DType dtype, RedOp op, const std::string& label) override;
  void all_reduce_f64(double* values, size_t n, RedOp op, const std::string& label) override;
  void broadcast(void* buf, size_t nbytes, int root, const std::string& label) override;
  void barrier(const std::string& label) override;
  // ncclCommSplit: HYBRID_SHARD's shard and replica groups.
  std::unique_ptr<Communicator> split(int color, int key, const std::string& label) override;
  fsdp_status_t failure() const override { return failure_.load(); }
  void abort(const std::string& reason) override;
  // The plane names the stream each collective is queued on.
  bool attach_data_plane(std::shared_ptr<DataPlane> plane) override;
  // The NCCL communicator itself (benchmarks call NCCL on it beside this).
  ncclComm_t native() const { return comm_; }

 private:
  struct InFlight {
    cudaEvent_t done;
    std::string what;
    std::chrono::steady_clock::time_point queued;
  };

  // The stream the collective goes to: the plane's (the comm stream's task),
  // or this communicator's own outside any task.
  cudaStream_t stream() const;
  // Fails at once if the communicator failed; names the collective for
  // messages; returns its description ("all_gather of unit 'h1' (collective #7)").
  std::string begin(const char* kind, const std::string& label);
  // After an NCCL call: its result (waiting out ncclInProgress, bounded by
  // timeout_s), then an event the watchdog follows.
  void queued(ncclResult_t r, const std::string& what, cudaStream_t s);
  // Host memory: `n` bytes through the staging buffer, `body(dev_in, dev_out)`
  // queued between the copies, and a wait for the result.
  void staged(const void* in, void* out, size_t in_nbytes, size_t out_nbytes, const std::string& what,
              const std::function<ncclResult_t(const void*, void*, cudaStream_t)>& body);
  void* scratch(size_t nbytes);
  void watch();
  void fail_with(fsdp_status_t status, const std::string& reason);
  [[noreturn]] void throw_failure();

  ncclComm_t comm_;
  int ordinal_;
  std::vector<int> world_ranks_;
  int rank_ = 0;
  int local_world_ = 1;
  double timeout_s_;
  uint64_t seq_ = 0;
  std::shared_ptr<DataPlane> plane_;
  cudaStream_t own_ = nullptr;  // outside any task (a world of one's SyncComm)
  void* scratch_ = nullptr;
  size_t scratch_nbytes_ = 0;
  std::atomic<fsdp_status_t> failure_{FSDP_OK};
  std::atomic<bool> aborted_{false};
  mutable std::mutex mu_;  // in_flight_, reason_, stop_
  std::condition_variable cv_;
  std::deque<InFlight> in_flight_;
  std::string reason_;
  bool stop_ = false;
  std::thread watchdog_;
};

// Bootstraps (nccl_world.cpp).
// The world communicator of a process that runs on GPU `opts.cuda_ordinal`:
// from a host-passed id (opts.nccl_id, `rank` of opts.world_size), from
// torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
// MASTER_PORT: rank 0 hands the id out over TCP), or under mpirun (the id
// broadcast over MPI). Throws INVALID_ARGUMENT / UNSUPPORTED with what is
// missing, TIMEOUT when the ranks do not all come within timeout_s.
std::unique_ptr<Communicator> make_nccl_world(const Options& opts, int rank);
// Whether a launcher's variables say that this process is one of several
// (torchrun's or mpirun's), so that comm=auto on a GPU takes NCCL.
bool launched_as_ranks();
// A new NCCL unique id as hex (fsdp_comm_id_create).
std::string new_nccl_id_hex();

}  // namespace fsdp::comm
