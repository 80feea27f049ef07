// The GPT of examples/gpt (the README's main job) trained through libfsdp,
// against an unsharded single-process reference computed here in double
// without libfsdp: the same model math (gpt_model, a template on the scalar),
// the same init and batches, and AdamW with clipping written out below.
//
// - GptBackward: the model's backward against central finite differences in
//   double (so a wrong grad anywhere, the tied head's included, fails), and the
//   recomputed backward equal to the stored one; with LoRA adapters on every
//   projection too (the adapters' grads and the base's through them).
// - GptFsdp: a 2-layer GPT at world 1, 3 and 4 under FULL_SHARD, SHARD_GRAD_OP
//   and HYBRID_SHARD, with and without recompute, 5 AdamW steps in fp32,
//   ending within fp32 tolerance of the reference.
// - GptLora: the base frozen and rank-4 adapters trained through libfsdp at
//   worlds 1-4 (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, recompute)
//   against the reference that updates the adapters alone: the base stays
//   bitwise as it was, grads and optimizer state are the adapters' only.
#include <cblas.h>
#include <fnmatch.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fsdp.h"
#include "gpt_fsdp.h"
#include "gpt_model.h"

namespace {

using gpt::Shape;

// One OpenBLAS thread per caller: the thread-ranks are the parallelism here,
// as in train_gpt (which gives each rank its share of the cores).
const bool kOneBlasThread = [] {
  openblas_set_num_threads(1);
  return true;
}();

// ---- finite differences ------------------------------------------------------------

struct DoubleModel {                                   // params and grads of every unit, as plain vectors
  std::vector<std::vector<std::vector<double>>> p, g;  // [unit][param][element]
  std::vector<gpt::UnitSpec> specs;                    // model_units, then lora_units with LoRA
  size_t n_base = 0;                                   // units of the base model

  explicit DoubleModel(const Shape& s, int lora_rank = 0) : specs(gpt::model_units(s)), n_base(specs.size()) {
    if (lora_rank > 0) {
      const auto adapters = gpt::lora_units(s, lora_rank);
      specs.insert(specs.end(), adapters.begin(), adapters.end());
    }
    for (const gpt::UnitSpec& u : specs) {
      p.emplace_back(), g.emplace_back();
      for (const gpt::ParamSpec& ps : u.params) {
        p.back().emplace_back(ps.numel(), 0.0);
        g.back().emplace_back(ps.numel(), 0.0);
      }
    }
  }
  gpt::UnitView<double> view(size_t u) {
    gpt::UnitView<double> v;
    for (size_t i = 0; i < p[u].size(); ++i) {
      v.p.push_back(p[u][i].data());
      v.g.push_back(g[u][i].data());
    }
    return v;
  }
  void zero_grads() {
    for (auto& unit : g)
      for (auto& t : unit) std::fill(t.begin(), t.end(), 0.0);
  }
  // The mean loss on (inputs, targets); with backward, the grads of it.
  double run(gpt::Model<double>& m, const uint8_t* in, const uint8_t* tg, int t, bool backward) {
    const size_t L = static_cast<size_t>(m.shape().layers);
    const bool lora = specs.size() > n_base;
    std::vector<gpt::UnitView<double>> adapters;
    for (size_t l = 0; lora && l < L; ++l) adapters.push_back(view(n_base + l));
    auto adapter = [&](size_t l) { return lora ? &adapters[l] : nullptr; };
    m.embed_forward(view(0), in, t);
    for (size_t l = 0; l < L; ++l) m.block_forward(static_cast<int>(l), view(1 + l), adapter(l));
    m.final_forward(view(1 + L));
    const double loss = m.head_forward(view(0), tg);
    if (backward) {
      m.head_backward(view(0));
      m.final_backward(view(1 + L));
      for (size_t l = L; l-- > 0;) m.block_backward(static_cast<int>(l), view(1 + l), adapter(l));
      m.embed_backward(view(0));
    }
    return loss;
  }
};

std::vector<uint8_t> random_bytes(size_t n, uint64_t seed) {
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>((seed = seed * 6364136223846793005ull + 1442695040888963407ull) >> 56);
  return v;
}

// Every param's grad against central differences; with LoRA (rank
// lora.rank, B away from zero) the adapters' too, and the base's through them.
void check_finite_differences(gpt::Lora lora) {
  const Shape s{2, 8, 2, 5};
  const int batch = 2, t = 5;
  DoubleModel dm(s, lora.rank);
  uint64_t seed = 7;
  for (auto& unit : dm.p)  // params of a size that moves every path (norm weights away from 1)
    for (auto& tensor : unit)
      for (double& x : tensor)
        x = (static_cast<double>((seed = seed * 6364136223846793005ull + 1442695040888963407ull) >> 11) /
                 9007199254740992.0 -
             0.5);
  // Few distinct tokens, so the embedding rows of the input and the head overlap.
  std::vector<uint8_t> in = random_bytes(batch * t, 3), tg = random_bytes(batch * t, 4);
  for (auto& b : in) b %= 7;
  for (auto& b : tg) b %= 7;
  gpt::Model<double> m(s, batch, false, lora);
  dm.zero_grads();
  dm.run(m, in.data(), tg.data(), t, true);
  const auto grads = dm.g;
  const double eps = 1e-5;
  // d loss / d x by central differences: truncation ~eps^2, rounding ~1e-16/eps in double.
  auto central = [&](double& x) {
    const double x0 = x;
    x = x0 + eps;
    const double up = dm.run(m, in.data(), tg.data(), t, false);
    x = x0 - eps;
    const double down = dm.run(m, in.data(), tg.data(), t, false);
    x = x0;
    return (up - down) / (2 * eps);
  };
  size_t checked = 0;
  for (size_t u = 0; u < dm.p.size(); ++u)
    for (size_t i = 0; i < dm.p[u].size(); ++i)
      for (size_t k = 0; k < dm.p[u][i].size(); ++k) {
        if (u == 0 && i == gpt::kWte && k / static_cast<size_t>(s.width) >= 8) continue;  // bytes 8..255: see below
        const double fd = central(dm.p[u][i][k]), an = grads[u][i][k];
        ASSERT_NEAR(an, fd, 1e-7 + 1e-6 * std::fabs(fd))
            << dm.specs[u].params[i].name << "[" << k << "] of unit " << dm.specs[u].name;
        ++checked;
      }
  // The rows of bytes that never occur still get the head's grad (softmax over
  // every byte): check a few of them too.
  for (size_t k = 200 * static_cast<size_t>(s.width); k < 201 * static_cast<size_t>(s.width); ++k) {
    ASSERT_NEAR(grads[0][gpt::kWte][k], central(dm.p[0][gpt::kWte][k]), 1e-9) << "wte[" << k << "]";
    ASSERT_NE(grads[0][gpt::kWte][k], 0.0);
  }
  EXPECT_GT(checked, 1000u);
}

TEST(GptBackward, MatchesFiniteDifferencesOfEveryParam) { check_finite_differences({}); }

// alpha / rank = 2: a scale left out of either pass fails.
TEST(GptBackward, WithLoraAdaptersMatchesFiniteDifferencesOfEveryParam) { check_finite_differences({3, 6.0}); }

TEST(GptBackward, RecomputeGivesTheSameGrads) {
  const Shape s{2, 8, 2, 5};
  DoubleModel a(s), b(s);
  for (size_t u = 0; u < a.p.size(); ++u)
    for (size_t i = 0; i < a.p[u].size(); ++i) {
      std::vector<float> init(a.p[u][i].size());
      gpt::init_param(s, a.specs[u].params[i], 5, init.data());
      a.p[u][i].assign(init.begin(), init.end());
      b.p[u][i] = a.p[u][i];
    }
  const std::vector<uint8_t> in = random_bytes(10, 1), tg = random_bytes(10, 2);
  gpt::Model<double> keep(s, 2, false), again(s, 2, true);
  a.zero_grads(), b.zero_grads();
  EXPECT_EQ(a.run(keep, in.data(), tg.data(), 5, true), b.run(again, in.data(), tg.data(), 5, true));
  EXPECT_EQ(a.g, b.g);
  EXPECT_LT(again.activation_bytes(), keep.activation_bytes());
}

// ---- libfsdp against the reference ----------------------------------------------

const Shape kShape{2, 16, 2, 8};
constexpr int kBatch = 12, kSteps = 5;
constexpr double kLr = 1e-2, kB1 = 0.9, kB2 = 0.95, kEps = 1e-8, kWd = 0.1, kClip = 0.5;
constexpr uint64_t kSeed = 11;

// The global batch of a step: kBatch sequences of random bytes.
std::vector<uint8_t> batch_of(int step, bool targets) {
  std::vector<uint8_t> w = random_bytes(static_cast<size_t>(kBatch) * (kShape.context + 1), 100 + step);
  std::vector<uint8_t> out;
  for (int b = 0; b < kBatch; ++b) {
    const uint8_t* row = w.data() + static_cast<size_t>(b) * (kShape.context + 1);
    out.insert(out.end(), row + (targets ? 1 : 0), row + (targets ? 1 : 0) + kShape.context);
  }
  return out;
}

bool no_decay(const std::string& name) {
  std::stringstream ss(gpt::kNoWeightDecay);
  std::string pat;
  while (std::getline(ss, pat, ','))
    if (fnmatch(pat.c_str(), name.c_str(), 0) == 0) return true;
  return false;
}

// kSteps of AdamW with clipping on the whole batch in one process, in double.
// With LoRA the base is frozen: the adapters alone are clipped and updated.
std::vector<std::vector<double>> reference(double* clip_coef_first, gpt::Lora lora = {}, double clip = kClip) {
  DoubleModel dm(kShape, lora.rank);
  const size_t first_trained = lora.on() ? dm.n_base : 0;
  for (size_t u = 0; u < dm.p.size(); ++u)
    for (size_t i = 0; i < dm.p[u].size(); ++i) {
      std::vector<float> init(dm.p[u][i].size());
      gpt::init_param(kShape, dm.specs[u].params[i], kSeed, init.data());
      dm.p[u][i].assign(init.begin(), init.end());
    }
  auto m1 = dm.g, m2 = dm.g;
  gpt::Model<double> model(kShape, kBatch, false, lora);
  for (int step = 1; step <= kSteps; ++step) {
    dm.zero_grads();
    const auto in = batch_of(step, false), tg = batch_of(step, true);
    dm.run(model, in.data(), tg.data(), kShape.context, true);
    double sq = 0;
    for (size_t u = first_trained; u < dm.g.size(); ++u)
      for (auto& t : dm.g[u])
        for (double x : t) sq += x * x;
    const double coef = std::min(1.0, clip / (std::sqrt(sq) + 1e-6));
    if (step == 1) *clip_coef_first = coef;
    const double bc1 = 1 - std::pow(kB1, step), bc2 = 1 - std::pow(kB2, step);
    for (size_t u = first_trained; u < dm.p.size(); ++u)
      for (size_t i = 0; i < dm.p[u].size(); ++i) {
        const double wd = no_decay(dm.specs[u].params[i].name) ? 0.0 : kWd;
        for (size_t k = 0; k < dm.p[u][i].size(); ++k) {
          double& p = dm.p[u][i][k];
          const double g = dm.g[u][i][k] * coef;
          double& m = m1[u][i][k];
          double& v = m2[u][i][k];
          p *= 1 - kLr * wd;
          m = kB1 * m + (1 - kB1) * g;
          v = kB2 * v + (1 - kB2) * g * g;
          p -= kLr / bc1 * m / (std::sqrt(v / bc2) + kEps);
        }
      }
  }
  std::vector<std::vector<double>> flat;
  for (auto& unit : dm.p)
    for (auto& t : unit) flat.push_back(t);
  return flat;
}

struct Case {
  int world;
  const char* sharding;
  int group;  // shard_group_size for HYBRID_SHARD
  bool recompute;
  const char* dtype = "fp32";
  bool keep_shard = true;              // keep_param_dtype_shard
  fsdp_memory_stats_t* mem = nullptr;  // rank 0's memory after training, when asked
  gpt::Lora lora = {};                 // adapters on a frozen base
  size_t* lora_shard_numel = nullptr;  // rank 0's adapter shard elements, when asked
  double clip = kClip;                 // max_grad_norm
};
std::string case_name(const testing::TestParamInfo<Case>& info) {
  return std::string(info.param.sharding) + "_world" + std::to_string(info.param.world) +
         (info.param.group ? "_group" + std::to_string(info.param.group) : "") +
         (info.param.recompute ? "_recompute" : "");
}

// Trains kSteps through libfsdp on c.world thread-ranks (fp32); rank 0's
// gathered params.
std::vector<std::vector<float>> train_fsdp(const Case& c) {
  fsdp_local_group_t* group;
  EXPECT_EQ(fsdp_local_group_create(c.world, &group), FSDP_OK);
  std::vector<std::vector<float>> out;
  std::vector<std::string> errors(static_cast<size_t>(c.world));
  std::vector<std::thread> threads;
  for (int r = 0; r < c.world; ++r)
    threads.emplace_back([&, r] {
      fsdp_ctx_t* ctx = nullptr;
      try {
        fsdp_config_t* cfg;
        gpt::check_fsdp(fsdp_config_create(&cfg), "config");
        const std::pair<const char*, std::string> kv[] = {{"sharding", c.sharding},
                                                          {"param_dtype", c.dtype},
                                                          {"keep_param_dtype_shard", c.keep_shard ? "1" : "0"},
                                                          {"optimizer", "adamw"},
                                                          {"lr", std::to_string(kLr)},
                                                          {"beta1", std::to_string(kB1)},
                                                          {"beta2", std::to_string(kB2)},
                                                          {"eps", "1e-8"},
                                                          {"weight_decay", std::to_string(kWd)},
                                                          {"no_weight_decay", gpt::kNoWeightDecay},
                                                          {"max_grad_norm", std::to_string(c.clip)},
                                                          {"forward_prefetch", "1"},
                                                          {"shard_group_size", std::to_string(c.group)}};
        for (const auto& [k, v] : kv) gpt::check_fsdp(fsdp_config_set(cfg, k, v.c_str()), k);
        const fsdp_status_t st = fsdp_ctx_create(cfg, group, r, &ctx);
        fsdp_config_destroy(cfg);
        gpt::check_fsdp(st, "fsdp_ctx_create");
        const int local = kBatch / c.world;
        gpt::FsdpGpt model(ctx, kShape, local, c.recompute, kSeed, c.lora);
        const size_t t = static_cast<size_t>(kShape.context);
        for (int step = 1; step <= kSteps; ++step) {
          const auto in = batch_of(step, false), tg = batch_of(step, true);
          model.train_step(in.data() + r * local * t, tg.data() + r * local * t);
        }
        auto params = model.gather_params();
        if (r == 0) out = std::move(params);
        if (r == 0 && c.mem) {
          c.mem->struct_size = sizeof *c.mem;
          gpt::check_fsdp(fsdp_memory_stats(ctx, c.mem), "fsdp_memory_stats");
        }
        if (r == 0 && c.lora_shard_numel) {
          const std::vector<fsdp_unit_t*> units = model.units();
          *c.lora_shard_numel = 0;
          for (size_t u = model.specs().size(); u < units.size(); ++u) {
            float* p = nullptr;
            size_t off = 0, n = 0;
            gpt::check_fsdp(fsdp_shard_info(units[u], &p, &off, &n), "fsdp_shard_info");
            *c.lora_shard_numel += n;
          }
        }
        gpt::check_fsdp(fsdp_ctx_finalize(ctx), "fsdp_ctx_finalize");
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
        fsdp_local_group_abort(group, e.what());
      }
      fsdp_ctx_destroy(ctx);
    });
  for (auto& th : threads) th.join();
  fsdp_local_group_destroy(group);
  for (int r = 0; r < c.world; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
  return out;
}

class GptFsdp : public testing::TestWithParam<Case> {};

TEST_P(GptFsdp, TrainsLikeTheUnshardedReference) {
  double coef = 0;
  const auto ref = reference(&coef);
  ASSERT_LT(coef, 1.0) << "clipping must be active in the reference for the test to cover it";
  const auto got = train_fsdp(GetParam());
  ASSERT_EQ(got.size(), ref.size());
  const auto specs = gpt::model_units(kShape);
  std::vector<std::string> names;
  for (const auto& u : specs)
    for (const auto& p : u.params) names.push_back(p.name);
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_EQ(got[i].size(), ref[i].size());
    for (size_t k = 0; k < ref[i].size(); ++k) {
      // fp32 against double: the grads differ in their last bits (sums in
      // another order and precision); AdamW's update is m / sqrt(v), so a
      // relative grad error e moves a param by about lr * e per step, more
      // where a grad is near zero and sqrt(v) small. Seen here: at most 4e-6
      // after 5 steps of lr 1e-2. A grad that is lost, doubled or mis-sharded
      // moves params by ~lr = 1e-2 (dropping 16 elements of the head's wte
      // grad fails every case).
      const double d = std::fabs(got[i][k] - ref[i][k]);
      worst = std::max(worst, d);
      ASSERT_LT(d, 2e-5) << names[i] << "[" << k << "]: " << got[i][k] << " vs " << ref[i][k];
    }
  }
  RecordProperty("max_abs_diff", std::to_string(worst));
}

INSTANTIATE_TEST_SUITE_P(Worlds, GptFsdp,
                         testing::Values(Case{1, "FULL_SHARD", 0, false}, Case{3, "FULL_SHARD", 0, false},
                                         Case{3, "FULL_SHARD", 0, true}, Case{3, "SHARD_GRAD_OP", 0, false},
                                         Case{3, "HYBRID_SHARD", 1, false}, Case{3, "HYBRID_SHARD", 3, true},
                                         Case{4, "HYBRID_SHARD", 2, false}),
                         case_name);

TEST(GptFsdpRecompute, IsBitwiseTheSameTraining) {
  const auto keep = train_fsdp({3, "FULL_SHARD", 0, false});
  const auto again = train_fsdp({3, "FULL_SHARD", 0, true});
  EXPECT_EQ(keep, again);
}

// keep_param_dtype_shard=0 casts the fp32 master at each gather instead of
// keeping a bf16 copy: the gathered bf16 params are the same bits (both are
// the master rounded to nearest even), so training is bitwise the same, and
// each rank holds 2 bytes less per element of its shard.
TEST(GptFsdpParamShard, CastAtGatherTrainsBitwiseLikeAKeptShard) {
  for (const char* sharding : {"FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"}) {
    fsdp_memory_stats_t kept{}, cast{};
    const auto a = train_fsdp({3, sharding, sharding[0] == 'H' ? 3 : 0, false, "bf16", true, &kept});
    const auto b = train_fsdp({3, sharding, sharding[0] == 'H' ? 3 : 0, false, "bf16", false, &cast});
    EXPECT_EQ(a, b) << sharding;
    size_t shard_elems = kept.sharded_params_nbytes / 6;  // fp32 master + bf16 copy
    EXPECT_EQ(kept.sharded_params_nbytes, shard_elems * 6) << sharding;
    EXPECT_EQ(cast.sharded_params_nbytes, shard_elems * 4) << sharding;
    // The stage of a gather is transient: nothing of it is held after training.
    EXPECT_LE(cast.total_nbytes, kept.total_nbytes - shard_elems * 2) << sharding;
  }
}

TEST(GptFsdpParamShard, CastAtGatherWithOffloadIsRefusedWithAReason) {
  fsdp_config_t* cfg;
  ASSERT_EQ(fsdp_config_create(&cfg), FSDP_OK);
  char value[16];
  ASSERT_EQ(fsdp_config_get(cfg, "keep_param_dtype_shard", value, sizeof value, nullptr), FSDP_OK);
  EXPECT_STREQ(value, "auto");  // the default: no copy where units are gathered, except with offload
  EXPECT_EQ(fsdp_config_set(cfg, "keep_param_dtype_shard", "sometimes"), FSDP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fsdp_last_error()).find("auto"), std::string::npos) << fsdp_last_error();
  ASSERT_EQ(fsdp_config_set(cfg, "param_dtype", "bf16"), FSDP_OK);
  ASSERT_EQ(fsdp_config_set(cfg, "offload", "cpu"), FSDP_OK);
  ASSERT_EQ(fsdp_config_set(cfg, "keep_param_dtype_shard", "0"), FSDP_OK);
  fsdp_ctx_t* ctx = nullptr;
  EXPECT_EQ(fsdp_ctx_create(cfg, nullptr, 0, &ctx), FSDP_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(fsdp_last_error()).find("offload=cpu"), std::string::npos) << fsdp_last_error();
  EXPECT_EQ(ctx, nullptr);
  fsdp_config_destroy(cfg);
}

// ---- LoRA: adapters on a frozen base -----------------------------------------------

class GptLora : public testing::TestWithParam<Case> {};

// The base keeps its init bitwise; the adapters end where the reference's
// do (within GptFsdp's tolerance and for its reason: fp32 against double);
// the grad and optimizer bytes are the adapters' shards alone.
TEST_P(GptLora, TrainsTheAdaptersAloneLikeTheReference) {
  Case c = GetParam();
  c.lora = {4, 8.0};
  c.clip = 0.06;  // the adapters' grad norm is 0.07-0.10 over these steps
  fsdp_memory_stats_t mem{};
  size_t lora_numel = 0;
  c.mem = &mem;
  c.lora_shard_numel = &lora_numel;
  double coef = 0;
  const auto ref = reference(&coef, c.lora, c.clip);
  ASSERT_LT(coef, 1.0) << "clipping must be active in the reference for the test to cover it";
  const auto got = train_fsdp(c);
  ASSERT_EQ(got.size(), ref.size());
  const auto specs = gpt::model_units(kShape);
  size_t n_base = 0;
  for (const auto& u : specs) n_base += u.params.size();
  double moved = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_EQ(got[i].size(), ref[i].size());
    for (size_t k = 0; k < ref[i].size(); ++k) {
      if (i < n_base) {  // frozen: the init, bitwise (the reference never changes it)
        ASSERT_EQ(got[i][k], static_cast<float>(ref[i][k])) << "base param " << i << "[" << k << "] changed";
        continue;
      }
      ASSERT_NEAR(got[i][k], ref[i][k], 2e-5) << "adapter param " << i << "[" << k << "]";
    }
  }
  // The adapters did train: B moved away from zero.
  for (size_t i = n_base; i < ref.size(); ++i)
    for (double x : ref[i]) moved = std::max(moved, std::fabs(x));
  EXPECT_GT(moved, 1e-3);
  EXPECT_EQ(mem.sharded_grads_nbytes, lora_numel * sizeof(float));
  EXPECT_EQ(mem.optimizer_state_nbytes, 2 * lora_numel * sizeof(float));
  EXPECT_GT(lora_numel, 0u);
}

INSTANTIATE_TEST_SUITE_P(Worlds, GptLora,
                         testing::Values(Case{1, "FULL_SHARD", 0, false}, Case{3, "FULL_SHARD", 0, false},
                                         Case{3, "FULL_SHARD", 0, true}, Case{4, "SHARD_GRAD_OP", 0, false},
                                         Case{4, "HYBRID_SHARD", 2, false}),
                         case_name);

}  // namespace
