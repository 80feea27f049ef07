// src/core/context_groups.cpp - Context's groups of ranks (context.h): the
// HYBRID shard and replica groups, secondary_shard's groups, the quantized
// reduction's hierarchy, and whether the gathers run apart from the
// reductions. Split from context.cpp along that seam.
#include <algorithm>
#include <string>
#include <thread>

#include "../base/error.h"
#include "consensus.h"
#include "context.h"
#include "plan.h"

namespace fsdp::core {
bool Context::gathers_apart() {
  const Options& o = rt_.opts;
  if (o.gather_stream != AutoBool::kAuto) return o.gather_stream == AutoBool::kYes;
  if (o.on_cuda()) return true;
  // On the CPU a stream is a thread: apart, each rank runs three at once
  // (its compute, its reductions, its gathers). Where the host has fewer
  // cores than that for its ranks, the threads take turns on them and a
  // collective waits for the turn of every rank's thread, which costs more
  // than the overlap gains (bench_step at 2 ranks on 2 cores: 50% more
  // time in libfsdp). Every rank must choose alike: apart where all can.
  unsigned cores = std::thread::hardware_concurrency();
  double can = cores >= 3u * static_cast<unsigned>(std::max(1, world_->local_world_size())) ? 1.0 : 0.0;
  rt_.comm->all_reduce_f64(&can, 1, comm::RedOp::kMin, "fsdp_ctx_create (gather_stream=auto)");
  return can == 1.0;
}

void Context::setup_groups() {
  const Options& o = rt_.opts;
  if (!o.hybrid()) {
    rt_.shard_size = rt_.sharded() ? rt_.world : 1;
    rt_.shard_index = rt_.sharded() ? rt_.rank : 0;
    rt_.shard_comm = world_.get();
    rt_.shard_sync = rt_.comm;
    return;
  }
  // The default (one host) may differ between hosts: agree before splitting.
  int g = o.shard_group_size > 0 ? o.shard_group_size : world_->local_world_size();
  agree(*rt_.comm, "fsdp_ctx_create (HYBRID_SHARD shard group size)",
        "shard_group_size=" + std::to_string(g) + (o.shard_group_size > 0 ? "" : " (the default: ranks on this host)"));
  if (g > rt_.world || rt_.world % g != 0) {
    fail(FSDP_ERR_INVALID_ARGUMENT, "fsdp_ctx_create: " + std::string(sharding_name(o.sharding)) +
                                        " needs a shard group size that divides the world size " +
                                        std::to_string(rt_.world) + ", not " + std::to_string(g) +
                                        "; set shard_group_size");
  }
  // Shard groups are runs of consecutive ranks (a host, as launchers place
  // them); a replica group holds the same shard index of every shard group.
  shard_ = sync_world_->split(rt_.rank / g, rt_.rank, "split into shard groups");
  replica_ = sync_world_->split(rt_.rank % g, rt_.rank, "split into replica groups");
  for (auto [c, tag] : {std::make_pair(shard_.get(), comm::CommGroup::kShard),
                        std::make_pair(replica_.get(), comm::CommGroup::kReplica)}) {
    if (auto* counted = dynamic_cast<comm::CountingComm*>(c)) counted->set_group(tag);
  }
  sync_shard_ = std::make_unique<SyncComm>(*stream_, *shard_);
  rt_.shard_size = g;
  rt_.shard_index = rt_.rank % g;
  rt_.shard_comm = shard_.get();
  rt_.shard_sync = sync_shard_.get();
  rt_.replica_comm = replica_->world_size() > 1 ? replica_.get() : nullptr;
}

void Context::setup_secondary() {
  const Options& o = rt_.opts;
  if (o.secondary_shard == 0) return;
  if (!o.reshard_after_forward()) {
    fail(FSDP_ERR_UNSUPPORTED,
         "fsdp_ctx_create: secondary_shard keeps a slice of each unit's params from forward's "
         "gather for backward's; " +
             std::string(sharding_name(o.sharding)) +
             " keeps the full params from forward to backward and gathers nothing in "
             "backward (use FULL_SHARD or HYBRID_SHARD, or secondary_shard=off)");
  }
  if (rt_.shard_size == 1) return;  // nothing is gathered: nothing to keep
  // The default (one host) may differ between hosts: agree before splitting.
  int g = o.secondary_shard > 0 ? o.secondary_shard : std::min(world_->local_world_size(), rt_.shard_size);
  agree(*rt_.comm, "fsdp_ctx_create (secondary_shard group size)",
        "secondary_shard=" + std::to_string(g) + (o.secondary_shard > 0 ? "" : " (node: the ranks on this host)"));
  if (g > rt_.shard_size || rt_.shard_size % g != 0) {
    fail(FSDP_ERR_INVALID_ARGUMENT,
         "fsdp_ctx_create: secondary_shard needs a group size that divides the shard "
         "group's " +
             std::to_string(rt_.shard_size) + " ranks, not " + std::to_string(g));
  }
  // Runs of g consecutive ranks of the shard group (a host, as launchers
  // place them), split off the shard group's synchronous communicator.
  SyncComm& group = o.hybrid() ? *sync_shard_ : *sync_world_;
  secondary_ = group.split(rt_.shard_index / g, rt_.shard_index, "split into secondary groups");
  if (auto* counted = dynamic_cast<comm::CountingComm*>(secondary_.get()))
    counted->set_group(comm::CommGroup::kSecondary);
  rt_.secondary_comm = secondary_.get();
  rt_.secondary_size = g;
  rt_.secondary_index = rt_.shard_index % g;
}

void Context::setup_reduce_hierarchy() {
  const Options& o = rt_.opts;
  if (!o.reduce_quantized || rt_.shard_size == 1) {
    reduce_group_size(o, world_->local_world_size(), rt_.shard_size, "fsdp_ctx_create");  // refuses a size set in vain
    return;
  }
  // The default (one host) may differ between hosts: agree before splitting.
  const int asked = o.reduce_hierarchy > 0   ? o.reduce_hierarchy
                    : o.reduce_hierarchy < 0 ? std::min(world_->local_world_size(), rt_.shard_size)
                                             : 0;
  agree(
      *rt_.comm, "fsdp_ctx_create (reduce_hierarchy group size)",
      "reduce_hierarchy=" + std::to_string(asked) + (o.reduce_hierarchy < 0 ? " (node: the ranks on this host)" : ""));
  const int g = reduce_group_size(o, world_->local_world_size(), rt_.shard_size, "fsdp_ctx_create");
  if (g == 1) return;
  // Runs of g consecutive ranks of the shard group (a host, as launchers
  // place them), and the ranks at one index of every run, each ordered by
  // shard index, split off the shard group's synchronous communicator (its
  // bytes count as the shard group's).
  SyncComm& group = o.hybrid() ? *sync_shard_ : *sync_world_;
  reduce_local_ = group.split(rt_.shard_index / g, rt_.shard_index, "split into the reduction's host groups");
  reduce_cross_ = group.split(rt_.shard_index % g, rt_.shard_index, "split across the reduction's host groups");
  rt_.reduce_local_comm = reduce_local_.get();
  rt_.reduce_cross_comm = reduce_cross_.get();
}

}  // namespace fsdp::core
