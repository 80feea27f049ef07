// Proves that fsdp_step applies PyTorch's AdamW / Adam / SGD (momentum, nesterov) exactly to the rank-averaged grads,
// with per-param weight decay, clipping and fsdp_set_lr.
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "rank_runner.h"

using namespace fsdp_test;

namespace {

using Tensor = std::vector<float>;
const double kNone = std::numeric_limits<double>::quiet_NaN();
constexpr double kTol = 1e-6;  // per tensor: max|lib - ref| / max|ref|

std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

struct OptCase {
  std::string name;
  int world = 1;
  int steps = 4;
  std::string optimizer = "adamw";
  double lr = 0.05, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0.1, momentum = 0, max_grad_norm = 0;
  bool nesterov = false, set_betas = false, reduce_sum = false;
  std::string no_weight_decay;  // config pattern ("" = not set)
  std::vector<ParamSpec> params = {{"proj.weight", {37}}, {"proj.bias", {5}}, {"gain", {1}}};
  std::vector<double> wd_override;       // fsdp_param_set_weight_decay per param; NaN = none
  std::vector<double> expected_wd;       // the decay each param must get (empty = weight_decay)
  std::vector<double> lr_schedule;       // fsdp_set_lr(lr_schedule[t]) before step t (empty = none)
  std::vector<float> grad_scale;         // grads of step t are scaled by this (empty = 1)
  std::vector<bool> skip_backward;       // no backward pass before step t
  fsdp_dtype_t dtype = FSDP_DTYPE_FP32;  // bf16 runs use bf16-exact grads and reduce_dtype=fp32
};

void PrintTo(const OptCase& c, std::ostream* os) { *os << c.name; }

Tensor init_values(size_t param, size_t n) { return Rng(100 + param).uniform_vec(n, -1.f, 1.f); }

// The grad rank `rank` writes for `param` before step t (0-based).
Tensor rank_grad(const OptCase& c, int t, int rank, size_t param, size_t n) {
  Tensor g = Rng(7919u * uint64_t(t + 1) + 31u * uint64_t(rank) + param).uniform_vec(n, -1.f, 1.f);
  const float s = c.grad_scale.empty() ? 1.f : c.grad_scale[size_t(t)];
  for (auto& v : g) v = round_to(c.dtype, v * s);
  return g;
}

bool skipped(const OptCase& c, int t) { return !c.skip_backward.empty() && c.skip_backward[size_t(t)]; }

struct Result {
  std::vector<Tensor> params;
  std::vector<double> norms;
  int clipped_steps = 0;
};

// ---- the scalar reference -------------------------------------------------

Result reference(const OptCase& c) {
  const size_t np = c.params.size();
  Result res;
  std::vector<Tensor> m(np), v(np), buf(np);
  for (size_t i = 0; i < np; ++i) {
    const size_t n = numel_of(c.params[i].shape);
    res.params.push_back(init_values(i, n));
    m[i].assign(n, 0.f);
    v[i].assign(n, 0.f);
    buf[i].assign(n, 0.f);
  }
  for (int t = 0; t < c.steps; ++t) {
    const double lr = c.lr_schedule.empty() ? c.lr : c.lr_schedule[size_t(t)];
    std::vector<Tensor> g(np);
    double sq = 0;
    for (size_t i = 0; i < np; ++i) {
      const size_t n = res.params[i].size();
      g[i].assign(n, 0.f);
      if (!skipped(c, t)) {
        for (int r = 0; r < c.world; ++r) {
          const Tensor gr = rank_grad(c, t, r, i, n);
          for (size_t k = 0; k < n; ++k) g[i][k] += gr[k];
        }
        if (!c.reduce_sum)
          for (auto& x : g[i]) x /= float(c.world);
      }
      for (float x : g[i]) sq += double(x) * double(x);
    }
    const double norm = std::sqrt(sq);
    res.norms.push_back(norm);
    if (c.max_grad_norm > 0) {
      const double coef = std::min(1.0, c.max_grad_norm / (norm + 1e-6));
      if (coef < 1.0) res.clipped_steps++;
      for (auto& gi : g)
        for (auto& x : gi) x = float(double(x) * coef);
    }
    const int step = t + 1;
    for (size_t i = 0; i < np; ++i) {
      const float wd = float(c.expected_wd.empty() ? c.weight_decay : c.expected_wd[i]);
      Tensor& p = res.params[i];
      for (size_t k = 0; k < p.size(); ++k) {
        float gk = g[i][k];
        if (c.optimizer == "sgd") {
          gk += wd * p[k];
          if (c.momentum != 0) {
            buf[i][k] = step == 1 ? gk : float(c.momentum) * buf[i][k] + gk;
            gk = c.nesterov ? gk + float(c.momentum) * buf[i][k] : buf[i][k];
          }
          p[k] -= float(lr) * gk;
          continue;
        }
        if (c.optimizer == "adamw") {
          p[k] *= float(1.0 - lr * wd);
        } else {
          gk += wd * p[k];
        }
        m[i][k] = float(c.beta1) * m[i][k] + float(1.0 - c.beta1) * gk;
        v[i][k] = float(c.beta2) * v[i][k] + float(1.0 - c.beta2) * gk * gk;
        const float bc1 = float(1.0 - std::pow(c.beta1, step));
        const float bc2_sqrt = float(std::sqrt(1.0 - std::pow(c.beta2, step)));
        p[k] -= (float(lr) / bc1) * m[i][k] / (std::sqrt(v[i][k]) / bc2_sqrt + float(c.eps));
      }
    }
  }
  return res;
}

// ---- the same steps through libfsdp ---------------------------------------

Result run_lib(const OptCase& c) {
  std::vector<Result> by_rank(size_t(c.world));
  run_ranks(c.world, [&](int rank, fsdp_local_group_t* group) {
    std::map<std::string, std::string> opts = {{"optimizer", c.optimizer},
                                               {"lr", num(c.lr)},
                                               {"weight_decay", num(c.weight_decay)},
                                               {"timeout_s", "20"},
                                               {"param_dtype", dtype_config_name(c.dtype)}};
    if (c.optimizer == "sgd") {
      opts["momentum"] = num(c.momentum);
      opts["nesterov"] = c.nesterov ? "1" : "0";
    }
    if (c.set_betas) {
      opts["beta1"] = num(c.beta1);
      opts["beta2"] = num(c.beta2);
      opts["eps"] = num(c.eps);
    }
    if (c.max_grad_norm > 0) opts["max_grad_norm"] = num(c.max_grad_norm);
    if (c.reduce_sum) opts["reduce_op"] = "sum";
    if (!c.no_weight_decay.empty()) opts["no_weight_decay"] = c.no_weight_decay;
    if (c.dtype != FSDP_DTYPE_FP32) opts["reduce_dtype"] = "fp32";
    ConfigPtr cfg = make_config(opts);
    ASSERT_TRUE(cfg);
    fsdp_ctx_t* raw = nullptr;
    ASSERT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
    CtxPtr ctx(raw);
    fsdp_unit_t* unit = nullptr;
    ASSERT_OK(register_unit(ctx.get(), "opt", c.params, &unit));
    for (size_t i = 0; i < c.params.size(); ++i) {
      const Tensor v = init_values(i, numel_of(c.params[i].shape));
      ASSERT_OK(fsdp_param_set_values(unit, i, v.data(), v.size()));
      if (i < c.wd_override.size() && !std::isnan(c.wd_override[i]))
        ASSERT_OK(fsdp_param_set_weight_decay(unit, i, c.wd_override[i]));
    }
    Result& res = by_rank[size_t(rank)];
    for (int t = 0; t < c.steps; ++t) {
      if (!skipped(c, t)) {
        ASSERT_OK(fsdp_forward_begin(unit, nullptr));
        ASSERT_OK(fsdp_forward_end(unit, nullptr));
        ASSERT_OK(fsdp_backward_begin(unit, nullptr));
        for (size_t i = 0; i < c.params.size(); ++i) {
          void* gp = nullptr;
          ASSERT_OK(fsdp_grad_ptr(unit, i, &gp));
          ASSERT_NE(gp, nullptr);
          const Tensor g = rank_grad(c, t, rank, i, numel_of(c.params[i].shape));
          for (size_t k = 0; k < g.size(); ++k) add_elem(gp, k, c.dtype, g[k]);
        }
        ASSERT_OK(fsdp_backward_end(unit, nullptr));
      }
      if (!c.lr_schedule.empty()) ASSERT_OK(fsdp_set_lr(ctx.get(), c.lr_schedule[size_t(t)]));
      ASSERT_OK(fsdp_step(ctx.get(), nullptr));
      double norm = -1;
      ASSERT_OK(fsdp_last_grad_norm(ctx.get(), &norm));
      res.norms.push_back(norm);
    }
    for (size_t i = 0; i < c.params.size(); ++i) {
      Tensor p(numel_of(c.params[i].shape), NAN);
      EXPECT_OK(fsdp_gather_param(unit, i, p.data(), p.size()));
      res.params.push_back(p);
    }
    if (c.dtype != FSDP_DTYPE_FP32) {
      // The low-precision copy the next forward uses is the rounded master.
      ASSERT_OK(fsdp_forward_begin(unit, nullptr));
      for (size_t i = 0; i < c.params.size(); ++i) {
        void* pp = nullptr;
        ASSERT_OK(fsdp_param_ptr(unit, i, &pp));
        ASSERT_NE(pp, nullptr);
        for (size_t k = 0; k < res.params[i].size(); ++k)
          EXPECT_EQ(load_elem(pp, k, c.dtype), round_to(c.dtype, res.params[i][k])) << "param " << i << "[" << k << "]";
      }
      ASSERT_OK(fsdp_forward_end(unit, nullptr));
    }
    EXPECT_OK(fsdp_ctx_finalize(ctx.get()));
  });
  for (int r = 1; r < c.world; ++r) {
    EXPECT_EQ(by_rank[size_t(r)].params, by_rank[0].params) << "rank " << r << " gathered other values";
    EXPECT_EQ(by_rank[size_t(r)].norms, by_rank[0].norms) << "rank " << r << " saw another grad norm";
  }
  return by_rank[0];
}

void expect_matches(const OptCase& c, const Result& lib, const Result& ref) {
  ASSERT_EQ(lib.params.size(), ref.params.size());
  for (size_t i = 0; i < ref.params.size(); ++i)
    EXPECT_LE(rel_max_diff(lib.params[i], ref.params[i]), kTol) << c.params[i].name;
}

// The reference under `other` must be far from the reference under `c`, or
// the comparison could not tell them apart.
void expect_distinguishable(const OptCase& c, const OptCase& other, const std::string& what) {
  const Result a = reference(c), b = reference(other);
  double worst = 0;
  for (size_t i = 0; i < a.params.size(); ++i) worst = std::max(worst, rel_max_diff(b.params[i], a.params[i]));
  EXPECT_GT(worst, 100 * kTol) << "the test cannot see " << what;
}

// ---- optimizer x world -------------------------------------------------------

std::vector<OptCase> cases() {
  std::vector<OptCase> out;
  auto add = [&](OptCase c, const std::string& name) {
    for (int w : {1, 3}) {
      c.world = w;
      c.name = name + "_world" + std::to_string(w);
      out.push_back(c);
    }
  };
  OptCase adamw;
  add(adamw, "AdamW");
  OptCase betas = adamw;
  betas.set_betas = true;
  betas.beta1 = 0.8;
  betas.beta2 = 0.95;
  betas.eps = 1e-3;
  add(betas, "AdamWBetasAndEps");
  OptCase adam = adamw;
  adam.optimizer = "adam";
  add(adam, "Adam");
  OptCase sgd;
  sgd.optimizer = "sgd";
  sgd.lr = 0.1;
  add(sgd, "Sgd");
  OptCase mom = sgd;
  mom.momentum = 0.9;
  add(mom, "SgdMomentum");
  OptCase nest = mom;
  nest.nesterov = true;
  add(nest, "SgdNesterov");
  OptCase sum = sgd;
  sum.reduce_sum = true;
  add(sum, "SgdReduceOpSum");
  OptCase sgd_lr = sgd;
  sgd_lr.lr_schedule = {0.1, 0.01, 0.5, 0.05};
  add(sgd_lr, "SgdSetLr");
  OptCase adamw_lr = adamw;
  adamw_lr.lr_schedule = {0.05, 0.2, 0.01, 0.1};
  add(adamw_lr, "AdamWSetLr");
  return out;
}

class OptimizerStep : public ::testing::TestWithParam<OptCase> {};

TEST_P(OptimizerStep, MatchesScalarReferenceOnAveragedGrads) {
  const OptCase& c = GetParam();
  const Result ref = reference(c);
  // What each case must be able to tell apart.
  OptCase other = c;
  other.weight_decay = 0;
  expect_distinguishable(c, other, "weight decay");
  if (c.world > 1) {
    other = c;
    other.world = 1;  // only rank 0's grads
    expect_distinguishable(c, other, "grads of the other ranks");
  }
  if (c.optimizer == "sgd" && c.world > 1) {
    other = c;
    other.reduce_sum = !c.reduce_sum;
    expect_distinguishable(c, other, "sum vs average");
  }
  if (!c.lr_schedule.empty()) {
    other = c;
    other.lr_schedule.clear();
    expect_distinguishable(c, other, "fsdp_set_lr");
  }
  const Result lib = run_lib(c);
  if (::testing::Test::HasFailure()) return;
  expect_matches(c, lib, ref);
}

INSTANTIATE_TEST_SUITE_P(Optimizers, OptimizerStep, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<OptCase>& pi) { return pi.param.name; });

// ---- weight decay mask -----------------------------------------------------

TEST(WeightDecay, PatternsAndPerParamOverridesSelectWhichParamsDecay) {
  OptCase c;
  c.world = 3;
  c.weight_decay = 0.1;
  c.params = {{"proj.weight", {37}},      // context weight_decay
              {"proj.bias", {5}},         // "*bias" -> 0
              {"final_norm.scale", {2}},  // "*norm*" -> 0
              {"gain", {1}},              // fsdp_param_set_weight_decay(0)
              {"head.bias", {3}},         // matches "*bias" but set to 0.3: the override wins
              {"head.weight", {3, 4}}};   // set to 0.25
  c.no_weight_decay = "*bias,*norm*";
  c.wd_override = {kNone, kNone, kNone, 0.0, 0.3, 0.25};
  c.expected_wd = {0.1, 0.0, 0.0, 0.0, 0.3, 0.25};
  c.lr = 0.2;  // large enough that a decay of 0.1 moves params well past kTol
  // Every param's decay must matter: each one given another decay is visible.
  for (size_t i = 0; i < c.params.size(); ++i) {
    OptCase other = c;
    other.expected_wd[i] = c.expected_wd[i] == 0 ? 0.1 : 0;
    const Result a = reference(c), b = reference(other);
    EXPECT_GT(rel_max_diff(b.params[i], a.params[i]), 100 * kTol) << c.params[i].name;
  }
  const Result ref = reference(c);
  const Result lib = run_lib(c);
  if (::testing::Test::HasFailure()) return;
  expect_matches(c, lib, ref);
}

// ---- clipping ----------------------------------------------------------------

TEST(Clipping, ScalesAveragedGradsByGlobalNormBeforeWeightDecay) {
  OptCase c;
  c.optimizer = "sgd";
  c.lr = 0.1;
  c.momentum = 0.9;
  c.weight_decay = 0.5;
  c.world = 3;
  c.steps = 4;
  // The averaged grads' norm is ~2 at scale 1 and ~0.02 at scale 0.01.
  c.grad_scale = {1.f, 3.f, 0.01f, 1.f};
  c.max_grad_norm = 1.0;
  const Result ref = reference(c);
  EXPECT_EQ(ref.clipped_steps, 3) << "steps 1, 2, 4 must clip and step 3 must not";
  OptCase other = c;
  other.max_grad_norm = 0;
  expect_distinguishable(c, other, "clipping");
  other = c;
  other.reduce_sum = true;  // a norm taken over summed grads clips differently
  expect_distinguishable(c, other, "the norm of summed grads");

  const Result lib = run_lib(c);
  if (::testing::Test::HasFailure()) return;
  expect_matches(c, lib, ref);
  ASSERT_EQ(lib.norms.size(), ref.norms.size());
  for (size_t t = 0; t < ref.norms.size(); ++t)
    EXPECT_NEAR(lib.norms[t], ref.norms[t], 1e-5 * ref.norms[t]) << "grad norm before step " << t + 1;
}

// ---- grads are consumed by the step ------------------------------------------

TEST(Step, ZeroesShardedGradsSoAStepWithoutBackwardLeavesSgdParamsUnchanged) {
  OptCase c;
  c.optimizer = "sgd";
  c.lr = 0.1;
  c.weight_decay = 0;
  c.world = 3;
  c.steps = 3;
  c.skip_backward = {false, true, true};
  const Result ref = reference(c);
  OptCase other = c;
  other.skip_backward = {false, false, false};  // as if stale grads were reapplied
  expect_distinguishable(c, other, "grads that survive a step");
  const Result lib = run_lib(c);
  if (::testing::Test::HasFailure()) return;
  expect_matches(c, lib, ref);
  ASSERT_EQ(lib.norms.size(), 3u);
  EXPECT_GT(lib.norms[0], 0.0);
  EXPECT_EQ(lib.norms[1], 0.0);
  EXPECT_EQ(lib.norms[2], 0.0);
}

// ---- low-precision params ------------------------------------------------------

TEST(LowPrecision, Bf16ParamsAreTheRoundedFp32MasterAfterEachStep) {
  OptCase c;
  c.world = 3;
  c.dtype = FSDP_DTYPE_BF16;  // grads are bf16-exact and reduced in fp32
  const Result ref = reference(c);
  const Result lib = run_lib(c);
  if (::testing::Test::HasFailure()) return;
  expect_matches(c, lib, ref);
}

}  // namespace
