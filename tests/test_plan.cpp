// The plan of a configuration (core/plan.h) against what a run of it
// measures: for a grid of configurations (worlds 1-8 as thread ranks, every
// strategy, fp32 and bf16, quantized gathers and reductions, the secondary
// shard, offload, frozen params, the optimizers' states), each rank trains
// one step of units of uneven sizes, and fsdp_memory_stats' persistent
// categories and fsdp_comm_stats' bytes of the step (per kind and per group)
// must equal the plan's, exactly.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "../src/core/config.h"
#include "../src/core/plan.h"
#include "rank_runner.h"

using namespace fsdp_test;

namespace {

struct Case {
  int world;
  std::map<std::string, std::string> options;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string n = "world" + std::to_string(info.param.world);
  for (const auto& [k, v] : info.param.options) {
    if (k == "timeout_s") continue;
    n += "_" + k + "_" + v;
  }
  for (char& c : n) {
    if (!isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return n;
}

// Units of uneven sizes; unit 1 mixes a frozen param with trainable ones,
// unit 3 is frozen whole.
const std::vector<std::vector<ParamSpec>> kUnits = {
    {{"a.w", {17, 9}}, {"a.b", {17}}}, {{"b.w", {33, 5}}, {"b.f", {7, 7}}, {"b.b", {3}}}, {{"c.w", {301}}},
    {{"d.w", {12, 12}}}};
const std::vector<std::vector<int32_t>> kTrainable = {{1, 1}, {1, 0, 1}, {1}, {0}};

}  // namespace

class Plan : public ::testing::TestWithParam<Case> {};

TEST_P(Plan, PredictsTheMeasuredPersistentBytesAndEveryCollectivesBytesExactly) {
  const Case c = GetParam();
  std::map<std::string, std::string> opts = c.options;
  opts["timeout_s"] = "30";
  // The plan from the same options, parsed as fsdp_config_set parses them.
  fsdp::core::Options o;
  std::vector<fsdp::core::PlanUnit> units;
  {
    fsdp::core::Config conf;
    for (const auto& [k, v] : opts) conf.set(k, v);
    o = conf.options();
  }
  for (size_t u = 0; u < kUnits.size(); ++u) {
    fsdp::core::PlanUnit pu;
    for (size_t i = 0; i < kUnits[u].size(); ++i) {
      pu.params.push_back({kUnits[u][i].name, kUnits[u][i].shape, 0});
      pu.frozen.push_back(kTrainable[u][i] == 0);
    }
    units.push_back(pu);
  }
  const fsdp::core::RankPlan plan = fsdp::core::plan_rank(o, c.world, c.world, units);
  run_ranks(c.world, [&](int rank, fsdp_local_group_t* group) {
    ConfigPtr cfg = make_config(opts);
    ASSERT_TRUE(cfg);
    fsdp_ctx_t* raw = nullptr;
    ASSERT_OK(fsdp_ctx_create(cfg.get(), group, group ? rank : -1, &raw));
    CtxPtr ctx(raw);
    fsdp_dtype_t dt = FSDP_DTYPE_FP32;
    ASSERT_OK(fsdp_ctx_param_dtype(raw, &dt));
    std::vector<fsdp_unit_t*> handles(kUnits.size());
    for (size_t u = 0; u < kUnits.size(); ++u) {
      ASSERT_OK(register_unit(raw, "unit" + std::to_string(u), kUnits[u], &handles[u], &kTrainable[u]));
    }
    ASSERT_OK(fsdp_comm_stats_reset(raw));
    for (size_t u = 0; u < kUnits.size(); ++u) {
      ASSERT_OK(fsdp_forward_begin(handles[u], nullptr));
      ASSERT_OK(fsdp_forward_end(handles[u], nullptr));
    }
    for (size_t u = kUnits.size(); u-- > 0;) {
      ASSERT_OK(fsdp_backward_begin(handles[u], nullptr));
      for (size_t i = 0; i < kUnits[u].size(); ++i) {
        if (kTrainable[u][i] == 0) continue;
        void* g = nullptr;
        ASSERT_OK(fsdp_grad_ptr(handles[u], i, &g));
        for (size_t k = 0; k < numel_of(kUnits[u][i].shape); ++k) add_elem(g, k, dt, 0.01f * float(k % 7));
      }
      ASSERT_OK(fsdp_backward_end(handles[u], nullptr));
    }
    if (opts.count("optimizer") != 0 && opts.at("optimizer") == "host") {
      int update = 0;
      float scale = 0.0f;
      ASSERT_OK(fsdp_step_begin(raw, nullptr, &update, &scale));
      ASSERT_OK(fsdp_step_end(raw, nullptr));
    } else {
      ASSERT_OK(fsdp_step(raw, nullptr));
    }
    double norm = 0.0;
    ASSERT_OK(fsdp_last_grad_norm(raw, &norm));
    fsdp_comm_stats_t cs{};
    cs.struct_size = sizeof cs;
    ASSERT_OK(fsdp_comm_stats(raw, &cs));
    fsdp_memory_stats_t ms{};
    ms.struct_size = sizeof ms;
    ASSERT_OK(fsdp_memory_stats(raw, &ms));
    EXPECT_EQ(ms.sharded_params_nbytes, plan.sharded_params);
    EXPECT_EQ(ms.sharded_grads_nbytes, plan.sharded_grads);
    EXPECT_EQ(ms.optimizer_state_nbytes, plan.optimizer_state);
    EXPECT_EQ(ms.secondary_params_peak_nbytes, plan.secondary_peak);
    EXPECT_GE(ms.gathered_params_peak_nbytes, plan.largest_gathered) << "the largest unit was gathered";
    EXPECT_EQ(cs.all_gather_nbytes, plan.all_gather);
    EXPECT_EQ(cs.reduce_scatter_nbytes, plan.reduce_scatter);
    EXPECT_EQ(cs.all_reduce_nbytes, plan.all_reduce);
    EXPECT_EQ(cs.all_to_all_nbytes, plan.all_to_all);
    EXPECT_EQ(cs.broadcast_nbytes, 0u);
    using G = fsdp::core::PlanGroup;
    EXPECT_EQ(cs.world_group_nbytes, plan.group[size_t(G::kWorld)]);
    EXPECT_EQ(cs.shard_group_nbytes, plan.group[size_t(G::kShard)]);
    EXPECT_EQ(cs.replica_group_nbytes, plan.group[size_t(G::kReplica)]);
    EXPECT_EQ(cs.secondary_group_nbytes, plan.group[size_t(G::kSecondary)]);
    EXPECT_OK(fsdp_ctx_finalize(raw));
  });
}

namespace {

std::vector<Case> grid() {
  using M = std::map<std::string, std::string>;
  std::vector<Case> cs;
  for (int w : {1, 2, 3, 4, 8}) {
    cs.push_back({w, M{{"sharding", "FULL_SHARD"}}});
    cs.push_back({w, M{{"sharding", "FULL_SHARD"}, {"param_dtype", "bf16"}}});
  }
  for (int w : {2, 4}) {
    cs.push_back({w, M{{"sharding", "SHARD_GRAD_OP"}, {"param_dtype", "bf16"}, {"reduce_dtype", "fp32"}}});
    cs.push_back({w, M{{"sharding", "NO_SHARD"}, {"param_dtype", "bf16"}}});
    cs.push_back({w, M{{"sharding", "FULL_SHARD"}, {"gather_dtype", "int8"}, {"reduce_dtype", "int8"}}});
    cs.push_back({w, M{{"sharding", "FULL_SHARD"}, {"param_dtype", "bf16"}, {"offload", "cpu"}}});
    cs.push_back({w, M{{"sharding", "FULL_SHARD"}, {"optimizer", "sgd"}, {"momentum", "0.9"}}});
  }
  cs.push_back({1, M{{"sharding", "FULL_SHARD"}, {"offload", "cpu"}, {"param_dtype", "bf16"}}});
  cs.push_back({3, M{{"sharding", "FULL_SHARD"}, {"param_dtype", "bf16"}, {"keep_param_dtype_shard", "1"}}});
  cs.push_back({3, M{{"sharding", "FULL_SHARD"}, {"gather_dtype", "fp8_e4m3"}, {"gather_block", "64"},
                     {"reduce_dtype", "fp8_e4m3"}, {"reduce_block", "32"}}});
  cs.push_back({4, M{{"sharding", "FULL_SHARD"}, {"secondary_shard", "2"}, {"param_dtype", "bf16"}}});
  cs.push_back({8, M{{"sharding", "FULL_SHARD"}, {"secondary_shard", "4"}, {"gather_dtype", "int8"}}});
  cs.push_back({4, M{{"sharding", "HYBRID_SHARD"}, {"shard_group_size", "2"}}});
  cs.push_back({8, M{{"sharding", "HYBRID_SHARD"}, {"shard_group_size", "4"}, {"param_dtype", "bf16"},
                     {"reduce_dtype", "int8"}, {"secondary_shard", "2"}}});
  cs.push_back({6, M{{"sharding", "HYBRID_SHARD_ZERO2"}, {"shard_group_size", "3"}, {"optimizer", "sgd"}}});
  cs.push_back({4, M{{"sharding", "HYBRID_SHARD"}, {"shard_group_size", "1"}}});
  cs.push_back({2, M{{"sharding", "FULL_SHARD"}, {"optimizer", "host"}, {"host_state", "3"}}});
  return cs;
}

}  // namespace

INSTANTIATE_TEST_SUITE_P(Grid, Plan, ::testing::ValuesIn(grid()), case_name);
