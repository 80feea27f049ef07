// optimizer=host (issue 27): the host's own update between fsdp_step_begin
// and fsdp_step_end on the shards, reduced grads and host_state buffers that
// libfsdp keeps. Two optimizers written here, Lion (one state buffer) and
// SGD with momentum under max_grad_norm (so grad_scale matters), each against
// a single-process reference on the whole batch; the state checkpoints and
// resumes bitwise; misuse is refused.
#include <algorithm>
#include <string>
#include <vector>

#include "ckpt_util.h"

using namespace fsdp_test;

namespace {

const Net kNet = Net::make(3, 10);
constexpr int kSteps = 10;
constexpr float kLr = 0.01f, kLionB1 = 0.9f, kLionB2 = 0.99f, kLionWd = 0.1f, kMomentum = 0.9f;
constexpr double kMaxNorm = 0.5;  // below the grad norm of every step here: each step clips

enum class Kind { kLion, kSgdMomentum };

// The host's updates, element by element (padding: zeros in, zeros out).
void lion(float& p, float g, float& m) {
  float c = kLionB1 * m + (1.0f - kLionB1) * g;
  float sign = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f);
  p = p * (1.0f - kLr * kLionWd) - kLr * sign;
  m = kLionB2 * m + (1.0f - kLionB2) * g;
}
void sgd_momentum(float& p, float g, float& buf, bool first) {
  buf = first ? g : kMomentum * buf + g;  // torch.optim.SGD (dampening 0)
  p -= kLr * buf;
}

std::map<std::string, std::string> options(Kind k) {
  auto o = base_options("FULL_SHARD");
  o["optimizer"] = "host";
  o["host_state"] = "1";
  if (k == Kind::kSgdMomentum) o["max_grad_norm"] = std::to_string(kMaxNorm);
  return o;
}

// Steps [s0, s1) with the host's update: grads as ckpt_util's train() makes them.
void train_host(Job& job, Kind kind, int s0, int s1, int world, int rank) {
  const int rows = kRows / world;
  for (int s = s0; s < s1; ++s) {
    for (size_t k = kNet.units.size(); k-- > 0;) {
      ASSERT_OK(fsdp_backward_begin(job.units[k], nullptr));
      int trainable = 1;
      ASSERT_OK(fsdp_unit_trainable(job.units[k], &trainable));
      for (size_t i = 0; trainable == 1 && i < kNet.units[k].size(); ++i) {
        int param_trainable = 1;  // a param frozen inside its unit has no grads
        ASSERT_OK(fsdp_param_trainable(job.units[k], i, &param_trainable));
        if (param_trainable == 0) continue;
        void *pp = nullptr, *gp = nullptr;
        ASSERT_OK(fsdp_param_ptr(job.units[k], i, &pp));
        ASSERT_OK(fsdp_grad_ptr(job.units[k], i, &gp));
        for (size_t e = 0; e < numel_of(kNet.units[k][i].shape); ++e) {
          static_cast<float*>(gp)[e] += mean_grad(static_cast<float*>(pp)[e], s, rank * rows, rows, k, i, e);
        }
      }
      ASSERT_OK(fsdp_backward_end(job.units[k], nullptr));
    }
    int update = 0;
    float scale = 0;
    ASSERT_OK(fsdp_step_begin(job.ctx.get(), nullptr, &update, &scale));
    uint64_t before = 0;
    ASSERT_OK(fsdp_ctx_step(job.ctx.get(), &before));
    for (size_t k = 0; update == 1 && k < job.units.size(); ++k) {
      int trainable = 1;
      ASSERT_OK(fsdp_unit_trainable(job.units[k], &trainable));
      if (trainable == 0) continue;
      float *p = nullptr, *g = nullptr, *state = nullptr;
      size_t n = 0;
      ASSERT_OK(fsdp_shard_tensors(job.ctx.get(), job.units[k], &p, &g, &state, 1, &n));
      for (size_t e = 0; e < n; ++e) {
        if (kind == Kind::kLion) {
          lion(p[e], g[e] * scale, state[e]);
        } else {
          sgd_momentum(p[e], g[e] * scale, state[e], before == 0);
        }
      }
    }
    ASSERT_OK(fsdp_step_end(job.ctx.get(), nullptr));
  }
}

// The same on one process and the whole batch, with the clipping of
// torch.nn.utils.clip_grad_norm_ for SGD; `frozen` params (unit, index) get
// no grad: out of the norm, never updated.
State reference(Kind kind, const State& init, const std::vector<std::pair<size_t, size_t>>& frozen = {}) {
  State p = init, m = init;
  for (auto& u : m)
    for (auto& t : u) std::fill(t.begin(), t.end(), 0.0f);
  for (int s = 0; s < kSteps; ++s) {
    State g = p;
    double sq = 0;
    for (size_t k = 0; k < p.size(); ++k)
      for (size_t i = 0; i < p[k].size(); ++i)
        for (size_t e = 0; e < p[k][i].size(); ++e) {
          float acc = mean_grad(p[k][i][e], s, 0, kRows, k, i, e);
          if (std::find(frozen.begin(), frozen.end(), std::make_pair(k, i)) != frozen.end()) acc = 0;
          g[k][i][e] = acc;
          sq += double(acc) * acc;
        }
    float scale = 1.0f;
    if (kind == Kind::kSgdMomentum) scale = float(std::min(1.0, kMaxNorm / (std::sqrt(sq) + 1e-6)));
    for (size_t k = 0; k < p.size(); ++k)
      for (size_t i = 0; i < p[k].size(); ++i)
        for (size_t e = 0; e < p[k][i].size(); ++e) {
          if (std::find(frozen.begin(), frozen.end(), std::make_pair(k, i)) != frozen.end()) continue;
          if (kind == Kind::kLion) {
            lion(p[k][i][e], g[k][i][e] * scale, m[k][i][e]);
          } else {
            sgd_momentum(p[k][i][e], g[k][i][e] * scale, m[k][i][e], s == 0);
          }
        }
  }
  return p;
}

}  // namespace

// Each rank averages its rows' grads and the ranks average theirs: the sums
// run in another order than the reference's, so grads differ by a few ulps
// (~1e-7 relative). SGD with momentum is continuous in its grads: 10 steps
// stay within 1e-5 relative. Lion takes the sign of an average: an element
// whose average sits within rounding of zero may step the other way (2 lr),
// rarely; every other element lands within 1e-5. A missing grad_scale, a
// lost state buffer or grads from the wrong rank are off by O(lr) on most
// elements.
class HostOptimizer : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(HostOptimizer, MatchesItsSingleProcessReference) {
  const Kind kind = std::get<0>(GetParam()) == 0 ? Kind::kLion : Kind::kSgdMomentum;
  const int world = std::get<1>(GetParam());
  const State init = make_init(kNet, 21);
  const State want = reference(kind, init);
  std::vector<State> got(static_cast<size_t>(world));
  run_ranks(world, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, kNet, options(kind), rank, group);
    if (HasFatalFailure()) return;
    ASSERT_NO_FATAL_FAILURE(set_state(job, init));
    ASSERT_NO_FATAL_FAILURE(train_host(job, kind, 0, kSteps, world, rank));
    uint64_t steps = 0;
    ASSERT_OK(fsdp_ctx_step(job.ctx.get(), &steps));
    EXPECT_EQ(steps, uint64_t(kSteps));
    got[size_t(rank)] = gather(job, kNet);
  });
  size_t total = 0, far = 0;
  double worst = 0;
  for (size_t k = 0; k < want.size(); ++k)
    for (size_t i = 0; i < want[k].size(); ++i)
      for (size_t e = 0; e < want[k][i].size(); ++e) {
        double d = std::fabs(double(got[0][k][i][e]) - want[k][i][e]);
        double tol = 1e-5 * std::max(1.0, std::fabs(double(want[k][i][e])));
        ++total;
        if (d > tol) ++far;
        worst = std::max(worst, d);
      }
  if (kind == Kind::kSgdMomentum) {
    EXPECT_EQ(far, 0u) << "worst difference " << worst;
  } else {
    EXPECT_LE(far, total / 200) << far << " of " << total << " elements off; worst " << worst;
    EXPECT_LE(worst, 2.0 * kLr * kSteps);
  }
  // The reference moves the params far past the tolerance (a host step that
  // ran no update would fail; dropping grad_scale fails the SGD cases).
  EXPECT_GT(rel_max_diff(init[0][0], want[0][0]), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(LionAndSgd, HostOptimizer,
                         ::testing::Combine(::testing::Values(0, 1), ::testing::Values(1, 2, 3, 4)),
                         [](const auto& i) {
                           return std::string(std::get<0>(i.param) == 0 ? "Lion" : "SgdMomentum") + "_world" +
                                  std::to_string(std::get<1>(i.param));
                         });

// A param frozen inside its unit: fsdp_shard_tensors hands out the unit's
// trainable block alone (the front of the master, which the grads and the
// state cover), so the host's SGD with momentum leaves the frozen weight
// bitwise as it was and trains its unit's bias as the reference does.
TEST(HostOptimizerFrozenParam, UpdatesTheTrainableBlockAlone) {
  const std::vector<std::pair<size_t, size_t>> frozen = {{1, 0}};
  const State init = make_init(kNet, 21);
  const State want = reference(Kind::kSgdMomentum, init, frozen);
  for (int world : {1, 3}) {
    std::vector<State> got(static_cast<size_t>(world));
    run_ranks(world, [&](int rank, fsdp_local_group_t* group) {
      Job job;
      open_job(job, kNet, options(Kind::kSgdMomentum), rank, group);
      if (HasFatalFailure()) return;
      ASSERT_NO_FATAL_FAILURE(set_state(job, init));
      ASSERT_OK(fsdp_param_set_trainable(job.ctx.get(), job.units[1], 0, 0));
      ASSERT_NO_FATAL_FAILURE(train_host(job, Kind::kSgdMomentum, 0, kSteps, world, rank));
      got[size_t(rank)] = gather(job, kNet);
    });
    EXPECT_TRUE(bitwise_equal(got[0][1][0], init[1][0])) << "world " << world << ": the frozen weight changed";
    for (size_t k = 0; k < want.size(); ++k)
      for (size_t i = 0; i < want[k].size(); ++i)
        EXPECT_LE(rel_max_diff(got[0][k][i], want[k][i]), 1e-5) << "world " << world << " unit " << k << " param " << i;
  }
  EXPECT_GT(rel_max_diff(init[1][1], want[1][1]), 1e-3) << "the bias beside the frozen weight must train";
}

// The host's state buffer is checkpointed ("host0") and resumes bitwise.
TEST(HostOptimizerCheckpoint, ResumesBitwise) {
  TempDir tmp;
  const std::string dir = tmp / "ck";
  const State init = make_init(kNet, 22);
  State end;
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, kNet, options(Kind::kLion), rank, group);
    if (HasFatalFailure()) return;
    ASSERT_NO_FATAL_FAILURE(set_state(job, init));
    ASSERT_NO_FATAL_FAILURE(train_host(job, Kind::kLion, 0, 4, 2, rank));
    ASSERT_OK(fsdp_save(job.ctx.get(), dir.c_str(), "sharded"));
    ASSERT_NO_FATAL_FAILURE(train_host(job, Kind::kLion, 4, 8, 2, rank));
    State e = gather(job, kNet);
    if (rank == 0) end = e;
  });
  auto t = read_safetensors(dir + "/shard-00000-of-00002.safetensors");
  EXPECT_EQ(t.count("units.0.host0"), 1u);
  for (bool with_state : {true, false}) {
    State got;
    run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
      Job job;
      open_job(job, kNet, options(Kind::kLion), rank, group);
      if (HasFatalFailure()) return;
      ASSERT_OK(fsdp_load(job.ctx.get(), dir.c_str()));
      if (!with_state) {  // the state zeroed by hand: the resume must differ
        int update = 0;
        float scale = 0;
        ASSERT_OK(fsdp_step_begin(job.ctx.get(), nullptr, &update, &scale));
        for (size_t k = 0; k < job.units.size(); ++k) {
          float *p = nullptr, *g = nullptr, *s = nullptr;
          size_t n = 0;
          ASSERT_OK(fsdp_shard_tensors(job.ctx.get(), job.units[k], &p, &g, &s, 1, &n));
          std::fill(s, s + n, 0.0f);
        }
        ASSERT_OK(fsdp_step_end(job.ctx.get(), nullptr));
      }
      ASSERT_NO_FATAL_FAILURE(train_host(job, Kind::kLion, 4, 8, 2, rank));
      State e = gather(job, kNet);
      if (rank == 0) got = e;
    });
    EXPECT_EQ(bitwise_equal(got, end), with_state);
  }
}

TEST(HostOptimizerMisuse, IsRefusedAndChangesNothing) {
  run_ranks(1, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, kNet, options(Kind::kLion), rank, group);
    if (HasFatalFailure()) return;
    fsdp_ctx_t* ctx = job.ctx.get();
    float *p = nullptr, *g = nullptr, *s = nullptr;
    size_t n = 0;
    int update = 0;
    float scale = 0;
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_step(ctx, nullptr));
    EXPECT_NE(last_error_str().find("fsdp_step_begin"), std::string::npos) << last_error_str();
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_step_end(ctx, nullptr));
    // Outside the host's step: the buffers it will hand out (a binding's views), the same as inside.
    ASSERT_OK(fsdp_shard_tensors(ctx, job.units[0], &p, &g, &s, 1, &n));
    float *p_out = p, *g_out = g, *s_out = s;
    const size_t n_out = n;
    EXPECT_STATUS(FSDP_ERR_UNSUPPORTED, fsdp_set_param_group(ctx, "*", "lr_scale=2", nullptr));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_step_begin(ctx, nullptr, nullptr, &scale));
    ASSERT_OK(fsdp_unit_set_trainable(ctx, job.units[2], 0));
    const State before = gather(job, kNet);
    ASSERT_OK(fsdp_step_begin(ctx, nullptr, &update, &scale));
    EXPECT_EQ(update, 1);
    // The first step's norm is known inside it (a binding's clip_grad_norm_ reads it there).
    double norm = -1.0;
    ASSERT_OK(fsdp_last_grad_norm(ctx, &norm));
    EXPECT_EQ(norm, 0.0) << "no backward ran: the grads are zero";
    ASSERT_OK(fsdp_shard_tensors(ctx, job.units[0], &p, &g, &s, 1, &n));
    EXPECT_TRUE(p == p_out && g == g_out && s == s_out && n == n_out) << "the host step hands out other buffers";
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_shard_tensors(ctx, job.units[0], &p, &g, &s, 2, &n));
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_shard_tensors(ctx, job.units[2], &p, &g, &s, 1, &n));
    EXPECT_NE(last_error_str().find("frozen"), std::string::npos) << last_error_str();
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_forward_begin(job.units[0], nullptr));
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_save(ctx, "/nonexistent/x", "sharded"));
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_step_begin(ctx, nullptr, &update, &scale));
    ASSERT_OK(fsdp_step_end(ctx, nullptr));
    EXPECT_TRUE(bitwise_equal(gather(job, kNet), before));
  });
  ConfigPtr cfg = make_config({});
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_set(cfg.get(), "host_state", "9"));
  // Another optimizer has no host step.
  run_ranks(1, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
    if (HasFatalFailure()) return;
    int update = 0;
    float scale = 0;
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_step_begin(job.ctx.get(), nullptr, &update, &scale));
    float *p = nullptr, *g = nullptr;
    size_t n = 0;
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_shard_tensors(job.ctx.get(), job.units[0], &p, &g, nullptr, 0, &n));
    EXPECT_NE(last_error_str().find("optimizer=host"), std::string::npos) << last_error_str();
  });
}
