// The node-local secondary shard (secondary_shard, ZeRO++'s hpZ): after a
// unit's forward gather each rank keeps its slice of the full params sliced
// among its secondary group, and backward's gather reads from that group only.
//
// Each case trains three units for three steps with the option and without
// it, the host's grads a function of the params it reads: in backward every
// rank must read, bit for bit, the params it read in forward; the trained
// masters must be bitwise those of the run without the option. The bytes:
// backward's gathers move nothing over the shard group (fsdp_comm_stats'
// world or shard group bytes drop by exactly one gather of every unit per
// step), and the secondary group moves exactly those gathers' bytes. The
// memory: secondary_params_peak is every unit's slice at once (forward keeps
// all of them until backward), padded / group size values of param_dtype.
// For FULL_SHARD and HYBRID_SHARD, fp32 and bf16, quantized gathers, offload,
// the late host stream; the strategies that keep their params from forward to
// backward are refused, as is a group that does not divide the shard group.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "../kernels/quant.h"
#include "host_stream.h"
#include "rank_runner.h"

using namespace fsdp_test;

namespace {

struct Case {
  const char* sharding;
  int world;
  int shard_group;  // HYBRID_SHARD's shard_group_size (0: the world)
  const char* secondary;
  int group;  // the secondary group size that `secondary` means here
  fsdp_dtype_t dtype;
  const char* gather_dtype = "param";
  bool offload = false;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(c.sharding) + "_world" + std::to_string(c.world) + "_secondary_" + c.secondary + "_" +
         dtype_config_name(c.dtype) + "_gather_" + c.gather_dtype + (c.offload ? "_offload" : "");
}

const std::vector<std::vector<ParamSpec>> kUnits = {
    {{"u0.w", {13, 7}}, {"u0.b", {13}}}, {{"u1.w", {40}}}, {{"u2.w", {9, 11}}, {"u2.b", {3}}}};
constexpr int kSteps = 3;

std::vector<float> init_of(size_t u, size_t p) {
  Rng rng(700 + 10 * u + p);
  return rng.uniform_vec(numel_of(kUnits[u][p].shape), -1.f, 1.f);
}

struct RunResult {
  std::vector<std::vector<std::vector<float>>> masters;  // [unit][param][elem] after the steps
  fsdp_comm_stats_t comm{};
  fsdp_memory_stats_t mem{};
  std::vector<size_t> padded;  // each unit's padded numel
  bool read_back_same = true;  // backward read the forward's params, bit for bit
};

// One rank's training; `secondary` null: the option off.
RunResult train(const Case& c, int rank, fsdp_local_group_t* group, const char* secondary) {
  RunResult out;
  std::map<std::string, std::string> o = {{"sharding", c.sharding},
                                          {"param_dtype", dtype_config_name(c.dtype)},
                                          {"gather_dtype", c.gather_dtype},
                                          {"optimizer", "sgd"},
                                          {"lr", "0.25"},
                                          {"loss_scale", "off"},
                                          {"timeout_s", "30"}};
  if (c.shard_group > 0) o["shard_group_size"] = std::to_string(c.shard_group);
  if (c.offload) o["offload"] = "cpu";
  if (secondary != nullptr) o["secondary_shard"] = secondary;
  ConfigPtr cfg = make_config(o);
  EXPECT_TRUE(cfg);
  fsdp_ctx_t* raw = nullptr;
  EXPECT_OK(fsdp_ctx_create(cfg.get(), group, group ? rank : -1, &raw));
  if (raw == nullptr) return out;
  CtxPtr ctx(raw);
  std::vector<fsdp_unit_t*> units(kUnits.size());
  for (size_t u = 0; u < kUnits.size(); ++u) {
    EXPECT_OK(register_unit(raw, "unit" + std::to_string(u), kUnits[u], &units[u]));
    for (size_t p = 0; p < kUnits[u].size(); ++p) {
      const std::vector<float> v = init_of(u, p);
      EXPECT_OK(fsdp_param_set_values(units[u], p, v.data(), v.size()));
    }
    float* shard = nullptr;
    size_t off = 0, n = 0;
    EXPECT_OK(fsdp_shard_info(units[u], &shard, &off, &n));
    int shard_world = c.shard_group > 0 ? c.shard_group : c.world;
    out.padded.push_back(n * size_t(shard_world));
  }
  EXPECT_OK(fsdp_comm_stats_reset(raw));
  EXPECT_OK(fsdp_memory_stats_reset_peak(raw));
  Host host(raw);
  const fsdp_dtype_t dt = c.dtype;
  for (int step = 0; step < kSteps; ++step) {
    // What forward read of each unit, kept for backward's comparison (read on
    // the host's stream: shared pointers it fills, the host syncs before use).
    auto seen = std::make_shared<std::vector<std::vector<std::vector<float>>>>(kUnits.size());
    for (size_t u = 0; u < kUnits.size(); ++u) {
      EXPECT_OK(fsdp_forward_begin(units[u], host.stream()));
      std::vector<void*> ptrs(kUnits[u].size());
      for (size_t p = 0; p < ptrs.size(); ++p) EXPECT_OK(fsdp_param_ptr(units[u], p, &ptrs[p]));
      host.run([seen, u, ptrs, dt] {
        for (size_t p = 0; p < ptrs.size(); ++p) {
          std::vector<float> v(numel_of(kUnits[u][p].shape));
          for (size_t i = 0; i < v.size(); ++i) v[i] = load_elem(ptrs[p], i, dt);
          (*seen)[u].push_back(std::move(v));
        }
      });
      EXPECT_OK(fsdp_forward_end(units[u], host.stream()));
    }
    auto same = std::make_shared<bool>(true);
    for (size_t u = kUnits.size(); u-- > 0;) {
      EXPECT_OK(fsdp_backward_begin(units[u], host.stream()));
      std::vector<void*> ptrs(kUnits[u].size()), grads(kUnits[u].size());
      for (size_t p = 0; p < ptrs.size(); ++p) {
        EXPECT_OK(fsdp_param_ptr(units[u], p, &ptrs[p]));
        EXPECT_OK(fsdp_grad_ptr(units[u], p, &grads[p]));
      }
      // The grads depend on the params backward reads: a wrong read trains differently.
      host.run([seen, same, u, ptrs, grads, dt, rank] {
        for (size_t p = 0; p < ptrs.size(); ++p) {
          for (size_t i = 0; i < numel_of(kUnits[u][p].shape); ++i) {
            const float v = load_elem(ptrs[p], i, dt);
            if (f32_bits(v) != f32_bits((*seen)[u][p][i])) *same = false;
            add_elem(grads[p], i, dt, 0.5f * v + 0.01f * float(rank + 1));
          }
        }
      });
      EXPECT_OK(fsdp_backward_end(units[u], host.stream()));
    }
    EXPECT_OK(fsdp_step(raw, host.stream()));
    host.sync();
    out.read_back_same = out.read_back_same && *same;
  }
  double norm = 0.0;
  EXPECT_OK(fsdp_last_grad_norm(raw, &norm));  // waits for the last step
  out.comm.struct_size = sizeof out.comm;
  EXPECT_OK(fsdp_comm_stats(raw, &out.comm));
  out.mem.struct_size = sizeof out.mem;
  EXPECT_OK(fsdp_memory_stats(raw, &out.mem));
  for (size_t u = 0; u < kUnits.size(); ++u) {
    out.masters.emplace_back();
    for (size_t p = 0; p < kUnits[u].size(); ++p) {
      std::vector<float> m(numel_of(kUnits[u][p].shape));
      EXPECT_OK(fsdp_gather_param(units[u], p, m.data(), m.size()));
      out.masters.back().push_back(std::move(m));
    }
  }
  EXPECT_OK(fsdp_ctx_finalize(raw));
  return out;
}

size_t packed_gather_bytes(const Case& c, size_t padded, int shard_world) {
  if (std::string(c.gather_dtype) == "param") return padded * dtype_nbytes(c.dtype);
  const size_t slice = padded / size_t(shard_world);  // one block: no frozen params here
  return fsdp::kernels::quant_packed_bytes(slice, 256) * size_t(shard_world);
}

}  // namespace

class SecondaryShard : public ::testing::TestWithParam<Case> {};

TEST_P(SecondaryShard, BackwardReadsForwardsParamsFromTheGroupAndTrainsBitwiseAsWithout) {
  const Case c = GetParam();
  const int shard_world = c.shard_group > 0 ? c.shard_group : c.world;
  const bool hybrid = std::string(c.sharding).rfind("HYBRID", 0) == 0;
  run_ranks(c.world, [&](int rank, fsdp_local_group_t* group) {
    const RunResult off = train(c, rank, group, nullptr);
    const RunResult on = train(c, rank, group, c.secondary);
    if (::testing::Test::HasFailure()) return;
    EXPECT_TRUE(on.read_back_same) << "backward read other params than forward";
    EXPECT_TRUE(off.read_back_same);
    for (size_t u = 0; u < kUnits.size(); ++u) {
      for (size_t p = 0; p < kUnits[u].size(); ++p) {
        for (size_t i = 0; i < on.masters[u][p].size(); ++i) {
          ASSERT_EQ(f32_bits(on.masters[u][p][i]), f32_bits(off.masters[u][p][i]))
              << kUnits[u][p].name << "[" << i << "]: trained differently with secondary_shard";
        }
      }
    }
    // The gathers' bytes per step: forward's over the shard group in both
    // runs, backward's over the shard group without the option and over the
    // secondary group with it (the full buffer, in param_dtype).
    uint64_t fwd = 0, bwd = 0, slices = 0;
    for (size_t padded : on.padded) {
      fwd += packed_gather_bytes(c, padded, shard_world);
      bwd += padded * dtype_nbytes(c.dtype);
      slices += padded / size_t(c.group) * dtype_nbytes(c.dtype);
    }
    const uint64_t off_bwd =
        std::string(c.gather_dtype) == "param" ? bwd : fwd;  // without: backward gathers as forward
    EXPECT_EQ(off.comm.all_gather_nbytes, kSteps * (fwd + off_bwd));
    EXPECT_EQ(on.comm.all_gather_nbytes, kSteps * (fwd + bwd));
    EXPECT_EQ(on.comm.secondary_group_nbytes, kSteps * bwd) << "backward's gathers, inside the secondary group";
    EXPECT_EQ(off.comm.secondary_group_nbytes, 0u);
    const uint64_t shard_side_on = hybrid ? on.comm.shard_group_nbytes : on.comm.world_group_nbytes;
    const uint64_t shard_side_off = hybrid ? off.comm.shard_group_nbytes : off.comm.world_group_nbytes;
    EXPECT_EQ(shard_side_off - shard_side_on, kSteps * off_bwd) << "backward's gathers left the shard group entirely";
    EXPECT_EQ(on.comm.replica_group_nbytes, off.comm.replica_group_nbytes);
    EXPECT_EQ(on.comm.reduce_scatter_nbytes, off.comm.reduce_scatter_nbytes);
    // Every unit's slice is held between its forward and its backward: at the
    // last unit's forward, all of them.
    EXPECT_EQ(on.mem.secondary_params_peak_nbytes, slices);
    EXPECT_EQ(off.mem.secondary_params_peak_nbytes, 0u);
    if (late_host_us() == 0) {
      EXPECT_EQ(on.mem.secondary_params_nbytes, 0u) << "backward frees each slice";
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Strategies, SecondaryShard,
                         ::testing::Values(Case{"FULL_SHARD", 4, 0, "2", 2, FSDP_DTYPE_FP32},
                                           Case{"FULL_SHARD", 4, 0, "2", 2, FSDP_DTYPE_BF16, "int8"},
                                           Case{"FULL_SHARD", 4, 0, "node", 4,
                                                FSDP_DTYPE_BF16},  // threads: one host of 4
                                           Case{"FULL_SHARD", 2, 0, "1", 1, FSDP_DTYPE_FP32, "param", true},
                                           Case{"FULL_SHARD", 3, 0, "1", 1, FSDP_DTYPE_BF16, "fp8_e4m3"},
                                           Case{"HYBRID_SHARD", 4, 2, "1", 1, FSDP_DTYPE_BF16},
                                           Case{"HYBRID_SHARD", 4, 4, "2", 2, FSDP_DTYPE_FP32, "param", true}),
                         case_name);

TEST(SecondaryShardRefusals, StrategiesWithoutABackwardGatherAndGroupsThatDoNotDivideAreRefused) {
  for (const char* sharding : {"SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2", "NO_SHARD"}) {
    SCOPED_TRACE(sharding);
    run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
      ConfigPtr cfg = make_config({{"sharding", sharding}, {"secondary_shard", "node"}, {"timeout_s", "30"}});
      ASSERT_TRUE(cfg);
      fsdp_ctx_t* raw = nullptr;
      EXPECT_STATUS(FSDP_ERR_UNSUPPORTED, fsdp_ctx_create(cfg.get(), group, group ? rank : -1, &raw));
      EXPECT_EQ(raw, nullptr);
      EXPECT_NE(last_error_str().find("secondary_shard"), std::string::npos) << last_error_str();
      EXPECT_NE(last_error_str().find(sharding), std::string::npos) << last_error_str();
    });
  }
  run_ranks(4, [&](int rank, fsdp_local_group_t* group) {
    ConfigPtr cfg = make_config({{"secondary_shard", "3"}, {"timeout_s", "30"}});
    ASSERT_TRUE(cfg);
    fsdp_ctx_t* raw = nullptr;
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_ctx_create(cfg.get(), group, group ? rank : -1, &raw));
    EXPECT_NE(last_error_str().find("divides the shard group's 4 ranks, not 3"), std::string::npos) << last_error_str();
  });
  ConfigPtr cfg = make_config({});
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_set(cfg.get(), "secondary_shard", "nodes"));
  EXPECT_NE(last_error_str().find("off, node, or a group size"), std::string::npos) << last_error_str();
  ASSERT_OK(fsdp_config_set(cfg.get(), "secondary_shard", "node"));
  char got[16] = {};
  ASSERT_OK(fsdp_config_get(cfg.get(), "secondary_shard", got, sizeof got, nullptr));
  EXPECT_STREQ(got, "node");
}
