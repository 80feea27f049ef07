// Proves that N-rank sharded training (every sharding; fp32/bf16/fp16; grad accumulation; no_sync; clipping; padding;
// the quantized grad reduction, which the reference models exactly) matches a single-process unsharded reference.
// The model and the reference: equivalence_reference.h; the variants' cases: equivalence_cases.h; here the same
// training driven through libfsdp, and the tests.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "equivalence_cases.h"
#include "equivalence_reference.h"
#include "host_stream.h"
#include "rank_runner.h"

using namespace fsdp_test;
using namespace fsdp_test::equivalence;

namespace {

// ---- the same training driven through libfsdp on N ranks -------------------

// A group as fsdp_set_param_group's options.
std::string group_options(const RefOptions::Group& g) {
  std::string o;
  auto add = [&](const char* key, double v) {
    if (v >= 0) o += (o.empty() ? "" : ";") + std::string(key) + "=" + std::to_string(v);
  };
  add("lr_scale", g.lr_scale);
  add("beta1", g.beta1);
  add("beta2", g.beta2);
  add("weight_decay", g.weight_decay);
  return o;
}

struct LibResult {
  std::vector<Params> params_by_rank;
  std::vector<std::vector<double>> norms_by_rank;
};

// Pointers to unit u's params (grads: `grads`), taken on the calling thread:
// compute on a late host stream may run after the unit's state moved on.
// A frozen unit or param has no grads: null pointers, and its backward adds none.
std::vector<void*> buffer_ptrs(fsdp_unit_t* unit, size_t n, bool grads) {
  std::vector<void*> out(n, nullptr);
  int trainable = 1;
  EXPECT_OK(fsdp_unit_trainable(unit, &trainable));
  if (grads && trainable == 0) return out;
  for (size_t i = 0; i < n; ++i) {
    int param_trainable = 1;
    EXPECT_OK(fsdp_param_trainable(unit, i, &param_trainable));
    if (grads && param_trainable == 0) continue;
    EXPECT_OK(grads ? fsdp_grad_ptr(unit, i, &out[i]) : fsdp_param_ptr(unit, i, &out[i]));
  }
  return out;
}

UnitParams load_params(const Model& m, size_t u, const std::vector<void*>& ptrs, fsdp_dtype_t dt) {
  UnitParams p;
  const auto specs = m.unit_params(u);
  for (size_t i = 0; i < specs.size(); ++i) {
    Tensor t(numel_of(specs[i].shape), NAN);
    if (ptrs[i] != nullptr)
      for (size_t k = 0; k < t.size(); ++k) t[k] = load_elem(ptrs[i], k, dt);
    p.push_back(std::move(t));
  }
  return p;
}

// The host's compute of one pass: activations, the loss's grad, the params
// each unit read (kept from forward to backward for backward_only).
struct PassState {
  std::vector<Tensor> acts;
  Tensor dh;
  Params params;
};

// One forward + backward pass over rows [row0, row0+rows) through libfsdp,
// the compute through `host` (at once, or on a late host stream: then the
// forward of a unit reads its params after forward_begin returned and its
// backward writes the grads after backward_end returned, and only libfsdp's
// events keep the gathers, reductions and buffer reuse in order with it).
// `expect` (if not NULL) are the param values every gather must produce.
void lib_pass(Host& host, const Model& m, const std::vector<fsdp_unit_t*>& units, fsdp_dtype_t dt, const Data& d,
              int row0, int rows, float scale, const Params* expect) {
  auto st = std::make_shared<PassState>();
  st->acts.resize(m.n_units() + 1);
  st->acts[0] = rows_of(d.x, m.in_dim(), row0, rows);
  for (size_t u = 0; u < m.n_units(); ++u) {
    ASSERT_OK(fsdp_forward_begin(units[u], host.stream()));
    auto ptrs = buffer_ptrs(units[u], m.unit_params(u).size(), false);
    host.run([&m, u, ptrs, dt, st, rows, expect] {
      UnitParams p = load_params(m, u, ptrs, dt);
      if (expect) {
        EXPECT_EQ(p, (*expect)[u]) << "forward gather of unit " << u;
      }
      unit_forward(m, u, p, st->acts[u], rows, st->acts[u + 1]);
    });
    ASSERT_OK(fsdp_forward_end(units[u], host.stream()));
  }
  host.run([st, &d, row0, scale] { st->dh = loss_grad(st->acts.back(), d, row0, scale); });
  for (size_t u = m.n_units(); u-- > 0;) {
    ASSERT_OK(fsdp_backward_begin(units[u], host.stream()));
    auto ptrs = buffer_ptrs(units[u], m.unit_params(u).size(), false);
    auto gptrs = buffer_ptrs(units[u], m.unit_params(u).size(), true);
    host.run([&m, u, ptrs, gptrs, dt, st, rows, expect] {
      UnitParams p = load_params(m, u, ptrs, dt);
      if (expect) {
        EXPECT_EQ(p, (*expect)[u]) << "backward gather of unit " << u;
      }
      UnitParams g;
      Tensor dx;
      unit_backward(m, u, p, st->acts[u], st->acts[u + 1], st->dh, rows, g, dx);
      for (size_t i = 0; i < g.size(); ++i)
        for (size_t k = 0; gptrs[i] != nullptr && k < g[i].size(); ++k) add_elem(gptrs[i], k, dt, g[i][k]);
      st->dh.swap(dx);
    });
    ASSERT_OK(fsdp_backward_end(units[u], host.stream()));
  }
}

// The same pass with no forward calls: backward_begin on every unit first,
// the whole forward on the params they gathered, then backward_end in reverse
// order (as jax.value_and_grad does: one gather per unit per step).
void lib_pass_backward_only(Host& host, const Model& m, const std::vector<fsdp_unit_t*>& units, fsdp_dtype_t dt,
                            const Data& d, int row0, int rows, float scale, const Params* expect) {
  auto st = std::make_shared<PassState>();
  st->params.resize(m.n_units());
  st->acts.resize(m.n_units() + 1);
  st->acts[0] = rows_of(d.x, m.in_dim(), row0, rows);
  for (size_t u = 0; u < m.n_units(); ++u) {
    ASSERT_OK(fsdp_backward_begin(units[u], host.stream()));
    auto ptrs = buffer_ptrs(units[u], m.unit_params(u).size(), false);
    host.run([&m, u, ptrs, dt, st, expect] {
      st->params[u] = load_params(m, u, ptrs, dt);
      if (expect) {
        EXPECT_EQ(st->params[u], (*expect)[u]) << "backward gather of unit " << u;
      }
    });
  }
  host.run([&m, st, &d, row0, rows, scale] {
    for (size_t u = 0; u < m.n_units(); ++u) unit_forward(m, u, st->params[u], st->acts[u], rows, st->acts[u + 1]);
    st->dh = loss_grad(st->acts.back(), d, row0, scale);
  });
  for (size_t u = m.n_units(); u-- > 0;) {
    auto gptrs = buffer_ptrs(units[u], m.unit_params(u).size(), true);
    host.run([&m, u, gptrs, dt, st, rows] {
      UnitParams g;
      Tensor dx;
      unit_backward(m, u, st->params[u], st->acts[u], st->acts[u + 1], st->dh, rows, g, dx);
      for (size_t i = 0; i < g.size(); ++i)
        for (size_t k = 0; gptrs[i] != nullptr && k < g[i].size(); ++k) add_elem(gptrs[i], k, dt, g[i][k]);
      st->dh.swap(dx);
    });
    ASSERT_OK(fsdp_backward_end(units[u], host.stream()));
  }
}

LibResult lib_train(const Case& c, const Model& m, const Params& init, const Data& d) {
  LibResult out;
  out.params_by_rank.resize(size_t(c.world));
  out.norms_by_rank.resize(size_t(c.world));
  run_ranks(c.world, [&](int rank, fsdp_local_group_t* group) {
    std::map<std::string, std::string> opts = {{"sharding", c.sharding},
                                               {"param_dtype", dtype_config_name(c.dtype)},
                                               {"reduce_dtype", c.reduce_dtype},
                                               {"optimizer", "adamw"},
                                               {"lr", "0.01"},
                                               {"weight_decay", std::to_string(c.weight_decay)},
                                               {"no_weight_decay", "*bias"},
                                               {"timeout_s", "20"},
                                               // The reference models unscaled grads; loss
                                               // scaling has its own tests (test_loss_scale).
                                               {"loss_scale", "off"}};
    if (c.max_grad_norm > 0) opts["max_grad_norm"] = std::to_string(c.max_grad_norm);
    if (c.shard_group_size > 0) opts["shard_group_size"] = std::to_string(c.shard_group_size);
    if (c.sync_module_states) opts["sync_module_states"] = "1";
    if (c.offload) opts["offload"] = "cpu";
    if (c.reduce_dtype == "int8" || c.reduce_dtype == "fp8_e4m3") opts["reduce_block"] = std::to_string(kQuantBlock);
    ConfigPtr cfg = make_config(opts);
    ASSERT_TRUE(cfg);
    fsdp_ctx_t* raw = nullptr;
    ASSERT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
    CtxPtr ctx(raw);
    fsdp_dtype_t dt = FSDP_DTYPE_FP32;
    ASSERT_OK(fsdp_ctx_param_dtype(ctx.get(), &dt));
    ASSERT_EQ(dt, c.dtype);

    std::vector<fsdp_unit_t*> units(m.n_units(), nullptr);
    for (size_t u = 0; u < m.n_units(); ++u) {
      ASSERT_OK(register_unit(ctx.get(), m.unit_name(u), m.unit_params(u), &units[u]));
      for (size_t i = 0; i < init[u].size(); ++i) {
        Tensor mine = init[u][i];
        if (c.rank_dependent_init)
          for (auto& v : mine) v += 0.5f * float(rank);
        ASSERT_OK(fsdp_param_set_values(units[u], i, mine.data(), mine.size()));
      }
    }
    for (size_t u = 0; u < m.n_units(); ++u) {
      if (c.frozen >> u & 1u) ASSERT_OK(fsdp_unit_set_trainable(ctx.get(), units[u], 0));
    }
    for (const auto& [u, i] : c.frozen_params) ASSERT_OK(fsdp_param_set_trainable(ctx.get(), units[u], i, 0));
    for (const RefOptions::Group& g : c.groups) {
      size_t matched = 0;
      ASSERT_OK(fsdp_set_param_group(ctx.get(), g.glob.c_str(), group_options(g).c_str(), &matched));
      EXPECT_GT(matched, 0u) << g.glob;
    }
    const Params init_rounded = rounded(init, dt);
    const bool init_known = !c.rank_dependent_init || c.sync_module_states;
    const int rows = kBatch / c.world, micro_rows = rows / c.micro;
    // The case's own late host stream, or the environment's (the .late CTests).
    Host host(ctx.get(), c.host_stream_delay_us > 0 ? c.host_stream_delay_us : -1);
    for (int step = 0; step < kSteps; ++step) {
      if (step + 1 == c.unfreeze_at) {
        for (size_t u = 0; u < m.n_units(); ++u) {
          if (c.frozen >> u & 1u) ASSERT_OK(fsdp_unit_set_trainable(ctx.get(), units[u], 1));
        }
        for (const auto& [u, i] : c.frozen_params) ASSERT_OK(fsdp_param_set_trainable(ctx.get(), units[u], i, 1));
      }
      for (int k = 0; k < c.micro; ++k) {
        if (c.no_sync) {
          // The last micro-batch syncs, or (sync_at_step) none does and
          // fsdp_step reduces the pending grads itself.
          ASSERT_OK(fsdp_set_grad_sync(ctx.get(), k + 1 == c.micro && !c.sync_at_step ? 1 : 0));
        }
        const Params* expect = step == 0 && init_known ? &init_rounded : nullptr;
        const int row0 = rank * rows + k * micro_rows;
        const float scale = 1.f / float(c.micro);
        (c.backward_only ? lib_pass_backward_only : lib_pass)(host, m, units, dt, d, row0, micro_rows, scale, expect);
        if (::testing::Test::HasFatalFailure()) return;
      }
      if (c.sync_at_step) ASSERT_OK(fsdp_set_grad_sync(ctx.get(), 1));
      ASSERT_OK(fsdp_step(ctx.get(), host.stream()));
      double norm = -1;
      ASSERT_OK(fsdp_last_grad_norm(ctx.get(), &norm));
      out.norms_by_rank[size_t(rank)].push_back(norm);
    }
    Params& got = out.params_by_rank[size_t(rank)];
    got = init;
    for (size_t u = 0; u < m.n_units(); ++u)
      for (size_t i = 0; i < got[u].size(); ++i) {
        std::fill(got[u][i].begin(), got[u][i].end(), NAN);
        EXPECT_OK(fsdp_gather_param(units[u], i, got[u][i].data(), got[u][i].size()));
      }
    EXPECT_OK(fsdp_ctx_finalize(ctx.get()));
  });
  return out;
}

// Under mpirun each process holds only its own rank's result: exchange them
// (params flattened in model order, norms as doubles) so ranks can be compared.
void share_result(LibResult& lib, const Params& shape) {
  if (launcher_world() == 0) return;
  const size_t me = size_t(launcher_rank());
  std::vector<std::vector<float>> flat(lib.params_by_rank.size());
  for (const auto& unit : lib.params_by_rank[me])
    for (const auto& t : unit) flat[me].insert(flat[me].end(), t.begin(), t.end());
  share_floats(flat);
  const auto& norms = lib.norms_by_rank[me];
  const auto all_norms =
      share_bytes(std::string(reinterpret_cast<const char*>(norms.data()), norms.size() * sizeof(double)));
  for (size_t r = 0; r < flat.size(); ++r) {
    Params p = shape;
    size_t k = 0;
    for (auto& unit : p)
      for (auto& t : unit)
        for (auto& v : t) v = k < flat[r].size() ? flat[r][k++] : NAN;
    lib.params_by_rank[r] = p;
    if (r < all_norms.size()) {
      lib.norms_by_rank[r].resize(all_norms[r].size() / sizeof(double));
      std::memcpy(lib.norms_by_rank[r].data(), all_norms[r].data(), all_norms[r].size());
    }
  }
}

// Largest per-tensor max|a-b| / max|ref| over the model.
double max_rel_error(const Params& a, const Params& ref, std::string* where) {
  double worst = 0;
  for (size_t u = 0; u < ref.size(); ++u)
    for (size_t i = 0; i < ref[u].size(); ++i) {
      const double e = (u < a.size() && i < a[u].size()) ? rel_max_diff(a[u][i], ref[u][i]) : INFINITY;
      if (!(e <= worst)) {
        worst = e;
        *where = "unit " + std::to_string(u) + " param " + std::to_string(i);
      }
    }
  return worst;
}

// ||a - ref|| / ||ref|| over all params of the model (Frobenius).
double model_rel_error(const Params& a, const Params& ref) {
  double num = 0, den = 0;
  for (size_t u = 0; u < ref.size(); ++u)
    for (size_t i = 0; i < ref[u].size(); ++i)
      for (size_t k = 0; k < ref[u][i].size(); ++k) {
        const double x = (u < a.size() && i < a[u].size() && k < a[u][i].size()) ? a[u][i][k] : NAN;
        num += (x - ref[u][i][k]) * (x - ref[u][i][k]);
        den += double(ref[u][i][k]) * ref[u][i][k];
      }
  return std::isnan(num) ? INFINITY : std::sqrt(num / den);
}

// The distance the case's tolerance applies to.
double case_error(const Case& c, const Params& a, const Params& ref, std::string* where) {
  if (c.model_metric) {
    *where = "whole model";
    return model_rel_error(a, ref);
  }
  return max_rel_error(a, ref, where);
}

void check_case(const Case& c) {
  const Model& m = c.uneven ? kUnevenMlp : kMlp;
  const Data d = make_data(m, 1234);
  const Params init = make_init(m, 42);
  RefOptions o;
  o.dtype = c.dtype;
  o.reduce_dtype = c.reduce_dtype == "fp32" ? FSDP_DTYPE_FP32 : c.dtype;
  if (c.reduce_dtype == "int8" || c.reduce_dtype == "fp8_e4m3") {
    o.quant = static_cast<int>(c.reduce_dtype == "int8" ? fsdp::kernels::QType::kInt8 : fsdp::kernels::QType::kFp8E4m3);
    o.quant_block = kQuantBlock;
    o.reduce_dtype = FSDP_DTYPE_FP32;
    o.shard_world = c.shard_group_size > 0 ? c.shard_group_size : c.world;
  }
  o.world = c.world;
  o.weight_decay = c.weight_decay;
  o.max_grad_norm = c.max_grad_norm;
  o.frozen = c.frozen;
  o.frozen_params = c.frozen_params;
  o.unfreeze_at = c.unfreeze_at;
  o.groups = c.groups;
  const RefResult ref = reference_train(m, init, d, o);

  // The test's power: a missing weight decay, missing clipping, or no
  // training at all must be farther from the reference than the tolerance.
  std::string where;
  RefOptions no_wd = o;
  no_wd.weight_decay = 0;
  EXPECT_GT(case_error(c, reference_train(m, init, d, no_wd).params, ref.params, &where), 3 * c.tol)
      << "the tolerance is too loose to see a missing weight decay";
  EXPECT_GT(case_error(c, init, ref.params, &where), 10 * c.tol) << "the reference barely trains";
  if (c.max_grad_norm > 0) {
    EXPECT_EQ(ref.clipped_steps, kSteps) << "max_grad_norm must clip every step";
    RefOptions no_clip = o;
    no_clip.max_grad_norm = 0;
    EXPECT_GT(case_error(c, reference_train(m, init, d, no_clip).params, ref.params, &where), 3 * c.tol)
        << "the tolerance is too loose to see missing clipping";
  }

  if (o.quant >= 0 && c.world > 1) {
    RefOptions plain = o;
    plain.quant = -1;
    EXPECT_GT(case_error(c, reference_train(m, init, d, plain).params, ref.params, &where), 3 * c.tol)
        << "the tolerance is too loose to see the reduction unquantized";
  }

  LibResult lib = lib_train(c, m, init, d);
  share_result(lib, init);  // under mpirun: every rank's result, from its process
  if (::testing::Test::HasFailure()) return;
  for (int r = 0; r < c.world; ++r) {
    EXPECT_EQ(lib.params_by_rank[size_t(r)], lib.params_by_rank[0])
        << "rank " << r << " gathered different values than rank 0";
    EXPECT_EQ(lib.norms_by_rank[size_t(r)], lib.norms_by_rank[0]) << "rank " << r << " grad norms";
  }
  const double err = case_error(c, lib.params_by_rank[0], ref.params, &where);
  EXPECT_LE(err, c.tol) << "worst: " << where;
  if (c.frozen != 0) {
    // Units frozen throughout are bitwise as they started (the fp32 master);
    // training them, or unfreezing with stale state, is farther off than the
    // tolerance.
    for (size_t u = 0; u < m.n_units() && c.unfreeze_at < 0; ++u) {
      if (c.frozen >> u & 1u) {
        EXPECT_EQ(lib.params_by_rank[0][u], init[u]) << "frozen unit " << u << " changed";
      }
    }
    RefOptions all = o;
    all.frozen = 0;
    EXPECT_GT(case_error(c, reference_train(m, init, d, all).params, ref.params, &where), 3 * c.tol)
        << "the tolerance is too loose to see frozen units trained";
  }
  if (!c.frozen_params.empty()) {
    for (const auto& [u, i] : c.frozen_params) {
      if (c.unfreeze_at < 0) {
        EXPECT_EQ(lib.params_by_rank[0][u][i], init[u][i]) << "frozen param " << i << " of unit " << u << " changed";
      }
    }
    RefOptions all = o;
    all.frozen_params.clear();
    EXPECT_GT(case_error(c, reference_train(m, init, d, all).params, ref.params, &where), 3 * c.tol)
        << "the tolerance is too loose to see frozen params trained";
  }
  for (size_t k = 0; k < c.groups.size(); ++k) {
    // Each group's settings matter: without any one of them the reference is farther off than the tolerance.
    RefOptions without = o;
    without.groups.erase(without.groups.begin() + long(k));
    EXPECT_GT(case_error(c, reference_train(m, init, d, without).params, ref.params, &where), 3 * c.tol)
        << "the tolerance is too loose to see param group " << c.groups[k].glob << " ignored";
  }
  if (c.dtype == FSDP_DTYPE_FP32) {
    // The norm of the averaged grads, before clipping, every step.
    for (int s = 0; s < kSteps; ++s)
      EXPECT_NEAR(lib.norms_by_rank[0][size_t(s)], ref.norms[size_t(s)],
                  (c.reduce_dtype == "int8" ? kInt8ReduceTol : 1e-4) * ref.norms[size_t(s)])
          << "fsdp_last_grad_norm at step " << s + 1;
  }
}

// ---- world x sharding, fp32 ------------------------------------------------

class ShardedTraining : public ::testing::TestWithParam<std::tuple<int, const char*>> {};

TEST_P(ShardedTraining, MatchesSingleProcessAdamWReference) {
  Case c;
  c.world = std::get<0>(GetParam());
  c.sharding = std::get<1>(GetParam());
  check_case(c);
}

INSTANTIATE_TEST_SUITE_P(WorldBySharding, ShardedTraining,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")),
                         [](const ::testing::TestParamInfo<ShardedTraining::ParamType>& pi) {
                           return std::string(std::get<1>(pi.param)) + "_world" + std::to_string(std::get<0>(pi.param));
                         });

class TrainingVariant : public ::testing::TestWithParam<Case> {};

TEST_P(TrainingVariant, MatchesSingleProcessReference) { check_case(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Variants, TrainingVariant, ::testing::ValuesIn(variant_cases()),
                         [](const ::testing::TestParamInfo<Case>& pi) { return pi.param.name; });

// ---- identical starting point -------------------------------------------------

// With sync_module_states=1 rank 0's values win, so ranks start identical even
// when the others pass NULL or different values.
TEST(SyncModuleStates, RankZerosValuesWinAndOtherRanksMayPassNull) {
  FSDP_SKIP_WHEN_LATE("no host compute and no call that takes a stream: set_values and gather_param alone");
  const std::vector<ParamSpec> params = {{"w", {4, 3}}, {"b", {4}}};
  const std::vector<float> w = Rng(9).uniform_vec(12, -1, 1);
  std::vector<std::vector<float>> got(3);
  run_ranks(3, [&](int rank, fsdp_local_group_t* group) {
    ConfigPtr cfg = make_config({{"sync_module_states", "1"}, {"timeout_s", "10"}});
    ASSERT_TRUE(cfg);
    fsdp_ctx_t* raw = nullptr;
    ASSERT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
    CtxPtr ctx(raw);
    fsdp_unit_t* u = nullptr;
    ASSERT_OK(register_unit(raw, "u", params, &u));
    const std::vector<float> junk(12, float(rank));
    ASSERT_OK(fsdp_param_set_values(u, 0, rank == 0 ? w.data() : rank == 1 ? nullptr : junk.data(), 12));
    got[size_t(rank)].assign(12, NAN);
    EXPECT_OK(fsdp_gather_param(u, 0, got[size_t(rank)].data(), 12));
    EXPECT_OK(fsdp_ctx_finalize(raw));
  });
  share_floats(got);
  for (size_t r = 0; r < 3; ++r) EXPECT_EQ(got[r], w) << "rank " << r;
}

// Ranks that set different initial values train, with sync_module_states=1,
// exactly as a run where every rank set rank 0's values.
class SyncModuleStatesTraining : public ::testing::TestWithParam<std::tuple<int, const char*>> {};

TEST_P(SyncModuleStatesTraining, RanksThatSetDifferentValuesEndIdenticalToRankZerosRun) {
  Case c;
  c.world = std::get<0>(GetParam());
  c.sharding = std::get<1>(GetParam());
  const Data d = make_data(kMlp, 1234);
  const Params init = make_init(kMlp, 42);
  LibResult same = lib_train(c, kMlp, init, d);
  share_result(same, init);
  Case synced = c;
  synced.sync_module_states = true;
  synced.rank_dependent_init = true;
  LibResult got = lib_train(synced, kMlp, init, d);
  share_result(got, init);
  Case unsynced = c;
  unsynced.rank_dependent_init = true;
  LibResult diverged = lib_train(unsynced, kMlp, init, d);
  share_result(diverged, init);
  if (::testing::Test::HasFailure()) return;
  for (int r = 0; r < c.world; ++r) {
    EXPECT_EQ(got.params_by_rank[size_t(r)], same.params_by_rank[0]) << "rank " << r;
  }
  // The test's power: without the option the different values do matter.
  EXPECT_NE(diverged.params_by_rank[0], same.params_by_rank[0]);
}

// ---- CPU offload -------------------------------------------------------------

// offload=cpu moves shards, grads and optimizer state to the host and the
// optimizer with them; the arithmetic is the same, so fp32 results must be
// bitwise equal to training without offload (and match the reference).
class OffloadTraining : public ::testing::TestWithParam<std::tuple<int, const char*>> {};

TEST_P(OffloadTraining, MatchesTrainingWithoutOffloadBitwiseInFp32) {
  Case c;
  c.world = std::get<0>(GetParam());
  c.sharding = std::get<1>(GetParam());
  if (c.sharding.rfind("HYBRID", 0) == 0) c.shard_group_size = std::min(2, c.world);
  c.micro = 2;  // grad accumulation over two backward passes, both offloaded
  const Data d = make_data(kMlp, 1234);
  const Params init = make_init(kMlp, 42);
  LibResult off = lib_train(c, kMlp, init, d);
  share_result(off, init);
  Case on = c;
  on.offload = true;
  LibResult got = lib_train(on, kMlp, init, d);
  share_result(got, init);
  if (::testing::Test::HasFailure()) return;
  for (int r = 0; r < c.world; ++r) {
    EXPECT_EQ(got.params_by_rank[size_t(r)], off.params_by_rank[0]) << "rank " << r;
    EXPECT_EQ(got.norms_by_rank[size_t(r)], off.norms_by_rank[0]) << "rank " << r;
  }
  check_case(on);  // and against the single-process reference
}

INSTANTIATE_TEST_SUITE_P(WorldBySharding, OffloadTraining,
                         ::testing::Combine(::testing::Values(1, 2, 4), ::testing::Values("FULL_SHARD", "SHARD_GRAD_OP",
                                                                                          "NO_SHARD", "HYBRID_SHARD")),
                         [](const ::testing::TestParamInfo<OffloadTraining::ParamType>& pi) {
                           return std::string(std::get<1>(pi.param)) + "_world" + std::to_string(std::get<0>(pi.param));
                         });

TEST(OffloadMixedPrecision, Bf16ReduceFp32MatchesTheReference_world2) {
  Case c;
  c.name = "OffloadBf16";
  c.world = 2;
  c.dtype = FSDP_DTYPE_BF16;
  c.reduce_dtype = "fp32";
  c.weight_decay = 1.0;
  c.model_metric = true;
  c.tol = kBf16Fp32ReduceTol;
  c.offload = true;
  check_case(c);
}

INSTANTIATE_TEST_SUITE_P(WorldBySharding, SyncModuleStatesTraining,
                         ::testing::Combine(::testing::Values(2, 4),
                                            ::testing::Values("FULL_SHARD", "NO_SHARD", "HYBRID_SHARD")),
                         [](const ::testing::TestParamInfo<SyncModuleStatesTraining::ParamType>& pi) {
                           return std::string(std::get<1>(pi.param)) + "_world" + std::to_string(std::get<0>(pi.param));
                         });

}  // namespace
