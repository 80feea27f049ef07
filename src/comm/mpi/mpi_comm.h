// src/comm/mpi/mpi_comm.h - the `mpi` Communicator: ranks are processes on one
// or many hosts, started by mpirun. Every collective starts with a check-in at
// rank 0 (all ranks called the same collective; a rank that never arrives is
// named after timeout_s), then moves the data with non-blocking MPI calls that
// the comm stream's worker polls: a ring of point-to-point transfers with
// local reductions, or MPI's own collectives (mpi_algorithm).
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../communicator.h"
#include "../options.h"

namespace fsdp::comm {

class MpiComm final : public Communicator {
 public:
  // Owns `comm`. `world_ranks[i]` is rank i's rank in MPI_COMM_WORLD (named
  // in messages); `local_world` its count of ranks on this host.
  MpiComm(MPI_Comm comm, std::vector<int> world_ranks, int local_world, double timeout_s, MpiAlgorithm algo);
  ~MpiComm() override;
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  int local_world_size() const override { return local_world_; }

  void all_gather(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) override;
  void reduce_scatter(const void* send, void* recv, size_t numel_per_rank, DType dtype, RedOp op,
                      const std::string& label) override;
  void reduce_scatter_clear(void* send, void* recv, size_t numel_per_rank, DType dtype, RedOp op,
                            const std::string& label) override;
  void all_to_all(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) override;
  void all_reduce(const void* send, void* recv, size_t numel, DType dtype, RedOp op, const std::string& label) override;
  void all_reduce_f64(double* values, size_t n, RedOp op, const std::string& label) override;
  void broadcast(void* buf, size_t nbytes, int root, const std::string& label) override;
  void barrier(const std::string& label) override;
  std::unique_ptr<Communicator> split(int color, int key, const std::string& label) override;
  fsdp_status_t failure() const override { return failure_.load(); }
  void abort(const std::string& reason) override;

  // Which data path a collective of `nbytes` takes (for benchmarks and tests).
  bool uses_ring(const char* kind, size_t nbytes) const;

 private:
  struct Desc;
  using Clock = std::chrono::steady_clock;

  // Runs `body` after the check-in; any error marks the communicator failed.
  template <typename Body>
  void collective(const char* kind, size_t size, int dtype, int op, int root, const std::string& label, Body&& body);
  void check_in(const Desc& mine);
  // Waits for `reqs` until `deadline`; false on timeout (unfinished requests
  // stay set). Throws COMM if the communicator is aborted meanwhile, giving
  // the requests up; `buffers` (theirs) are then kept alive for MPI.
  // `for_peers`: the wait is for other ranks to arrive (the check-in), so it
  // sleeps between polls after a short spin; else it polls at full speed.
  bool poll(std::vector<MPI_Request>& reqs, Clock::time_point deadline, std::shared_ptr<void> buffers = nullptr,
            bool for_peers = false);
  // Waits for a data transfer of the current collective, or fails naming
  // `peer` (with `peers`, the peer of each request: the first still pending).
  void wait_data(std::vector<MPI_Request>& reqs, int peer, const std::vector<int>* peers = nullptr);
  // The point-to-point algorithms (mpi_ring.cpp). Data messages' tag, and
  // the largest piece one carries: MPI counts are ints.
  static constexpr int kTagData = 3;
  static constexpr size_t kMaxPiece = size_t(1) << 30;
  static int as_count(size_t n) { return static_cast<int>(n); }  // callers keep n <= kMaxPiece
  // Each rank's part `nbytes` of `send` to its rank, point to point (parts
  // past MPI's int counts, and mpi_algorithm=ring).
  void pairwise_all_to_all(const void* send, void* recv, size_t nbytes);
  // Sends `send_nbytes` to the next rank and receives `recv_nbytes` from the
  // previous one (in pieces MPI's int counts can carry).
  void ring_exchange(const void* send, size_t send_nbytes, void* recv, size_t recv_nbytes);
  // Ring reduce-scatter over chunks [first[c], first[c + 1]) of `send`; rank r
  // gets chunk r reduced (times `scale`) into `out`.
  // With `clear`, each chunk of `send` is zeroed once read (send is then writable).
  void ring_reduce_scatter(const void* send, void* out, const std::vector<size_t>& first, DType dtype, float scale,
                           bool clear = false);
  void reduce_scatter_impl(const void* send, void* recv, size_t numel_per_rank, DType dtype, RedOp op,
                           const std::string& label, bool clear);
  // Ring all-gather in place over byte ranges [first[c], first[c + 1]) of `buf`.
  void ring_all_gather(void* buf, const std::vector<size_t>& first);
  // Waits for a native collective's request.
  void wait_native(MPI_Request req);
  // MPI's own sum (`post` starts it into `summed`, under the MPI lock), then
  // out = scale * summed: MPI ops cannot average.
  void native_sum(void* out, size_t numel, DType dtype, float scale,
                  const std::function<void(void* summed, MPI_Request* req)>& post);
  // Scratch buffer `i` of at least `nbytes`, kept between collectives (a fresh
  // allocation per call costs page faults on every element).
  char* scratch(int i, size_t nbytes);
  std::string rank_name(int rank) const { return "rank " + std::to_string(world_ranks_[static_cast<size_t>(rank)]); }

  MPI_Comm comm_;
  std::vector<int> world_ranks_;
  int rank_ = 0;
  int world_ = 1;
  int local_world_ = 1;
  double timeout_s_;
  MpiAlgorithm algo_;
  uint64_t seq_ = 0;
  std::string what_;  // the collective in progress, for messages
  std::atomic<fsdp_status_t> failure_{FSDP_OK};
  std::atomic<bool> aborted_{false};
  std::mutex reason_mu_;
  std::string failure_reason_;
  std::vector<char> scratch_[2];
};

// The world communicator of this process (MPI_COMM_WORLD, duplicated). Checks
// the launcher's variables against MPI and `expected_rank` (-1: any).
std::unique_ptr<Communicator> make_mpi_world(const Options& opts, int expected_rank);

}  // namespace fsdp::comm
