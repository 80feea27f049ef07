// src/comm/counting.h - CountingComm: a Communicator that passes every call to
// the one it wraps and counts, per kind of collective, the calls and the bytes
// of their data (fsdp_comm_stats). The communicators split from it count into
// the same counters, so one set covers a rank's world, shard and replica
// groups. Counters are atomics: the comm stream's thread counts, the API's
// reads.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>

#include "communicator.h"

namespace fsdp::comm {

enum class Collective { kAllGather, kReduceScatter, kAllReduce, kBroadcast, kControl, kAllToAll, kCount };
// The group of ranks a communicator spans, for the bytes per group.
enum class CommGroup { kWorld, kShard, kReplica, kSecondary, kCount };

// What a rank's collectives moved. Bytes are the collective's data as the
// caller sees it, independent of the algorithm: an all_gather's result (every
// rank's part), a reduce_scatter's input (every rank's part), an all_reduce's
// buffer, a broadcast's buffer, an all_to_all's send buffer (every rank's part). kControl counts the small double
// reductions (norms, flags, consensus checks) and barriers: calls only.
struct CommCounters {
  std::array<std::atomic<uint64_t>, static_cast<size_t>(Collective::kCount)> calls{};
  std::array<std::atomic<uint64_t>, static_cast<size_t>(Collective::kCount)> nbytes{};
  std::array<std::atomic<uint64_t>, static_cast<size_t>(CommGroup::kCount)> group_nbytes{};
  void add(Collective k, uint64_t bytes, CommGroup g) {
    calls[static_cast<size_t>(k)].fetch_add(1, std::memory_order_relaxed);
    nbytes[static_cast<size_t>(k)].fetch_add(bytes, std::memory_order_relaxed);
    group_nbytes[static_cast<size_t>(g)].fetch_add(bytes, std::memory_order_relaxed);
  }
  void reset() {
    for (auto& c : calls) c.store(0, std::memory_order_relaxed);
    for (auto& b : nbytes) b.store(0, std::memory_order_relaxed);
    for (auto& b : group_nbytes) b.store(0, std::memory_order_relaxed);
  }
};

class CountingComm final : public Communicator {
 public:
  CountingComm(std::unique_ptr<Communicator> inner, std::shared_ptr<CommCounters> counters,
               CommGroup group = CommGroup::kWorld)
      : inner_(std::move(inner)), counters_(std::move(counters)), group_(group) {}
  // The group its bytes (and its splits', unless they are told another) count under.
  void set_group(CommGroup g) { group_ = g; }
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  void all_gather(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) override;
  void reduce_scatter(const void* send, void* recv, size_t numel_per_rank, DType dtype, RedOp op,
                      const std::string& label) override;
  void reduce_scatter_clear(void* send, void* recv, size_t numel_per_rank, DType dtype, RedOp op,
                            const std::string& label) override;
  void all_to_all(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) override;
  void all_reduce(const void* send, void* recv, size_t numel, DType dtype, RedOp op,
                  const std::string& label) override;
  void all_reduce_f64(double* values, size_t n, RedOp op, const std::string& label) override;
  void sum_f64(const double* send, double* recv, size_t n, const std::string& label) override;
  void broadcast(void* buf, size_t nbytes, int root, const std::string& label) override;
  void barrier(const std::string& label) override;
  // The new communicator counts into the same counters, under the same group.
  std::unique_ptr<Communicator> split(int color, int key, const std::string& label) override;
  int local_world_size() const override { return inner_->local_world_size(); }
  bool capturable() const override { return inner_->capturable(); }
  bool attach_data_plane(std::shared_ptr<DataPlane> plane) override {
    return inner_->attach_data_plane(std::move(plane));
  }
  fsdp_status_t failure() const override { return inner_->failure(); }
  void abort(const std::string& reason) override { inner_->abort(reason); }

 private:
  std::unique_ptr<Communicator> inner_;
  std::shared_ptr<CommCounters> counters_;
  CommGroup group_;
};

}  // namespace fsdp::comm
