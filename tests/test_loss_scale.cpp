// Proves fp16 loss scaling: inf/nan on one rank skips the step on every rank
// (params and optimizer state bitwise unchanged) and backs the scale off; clean
// steps grow it after growth_interval; a static scale stays put; the scale is
// divided out exactly (scaled training equals unscaled training bitwise).
// The host's grads go through tests/host_stream.h's Host: at once, or late on
// a host stream (the .late CTests), where only the events libfsdp waits for
// order them before the reductions, the inf/nan check and the step.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <utility>
#include <string>
#include <vector>

#include "host_stream.h"
#include "rank_runner.h"

using namespace fsdp_test;

namespace {

constexpr size_t kNumel = 37;

struct Rank {
  CtxPtr ctx;
  fsdp_unit_t* unit = nullptr;
  Host host;  // after ctx: drained before the context goes
};

void make(Rank& s, std::map<std::string, std::string> opts, fsdp_local_group_t* group, int rank) {
  opts["timeout_s"] = "20";
  ConfigPtr cfg = make_config(opts);
  ASSERT_TRUE(cfg);
  fsdp_ctx_t* raw = nullptr;
  ASSERT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
  s.ctx.reset(raw);
  s.host.attach(raw);
  ASSERT_OK(register_unit(raw, "u", {{"w", {int64_t(kNumel)}}}, &s.unit));
  const auto init = Rng(9).uniform_vec(kNumel, -1.f, 1.f);
  ASSERT_OK(fsdp_param_set_values(s.unit, 0, init.data(), kNumel));
}

// One pass whose grad is `scale` * (a fixed per-rank grad), written in the
// context's param dtype; `poison` puts an inf into element 3. With `clip`
// > 0, fsdp_clip_grad_norm(clip) before the step, its norm into *norm.
void pass(Rank& s, int rank, int step, double scale, bool poison, double clip = 0.0, double* norm = nullptr) {
  fsdp_dtype_t dt;
  ASSERT_OK(fsdp_ctx_param_dtype(s.ctx.get(), &dt));
  ASSERT_OK(fsdp_forward_begin(s.unit, s.host.stream()));
  ASSERT_OK(fsdp_forward_end(s.unit, s.host.stream()));
  ASSERT_OK(fsdp_backward_begin(s.unit, s.host.stream()));
  void* g = nullptr;
  ASSERT_OK(fsdp_grad_ptr(s.unit, 0, &g));
  const auto grad =
      Rng(1000 + 10 * static_cast<uint64_t>(step) + static_cast<uint64_t>(rank)).uniform_vec(kNumel, -0.01f, 0.01f);
  s.host.run([g, dt, grad, scale, poison] {
    for (size_t k = 0; k < kNumel; ++k) add_elem(g, k, dt, static_cast<float>(grad[k] * scale));
    if (poison) add_elem(g, 3, dt, std::numeric_limits<float>::infinity());
  });
  ASSERT_OK(fsdp_backward_end(s.unit, s.host.stream()));
  if (clip > 0.0) ASSERT_OK(fsdp_clip_grad_norm(s.ctx.get(), s.host.stream(), clip, norm));
  ASSERT_OK(fsdp_step(s.ctx.get(), s.host.stream()));
}

std::vector<float> params(Rank& s) {
  std::vector<float> w(kNumel);
  EXPECT_OK(fsdp_gather_param(s.unit, 0, w.data(), kNumel));
  return w;
}

void scale_of(Rank& s, double* scale, uint64_t* skipped) { EXPECT_OK(fsdp_loss_scale(s.ctx.get(), scale, skipped)); }

}  // namespace

TEST(LossScale, InfOnOneRankSkipsTheStepEverywhereAndBacksOff) {
  for (int world : {2, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    run_ranks(world, [world](int rank, fsdp_local_group_t* group) {
      Rank s;
      make(s, {{"param_dtype", "fp16"}, {"sharding", "FULL_SHARD"}, {"loss_scale_init", "1024"}}, group, rank);
      if (::testing::Test::HasFatalFailure()) return;
      double scale = 0;
      uint64_t skipped = 7;
      scale_of(s, &scale, &skipped);
      EXPECT_EQ(scale, 1024.0) << "fp16 defaults to dynamic scaling from loss_scale_init";
      EXPECT_EQ(skipped, 0u);
      pass(s, rank, 0, scale, false);  // a clean step moves Adam's state
      const auto before = params(s);
      // Only the last rank's grads are poisoned: every rank must skip.
      pass(s, rank, 1, scale, rank == world - 1);
      EXPECT_EQ(params(s), before) << "a skipped step must not change params";
      uint64_t steps = 0;
      EXPECT_OK(fsdp_ctx_step(s.ctx.get(), &steps));
      EXPECT_EQ(steps, 1u) << "the skipped step counts in fsdp_loss_scale, not in the optimizer's step";
      double norm = 0;
      EXPECT_OK(fsdp_last_grad_norm(s.ctx.get(), &norm));
      EXPECT_FALSE(std::isfinite(norm));
      scale_of(s, &scale, &skipped);
      EXPECT_EQ(scale, 512.0);
      EXPECT_EQ(skipped, 1u);
      // The optimizer state did not move either: the next clean step equals a
      // run that never saw the poisoned step (checked against a fresh context).
      pass(s, rank, 2, scale, false);
      const auto after = params(s);
      EXPECT_NE(after, before);
      EXPECT_OK(fsdp_ctx_finalize(s.ctx.get()));
    });
  }
}

TEST(LossScale, ASkippedStepLeavesOptimizerStateAsIfItNeverHappened) {
  // Run A: clean, poisoned, clean(step 2). Run B: clean, clean(step 2) with
  // the same scale as A had after its backoff. Same bits.
  std::vector<std::vector<float>> results(2);
  for (int run = 0; run < 2; ++run) {
    run_ranks(2, [&, run](int rank, fsdp_local_group_t* group) {
      Rank s;
      // Static scale 256: the backoff plays no part, only the skip does.
      make(s, {{"param_dtype", "fp16"}, {"loss_scale", "256"}}, group, rank);
      if (::testing::Test::HasFatalFailure()) return;
      pass(s, rank, 0, 256, false);
      if (run == 0) pass(s, rank, 1, 256, rank == 0);
      pass(s, rank, 2, 256, false);
      double scale = 0;
      uint64_t skipped = 0;
      scale_of(s, &scale, &skipped);
      EXPECT_EQ(scale, 256.0) << "a static scale does not back off";
      EXPECT_EQ(skipped, run == 0 ? 1u : 0u);
      auto w = params(s);
      if (rank == 0) results[static_cast<size_t>(run)] = w;
      EXPECT_OK(fsdp_ctx_finalize(s.ctx.get()));
    });
  }
  EXPECT_EQ(results[0], results[1]);
}

TEST(LossScale, GrowsAfterGrowthIntervalCleanSteps) {
  run_ranks(2, [](int rank, fsdp_local_group_t* group) {
    Rank s;
    make(s,
         {{"param_dtype", "fp16"},
          {"loss_scale", "dynamic"},
          {"loss_scale_init", "8"},
          {"loss_scale_growth", "2"},
          {"loss_scale_growth_interval", "3"}},
         group, rank);
    if (::testing::Test::HasFatalFailure()) return;
    const double expected[] = {8, 8, 16, 16, 16, 32};  // scale after steps 1..6
    for (int step = 0; step < 6; ++step) {
      double scale = 0;
      uint64_t skipped = 0;
      scale_of(s, &scale, &skipped);
      pass(s, rank, step, scale, false);
      scale_of(s, &scale, &skipped);
      EXPECT_EQ(scale, expected[step]) << "after step " << step + 1;
      EXPECT_EQ(skipped, 0u);
    }
    EXPECT_OK(fsdp_ctx_finalize(s.ctx.get()));
  });
}

TEST(LossScale, TheScaleIsDividedOutExactly) {
  // fp32 grads scaled by a power of two and unscaled by the library give the
  // same bits as unscaled training.
  std::vector<std::vector<float>> results(2);
  for (int run = 0; run < 2; ++run) {
    run_ranks(3, [&, run](int rank, fsdp_local_group_t* group) {
      Rank s;
      make(s, {{"loss_scale", run == 0 ? "off" : "1024"}, {"max_grad_norm", "0.01"}}, group, rank);
      if (::testing::Test::HasFatalFailure()) return;
      for (int step = 0; step < 4; ++step) pass(s, rank, step, run == 0 ? 1.0 : 1024.0, false);
      auto w = params(s);
      if (rank == 0) results[static_cast<size_t>(run)] = w;
      EXPECT_OK(fsdp_ctx_finalize(s.ctx.get()));
    });
  }
  EXPECT_EQ(results[0], results[1]);
}

// fsdp_clip_grad_norm (torch.nn.utils.clip_grad_norm_ for libfsdp's own
// optimizer) clips the coming step as the max_grad_norm option does, to the
// bit, with a static loss scale divided out, and returns the norm that
// fsdp_last_grad_norm reports for that step; the clip bites (without it the
// params differ), a max_norm above the norm changes nothing, a skipped step
// leaves no coefficient behind, and bad calls are refused.
TEST(LossScale, ClipGradNormClipsTheComingStepLikeMaxGradNorm) {
  enum Run { kOption, kCall, kNone, kLoose };
  constexpr int kSteps = 4;
  for (int world : {1, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    std::vector<std::vector<float>> w(4);
    std::vector<std::vector<double>> norms(4, std::vector<double>(kSteps));
    for (int run : {kOption, kCall, kNone, kLoose}) {
      run_ranks(world, [&, run](int rank, fsdp_local_group_t* group) {
        Rank s;
        std::map<std::string, std::string> opts = {{"loss_scale", "1024"}};
        if (run == kOption) opts["max_grad_norm"] = "0.01";
        make(s, opts, group, rank);
        if (::testing::Test::HasFatalFailure()) return;
        for (int step = 0; step < kSteps; ++step) {
          double norm = -1.0;
          const double clip = run == kCall ? 0.01 : run == kLoose ? 1e9 : 0.0;
          pass(s, rank, step, 1024.0, /*poison=*/run == kCall && step == 1, clip, &norm);
          double last = 0.0;
          ASSERT_OK(fsdp_last_grad_norm(s.ctx.get(), &last));
          if (clip > 0.0 && std::isfinite(last)) {
            EXPECT_EQ(norm, last) << "step " << step;
          }
          if (rank == 0) norms[size_t(run)][size_t(step)] = last;
        }
        const std::vector<float> got = params(s);  // collective
        if (rank == 0) w[size_t(run)] = got;
        if (run == kCall) {
          double n = 0.0;
          for (double bad : {0.0, -1.0, std::numeric_limits<double>::infinity(), std::nan("")}) {
            EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_clip_grad_norm(s.ctx.get(), s.host.stream(), bad, &n));
          }
          EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_clip_grad_norm(s.ctx.get(), s.host.stream(), 1.0, nullptr));
          ASSERT_OK(fsdp_forward_begin(s.unit, s.host.stream()));
          EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_clip_grad_norm(s.ctx.get(), s.host.stream(), 1.0, &n));
          ASSERT_OK(fsdp_forward_end(s.unit, s.host.stream()));
        }
        EXPECT_OK(fsdp_ctx_finalize(s.ctx.get()));
      });
    }
    // The call's run skipped its step 1 (an inf): compare it with the option's over the steps both ran.
    EXPECT_FALSE(std::isfinite(norms[kCall][1]));
    EXPECT_NE(w[kOption], w[kNone]) << "the clip must bite for the test to show it";
    EXPECT_EQ(w[kLoose], w[kNone]) << "a max_norm above the norm changed the step";
    EXPECT_EQ(norms[kCall][0], norms[kOption][0]);
  }
}

// Without a skipped step in between, the call gives the option's bits step by step.
TEST(LossScale, ClipGradNormGivesTheMaxGradNormOptionsBits) {
  std::vector<std::vector<float>> w(2);
  for (int run : {0, 1}) {
    run_ranks(2, [&, run](int rank, fsdp_local_group_t* group) {
      Rank s;
      std::map<std::string, std::string> opts = {{"loss_scale", "1024"}};
      if (run == 0) opts["max_grad_norm"] = "0.01";
      make(s, opts, group, rank);
      if (::testing::Test::HasFatalFailure()) return;
      for (int step = 0; step < 4; ++step) {
        double norm = 0.0;
        pass(s, rank, step, 1024.0, false, run == 1 ? 0.01 : 0.0, &norm);
      }
      const std::vector<float> got = params(s);  // collective
      if (rank == 0) w[size_t(run)] = got;
      EXPECT_OK(fsdp_ctx_finalize(s.ctx.get()));
    });
  }
  EXPECT_EQ(w[0], w[1]);
}

TEST(LossScale, DefaultIsOffOutsideFp16AndNullArgumentsAreRejected) {
  FSDP_SKIP_WHEN_LATE("no host compute and no call that takes a stream: only defaults and argument checks");
  run_ranks(1, [](int rank, fsdp_local_group_t* group) {
    Rank s;
    make(s, {{"param_dtype", "bf16"}}, group, rank);
    if (::testing::Test::HasFatalFailure()) return;
    double scale = 0;
    uint64_t skipped = 0;
    scale_of(s, &scale, &skipped);
    EXPECT_EQ(scale, 1.0);
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_loss_scale(nullptr, &scale, &skipped));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_loss_scale(s.ctx.get(), nullptr, &skipped));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_loss_scale(s.ctx.get(), &scale, nullptr));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_trace_write(s.ctx.get(), nullptr));
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_trace_write(s.ctx.get(), "/tmp/never.json")) << "no trace begun";
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_trace_begin(nullptr));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_log_set_level(9));
    ConfigPtr cfg = make_config({});
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_set(cfg.get(), "loss_scale", "-2"));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_set(cfg.get(), "backward_prefetch", "sideways"));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_set(cfg.get(), "limit_all_gathers", "0"));
    EXPECT_OK(fsdp_ctx_finalize(s.ctx.get()));
  });
}

TEST(LossScale, ASkippedFirstStepIsAStepThatRanForTheGradNorm) {
  // A nan in a grad at step 1 (fp32, loss scaling off): fsdp_last_grad_norm
  // reports the nan, as fsdp.h promises, and not "no step has run yet" (which
  // stays the answer before any step, and survives a checkpoint of it).
  const std::string dir = ::testing::TempDir() + "fsdp_skipped_first_step_" + std::to_string(::getpid());
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    Rank s;
    make(s, {{"sharding", "FULL_SHARD"}}, group, rank);
    if (::testing::Test::HasFatalFailure()) return;
    double norm = 0;
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_last_grad_norm(s.ctx.get(), &norm));
    ASSERT_OK(fsdp_forward_begin(s.unit, s.host.stream()));
    ASSERT_OK(fsdp_forward_end(s.unit, s.host.stream()));
    ASSERT_OK(fsdp_backward_begin(s.unit, s.host.stream()));
    void* g = nullptr;
    ASSERT_OK(fsdp_grad_ptr(s.unit, 0, &g));
    if (rank == 1) s.host.run([g] { static_cast<float*>(g)[5] = std::numeric_limits<float>::quiet_NaN(); });
    ASSERT_OK(fsdp_backward_end(s.unit, s.host.stream()));
    const auto before = params(s);
    ASSERT_OK(fsdp_step(s.ctx.get(), s.host.stream()));
    EXPECT_EQ(params(s), before) << "the step was not skipped";
    norm = 0;
    ASSERT_OK(fsdp_last_grad_norm(s.ctx.get(), &norm));
    EXPECT_TRUE(std::isnan(norm)) << norm;
    ASSERT_OK(fsdp_save(s.ctx.get(), dir.c_str(), "sharded"));
    s.host.attach(nullptr);  // its stream goes with the context
    s.ctx.reset();
    Rank t;
    make(t, {{"sharding", "FULL_SHARD"}}, group, rank);
    if (::testing::Test::HasFatalFailure()) return;
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_last_grad_norm(t.ctx.get(), &norm));
    ASSERT_OK(fsdp_load(t.ctx.get(), dir.c_str()));
    norm = 0;
    ASSERT_OK(fsdp_last_grad_norm(t.ctx.get(), &norm));
    EXPECT_TRUE(std::isnan(norm)) << "after loading a checkpoint of a skipped first step: " << norm;
  });
}

namespace {
std::mutex g_log_mu;
std::vector<std::pair<fsdp_log_level_t, std::string>> g_log;
void keep_log(fsdp_log_level_t level, int, const char* message, void*) {
  std::lock_guard<std::mutex> lock(g_log_mu);
  g_log.emplace_back(level, message);
}
// The messages about skipped steps, with their levels.
std::vector<std::pair<fsdp_log_level_t, std::string>> skipped_messages() {
  std::lock_guard<std::mutex> lock(g_log_mu);
  std::vector<std::pair<fsdp_log_level_t, std::string>> out;
  for (const auto& m : g_log) {
    if (m.second.find("the step is skipped") != std::string::npos) out.push_back(m);
  }
  return out;
}
}  // namespace

// Without a dynamic loss scale, inf/nan grads are a fault of the host (a NaN
// loss, or params read after their *_end: what debug_poison exposes), and the
// skipped step says so loudly, once (rank 0); with a dynamic scale a skip is
// how the scale finds its level and is only information.
TEST(LossScale, ASkippedStepWarnsWithoutADynamicScaleAndInformsWithOne) {
  for (const char* dtype : {"fp32", "fp16"}) {
    SCOPED_TRACE(dtype);
    {
      std::lock_guard<std::mutex> lock(g_log_mu);
      g_log.clear();
    }
    ASSERT_OK(fsdp_log_set_level(FSDP_LOG_INFO));
    ASSERT_OK(fsdp_log_set_callback(keep_log, nullptr));
    run_ranks(2, [dtype](int rank, fsdp_local_group_t* group) {
      Rank s;
      make(s, {{"param_dtype", dtype}, {"sharding", "FULL_SHARD"}}, group, rank);
      if (::testing::Test::HasFatalFailure()) return;
      double scale = 0;
      uint64_t skipped = 0;
      scale_of(s, &scale, &skipped);
      pass(s, rank, 0, scale, rank == 1);
      EXPECT_OK(fsdp_ctx_finalize(s.ctx.get()));
    });
    ASSERT_OK(fsdp_log_set_callback(nullptr, nullptr));
    ASSERT_OK(fsdp_log_set_level(FSDP_LOG_WARN));
    const auto got = skipped_messages();
    ASSERT_EQ(got.size(), 1u) << "rank 0 says it, once";
    if (std::string(dtype) == "fp32") {
      EXPECT_EQ(got[0].first, FSDP_LOG_WARN) << got[0].second;
      EXPECT_NE(got[0].second.find("debug_poison=1"), std::string::npos) << got[0].second;
    } else {
      EXPECT_EQ(got[0].first, FSDP_LOG_INFO) << got[0].second;
      EXPECT_NE(got[0].second.find("backs off"), std::string::npos) << got[0].second;
    }
  }
}
