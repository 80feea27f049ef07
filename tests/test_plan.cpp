// The plan of a configuration (core/plan.h) against what a run of it
// measures: for a grid of configurations (worlds 1-8 as thread ranks, every
// strategy, fp32 and bf16, quantized gathers and reductions, the secondary
// shard, offload, frozen params, the optimizers' states), each rank trains
// one step of units of uneven sizes, and fsdp_memory_stats' persistent
// categories and fsdp_comm_stats' bytes of the step (per kind and per group)
// must equal the plan's, exactly.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
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
const std::vector<std::vector<ParamSpec>> kUnits = {{{"a.w", {17, 9}}, {"a.b", {17}}},
                                                    {{"b.w", {33, 5}}, {"b.f", {7, 7}}, {"b.b", {3}}},
                                                    {{"c.w", {301}}},
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
    pu.name = "unit" + std::to_string(u);
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
  cs.push_back({3, M{{"sharding", "FULL_SHARD"},
                     {"gather_dtype", "fp8_e4m3"},
                     {"gather_block", "64"},
                     {"reduce_dtype", "fp8_e4m3"},
                     {"reduce_block", "32"}}});
  // gather_dtype_exclude: the units it names gather param_dtype values.
  cs.push_back({4, M{{"sharding", "FULL_SHARD"},
                     {"param_dtype", "bf16"},
                     {"gather_dtype", "int8"},
                     {"gather_dtype_exclude", "unit[02]"}}});
  cs.push_back({8, M{{"sharding", "FULL_SHARD"},
                     {"gather_dtype", "fp8_e4m3"},
                     {"gather_block", "32"},
                     {"secondary_shard", "4"},
                     {"gather_dtype_exclude", "unit1"}}});
  cs.push_back({4, M{{"sharding", "FULL_SHARD"}, {"secondary_shard", "2"}, {"param_dtype", "bf16"}}});
  cs.push_back({8, M{{"sharding", "FULL_SHARD"}, {"secondary_shard", "4"}, {"gather_dtype", "int8"}}});
  cs.push_back({4, M{{"sharding", "HYBRID_SHARD"}, {"shard_group_size", "2"}}});
  cs.push_back({8, M{{"sharding", "HYBRID_SHARD"},
                     {"shard_group_size", "4"},
                     {"param_dtype", "bf16"},
                     {"reduce_dtype", "int8"},
                     {"secondary_shard", "2"}}});
  cs.push_back({6, M{{"sharding", "HYBRID_SHARD_ZERO2"}, {"shard_group_size", "3"}, {"optimizer", "sgd"}}});
  cs.push_back({6, M{{"sharding", "HYBRID_SHARD_ZERO2"}, {"shard_group_size", "2"}, {"reduce_dtype", "fp8_e4m3"}}});
  cs.push_back({4, M{{"sharding", "HYBRID_SHARD"}, {"shard_group_size", "1"}}});
  // reduce_hierarchy: the quantized reduction in two all-to-alls.
  cs.push_back(
      {8, M{{"sharding", "FULL_SHARD"}, {"param_dtype", "bf16"}, {"reduce_dtype", "int8"}, {"reduce_hierarchy", "2"}}});
  cs.push_back({6, M{{"sharding", "SHARD_GRAD_OP"}, {"reduce_dtype", "fp8_e4m3"}, {"reduce_hierarchy", "3"}}});
  cs.push_back({8, M{{"sharding", "HYBRID_SHARD"},
                     {"shard_group_size", "4"},
                     {"reduce_dtype", "int8"},
                     {"reduce_hierarchy", "2"},
                     {"secondary_shard", "2"}}});
  cs.push_back({2, M{{"sharding", "FULL_SHARD"}, {"optimizer", "host"}, {"host_state", "3"}}});
  return cs;
}

}  // namespace

INSTANTIATE_TEST_SUITE_P(Grid, Plan, ::testing::ValuesIn(grid()), case_name);

// ---- the planner's request (fsdp_plan) ----

namespace {

nlohmann::json plan_of(const std::string& request) {
  size_t len = 0;
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_plan(request.c_str(), nullptr, 0, &len));  // too small: the length
  std::string out(len + 1, '\0');
  EXPECT_OK(fsdp_plan(request.c_str(), out.data(), out.size(), &len));
  out.resize(len);
  return nlohmann::json::parse(out);
}

nlohmann::json cluster_json() {
  return {{"gpus", 4},          {"gpus_per_node", 2}, {"intra_node_GBps", 400}, {"inter_node_GBps", 50},
          {"peak_tflops", 100}, {"mfu", 0.5},         {"memory_GiB", 1}};
}

}  // namespace

TEST(PlanRequest, EachRowsBytesAreThePlansAndItsTimesTheLinksArithmetic) {
  nlohmann::json units = nlohmann::json::array();
  for (size_t u = 0; u < kUnits.size(); ++u) {
    nlohmann::json params = nlohmann::json::array();
    for (size_t i = 0; i < kUnits[u].size(); ++i) {
      params.push_back({{"name", kUnits[u][i].name}, {"shape", kUnits[u][i].shape}, {"frozen", kTrainable[u][i] == 0}});
    }
    units.push_back({{"name", "unit" + std::to_string(u)}, {"params", params}});
  }
  const nlohmann::json req = {{"model", {{"units", units}}}, {"cluster", cluster_json()}, {"tokens_per_gpu", 1000}};
  const nlohmann::json plan = plan_of(req.dump());
  double params = 0;
  std::vector<fsdp::core::PlanUnit> pus;
  for (size_t u = 0; u < kUnits.size(); ++u) {
    fsdp::core::PlanUnit pu;
    pu.name = "unit" + std::to_string(u);
    for (size_t i = 0; i < kUnits[u].size(); ++i) {
      pu.params.push_back({kUnits[u][i].name, kUnits[u][i].shape, 0});
      pu.frozen.push_back(kTrainable[u][i] == 0);
      params += double(numel_of(kUnits[u][i].shape));
    }
    pus.push_back(pu);
  }
  EXPECT_EQ(plan["params"].get<double>(), params);
  const double compute = 6.0 * params * 1000 / (100e12 * 0.5);
  EXPECT_DOUBLE_EQ(plan["compute_s"].get<double>(), compute);
  ASSERT_GT(plan["rows"].size(), 8u);
  int checked = 0;
  for (const nlohmann::json& r : plan["rows"]) {
    fsdp::core::Config conf;
    conf.set("param_dtype", "bf16");
    for (const auto& [k, v] : r.items()) {
      if (v.is_string()) conf.set(k, v.get<std::string>());
    }
    const fsdp::core::RankPlan p = fsdp::core::plan_rank(conf.options(), 4, 2, pus);
    EXPECT_EQ(r["step_bytes"]["all_gather"].get<uint64_t>(), p.all_gather);
    EXPECT_EQ(r["step_bytes"]["all_to_all"].get<uint64_t>(), p.all_to_all);
    EXPECT_EQ(r["persistent_bytes"].get<uint64_t>(), p.sharded_params + p.sharded_grads + p.optimizer_state);
    if (r["sharding"] == "FULL_SHARD" && r["secondary_shard"] == "off") {
      // The world's ring crosses nodes (4 GPUs, 2 per node): 3/4 of its bytes on the inter-node link.
      // A quantized reduction (reduce_hierarchy=node: groups of 2) moves 1/2 of its first all-to-all
      // inside the node and 1/2 of its second across.
      const bool quantized = r["reduce_dtype"] == "int8";
      EXPECT_EQ(p.reduce_group, quantized ? 2 : 1);
      const double local = double(p.reduce_local), cross = double(p.reduce_cross);
      EXPECT_EQ(local, 2 * cross) << "4 ranks' parts in the first all-to-all, 2 groups' in the second";
      EXPECT_EQ(cross > 0, quantized);
      const double wire = (double(p.group[0]) - local - cross) * 3 / 4 + cross / 2;
      EXPECT_DOUBLE_EQ(r["wire_bytes_inter_node"].get<double>(), wire);
      EXPECT_DOUBLE_EQ(r["wire_bytes_intra_node"].get<double>(), local / 2);
      EXPECT_DOUBLE_EQ(r["comm_s"].get<double>(), wire / 50e9 + local / 2 / 400e9);
      EXPECT_EQ(r["comm_hidden"].get<bool>(), r["comm_s"].get<double>() <= compute);
      ++checked;
    }
    if (r["sharding"] == "HYBRID_SHARD" && r["secondary_shard"] == "off" && r["offload"] == "none") {
      // Shard groups of 2 inside a node, replicas of 2 across: an all-reduce's 2 * 1/2; a quantized
      // reduction's all-to-all and all-gather, counted whole, 1/2.
      EXPECT_DOUBLE_EQ(r["wire_bytes_intra_node"].get<double>(), double(p.group[1]) / 2);
      const bool quantized = r["reduce_dtype"] == "int8";
      EXPECT_DOUBLE_EQ(r["wire_bytes_inter_node"].get<double>(), double(p.group[2]) / (quantized ? 2 : 1));
      ++checked;
    }
  }
  EXPECT_EQ(checked, 8 + 4);
  const int best = plan["best"].get<int>();
  ASSERT_GE(best, 0);
  EXPECT_TRUE(plan["rows"][size_t(best)]["fits"].get<bool>());
  const nlohmann::json& b = plan["rows"][size_t(best)];
  for (const nlohmann::json& r : plan["rows"]) {
    if (!r["fits"].get<bool>()) continue;
    const double step = std::max(r["comm_s"].get<double>(), compute),
                 best_step = std::max(b["comm_s"].get<double>(), compute);
    EXPECT_LE(best_step, step) << "a fitting row with a shorter step than the best";
    if (step == best_step && r["offload"] == b["offload"]) {
      auto lossy = [](const nlohmann::json& x) {
        return (x["gather_dtype"] != "param") + (x["reduce_dtype"] != "auto");
      };
      EXPECT_LE(lossy(b), lossy(r)) << "the best quantizes where a row as fast does not";
    }
  }
}

TEST(PlanRequest, TheOptionsGatherDtypeExcludeKeepsTheUnitsItNamesInParamDtypeInTheQuantizedRows) {
  // Units layer0, layer1 and other (the size description's names).
  const nlohmann::json req = {
      {"model", {{"size", {{"layers", 2}, {"params_per_layer", 4096}, {"other_params", 3000}}}}},
      {"cluster", cluster_json()},
      {"tokens_per_gpu", 1000},
      {"options", {{"gather_dtype_exclude", "oth*"}}}};
  const nlohmann::json plan = plan_of(req.dump());
  std::vector<fsdp::core::PlanUnit> pus;
  for (const auto& [name, n] :
       std::vector<std::pair<std::string, int64_t>>{{"layer0", 4096}, {"layer1", 4096}, {"other", 3000}}) {
    fsdp::core::PlanUnit pu;
    pu.name = name;
    pu.params.push_back({name, {n}, 0});
    pus.push_back(pu);
  }
  int quantized_rows = 0;
  for (const nlohmann::json& r : plan["rows"]) {
    SCOPED_TRACE(r.dump());
    fsdp::core::Config conf;
    conf.set("param_dtype", "bf16");
    for (const auto& [k, v] : r.items()) {
      if (v.is_string()) conf.set(k, v.get<std::string>());
    }
    const uint64_t plain = fsdp::core::plan_rank(conf.options(), 4, 2, pus).all_gather;
    const bool quantized = r["gather_dtype"] == "int8";
    if (quantized) conf.set("gather_dtype_exclude", "oth*");
    const uint64_t want = fsdp::core::plan_rank(conf.options(), 4, 2, pus).all_gather;
    EXPECT_EQ(r["step_bytes"]["all_gather"].get<uint64_t>(), want);
    if (quantized) {
      // "other" gathers 2 bytes a value instead of 1 + 4 / 256: more than without the exclusion.
      EXPECT_GT(want, plain);
      ++quantized_rows;
    }
  }
  EXPECT_GT(quantized_rows, 0);
}

TEST(PlanRequest, ASafetensorsFilesHeadersMakeTheUnitsByTheRule) {
  // A file with h.0.*, h.1.* and two tensors of no layer, F32 and BF16.
  const std::string dir = ::testing::TempDir() + "/plan_st_" + std::to_string(::getpid());
  ASSERT_EQ(std::system(("mkdir -p " + dir).c_str()), 0);
  const std::vector<std::tuple<std::string, std::vector<int64_t>, size_t>> tensors = {
      {"wte.weight", {10, 4}, 4}, {"h.0.w", {4, 4}, 4}, {"h.0.b", {4}, 4}, {"h.1.w", {4, 4}, 2}, {"ln_f.b", {4}, 2}};
  nlohmann::json header = nlohmann::json::object();
  size_t at = 0;
  for (const auto& [name, shape, es] : tensors) {
    size_t n = es;
    for (int64_t d : shape) n *= size_t(d);
    header[name] = {{"dtype", es == 4 ? "F32" : "BF16"}, {"shape", shape}, {"data_offsets", {at, at + n}}};
    at += n;
  }
  const std::string text = header.dump();
  std::string file(8, '\0');
  for (int b = 0; b < 8; ++b) file[size_t(b)] = char((uint64_t(text.size()) >> (8 * b)) & 0xff);
  file += text + std::string(at, '\0');
  {
    FILE* f = std::fopen((dir + "/model.safetensors").c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(std::fwrite(file.data(), 1, file.size(), f), file.size());
    std::fclose(f);
  }
  const nlohmann::json req = {{"model", {{"safetensors", dir}, {"unit_rule", "h.{i}."}}},
                              {"cluster", cluster_json()},
                              {"tokens_per_gpu", 1000}};
  const nlohmann::json plan = plan_of(req.dump());
  EXPECT_EQ(plan["units"].get<size_t>(), 3u) << "rest, h.0., h.1.";
  EXPECT_EQ(plan["params"].get<double>(), 40 + 16 + 4 + 16 + 4);
}

TEST(PlanRequest, ARequestItCannotReadIsRefusedNamingWhat) {
  struct Bad {
    std::string request, says;
  };
  const std::string cluster = cluster_json().dump();
  const std::vector<Bad> bad = {
      {"{", "not JSON"},
      {"{\"model\": {\"size\": {\"layers\": 2, \"params_per_layer\": 10}}, \"cluster\": " + cluster + "}",
       "needs \"tokens_per_gpu\""},
      {"{\"model\": {\"size\": {\"layers\": 2, \"params_per_layer\": 10}}, \"cluster\": {\"gpus\": 4}, "
       "\"tokens_per_gpu\": 1}",
       "cluster needs \"gpus_per_node\""},
      {"{\"model\": {\"size\": {\"layers\": 2}}, \"cluster\": " + cluster + ", \"tokens_per_gpu\": 1}",
       "params_per_layer"},
      {"{\"model\": {\"sizes\": 1}, \"cluster\": " + cluster + ", \"tokens_per_gpu\": 1}", "unknown key \"sizes\""},
      {"{\"model\": {\"safetensors\": \"/nonexistent/dir\"}, \"cluster\": " + cluster + ", \"tokens_per_gpu\": 1}",
       "/nonexistent/dir"},
      {"{\"model\": {\"size\": {\"layers\": 2, \"params_per_layer\": 10}}, \"cluster\": " + cluster +
           ", \"tokens_per_gpu\": -1}",
       "tokens_per_gpu must be a positive number"},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.request);
    char out[64] = "untouched";
    size_t len = 7;
    const fsdp_status_t s = fsdp_plan(b.request.c_str(), out, sizeof out, &len);
    EXPECT_NE(s, FSDP_OK);
    EXPECT_NE(last_error_str().find(b.says), std::string::npos) << last_error_str();
    EXPECT_STREQ(out, "untouched");
  }
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_plan(nullptr, nullptr, 0, nullptr));
}
