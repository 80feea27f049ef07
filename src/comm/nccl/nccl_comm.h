// src/comm/nccl/nccl_comm.h - the `nccl` Communicator: ranks are GPUs of one
// or many processes and hosts. Collectives over GPU memory are NCCL calls
// queued on the stream that runs the collective (the comm stream's task,
// which the attached DataPlane names), so they are ordered with the engine's
// other work by its events and no host thread waits for them. Host memory
// (the consensus checks, norms, metrics) is staged through pinned host memory
// and a device buffer on the same stream, so that every rank queues its NCCL
// calls in one order.
//
// Two NCCL communicators per group of ranks (docs/gpu.md, "NCCL: blocking
// collectives, non-blocking formation"):
// - the formation communicator is non-blocking (NCCL's `blocking = 0`): the
//   waits for peers that forming a group takes (ncclCommInitRankConfig,
//   ncclCommSplit) are polled with a bound and abortable, as NCCL's fault
//   tolerance guide does it;
// - the data communicator, split from it with `blocking = 1`, carries every
//   collective: NCCL returns once the collective is queued on the stream,
//   with no host thread of its own per call (a non-blocking communicator
//   launches each call from a new thread and returns ncclInProgress).
//
// Faults: a watchdog thread follows each queued collective (an event when the
// stream reaches it, one when it completes) and NCCL's asynchronous error,
// and aborts the communicators (ncclCommAbort) when a collective has run
// longer than timeout_s since the stream reached it (naming it, its sequence
// number and its unit) or NCCL reports an error; the failure then reaches the
// engine through failure() (fsdp_ctx_async_error), the event waits that time
// out, and every later call. NCCL calls on the communicators are made one at
// a time (NCCL's thread-safety rule) and never after the abort, which frees
// them; an abort asked for while a call is inside NCCL happens when it returns.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../../base/ring.h"
#include "../communicator.h"
#include "../options.h"

namespace fsdp::comm {

class NcclComm final : public Communicator {
 public:
  // Takes `formed` (a non-blocking communicator NCCL has formed, on GPU
  // `ordinal`) and splits the blocking data communicator from it (collective:
  // every rank of `formed` constructs one; bounded by timeout_s, which fails
  // with FSDP_ERR_TIMEOUT and aborts both). `world_ranks[i]` names rank i in
  // messages; `local_world`: the ranks on this host.
  NcclComm(ncclComm_t formed, int ordinal, std::vector<int> world_ranks, int local_world, double timeout_s);
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
  void all_to_all(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) override;
  void all_reduce(const void* send, void* recv, size_t numel, DType dtype, RedOp op, const std::string& label) override;
  void all_reduce_f64(double* values, size_t n, RedOp op, const std::string& label) override;
  // Device memory: ncclAllReduce on the plane's stream (NCCL's order of the
  // sum, not rank order); host memory: all_reduce_f64's staged path.
  void sum_f64(const double* send, double* recv, size_t n, const std::string& label) override;
  void broadcast(void* buf, size_t nbytes, int root, const std::string& label) override;
  void barrier(const std::string& label) override;
  // ncclCommSplit of the formation communicator: HYBRID_SHARD's shard and
  // replica groups (each with a data communicator of its own).
  std::unique_ptr<Communicator> split(int color, int key, const std::string& label) override;
  fsdp_status_t failure() const override { return failure_.load(); }
  void abort(const std::string& reason) override;
  // The plane names the stream each collective is queued on.
  bool attach_data_plane(std::shared_ptr<DataPlane> plane) override;
  // The blocking NCCL communicator the collectives go to (benchmarks call
  // NCCL on it beside this; not after an abort).
  ncclComm_t native() const { return comm_; }

 private:
  // A queued collective the watchdog follows: `start` completes when the
  // stream reaches it, `done` when it has run. Its description is built only
  // for a message.
  struct InFlight {
    cudaEvent_t start = nullptr;
    cudaEvent_t done = nullptr;
    // The label's first bytes: copied without an allocation (the caller's
    // string may go before the watchdog reads it, only for a message).
    char label[96] = {};
    const char* kind = "";
    uint64_t seq = 0;
    std::chrono::steady_clock::time_point started{};  // when the watchdog first saw `start` complete
    bool seen_started = false;
  };
  // Holds the right to make NCCL calls on the communicators (comm_mu_) for
  // its scope, and throws the failure if they were aborted. The abort that
  // was asked for meanwhile happens when it goes.
  class Call {
   public:
    // `watched`: the watchdog reports the call if it has not returned within
    // timeout_s (a formation call bounds its own wait instead).
    explicit Call(NcclComm& c, bool watched = true);
    ~Call();
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;

   private:
    NcclComm& c_;
    std::unique_lock<std::mutex> lock_;
    bool watched_;
  };

  // The stream the collective goes to: the plane's (the comm stream's task),
  // or this communicator's own outside any task.
  cudaStream_t stream() const;
  // Fails at once if the communicator failed; the collective's number.
  uint64_t begin();
  static std::string describe(const char* kind, const std::string& label, uint64_t seq);
  // Queues `call(comm_, s)` (an NCCL collective) between the two events the
  // watchdog follows.
  template <typename Fn>
  void collective(const char* kind, const std::string& label, uint64_t seq, cudaStream_t s, Fn&& call);
  // Host memory: `in` through pinned memory and the device staging buffer,
  // `body(dev_in, dev_out, comm, s)` queued between the copies, a bounded wait
  // for the result and a check that the communicator did not fail meanwhile
  // (an aborted collective "completes" with whatever its buffer held).
  template <typename Fn>
  void staged(const void* in, void* out, size_t in_nbytes, size_t out_nbytes, const char* kind,
              const std::string& label, uint64_t seq, Fn&& body);
  void ensure_staging(size_t nbytes);
  cudaEvent_t take_event();
  void give_event(cudaEvent_t ev);
  void watch();
  void fail_with(fsdp_status_t status, const std::string& reason);
  [[noreturn]] void throw_failure();
  // Aborts now if no NCCL call is in progress, else when it returns; never
  // blocks on one.
  void request_abort();
  // Makes the abort that was asked for if comm_mu_ is free (else its holder
  // makes it when it lets go).
  void abort_if_requested();
  void abort_locked();  // under comm_mu_

  ncclComm_t ctrl_ = nullptr;  // non-blocking: formation (split)
  ncclComm_t comm_ = nullptr;  // blocking: collectives
  int ordinal_;
  std::vector<int> world_ranks_;
  int rank_ = 0;
  int local_world_ = 1;
  double timeout_s_;
  uint64_t seq_ = 0;
  std::shared_ptr<DataPlane> plane_;
  cudaStream_t own_ = nullptr;  // outside any task (a world of one's SyncComm)
  void* scratch_ = nullptr;     // device staging
  void* pinned_ = nullptr;      // host staging (pinned: the copies are asynchronous)
  size_t staging_nbytes_ = 0;
  cudaEvent_t staged_done_ = nullptr;
  bool staged_pending_ = false;
  std::atomic<fsdp_status_t> failure_{FSDP_OK};
  std::mutex comm_mu_;    // held across every NCCL call on ctrl_ and comm_
  bool aborted_ = false;  // under comm_mu_: ctrl_ and comm_ are gone
  std::atomic<bool> abort_requested_{false};
  std::atomic<int64_t> call_since_ns_{0};  // when the NCCL call now in progress began (0: none)
  mutable std::mutex mu_;                  // in_flight_, events_, reason_, stop_
  std::condition_variable cv_;
  base::Ring<InFlight> in_flight_{64};
  std::vector<cudaEvent_t> events_;  // free events for InFlight
  size_t events_made_ = 0;
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
