// src/comm/local/local_comm.h - the `local` Communicator: ranks are threads of
// one process joined by a LocalGroup; each collective publishes buffer pointers
// and every rank copies or reduces straight from its peers' memory: with the
// host's loops, or, for memory of an attached DataPlane (a GPU that the ranks
// share), with the plane's copies and reductions queued on each rank's
// stream. Then every phase also publishes a mark of the rank's stream, and
// each rank's stream waits for its peers' marks: a peer's buffer is read only
// after the work that wrote it, and a rank's buffers are reused only after
// the peers' reads of them, with no host thread waiting for the data.
#pragma once

#include <atomic>
#include <functional>
#include <memory>

#include "../../base/function_ref.h"
#include "../communicator.h"
#include "local_group.h"

namespace fsdp::comm {

class LocalComm final : public Communicator {
 public:
  // Claims `rank` in `group`; released by the destructor.
  LocalComm(std::shared_ptr<LocalGroup> group, int rank, double timeout_s);
  ~LocalComm() override;

  int rank() const override { return rank_; }
  int world_size() const override { return group_->world_size(); }

  void all_gather(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) override;
  void reduce_scatter(const void* send, void* recv, size_t numel_per_rank, DType dtype, RedOp op,
                      const std::string& label) override;
  void reduce_scatter_clear(void* send, void* recv, size_t numel_per_rank, DType dtype, RedOp op,
                            const std::string& label) override;
  void all_to_all(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) override;
  void all_reduce(const void* send, void* recv, size_t numel, DType dtype, RedOp op, const std::string& label) override;
  void all_reduce_f64(double* values, size_t n, RedOp op, const std::string& label) override;
  void sum_f64(const double* send, double* recv, size_t n, const std::string& label) override;
  void broadcast(void* buf, size_t nbytes, int root, const std::string& label) override;
  void barrier(const std::string& label) override;
  std::unique_ptr<Communicator> split(int color, int key, const std::string& label) override;
  int local_world_size() const override { return world_size(); }  // every rank is a thread of this process
  fsdp_status_t failure() const override { return failure_.load(); }
  void abort(const std::string& reason) override;
  bool attach_data_plane(std::shared_ptr<DataPlane> plane) override;
  // Ranks that are threads sharing a GPU, captured into one graph, hung in
  // their GPU test (docs/gpu.md, "GPU runs", 2026-11-27): refused until that
  // passes. Alone, a rank meets nobody and is captured like any other.
  bool capturable() const override { return world_size() == 1; }

 private:
  // Publishes (desc, send, recv), waits for every rank, checks that all ranks
  // called the same collective, runs `body` (which may call sync() for extra
  // phases) and waits again so that no rank's buffers are released while a
  // peer still reads them.
  void run(CollectiveDesc desc, const void* send, void* recv, base::FunctionRef<void()> body);
  void run_checked(CollectiveDesc desc, const void* send, void* recv, base::FunctionRef<void()> body);
  // `what` names the phase in an error (built only then).
  void sync(base::FunctionRef<std::string()> what);
  // The device path's halves of a phase: publish this rank's mark, and make
  // this rank's stream wait for every peer's.
  void publish_mark();
  void wait_for_peers_marks();
  // dst = src (n bytes): a host copy, or the plane's in the device path.
  void move(void* dst, const void* src, size_t nbytes);
  // The plane the running collective's reductions go through (null: the host's).
  DataPlane* plane() const { return on_plane_ ? plane_.get() : nullptr; }

  std::shared_ptr<LocalGroup> group_;
  int rank_;
  double timeout_s_;
  uint64_t seq_ = 0;
  std::shared_ptr<DataPlane> plane_;  // null: host memory only
  bool on_plane_ = false;             // the collective running now moves plane_'s memory
  uint64_t plane_phases_ = 0;         // device-path phases so far (the parity picks the mark)
  std::atomic<fsdp_status_t> failure_{FSDP_OK};
};

}  // namespace fsdp::comm
