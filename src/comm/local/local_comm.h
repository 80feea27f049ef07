// src/comm/local/local_comm.h - the `local` Communicator: ranks are threads of
// one process joined by a LocalGroup; each collective publishes buffer pointers
// and every rank copies or reduces straight from its peers' memory.
#pragma once

#include <atomic>
#include <functional>
#include <memory>

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
  void all_reduce(const void* send, void* recv, size_t numel, DType dtype, RedOp op, const std::string& label) override;
  void all_reduce_f64(double* values, size_t n, RedOp op, const std::string& label) override;
  void broadcast(void* buf, size_t nbytes, int root, const std::string& label) override;
  void barrier(const std::string& label) override;
  std::unique_ptr<Communicator> split(int color, int key, const std::string& label) override;
  int local_world_size() const override { return world_size(); }  // every rank is a thread of this process
  fsdp_status_t failure() const override { return failure_.load(); }
  void abort(const std::string& reason) override;

 private:
  // Publishes (desc, send, recv), waits for every rank, checks that all ranks
  // called the same collective, runs `body` (which may call sync() for extra
  // phases) and waits again so that no rank's buffers are released while a
  // peer still reads them.
  void run(CollectiveDesc desc, const void* send, void* recv, const std::function<void()>& body);
  void run_checked(CollectiveDesc desc, const void* send, void* recv, const std::function<void()>& body);
  void sync(const std::string& what);

  std::shared_ptr<LocalGroup> group_;
  int rank_;
  double timeout_s_;
  uint64_t seq_ = 0;
  std::atomic<fsdp_status_t> failure_{FSDP_OK};
};

}  // namespace fsdp::comm
