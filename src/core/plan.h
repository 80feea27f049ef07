// src/core/plan.h - what a configuration costs one rank, before a run: the
// bytes fsdp_memory_stats will show in the persistent categories and the
// bytes each training step's collectives move as fsdp_comm_stats counts them
// (per kind and per group of ranks). Computed from the FlatLayout and the
// Options the engine itself lays units out and moves them with, so that the
// figures cannot drift from the engine's (tests/test_plan.cpp compares them
// with what a run measures, exactly, over a grid of configurations). The
// planner of issue 37 (candidates, links, times) builds on this.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "../base/layout.h"
#include "config.h"

namespace fsdp::core {

// One unit as registered: its params, and which are frozen (empty: none).
struct PlanUnit {
  std::vector<ParamSpec> params;
  std::vector<bool> frozen;
  std::string name;  // as registered (gather_dtype_exclude matches it)
};

// The group of ranks a collective runs over (as comm::CommGroup counts).
enum class PlanGroup { kWorld, kShard, kReplica, kSecondary, kCount };

struct RankPlan {
  int shard_size = 1;      // ranks per shard group
  int secondary_size = 1;  // ranks per secondary group (secondary_shard; 1: off)
  int reduce_group = 1;    // ranks per group of the quantized reduction's first stage (1: one all-to-all)
  // Persistent bytes (fsdp_memory_stats after the first step).
  uint64_t sharded_params = 0;  // fp32 master, and the param_dtype shard where kept
  uint64_t sharded_grads = 0;   // fp32 grad shards of trainable units
  uint64_t optimizer_state = 0;
  // Transient bytes: the largest unit's full params as gathered, and what
  // secondary_shard keeps at its peak (every unit's slice after forward).
  uint64_t largest_gathered = 0;
  uint64_t all_gathered = 0;  // every unit's full params at once (what SHARD_GRAD_OP holds after forward)
  uint64_t secondary_peak = 0;
  // Bytes of one training step (a forward and a backward of every unit, the
  // grads reduced once), as fsdp_comm_stats counts them.
  uint64_t all_gather = 0, reduce_scatter = 0, all_reduce = 0, all_to_all = 0;
  std::array<uint64_t, static_cast<size_t>(PlanGroup::kCount)> group{};
  // Of all_to_all (and of the shard group's bytes): the hierarchical
  // quantized reduction's two stages, inside the groups and across them.
  uint64_t reduce_local = 0, reduce_cross = 0;
  uint64_t step_total() const { return all_gather + reduce_scatter + all_reduce + all_to_all; }
};

// The plan of one rank of a world of `world` ranks, `local_world` of them on
// each host (the default HYBRID shard group and secondary group size).
// Throws INVALID_ARGUMENT for a group size that does not divide, as
// fsdp_ctx_create would.
RankPlan plan_rank(const Options& o, int world, int local_world, const std::vector<PlanUnit>& units);

// reduce_hierarchy resolved: the ranks per group of the quantized
// reduction's first all-to-all over a shard group of `shard_size` ranks,
// `local_world` on each host; 1 where it is one all-to-all (off, not
// quantized, or one group holds the whole shard group). Throws, prefixed
// by `who`: UNSUPPORTED for a group size set with a reduce_dtype that is
// not quantized; INVALID_ARGUMENT for one that does not divide shard_size.
int reduce_group_size(const Options& o, int local_world, int shard_size, const std::string& who);

// fsdp_plan: the JSON request (docs/scaling.md, "The planner") answered as
// JSON, one row per candidate configuration. FSDP_ERR_INVALID_ARGUMENT for a
// request it cannot read, naming what; the model's files' errors as theirs.
std::string plan_request(const std::string& request);

}  // namespace fsdp::core
