// gather_dtype_exclude: with quantized gathers (gather_dtype=int8|fp8_e4m3),
// the units whose names its patterns match gather param_dtype values, the
// others gather the codes. What each rank reads through fsdp_param_ptr is
// checked against the test's own model of both (the excluded unit: the fp32
// master rounded once to param_dtype; the others: each rank's slice of the
// master quantized in blocks by quant_ref.h, dequantized, rounded), and the
// forward gathers' bytes against each unit's own count (param_dtype bytes
// for the excluded unit, the packed codes and scales for the others). Then
// the refusals: the option without quantized gathers, a pattern that matches
// no registered unit (at the first step, before anything changes), ranks
// that disagree on it.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "../kernels/quant.h"
#include "quant_ref.h"
#include "rank_runner.h"

using namespace fsdp_test;
namespace k = fsdp::kernels;

namespace {

struct Case {
  const char* sharding;
  int world;
  fsdp_dtype_t dtype;
  k::QType qtype;
  bool offload;
  int secondary;  // secondary_shard's group size, 0 off
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(c.sharding) + "_world" + std::to_string(c.world) + "_" + dtype_config_name(c.dtype) + "_" +
         type_name(c.qtype) + (c.offload ? "_offload" : "") +
         (c.secondary > 0 ? "_secondary" + std::to_string(c.secondary) : "");
}

struct UnitDef {
  std::string name;
  std::vector<ParamSpec> params;
};

// "embed" is excluded by the pattern "emb*"; "h.0" and "head" are not.
const std::vector<UnitDef> kUnits = {
    {"embed", {{"wte", {11, 7}}, {"wpe", {5, 7}}}}, {"h.0", {{"w", {9, 13}}, {"b", {40}}}}, {"head", {{"ln", {23}}}}};
const std::vector<bool> kExcluded = {true, false, false};
constexpr size_t kBlock = 16;

std::vector<float> values_of(size_t u, size_t p) {
  Rng rng(700 + 10 * u + p);
  std::vector<float> v(numel_of(kUnits[u].params[p].shape));
  // Magnitudes that differ along the buffer, so that blocks get different scales.
  for (size_t i = 0; i < v.size(); ++i) v[i] = rng.uniform(-1.f, 1.f) * std::ldexp(1.0f, int(i % 19 / 4) - 2);
  return v;
}

// kUnits registered in `ctx` in order, each param set to values_of's values.
void register_units(fsdp_ctx_t* ctx, std::vector<fsdp_unit_t*>* units) {
  units->assign(kUnits.size(), nullptr);
  for (size_t u = 0; u < kUnits.size(); ++u) {
    ASSERT_OK(register_unit(ctx, kUnits[u].name, kUnits[u].params, &(*units)[u]));
    for (size_t p = 0; p < kUnits[u].params.size(); ++p) {
      const std::vector<float> v = values_of(u, p);
      ASSERT_OK(fsdp_param_set_values((*units)[u], p, v.data(), v.size()));
    }
  }
}

}  // namespace

class GatherDtypeExclude : public ::testing::TestWithParam<Case> {};

TEST_P(GatherDtypeExclude, TheUnitsItNamesGatherParamDtypeValuesAndTheOthersTheCodes) {
  const Case c = GetParam();
  const int shard_world = std::string(c.sharding).rfind("HYBRID", 0) == 0 ? 2 : c.world;
  std::map<std::string, std::string> opts = {{"sharding", c.sharding},
                                             {"param_dtype", dtype_config_name(c.dtype)},
                                             {"gather_dtype", type_name(c.qtype)},
                                             {"gather_block", std::to_string(kBlock)},
                                             {"gather_dtype_exclude", "emb*"},
                                             {"timeout_s", "30"}};
  if (c.offload) opts["offload"] = "cpu";
  if (shard_world != c.world) opts["shard_group_size"] = std::to_string(shard_world);
  if (c.secondary > 0) opts["secondary_shard"] = std::to_string(c.secondary);
  run_ranks(c.world, [&](int rank, fsdp_local_group_t* group) {
    ConfigPtr cfg = make_config(opts);
    ASSERT_TRUE(cfg);
    fsdp_ctx_t* raw = nullptr;
    ASSERT_OK(fsdp_ctx_create(cfg.get(), group, group ? rank : -1, &raw));
    CtxPtr ctx(raw);
    std::vector<fsdp_unit_t*> units;
    ASSERT_NO_FATAL_FAILURE(register_units(raw, &units));
    const size_t es = dtype_nbytes(c.dtype);
    for (size_t u = 0; u < kUnits.size(); ++u) {
      SCOPED_TRACE(kUnits[u].name);
      // The test's model of the unit's full buffer: the flat fp32 master (one
      // block: every param trainable), each rank's slice quantized on its own
      // unless the unit is excluded.
      float* shard = nullptr;
      size_t shard_off = 0, shard_n = 0;
      ASSERT_OK(fsdp_shard_info(units[u], &shard, &shard_off, &shard_n));
      const size_t padded = shard_n * size_t(shard_world);
      std::vector<float> want(padded, 0.0f);
      std::vector<size_t> offsets;
      for (size_t p = 0; p < kUnits[u].params.size(); ++p) {
        size_t off = 0, n = 0;
        ASSERT_OK(fsdp_param_flat_range(units[u], p, &off, &n));
        offsets.push_back(off);
        const std::vector<float> v = values_of(u, p);
        std::copy(v.begin(), v.end(), want.begin() + static_cast<ptrdiff_t>(off));
      }
      if (!kExcluded[u]) {
        for (int r = 0; r < shard_world; ++r) {
          const size_t at = size_t(r) * shard_n;
          const std::vector<float> q = ref_round_trip(want.data() + at, shard_n, kBlock, c.qtype);
          std::copy(q.begin(), q.end(), want.begin() + static_cast<ptrdiff_t>(at));
        }
      }
      fsdp_comm_stats_t before{}, after{};
      before.struct_size = after.struct_size = sizeof before;
      ASSERT_OK(fsdp_comm_stats(raw, &before));
      ASSERT_OK(fsdp_forward_begin(units[u], nullptr));
      for (size_t p = 0; p < kUnits[u].params.size(); ++p) {
        void* ptr = nullptr;
        ASSERT_OK(fsdp_param_ptr(units[u], p, &ptr));
        for (size_t i = 0; i < numel_of(kUnits[u].params[p].shape); ++i) {
          const float w = round_to(c.dtype, want[offsets[p] + i]);
          const float got = load_elem(ptr, i, c.dtype);
          ASSERT_TRUE(same_value(got, w)) << "param " << kUnits[u].params[p].name << " element " << i << ": read "
                                          << got << ", the model says " << w;
        }
      }
      ASSERT_OK(fsdp_forward_end(units[u], nullptr));
      ASSERT_OK(fsdp_comm_stats(raw, &after));
      // This unit's forward gather: every rank's slice, in param_dtype or packed.
      const uint64_t moved = after.all_gather_nbytes - before.all_gather_nbytes;
      const uint64_t expected =
          kExcluded[u] ? uint64_t(padded * es) : uint64_t(k::quant_packed_bytes(shard_n, kBlock) * size_t(shard_world));
      EXPECT_EQ(moved, expected);
    }
    EXPECT_OK(fsdp_ctx_finalize(raw));
  });
}

INSTANTIATE_TEST_SUITE_P(Strategies, GatherDtypeExclude,
                         ::testing::Values(Case{"FULL_SHARD", 2, FSDP_DTYPE_BF16, k::QType::kFp8E4m3, false, 0},
                                           Case{"FULL_SHARD", 3, FSDP_DTYPE_FP32, k::QType::kInt8, true, 0},
                                           Case{"HYBRID_SHARD", 4, FSDP_DTYPE_BF16, k::QType::kInt8, false, 0},
                                           Case{"FULL_SHARD", 4, FSDP_DTYPE_BF16, k::QType::kFp8E4m3, false, 2}),
                         case_name);

TEST(GatherDtypeExcludeOption, ReadsAsCommaSeparatedPatternsAndIsRefusedWithoutQuantizedGathers) {
  ConfigPtr cfg = make_config({{"gather_dtype_exclude", " embed , lm_head*,, "}});
  ASSERT_TRUE(cfg);
  char buf[64] = {0};
  size_t len = 0;
  ASSERT_OK(fsdp_config_get(cfg.get(), "gather_dtype_exclude", buf, sizeof buf, &len));
  EXPECT_STREQ(buf, "embed,lm_head*");
  // gather_dtype is param (the default): nothing to exclude from.
  fsdp_ctx_t* raw = nullptr;
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_ctx_create(cfg.get(), nullptr, -1, &raw));
  EXPECT_EQ(raw, nullptr);
  EXPECT_NE(last_error_str().find("gather_dtype_exclude=embed,lm_head*"), std::string::npos) << last_error_str();
  EXPECT_NE(last_error_str().find("gather_dtype=param"), std::string::npos) << last_error_str();
}

TEST(GatherDtypeExcludeOption, APatternThatMatchesNoUnitIsRefusedAtTheFirstStepWhichChangesNothing) {
  for (const char* optimizer : {"sgd", "host"}) {
    SCOPED_TRACE(optimizer);
    run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
      ConfigPtr cfg = make_config({{"sharding", "FULL_SHARD"},
                                   {"gather_dtype", "int8"},
                                   {"gather_dtype_exclude", "h.*,embd"},
                                   {"optimizer", optimizer},
                                   {"lr", "0.5"},
                                   {"timeout_s", "30"}});
      ASSERT_TRUE(cfg);
      fsdp_ctx_t* raw = nullptr;
      ASSERT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
      CtxPtr ctx(raw);
      std::vector<fsdp_unit_t*> units;
      ASSERT_NO_FATAL_FAILURE(register_units(raw, &units));
      for (fsdp_unit_t* unit : units) {
        ASSERT_OK(fsdp_forward_begin(unit, nullptr));
        ASSERT_OK(fsdp_forward_end(unit, nullptr));
      }
      for (size_t u = units.size(); u-- > 0;) {
        ASSERT_OK(fsdp_backward_begin(units[u], nullptr));
        for (size_t p = 0; p < kUnits[u].params.size(); ++p) {
          void* g = nullptr;
          ASSERT_OK(fsdp_grad_ptr(units[u], p, &g));
          for (size_t i = 0; i < numel_of(kUnits[u].params[p].shape); ++i) add_elem(g, i, FSDP_DTYPE_FP32, 1.0f);
        }
        ASSERT_OK(fsdp_backward_end(units[u], nullptr));
      }
      if (std::string(optimizer) == "host") {
        int update = 0;
        float scale = 0.0f;
        EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_step_begin(raw, nullptr, &update, &scale));
      } else {
        EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_step(raw, nullptr));
      }
      const std::string msg = last_error_str();
      EXPECT_NE(msg.find("'embd' matches none of the 3 units"), std::string::npos) << msg;
      EXPECT_NE(msg.find("'embed', 'h.0', 'head'"), std::string::npos) << msg;
      // Nothing was updated: the masters are the values set.
      for (size_t u = 0; u < kUnits.size(); ++u) {
        for (size_t p = 0; p < kUnits[u].params.size(); ++p) {
          const std::vector<float> v = values_of(u, p);
          std::vector<float> master(v.size(), NAN);
          ASSERT_OK(fsdp_gather_param(units[u], p, master.data(), master.size()));
          for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(f32_bits(master[i]), f32_bits(v[i])) << u << " " << p;
        }
      }
      EXPECT_OK(fsdp_ctx_finalize(raw));
    });
  }
}

TEST(GatherDtypeExcludeOption, RanksThatDisagreeOnItFailTogether) {
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    ConfigPtr cfg = make_config({{"sharding", "FULL_SHARD"},
                                 {"gather_dtype", "int8"},
                                 {"gather_dtype_exclude", rank == 0 ? "embed" : "emb*"},
                                 {"timeout_s", "30"}});
    ASSERT_TRUE(cfg);
    fsdp_ctx_t* raw = nullptr;
    EXPECT_STATUS(FSDP_ERR_MISMATCH, fsdp_ctx_create(cfg.get(), group, rank, &raw));
    EXPECT_EQ(raw, nullptr);
    EXPECT_NE(last_error_str().find("gather_dtype_exclude"), std::string::npos) << last_error_str();
  });
}
