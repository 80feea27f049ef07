// src/core/plan.cpp - see plan.h. Each figure follows the code that makes
// it: Unit's buffers (unit.cpp), Optimizer::state_names, the gathers of
// unit_gather.cpp and the reductions of Unit::reduce_task, and the bytes
// comm::CountingComm counts for each collective.
#include "plan.h"

#include <algorithm>
#include <string>

#include "../base/error.h"
#include "../kernels/quant.h"

namespace fsdp::core {
namespace {

size_t state_buffers(const Options& o) {
  if (o.optimizer == OptimizerKind::kHost) return static_cast<size_t>(o.host_state);
  if (o.optimizer != OptimizerKind::kSgd) return 2;  // exp_avg, exp_avg_sq
  return o.momentum != 0.0 ? 1 : 0;
}

}  // namespace

int reduce_group_size(const Options& o, int local_world, int shard_size, const std::string& who) {
  if (o.reduce_hierarchy > 0 && !o.reduce_quantized) {
    fail(FSDP_ERR_UNSUPPORTED,
         who + ": reduce_hierarchy=" + std::to_string(o.reduce_hierarchy) +
             " groups the quantized reduction's all-to-all, and reduce_dtype=" + dtype_name(o.reduce_dtype()) +
             " reduces by a reduce-scatter (set reduce_dtype=int8 or fp8_e4m3, or "
             "reduce_hierarchy=node or off)");
  }
  if (!o.reduce_quantized || shard_size <= 1 || o.reduce_hierarchy == 0) return 1;
  const int g = o.reduce_hierarchy > 0 ? o.reduce_hierarchy : std::min(local_world, shard_size);
  if (g > shard_size || shard_size % g != 0) {
    fail(FSDP_ERR_INVALID_ARGUMENT,
         who + ": reduce_hierarchy needs a group size that divides the shard group's " + std::to_string(shard_size) +
             " ranks, not " + std::to_string(g) +
             (o.reduce_hierarchy < 0 ? " (node: the ranks on this host; set reduce_hierarchy=off or a size)" : ""));
  }
  return g == shard_size ? 1 : g;
}

RankPlan plan_rank(const Options& o, int world, int local_world, const std::vector<PlanUnit>& units) {
  RankPlan p;
  const bool sharded = o.sharding != Sharding::kNoShard;
  int s = sharded ? world : 1;
  if (o.hybrid()) {
    s = o.shard_group_size > 0 ? o.shard_group_size : local_world;
    if (s > world || world % s != 0) {
      fail(FSDP_ERR_INVALID_ARGUMENT,
           "plan: a shard group size of " + std::to_string(s) + " does not divide " + std::to_string(world) + " ranks");
    }
  }
  p.shard_size = s;
  const bool gathers = (sharded && s > 1) || o.offload_cpu;  // Runtime::gathers
  const bool collective_gathers = sharded && s > 1;
  const int replicas = o.hybrid() ? world / s : 1;
  const bool secondary = o.secondary_shard != 0 && o.reshard_after_forward() && s > 1;
  if (secondary) {
    const int g = o.secondary_shard > 0 ? o.secondary_shard : std::min(local_world, s);
    if (g > s || s % g != 0) {
      fail(FSDP_ERR_INVALID_ARGUMENT, "plan: a secondary group size of " + std::to_string(g) +
                                          " does not divide the shard group's " + std::to_string(s) + " ranks");
    }
    p.secondary_size = g;
  }
  p.reduce_group = sharded ? reduce_group_size(o, local_world, s, "plan") : 1;
  const PlanGroup shard_group = o.hybrid() ? PlanGroup::kShard : PlanGroup::kWorld;
  const size_t pes = dtype_size(o.param_dtype), res = dtype_size(o.reduce_dtype());
  const bool lowp = o.param_dtype != DType::kFp32 && (o.keeps_param_dtype_shard() || !gathers);
  const size_t states = state_buffers(o);
  auto add = [&p](PlanGroup g, uint64_t bytes) { p.group[static_cast<size_t>(g)] += bytes; };

  for (const PlanUnit& u : units) {
    std::vector<ParamSpec> params = u.params;
    for (ParamSpec& ps : params) {
      if (ps.numel != 0) continue;
      ps.numel = 1;
      for (int64_t d : ps.shape) ps.numel *= static_cast<size_t>(d);
    }
    const FlatLayout layout(params, o.align_bytes / sizeof(float), s, u.frozen);
    const bool trainable = u.frozen.empty() || std::find(u.frozen.begin(), u.frozen.end(), false) != u.frozen.end();
    const size_t shard = layout.shard_numel(), ts = layout.trainable_shard_numel();
    const size_t padded = layout.padded_numel();
    p.sharded_params += shard * sizeof(float) + (lowp ? shard * pes : 0);
    if (trainable) {
      p.sharded_grads += ts * sizeof(float);
      p.optimizer_state += ts * sizeof(float) * states;
    }
    if (gathers) {
      p.largest_gathered = std::max<uint64_t>(p.largest_gathered, padded * pes);
      p.all_gathered += padded * pes;
    }
    if (world == 1) continue;  // nothing is communicated
    // The gathers: one all-gather per block, each rank's slice of it.
    if (collective_gathers) {
      uint64_t gather = 0;
      const bool quantized = o.quantizes_gathers_of(u.name);
      for (const ShardRange& r : layout.shard_ranges(0)) {
        gather += (quantized ? kernels::quant_packed_bytes(r.numel, o.gather_block) : r.numel * pes) *
                  static_cast<uint64_t>(s);
      }
      p.all_gather += gather;  // forward's
      add(shard_group, gather);
      if (o.reshard_after_forward()) {  // backward's, from the secondary group's slices where kept
        if (secondary) {
          p.all_gather += padded * pes;
          add(PlanGroup::kSecondary, padded * pes);
          p.secondary_peak += padded / static_cast<size_t>(p.secondary_size) * pes;
        } else {
          p.all_gather += gather;
          add(shard_group, gather);
        }
      }
    }
    if (!trainable) continue;
    // The reduction of the trainable block.
    if (!sharded) {
      const uint64_t b = layout.trainable_padded_numel() * res;
      p.all_reduce += b;
      add(PlanGroup::kWorld, b);
      continue;
    }
    if (o.reduce_quantized && p.reduce_group > 1) {  // Unit::reduce_scatter_hierarchical
      const uint64_t part = kernels::quant_packed_bytes(ts, o.reduce_block);
      const uint64_t local = part * static_cast<uint64_t>(s), cross = part * static_cast<uint64_t>(s / p.reduce_group);
      p.all_to_all += local + cross;
      p.reduce_local += local;
      p.reduce_cross += cross;
      add(shard_group, local + cross);
    } else if (o.reduce_quantized) {
      const uint64_t b = kernels::quant_packed_bytes(ts, o.reduce_block) * static_cast<uint64_t>(s);
      p.all_to_all += b;
      add(shard_group, b);
    } else {
      const uint64_t b = ts * res * static_cast<uint64_t>(s);
      p.reduce_scatter += b;
      add(shard_group, b);
    }
    if (replicas > 1 && o.reduce_quantized) {  // Unit::all_reduce_quantized: an all-to-all and an all-gather
      const uint64_t part = kernels::quant_packed_bytes((ts + size_t(replicas) - 1) / size_t(replicas), o.reduce_block);
      p.all_to_all += part * static_cast<uint64_t>(replicas);
      p.all_gather += part * static_cast<uint64_t>(replicas);
      add(PlanGroup::kReplica, 2 * part * static_cast<uint64_t>(replicas));
    } else if (replicas > 1) {
      p.all_reduce += ts * res;
      add(PlanGroup::kReplica, ts * res);
    }
  }
  return p;
}

}  // namespace fsdp::core
