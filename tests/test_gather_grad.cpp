// fsdp_gather_grad: the reduced grad of one param after backward, the call an
// integration's tests compare against their framework's own grads. Each rank
// adds its own grads (its own RNG stream) over two backward passes of one
// step; the test computes the expected reduction itself: the mean over the
// ranks (reduce_op avg) of each rank's sum of the passes, each pass's grads
// rounded to the param dtype first (the host writes them into a param_dtype
// buffer), reduced in fp32. Every strategy, worlds 1-4, offload, fp32 and bf16; the host's
// writes late on a host stream in the .late CTests, where the call must wait
// for them (at world 1 with fp32 they go straight into the grad shard). Then
// the refusals: while grads wait unreduced (no_sync), inside the unit's
// bracket, a wrong element count; and zeros after fsdp_step.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "host_stream.h"
#include "rank_runner.h"

using namespace fsdp_test;

namespace {

const std::vector<ParamSpec> kParams = {{"a", {5, 7}}, {"b", {13}}, {"c", {3, 3}}};
constexpr int kPasses = 2;

struct Case {
  const char* sharding;
  int world;
  fsdp_dtype_t dtype;
  bool offload;
  int shard_group;  // HYBRID_SHARD's shard_group_size, else 0
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(c.sharding) + "_world" + std::to_string(c.world) + "_" + dtype_config_name(c.dtype) +
         (c.offload ? "_offload" : "");
}

// The grads rank `rank` adds into param `p` in pass `pass`, as fp32 values
// already rounded to `dt` (what the host's param_dtype buffer holds).
std::vector<float> rank_grads(int rank, int pass, size_t p, fsdp_dtype_t dt) {
  Rng rng(1000 + 97 * uint64_t(rank) + 13 * uint64_t(pass) + p);
  std::vector<float> g = rng.uniform_vec(numel_of(kParams[p].shape), -1.f, 1.f);
  for (float& x : g) x = round_to(dt, x);
  return g;
}

// This rank's context with `options` and the unit "u" of kParams registered.
void open_unit(const std::map<std::string, std::string>& options, int rank, fsdp_local_group_t* group, CtxPtr& ctx,
               fsdp_unit_t** unit) {
  ConfigPtr cfg = make_config(options);
  ASSERT_TRUE(cfg);
  fsdp_ctx_t* raw = nullptr;
  ASSERT_OK(fsdp_ctx_create(cfg.get(), group, group ? rank : -1, &raw));
  ctx.reset(raw);
  ASSERT_OK(register_unit(ctx.get(), "u", kParams, unit));
}

class GatherGrad : public ::testing::TestWithParam<Case> {};

TEST_P(GatherGrad, IsTheMeanOverRanksOfEachRanksSummedPasses) {
  const Case c = GetParam();
  // reduce_dtype fp32: the reduction adds the ranks' bf16 grads exactly, so
  // that a few fp32 ulps bound the difference (a bf16 reduction's rounding is
  // test_equivalence's subject).
  std::map<std::string, std::string> options = {
      {"sharding", c.sharding}, {"param_dtype", dtype_config_name(c.dtype)}, {"reduce_dtype", "fp32"}};
  if (c.offload) options["offload"] = "cpu";
  if (c.shard_group > 0) options["shard_group_size"] = std::to_string(c.shard_group);
  // expected[k][p]: after pass k, in double over every rank's grads, then
  // compared in fp32.
  std::vector<std::vector<std::vector<double>>> expected(kPasses);
  for (int k = 0; k < kPasses; ++k) {
    for (size_t p = 0; p < kParams.size(); ++p) {
      expected[k].push_back(k > 0 ? expected[k - 1][p] : std::vector<double>(numel_of(kParams[p].shape), 0.0));
      for (int r = 0; r < c.world; ++r) {
        const std::vector<float> g = rank_grads(r, k, p, c.dtype);
        for (size_t i = 0; i < g.size(); ++i) expected[k][p][i] += double(g[i]) / c.world;
      }
    }
  }
  run_ranks(c.world, [&](int rank, fsdp_local_group_t* group) {
    CtxPtr ctx;
    fsdp_unit_t* unit = nullptr;
    open_unit(options, rank, group, ctx, &unit);
    if (HasFatalFailure()) return;
    Host host(ctx.get());
    for (int k = 0; k < kPasses; ++k) {
      ASSERT_OK(fsdp_backward_begin(unit, host.stream()));
      std::vector<void*> grads(kParams.size());
      for (size_t p = 0; p < kParams.size(); ++p) ASSERT_OK(fsdp_grad_ptr(unit, p, &grads[p]));
      host.run([grads, rank, k, dt = c.dtype] {
        for (size_t p = 0; p < kParams.size(); ++p) {
          const std::vector<float> g = rank_grads(rank, k, p, dt);
          for (size_t i = 0; i < g.size(); ++i) add_elem(grads[p], i, dt, g[i]);
        }
      });
      ASSERT_OK(fsdp_backward_end(unit, host.stream()));
      // After each pass (the first one's grads went straight into the grad
      // shard at world 1 with fp32, written late by the host stream).
      for (size_t p = 0; p < kParams.size(); ++p) {
        std::vector<float> got(expected[k][p].size(), NAN);
        ASSERT_OK(fsdp_gather_grad(unit, p, got.data(), got.size()));
        for (size_t i = 0; i < got.size(); ++i) {
          // fp32 sums of world * (k + 1) terms of magnitude <= 1, in an order
          // of the reduction's choosing: a few fp32 ulps of the largest partial sum.
          ASSERT_NEAR(got[i], expected[k][p][i], 1e-6 * kPasses)
              << "param " << kParams[p].name << " element " << i << " after pass " << k;
        }
      }
    }
    // fsdp_step consumes the grads: zeros afterwards.
    ASSERT_OK(fsdp_step(ctx.get(), host.stream()));
    std::vector<float> after(numel_of(kParams[0].shape), NAN);
    ASSERT_OK(fsdp_gather_grad(unit, 0, after.data(), after.size()));
    for (float v : after) ASSERT_EQ(v, 0.f) << "fsdp_step left a grad behind";
    EXPECT_OK(fsdp_ctx_finalize(ctx.get()));
  });
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, GatherGrad,
    ::testing::Values(Case{"FULL_SHARD", 1, FSDP_DTYPE_FP32, false, 0}, Case{"FULL_SHARD", 1, FSDP_DTYPE_BF16, false, 0},
                      Case{"FULL_SHARD", 2, FSDP_DTYPE_FP32, false, 0}, Case{"FULL_SHARD", 3, FSDP_DTYPE_BF16, false, 0},
                      Case{"FULL_SHARD", 4, FSDP_DTYPE_FP32, false, 0}, Case{"SHARD_GRAD_OP", 2, FSDP_DTYPE_FP32, false, 0},
                      Case{"SHARD_GRAD_OP", 3, FSDP_DTYPE_BF16, false, 0}, Case{"NO_SHARD", 2, FSDP_DTYPE_FP32, false, 0},
                      Case{"NO_SHARD", 3, FSDP_DTYPE_BF16, false, 0}, Case{"HYBRID_SHARD", 4, FSDP_DTYPE_FP32, false, 2},
                      Case{"HYBRID_SHARD", 4, FSDP_DTYPE_BF16, false, 2}, Case{"FULL_SHARD", 1, FSDP_DTYPE_FP32, true, 0},
                      Case{"FULL_SHARD", 2, FSDP_DTYPE_FP32, true, 0}, Case{"FULL_SHARD", 3, FSDP_DTYPE_BF16, true, 0}),
    case_name);

TEST(GatherGradMisuse, RefusedInsideTheBracketWhileUnreducedAndForAWrongCountChangingNothing) {
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    CtxPtr ctx;
    fsdp_unit_t* unit = nullptr;
    open_unit({{"sharding", "FULL_SHARD"}}, rank, group, ctx, &unit);
    if (HasFatalFailure()) return;
    std::vector<float> out(numel_of(kParams[1].shape), NAN);
    // No grads yet: zeros.
    ASSERT_OK(fsdp_gather_grad(unit, 1, out.data(), out.size()));
    for (float v : out) ASSERT_EQ(v, 0.f);
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_gather_grad(unit, 1, out.data(), out.size() + 1));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_gather_grad(unit, 3, out.data(), out.size()));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_gather_grad(unit, 1, nullptr, out.size()));
    // Inside the bracket.
    ASSERT_OK(fsdp_backward_begin(unit, nullptr));
    void* g = nullptr;
    ASSERT_OK(fsdp_grad_ptr(unit, 1, &g));
    for (size_t i = 0; i < out.size(); ++i) static_cast<float*>(g)[i] = float(rank + 1);
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_gather_grad(unit, 1, out.data(), out.size()));
    EXPECT_NE(std::string(fsdp_last_error()).find("fsdp_gather_grad"), std::string::npos) << fsdp_last_error();
    ASSERT_OK(fsdp_backward_end(unit, nullptr));
    // Grads accumulated with sync off wait unreduced: refused, naming the cause.
    ASSERT_OK(fsdp_set_grad_sync(ctx.get(), 0));
    ASSERT_OK(fsdp_backward_begin(unit, nullptr));
    ASSERT_OK(fsdp_grad_ptr(unit, 1, &g));
    for (size_t i = 0; i < out.size(); ++i) static_cast<float*>(g)[i] = 10.f;
    ASSERT_OK(fsdp_backward_end(unit, nullptr));
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_gather_grad(unit, 1, out.data(), out.size()));
    EXPECT_NE(std::string(fsdp_last_error()).find("gradient sync off"), std::string::npos) << fsdp_last_error();
    // Sync on again: the next backward reduces both passes, the refusals changed nothing.
    ASSERT_OK(fsdp_set_grad_sync(ctx.get(), 1));
    ASSERT_OK(fsdp_backward_begin(unit, nullptr));
    ASSERT_OK(fsdp_backward_end(unit, nullptr));
    out.assign(out.size(), NAN);
    ASSERT_OK(fsdp_gather_grad(unit, 1, out.data(), out.size()));
    // Pass 1: mean(1, 2) = 1.5; pass 2: 10 on both ranks.
    for (float v : out) ASSERT_EQ(v, 11.5f);
    EXPECT_OK(fsdp_ctx_finalize(ctx.get()));
  });
}

}  // namespace
