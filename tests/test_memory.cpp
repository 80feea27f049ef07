// Proves that sharding divides per-rank memory by the world size (exactly, per the flat layout rule) and that
// FULL_SHARD holds one gathered unit at a time. The host's compute (its grads)
// goes through tests/host_stream.h's Host: at once, or late on a host stream
// (the .late CTests), where each figure must hold as well.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "host_stream.h"
#include "rank_runner.h"

using namespace fsdp_test;

namespace {

// Four units of different sizes; the second is the largest.
const std::vector<std::vector<ParamSpec>> kUnits = {
    {{"l0.weight", {33, 17}}, {"l0.bias", {33}}},
    {{"l1.weight", {64, 33}}, {"l1.bias", {64}}},
    {{"l2.weight", {7, 64}}, {"l2.bias", {7}}},
    {{"l3.weight", {5, 7}}, {"l3.bias", {5}}, {"l3.scale", {1}}},
};

size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

// The documented layout: params in order, each start aligned to
// align_bytes/4 elements, total a multiple of world * align_bytes/4.
struct Layout {
  std::vector<size_t> offsets, numels;
  size_t padded = 0;
};

Layout layout_of(const std::vector<ParamSpec>& params, size_t align_bytes, int world) {
  const size_t a = align_bytes / 4;
  Layout l;
  size_t off = 0;
  for (const auto& p : params) {
    off = round_up(off, a);
    l.offsets.push_back(off);
    l.numels.push_back(numel_of(p.shape));
    off += l.numels.back();
  }
  l.padded = round_up(off, size_t(world) * a);
  return l;
}

// The hybrid strategies run here with shard groups of this many ranks.
constexpr int kHybridGroup = 2;

bool is_hybrid(const std::string& sharding) { return sharding.rfind("HYBRID_SHARD", 0) == 0; }

// The ranks a unit is sharded over.
int shard_world_of(const std::string& sharding, int world) {
  if (sharding == "NO_SHARD") return 1;
  return is_hybrid(sharding) ? kHybridGroup : world;
}

// Options of a strategy, with the shard group size the hybrid ones need.
std::map<std::string, std::string> sharding_options(const std::string& sharding) {
  std::map<std::string, std::string> o = {{"sharding", sharding}};
  if (is_hybrid(sharding)) o["shard_group_size"] = std::to_string(kHybridGroup);
  return o;
}

// Elements of the flat buffer this rank holds as its shard.
size_t shard_numel(const std::vector<ParamSpec>& params, const std::string& sharding, int world, size_t align = 64) {
  const int sw = shard_world_of(sharding, world);
  return layout_of(params, align, sw).padded / size_t(sw);
}

size_t full_numel(const std::vector<ParamSpec>& params, const std::string& sharding, int world, size_t align = 64) {
  return layout_of(params, align, shard_world_of(sharding, world)).padded;
}

fsdp_memory_stats_t stats_of(fsdp_ctx_t* ctx) {
  fsdp_memory_stats_t s;
  std::memset(&s, 0xAB, sizeof s);
  s.struct_size = sizeof s;
  EXPECT_OK(fsdp_memory_stats(ctx, &s));
  return s;
}

struct RankSetup {
  CtxPtr ctx;
  std::vector<fsdp_unit_t*> units;
  Host host;  // after ctx: drained before the context goes
};

// Creates the ctx and registers kUnits with random values.
void setup(RankSetup& s, const std::map<std::string, std::string>& opts, fsdp_local_group_t* group, int rank,
           const std::vector<std::vector<ParamSpec>>& units = kUnits) {
  ConfigPtr cfg = make_config(opts);
  ASSERT_TRUE(cfg);
  fsdp_ctx_t* raw = nullptr;
  ASSERT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
  s.ctx.reset(raw);
  s.host.attach(raw);
  Rng rng(5);
  for (size_t u = 0; u < units.size(); ++u) {
    fsdp_unit_t* unit = nullptr;
    ASSERT_OK(register_unit(raw, "unit" + std::to_string(u), units[u], &unit));
    s.units.push_back(unit);
    for (size_t i = 0; i < units[u].size(); ++i) {
      const auto v = rng.uniform_vec(numel_of(units[u][i].shape), -1.f, 1.f);
      ASSERT_OK(fsdp_param_set_values(unit, i, v.data(), v.size()));
    }
  }
}

// The host's grad of one unit: 1 added to its first element.
void add_grad(RankSetup& s, fsdp_unit_t* u) {
  void* g = nullptr;
  ASSERT_OK(fsdp_grad_ptr(u, 0, &g));
  fsdp_dtype_t dt = FSDP_DTYPE_FP32;
  ASSERT_OK(fsdp_ctx_param_dtype(s.ctx.get(), &dt));
  s.host.run([g, dt] { add_elem(g, 0, dt, 1.f); });
}

// One forward + backward pass (grads: ones) and a step.
// fsdp_step returns once the step is queued: on a late host stream the
// reductions before it and its update may still run (and hold scratch). A
// read of its results waits for them: from then on it is "between steps".
void settle_step(fsdp_ctx_t* ctx) {
  double norm = 0.0;
  ASSERT_OK(fsdp_last_grad_norm(ctx, &norm));
}

void train_step(RankSetup& s) {
  for (auto* u : s.units) {
    ASSERT_OK(fsdp_forward_begin(u, s.host.stream()));
    ASSERT_OK(fsdp_forward_end(u, s.host.stream()));
  }
  for (size_t k = s.units.size(); k-- > 0;) {
    ASSERT_OK(fsdp_backward_begin(s.units[k], s.host.stream()));
    ASSERT_NO_FATAL_FAILURE(add_grad(s, s.units[k]));
    ASSERT_OK(fsdp_backward_end(s.units[k], s.host.stream()));
  }
  ASSERT_OK(fsdp_step(s.ctx.get(), s.host.stream()));
  settle_step(s.ctx.get());
}

// ---- sharded bytes: FULL_SHARD x 4 == HYBRID_SHARD (2 x 2) x 2 == NO_SHARD up to padding

// By default (keep_param_dtype_shard=auto) a strategy that gathers keeps no
// bf16 copy of its shard: 4 bytes of params per shard element, as the fp32
// master alone; NO_SHARD's copy is the full params the host reads (6 bytes);
// with offload=cpu the copy stays (the host side of each gather's copy).
TEST(ShardedBytesByDefault, StrategiesThatGatherHoldTheFp32MasterAlone) {
  const int world = 4;
  for (const std::string sharding : {"FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD", "FULL_SHARD+offload"}) {
    const bool offload = sharding == "FULL_SHARD+offload";
    const std::string strategy = offload ? "FULL_SHARD" : sharding;
    size_t shard = 0;
    for (const auto& u : kUnits) shard += shard_numel(u, strategy, world);
    const size_t per_elem = strategy == "NO_SHARD" || offload ? 6 : 4;
    run_ranks(world, [&](int rank, fsdp_local_group_t* group) {
      RankSetup s;
      auto opts = sharding_options(strategy);
      opts["param_dtype"] = "bf16";
      if (offload) opts["offload"] = "cpu";
      setup(s, opts, group, rank);
      if (::testing::Test::HasFatalFailure()) return;
      train_step(s);
      if (::testing::Test::HasFatalFailure()) return;
      EXPECT_EQ(stats_of(s.ctx.get()).sharded_params_nbytes, shard * per_elem) << sharding;
      EXPECT_OK(fsdp_ctx_finalize(s.ctx.get()));
    });
  }
}

class ShardedBytes : public ::testing::TestWithParam<fsdp_dtype_t> {};

TEST_P(ShardedBytes, FullShardHoldsAQuarterAndHybridHalfOfNoShardUpToPadding) {
  const fsdp_dtype_t dt = GetParam();
  const int world = 4;
  const size_t master_plus_copy = 4 + (dt == FSDP_DTYPE_FP32 ? 0 : 2);
  std::map<std::string, size_t> per_rank_total;  // sharding -> params + grads + optimizer bytes
  for (const std::string sharding : {"FULL_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2", "NO_SHARD"}) {
    size_t shard = 0;
    for (const auto& u : kUnits) shard += shard_numel(u, sharding, world);
    std::vector<size_t> totals(world);
    run_ranks(world, [&](int rank, fsdp_local_group_t* group) {
      RankSetup s;
      auto opts = sharding_options(sharding);
      opts["param_dtype"] = dtype_config_name(dt);
      opts["optimizer"] = "adamw";
      opts["keep_param_dtype_shard"] = "1";  // every strategy holds the same kinds (the default: below)
      setup(s, opts, group, rank);
      if (::testing::Test::HasFatalFailure()) return;
      train_step(s);  // optimizer state may be allocated at the first step
      if (::testing::Test::HasFatalFailure()) return;
      const fsdp_memory_stats_t m = stats_of(s.ctx.get());
      EXPECT_EQ(m.sharded_params_nbytes, shard * master_plus_copy) << sharding;
      EXPECT_EQ(m.sharded_grads_nbytes, shard * 4) << sharding;
      EXPECT_EQ(m.optimizer_state_nbytes, shard * 8) << sharding;
      EXPECT_GE(m.total_nbytes, m.sharded_params_nbytes + m.sharded_grads_nbytes + m.optimizer_state_nbytes);
      EXPECT_GE(m.total_peak_nbytes, m.total_nbytes);
      totals[size_t(rank)] = m.sharded_params_nbytes + m.sharded_grads_nbytes + m.optimizer_state_nbytes;
      EXPECT_OK(fsdp_ctx_finalize(s.ctx.get()));
    });
    share(totals);
    for (int r = 1; r < world; ++r) EXPECT_EQ(totals[size_t(r)], totals[0]) << sharding << " rank " << r;
    per_rank_total[sharding] = totals[0];
  }
  // The same comparison as a ratio: the only difference is padding.
  size_t unpadded = 0, pad4 = 0;
  for (const auto& u : kUnits) {
    for (const auto& p : u) unpadded += numel_of(p.shape);
    pad4 += full_numel(u, "FULL_SHARD", world);
  }
  const double full_x4 = 4.0 * double(per_rank_total["FULL_SHARD"]);
  const double no_shard = double(per_rank_total["NO_SHARD"]);
  EXPECT_LE(std::fabs(full_x4 / no_shard - 1.0), double(pad4 - unpadded) / double(unpadded))
      << "FULL_SHARD x 4 = " << full_x4 << " bytes, NO_SHARD = " << no_shard << " bytes";
  EXPECT_LT(full_x4 / no_shard, 1.1);
  // Hybrid: sharded over groups of 2, so half of NO_SHARD's, up to its padding.
  size_t pad2 = 0;
  for (const auto& u : kUnits) pad2 += full_numel(u, "HYBRID_SHARD", world);
  for (const char* hybrid : {"HYBRID_SHARD", "HYBRID_SHARD_ZERO2"}) {
    const double hybrid_x2 = 2.0 * double(per_rank_total[hybrid]);
    EXPECT_LE(std::fabs(hybrid_x2 / no_shard - 1.0), double(pad2 - unpadded) / double(unpadded))
        << hybrid << " x 2 = " << hybrid_x2 << " bytes, NO_SHARD = " << no_shard << " bytes";
    EXPECT_LT(hybrid_x2 / no_shard, 1.1) << hybrid;
  }
}

INSTANTIATE_TEST_SUITE_P(ParamDtypes, ShardedBytes, ::testing::Values(FSDP_DTYPE_FP32, FSDP_DTYPE_BF16),
                         [](const ::testing::TestParamInfo<fsdp_dtype_t>& pi) {
                           return std::string(dtype_config_name(pi.param));
                         });

// ---- gathered params and unsharded grads during a pass ----------------------

class GatheredBytes : public ::testing::TestWithParam<std::tuple<std::string, fsdp_dtype_t>> {};

TEST_P(GatheredBytes, FullShardGathersOneUnitAtATimeShardGradOpKeepsAllUntilBackward) {
  const std::string sharding = std::get<0>(GetParam());
  const fsdp_dtype_t dt = std::get<1>(GetParam());
  const int world = 4;
  const bool full = sharding == "FULL_SHARD" || sharding == "HYBRID_SHARD";  // free after forward
  std::vector<size_t> unit_bytes;                                            // full padded numel * sizeof(param_dtype)
  size_t largest = 0, sum = 0;
  for (const auto& u : kUnits) {
    unit_bytes.push_back(full_numel(u, sharding, world) * dtype_nbytes(dt));
    largest = std::max(largest, unit_bytes.back());
    sum += unit_bytes.back();
  }
  run_ranks(world, [&](int rank, fsdp_local_group_t* group) {
    RankSetup s;
    // No prefetch: the exact one-unit (FULL_SHARD) peak; test_overlap covers prefetch.
    auto opts = sharding_options(sharding);
    opts["param_dtype"] = dtype_config_name(dt);
    opts["backward_prefetch"] = "none";
    setup(s, opts, group, rank);
    if (::testing::Test::HasFatalFailure()) return;
    fsdp_ctx_t* ctx = s.ctx.get();
    EXPECT_EQ(stats_of(ctx).gathered_params_nbytes, 0u) << "nothing is gathered before the first forward";
    ASSERT_OK(fsdp_memory_stats_reset_peak(ctx));
    size_t gathered_so_far = 0;
    for (size_t u = 0; u < s.units.size(); ++u) {
      ASSERT_OK(fsdp_forward_begin(s.units[u], s.host.stream()));
      gathered_so_far += unit_bytes[u];
      EXPECT_EQ(stats_of(ctx).gathered_params_nbytes, full ? unit_bytes[u] : gathered_so_far)
          << "in forward of unit " << u;
      ASSERT_OK(fsdp_forward_end(s.units[u], s.host.stream()));
      if (full) {
        EXPECT_EQ(stats_of(ctx).gathered_params_nbytes, 0u) << "after forward_end of unit " << u;
      }
    }
    EXPECT_EQ(stats_of(ctx).gathered_params_nbytes, full ? 0 : sum) << "between forward and backward";
    for (size_t u = s.units.size(); u-- > 0;) {
      ASSERT_OK(fsdp_backward_begin(s.units[u], s.host.stream()));
      const fsdp_memory_stats_t m = stats_of(ctx);
      // The previous unit's reduction may still run on the comm stream (at
      // most one runs behind the unit being computed, by design).
      const size_t behind = u + 1 < s.units.size() ? unit_bytes[u + 1] : 0;
      EXPECT_GE(m.unsharded_grads_nbytes, unit_bytes[u]) << "in backward of unit " << u;
      EXPECT_LE(m.unsharded_grads_nbytes, unit_bytes[u] + behind) << "in backward of unit " << u;
      ASSERT_NO_FATAL_FAILURE(add_grad(s, s.units[u]));
      ASSERT_OK(fsdp_backward_end(s.units[u], s.host.stream()));
    }
    ASSERT_OK(fsdp_step(ctx, s.host.stream()));
    settle_step(ctx);  // late, the step's scratch is freed only once it ran
    const fsdp_memory_stats_t m = stats_of(ctx);
    EXPECT_EQ(m.gathered_params_peak_nbytes, full ? largest : sum);
    size_t largest_pair = 0;
    for (size_t u = 0; u < unit_bytes.size(); ++u) {
      largest_pair = std::max(largest_pair, unit_bytes[u] + (u + 1 < unit_bytes.size() ? unit_bytes[u + 1] : 0));
    }
    EXPECT_GE(m.unsharded_grads_peak_nbytes, largest);
    EXPECT_LE(m.unsharded_grads_peak_nbytes, largest_pair);
    EXPECT_EQ(m.gathered_params_nbytes, 0u) << "after the step";
    EXPECT_EQ(m.unsharded_grads_nbytes, 0u) << "after the step";
    EXPECT_GE(m.total_peak_nbytes, m.sharded_params_nbytes + m.sharded_grads_nbytes + m.gathered_params_peak_nbytes);
    // Peaks restart from the current values.
    ASSERT_OK(fsdp_memory_stats_reset_peak(ctx));
    const fsdp_memory_stats_t r = stats_of(ctx);
    EXPECT_EQ(r.gathered_params_peak_nbytes, 0u);
    EXPECT_EQ(r.unsharded_grads_peak_nbytes, 0u);
    EXPECT_EQ(r.total_peak_nbytes, r.total_nbytes);
    EXPECT_OK(fsdp_ctx_finalize(ctx));
  });
}

INSTANTIATE_TEST_SUITE_P(ShardingByDtype, GatheredBytes,
                         ::testing::Combine(::testing::Values("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD",
                                                              "HYBRID_SHARD_ZERO2"),
                                            ::testing::Values(FSDP_DTYPE_FP32, FSDP_DTYPE_BF16)),
                         [](const ::testing::TestParamInfo<GatheredBytes::ParamType>& pi) {
                           return std::get<0>(pi.param) + "_" + dtype_config_name(std::get<1>(pi.param));
                         });

// ---- optimizer state ---------------------------------------------------------

TEST(OptimizerState, BytesPerShardElementFollowTheOptimizer) {
  struct Opt {
    const char* label;
    std::map<std::string, std::string> opts;
    size_t bytes_per_elem;
  };
  const std::vector<Opt> opts = {{"sgd", {{"optimizer", "sgd"}}, 0},
                                 {"sgd+momentum", {{"optimizer", "sgd"}, {"momentum", "0.9"}}, 4},
                                 {"adam", {{"optimizer", "adam"}}, 8},
                                 {"adamw", {{"optimizer", "adamw"}}, 8}};
  const int world = 3;
  size_t shard = 0;
  for (const auto& u : kUnits) shard += shard_numel(u, "FULL_SHARD", world);
  for (const auto& o : opts) {
    run_ranks(world, [&](int rank, fsdp_local_group_t* group) {
      RankSetup s;
      setup(s, o.opts, group, rank);
      if (::testing::Test::HasFatalFailure()) return;
      train_step(s);
      if (::testing::Test::HasFatalFailure()) return;
      EXPECT_EQ(stats_of(s.ctx.get()).optimizer_state_nbytes, shard * o.bytes_per_elem) << o.label;
      EXPECT_OK(fsdp_ctx_finalize(s.ctx.get()));
    });
  }
}

// ---- layout ---------------------------------------------------------------------

class LayoutRule : public ::testing::TestWithParam<std::tuple<int, int, std::string>> {};

TEST_P(LayoutRule, ShardInfoAndFlatRangesFollowAlignmentAndPadding) {
  const int align = std::get<0>(GetParam());
  const int world = std::get<1>(GetParam());
  const std::string sharding = std::get<2>(GetParam());
  const bool no_shard = sharding == "NO_SHARD";
  FSDP_SKIP_WHEN_LATE(
      "no host compute and no call that takes a stream: set_values and the layout are read back "
      "on the calling thread alone");
  run_ranks(world, [&](int rank, fsdp_local_group_t* group) {
    RankSetup s;
    setup(s, {{"sharding", sharding}, {"align_bytes", std::to_string(align)}}, group, rank);
    if (::testing::Test::HasFatalFailure()) return;
    Rng rng(5);  // the values setup() wrote
    for (size_t u = 0; u < kUnits.size(); ++u) {
      const Layout l = layout_of(kUnits[u], size_t(align), no_shard ? 1 : world);
      std::vector<float> flat(l.padded, 0.f);  // padding is zero
      for (size_t i = 0; i < kUnits[u].size(); ++i) {
        size_t off = 1234567, n = 1234567;
        EXPECT_OK(fsdp_param_flat_range(s.units[u], i, &off, &n));
        EXPECT_EQ(off, l.offsets[i]) << "unit " << u << " param " << i;
        EXPECT_EQ(n, l.numels[i]) << "unit " << u << " param " << i;
        const auto v = rng.uniform_vec(l.numels[i], -1.f, 1.f);
        std::copy(v.begin(), v.end(), flat.begin() + std::ptrdiff_t(l.offsets[i]));
      }
      float* ptr = nullptr;
      size_t off = 1234567, n = 1234567;
      ASSERT_OK(fsdp_shard_info(s.units[u], &ptr, &off, &n));
      const size_t shard = no_shard ? l.padded : l.padded / size_t(world);
      EXPECT_EQ(n, shard) << "unit " << u;
      EXPECT_EQ(off, no_shard ? 0 : size_t(rank) * shard) << "unit " << u;
      ASSERT_NE(ptr, nullptr);
      if (n != shard || off + n > l.padded) continue;
      for (size_t k = 0; k < n; ++k) EXPECT_EQ(ptr[k], flat[off + k]) << "unit " << u << " flat element " << off + k;
    }
    EXPECT_OK(fsdp_ctx_finalize(s.ctx.get()));
  });
}

INSTANTIATE_TEST_SUITE_P(AlignByWorldBySharding, LayoutRule,
                         ::testing::Combine(::testing::Values(4, 64, 256), ::testing::Values(1, 3, 4),
                                            ::testing::Values(std::string("FULL_SHARD"), std::string("NO_SHARD"))),
                         [](const ::testing::TestParamInfo<LayoutRule::ParamType>& pi) {
                           return "align" + std::to_string(std::get<0>(pi.param)) + "_world" +
                                  std::to_string(std::get<1>(pi.param)) + "_" + std::get<2>(pi.param);
                         });

// ---- offload=cpu: what lives on the device and what on the host ---------------

class OffloadPools : public ::testing::TestWithParam<std::tuple<std::string, fsdp_dtype_t>> {};

TEST_P(OffloadPools, DeviceHoldsOnlyGatheredParamsAndGradsInFlightHostHoldsAllState) {
  const std::string sharding = std::get<0>(GetParam());
  const fsdp_dtype_t dt = std::get<1>(GetParam());
  const int world = 2;
  std::vector<size_t> unit_bytes;
  for (const auto& u : kUnits) unit_bytes.push_back(full_numel(u, sharding, world) * dtype_nbytes(dt));
  for (const bool offload : {false, true}) {
    SCOPED_TRACE(offload ? "offload=cpu" : "offload=none");
    run_ranks(world, [&](int rank, fsdp_local_group_t* group) {
      RankSetup s;
      auto opts = sharding_options(sharding);
      opts["param_dtype"] = dtype_config_name(dt);
      opts["backward_prefetch"] = "none";
      opts["offload"] = offload ? "cpu" : "none";
      setup(s, opts, group, rank);
      if (::testing::Test::HasFatalFailure()) return;
      train_step(s);
      if (::testing::Test::HasFatalFailure()) return;
      fsdp_ctx_t* ctx = s.ctx.get();
      const fsdp_memory_stats_t m = stats_of(ctx);
      const size_t state = m.sharded_params_nbytes + m.sharded_grads_nbytes + m.optimizer_state_nbytes;
      ASSERT_GT(m.optimizer_state_nbytes, 0u);
      EXPECT_EQ(m.device_nbytes + m.host_nbytes, m.total_nbytes);
      // Between steps nothing else is allocated: the pools hold exactly the
      // state, and the device the slots kept for the next step.
      EXPECT_EQ(m.device_nbytes, (offload ? 0 : state) + m.free_slots_nbytes) << "device pool between steps";
      EXPECT_EQ(m.host_nbytes, offload ? state : 0) << "host pool between steps";
      if (offload) {
        EXPECT_GE(m.host_peak_nbytes, state);
        // (The device's peak is the slots and one pass's scratch; at this size
        // and world 2 that can reach the host's state, so no ratio is asserted:
        // the figures between steps above say where the state lives.)
      }
      // During forward the device holds this unit's full params, and nothing
      // else beyond the state it held anyway (the staged shard is freed).
      const size_t resident = offload ? 0 : state;
      for (size_t u = 0; u < s.units.size(); ++u) {
        ASSERT_OK(fsdp_forward_begin(s.units[u], s.host.stream()));
        if (s.host.late()) {
          // Late, forward_begin returned before the gather ran (as on a GPU):
          // the shard's transient stage that the gather reads (offload's copy
          // on the device, or bf16's cast of the fp32 master: half the unit's
          // bytes at world 2) is held while the gather's task runs, in both
          // modes, so the device may hold that much more now. The figures
          // below are those the host's compute of the unit sees, once its
          // stream has waited for the gather (on the NULL stream,
          // forward_begin itself waits).
          const fsdp_memory_stats_t early = stats_of(ctx);
          EXPECT_GE(early.device_nbytes - resident - early.free_slots_nbytes, early.gathered_params_nbytes)
              << "in forward of unit " << u << ", before the gather ran";
          s.host.sync();
        }
        const fsdp_memory_stats_t f = stats_of(ctx);
        EXPECT_EQ(f.device_nbytes - resident - f.free_slots_nbytes, f.gathered_params_nbytes)
            << "in forward of unit " << u;
        // (NO_SHARD without offload computes on its shards: nothing is gathered.)
        if (offload || sharding != "NO_SHARD") {
          EXPECT_GE(f.gathered_params_nbytes, unit_bytes[u]) << "in forward of unit " << u;
        }
        EXPECT_EQ(f.host_nbytes, offload ? state : 0) << "in forward of unit " << u;
        ASSERT_OK(fsdp_forward_end(s.units[u], s.host.stream()));
      }
      for (size_t u = s.units.size(); u-- > 0;) {
        ASSERT_OK(fsdp_backward_begin(s.units[u], s.host.stream()));
        ASSERT_OK(fsdp_backward_end(s.units[u], s.host.stream()));
      }
      ASSERT_OK(fsdp_step(ctx, s.host.stream()));
      settle_step(ctx);
      const fsdp_memory_stats_t after = stats_of(ctx);
      EXPECT_EQ(after.device_nbytes, resident + after.free_slots_nbytes) << "after the second step";
      EXPECT_EQ(after.free_slots_nbytes, m.free_slots_nbytes) << "the second step made no slot";
      EXPECT_EQ(after.host_nbytes, offload ? state : 0) << "after the second step";
      EXPECT_OK(fsdp_ctx_finalize(ctx));
    });
  }
}

INSTANTIATE_TEST_SUITE_P(ShardingByDtype, OffloadPools,
                         ::testing::Combine(::testing::Values("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"),
                                            ::testing::Values(FSDP_DTYPE_FP32, FSDP_DTYPE_BF16)),
                         [](const ::testing::TestParamInfo<OffloadPools::ParamType>& pi) {
                           return std::get<0>(pi.param) + "_" + dtype_config_name(std::get<1>(pi.param)) + "_world2";
                         });

// ---- the stats struct is versioned by struct_size ----------------------------

TEST(MemoryStats, FieldsPastAnOlderCallersStructSizeAreNotWritten) {
  run_ranks(1, [&](int rank, fsdp_local_group_t* group) {
    RankSetup s;
    setup(s, {}, group, rank);
    if (::testing::Test::HasFatalFailure()) return;
    train_step(s);
    if (::testing::Test::HasFatalFailure()) return;
    const fsdp_memory_stats_t full = stats_of(s.ctx.get());
    ASSERT_GT(full.sharded_params_nbytes, 0u);
    fsdp_memory_stats_t old;
    std::memset(&old, 0xAB, sizeof old);
    size_t sentinel;
    std::memset(&sentinel, 0xAB, sizeof sentinel);
    old.struct_size = offsetof(fsdp_memory_stats_t, optimizer_state_nbytes);
    ASSERT_OK(fsdp_memory_stats(s.ctx.get(), &old));
    EXPECT_EQ(old.sharded_params_nbytes, full.sharded_params_nbytes);
    EXPECT_EQ(old.sharded_grads_nbytes, full.sharded_grads_nbytes);
    EXPECT_EQ(old.optimizer_state_nbytes, sentinel);
    EXPECT_EQ(old.gathered_params_nbytes, sentinel);
    EXPECT_EQ(old.total_peak_nbytes, sentinel);
    EXPECT_OK(fsdp_ctx_finalize(s.ctx.get()));
  });
}

// ---- handle lifetime ---------------------------------------------------------------

TEST(LocalGroup, MayBeDestroyedBeforeItsContexts) {
  FSDP_SKIP_WHEN_LATE("no host compute: the test is about the local group's lifetime under its contexts");
  fsdp_local_group_t* group = nullptr;
  ASSERT_OK(fsdp_local_group_create(2, &group));
  std::atomic<int> created{0};
  std::atomic<bool> destroyed{false};
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      SCOPED_TRACE("rank " + std::to_string(rank));
      ConfigPtr cfg = make_config({{"timeout_s", "10"}, {"optimizer", "sgd"}});
      fsdp_ctx_t* raw = nullptr;
      EXPECT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
      CtxPtr ctx(raw);
      created++;
      while (!destroyed.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      // The group's memory must still be there for these collectives.
      fsdp_unit_t* u = nullptr;
      EXPECT_OK(register_unit(raw, "u", kUnits[0], &u));
      EXPECT_OK(fsdp_step(raw, nullptr));
      EXPECT_OK(fsdp_ctx_finalize(raw));
    });
  }
  while (created.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  fsdp_local_group_destroy(group);
  destroyed = true;
  for (auto& t : threads) t.join();
}

}  // namespace

// ---- gather and grad slots ---------------------------------------------------

// Gather and grad buffers are slots made in the first two steps (the second
// is the first that prefetches, in the order the first recorded) and reused
// after: later steps make none, and the slots kept are bounded as documented
// (docs/architecture.md, "Slots"): per unit size, no more gather slots than
// limit_all_gathers + 1 units of that size (FULL_SHARD) or all of them
// (SHARD_GRAD_OP, kept from forward to backward), and no more grad slots than
// two units of that size.
TEST(Slots, AreMadeInTheFirstTwoStepsOnlyAndBoundedByTheSchedule) {
  for (const std::string sharding : {"FULL_SHARD", "SHARD_GRAD_OP"}) {
    SCOPED_TRACE(sharding);
    const int world = 2, limit = 2;
    // Three units of one size and one of another: sizes repeat as in a stack of blocks.
    const std::vector<std::vector<ParamSpec>> units = {
        {{"a.weight", {32, 32}}}, {{"b.weight", {32, 32}}}, {{"c.weight", {32, 32}}}, {{"d.weight", {9, 7}}}};
    std::map<size_t, size_t> count_by_bytes;
    for (const auto& u : units) ++count_by_bytes[full_numel(u, sharding, world) * 4];
    size_t bound = 0;
    for (const auto& [bytes, n] : count_by_bytes) {
      size_t gathers = sharding == "FULL_SHARD" ? std::min(n, size_t(limit + 1)) : n;
      bound += bytes * (gathers + std::min(n, size_t(2)));
    }
    run_ranks(world, [&](int rank, fsdp_local_group_t* group) {
      RankSetup s;
      auto opts = sharding_options(sharding);
      opts["forward_prefetch"] = "1";
      opts["limit_all_gathers"] = std::to_string(limit);
      setup(s, opts, group, rank, units);
      if (::testing::Test::HasFatalFailure()) return;
      for (int step = 0; step < 2; ++step) {
        train_step(s);
        if (::testing::Test::HasFatalFailure()) return;
      }
      const size_t made = stats_of(s.ctx.get()).free_slots_nbytes;
      EXPECT_GT(made, 0u);
      EXPECT_LE(made, bound);
      for (int step = 2; step < 5; ++step) {
        train_step(s);
        if (::testing::Test::HasFatalFailure()) return;
        const fsdp_memory_stats_t m = stats_of(s.ctx.get());
        EXPECT_EQ(m.free_slots_nbytes, made) << "step " << step + 1 << " made a slot";
        EXPECT_EQ(m.gathered_params_nbytes, 0u);
        EXPECT_EQ(m.unsharded_grads_nbytes, 0u);
      }
      EXPECT_OK(fsdp_ctx_finalize(s.ctx.get()));
    });
  }
}
