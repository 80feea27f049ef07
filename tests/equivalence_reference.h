// The equivalence suite's model and its reference (tests/test_equivalence.cpp):
// an MLP whose forward and backward the test writes itself, the data and
// initial values every run shares, and a single-process AdamW on the whole
// batch (with the dtype's roundings, clipping, frozen params, param groups and
// the quantized reduction modelled exactly), computed without libfsdp.
#ifndef FSDP_TESTS_EQUIVALENCE_REFERENCE_H
#define FSDP_TESTS_EQUIVALENCE_REFERENCE_H

#include <fnmatch.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "base/layout.h"
#include "quant_ref.h"
#include "rank_runner.h"

namespace fsdp_test::equivalence {

constexpr int kBatch = 24;  // divisible by 1, 2, 3, 4 (and by 2 micro-batches per rank)
constexpr int kSteps = 20;
constexpr double kLr = 1e-2;
constexpr double kBeta1 = 0.9, kBeta2 = 0.999, kEps = 1e-8;
constexpr size_t kQuantBlock = 32;       // reduce_block of the quantized-reduction cases: several blocks per part
constexpr double kInt8ReduceTol = 2e-3;  // reduce_dtype=int8's tolerance: see its cases in variant_cases

using Tensor = std::vector<float>;
using UnitParams = std::vector<Tensor>;  // [param][elem]
using Params = std::vector<UnitParams>;  // [unit][param][elem]

// An MLP: one unit per Linear layer (W [out,in], bias [out]), tanh between
// layers, optionally a last unit holding one 1-element param that scales the
// output (a unit whose shard is pure padding on most ranks).
struct Model {
  std::vector<int> dims;
  bool gain_unit = false;

  size_t n_linear() const { return dims.size() - 1; }
  size_t n_units() const { return n_linear() + (gain_unit ? 1 : 0); }
  bool is_linear(size_t u) const { return u < n_linear(); }
  int in_dim() const { return dims.front(); }
  int out_dim() const { return dims.back(); }
  std::string unit_name(size_t u) const { return is_linear(u) ? "layer" + std::to_string(u) : "gain"; }
  std::vector<ParamSpec> unit_params(size_t u) const {
    if (!is_linear(u)) return {{"gain.scale", {1}}};
    const std::string n = unit_name(u);
    return {{n + ".weight", {dims[u + 1], dims[u]}}, {n + ".bias", {dims[u + 1]}}};
  }
};

inline const Model kMlp{{16, 32, 32, 32, 8}, false};
// A 7-wide and a 13-wide layer and a 1-element unit: sizes divisible by no world.
inline const Model kUnevenMlp{{16, 7, 13, 8}, true};

struct Data {
  Tensor x;  // [kBatch, in]
  Tensor t;  // [kBatch, out]
};

inline Data make_data(const Model& m, uint64_t seed) {
  Rng rng(seed);
  Data d;
  d.x = rng.uniform_vec(size_t(kBatch) * size_t(m.in_dim()), -1.f, 1.f);
  d.t = rng.uniform_vec(size_t(kBatch) * size_t(m.out_dim()), -0.8f, 0.8f);
  return d;
}

inline Params make_init(const Model& m, uint64_t seed) {
  Rng rng(seed);
  Params p(m.n_units());
  for (size_t u = 0; u < m.n_units(); ++u) {
    for (const auto& spec : m.unit_params(u)) {
      const float bound = m.is_linear(u) ? 1.f / std::sqrt(float(m.dims[u])) : 0.f;
      p[u].push_back(m.is_linear(u) ? rng.uniform_vec(numel_of(spec.shape), -bound, bound)
                                    : Tensor{rng.uniform(0.8f, 1.2f)});
    }
  }
  return p;
}

// ---- the model's math, shared by the reference and the libfsdp-driven run ----
// (on the test's own tensors, FSDP_TEST_OWN_MATH: rank_runner.h; libfsdp's
// buffers are read and written only in load_params and add_elem)

// h = act(W x + b) for `rows` rows of x [rows, in].
FSDP_TEST_OWN_MATH inline void unit_forward(const Model& m, size_t u, const UnitParams& p, const Tensor& x, int rows,
                                            Tensor& h) {
  if (!m.is_linear(u)) {
    h.resize(x.size());
    for (size_t i = 0; i < x.size(); ++i) h[i] = p[0][0] * x[i];
    return;
  }
  const int in = m.dims[u], out = m.dims[u + 1];
  const bool act = u + 1 < m.n_linear();
  h.assign(size_t(rows) * size_t(out), 0.f);
  const float *w = p[0].data(), *b = p[1].data(), *xs = x.data();
  for (int r = 0; r < rows; ++r)
    for (int o = 0; o < out; ++o) {
      float z = b[o];
      for (int i = 0; i < in; ++i) z += w[o * in + i] * xs[r * in + i];
      h[size_t(r * out + o)] = act ? std::tanh(z) : z;
    }
}

// Given dL/dh, the unit's param grads g (overwritten) and dL/dx.
FSDP_TEST_OWN_MATH inline void unit_backward(const Model& m, size_t u, const UnitParams& p, const Tensor& x,
                                             const Tensor& h, const Tensor& dh, int rows, UnitParams& g, Tensor& dx) {
  if (!m.is_linear(u)) {
    float ds = 0.f;
    dx.resize(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      ds += dh[i] * x[i];
      dx[i] = p[0][0] * dh[i];
    }
    g = {Tensor{ds}};
    return;
  }
  const int in = m.dims[u], out = m.dims[u + 1];
  const bool act = u + 1 < m.n_linear();
  Tensor dz(dh.size());
  for (size_t i = 0; i < dh.size(); ++i) dz[i] = act ? dh[i] * (1.f - h[i] * h[i]) : dh[i];
  g = {Tensor(size_t(out) * size_t(in)), Tensor(size_t(out))};
  dx.resize(size_t(rows) * size_t(in));
  // Each sum in a register, its terms in row (or output) order from 0: the
  // same float operations as accumulating in place row by row, with two
  // loads per product instead of six accesses (what the sanitizers pay for).
  const float *w = p[0].data(), *xs = x.data(), *dzs = dz.data();
  for (int o = 0; o < out; ++o) {
    float gb = 0.f;
    for (int r = 0; r < rows; ++r) gb += dzs[r * out + o];
    g[1][size_t(o)] = gb;
    for (int i = 0; i < in; ++i) {
      float gw = 0.f;
      for (int r = 0; r < rows; ++r) gw += dzs[r * out + o] * xs[r * in + i];
      g[0][size_t(o * in + i)] = gw;
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < in; ++i) {
      float s = 0.f;
      for (int o = 0; o < out; ++o) s += dzs[r * out + o] * w[o * in + i];
      dx[size_t(r * in + i)] = s;
    }
}

// dL/dy of L = scale * mean over rows and outputs of (y - t)^2.
inline Tensor loss_grad(const Tensor& y, const Data& d, int row0, float scale) {
  Tensor dy(y.size());
  const size_t off = size_t(row0) * size_t(d.t.size() / kBatch);
  for (size_t i = 0; i < y.size(); ++i) dy[i] = scale * 2.f * (y[i] - d.t[off + i]) / float(y.size());
  return dy;
}

inline Tensor rows_of(const Tensor& x, int width, int row0, int rows) {
  return Tensor(x.begin() + row0 * width, x.begin() + (row0 + rows) * width);
}

// Grads of scale * (mean loss over rows [row0, row0+rows)) at params p.
inline Params grads_on_rows(const Model& m, const Params& p, const Data& d, int row0, int rows, float scale) {
  std::vector<Tensor> acts(m.n_units() + 1);
  acts[0] = rows_of(d.x, m.in_dim(), row0, rows);
  for (size_t u = 0; u < m.n_units(); ++u) unit_forward(m, u, p[u], acts[u], rows, acts[u + 1]);
  Tensor dh = loss_grad(acts.back(), d, row0, scale), dx;
  Params g(m.n_units());
  for (size_t u = m.n_units(); u-- > 0;) {
    unit_backward(m, u, p[u], acts[u], acts[u + 1], dh, rows, g[u], dx);
    dh.swap(dx);
  }
  return g;
}

inline Params rounded(const Params& p, fsdp_dtype_t dt) {
  Params r = p;
  for (auto& unit : r)
    for (auto& t : unit)
      for (auto& v : t) v = round_to(dt, v);
  return r;
}

// ---- the reference: one process, whole batch, own AdamW -------------------

struct RefOptions {
  fsdp_dtype_t dtype = FSDP_DTYPE_FP32;
  fsdp_dtype_t reduce_dtype = FSDP_DTYPE_FP32;  // with a low-precision dtype: the reduction's
  int world = 1;                                // only used to emulate per-rank rounding of low-precision grads
  double weight_decay = 0.01;                   // "*bias" params get 0
  double max_grad_norm = 0;
  unsigned frozen = 0;  // bit u: unit u frozen (requires_grad False): no grad, no state, no update
  // Params (unit, index) frozen inside trainable units, the same way.
  std::vector<std::pair<size_t, size_t>> frozen_params;
  int unfreeze_at = -1;  // the step (1-based) from which the frozen units and params train, with fresh state
  // Param groups: (glob, lr scale, beta1, beta2, weight decay; < 0: unchanged), later ones win.
  struct Group {
    std::string glob;
    double lr_scale, beta1, beta2, weight_decay;
  };
  std::vector<Group> groups;
  // reduce_dtype=int8|fp8_e4m3 (quant >= 0: a kernels::QType): the
  // reduction as libfsdp defines it, modelled on each unit's flat layout
  // (align_elems, shard_world ranks per shard group).
  int quant = -1;
  size_t quant_block = 0, align_elems = 16;
  int shard_world = 1;
};

inline bool frozen_at(const RefOptions& o, size_t u, size_t i, int step) {
  const bool listed = (o.frozen >> u & 1u) != 0 || std::find(o.frozen_params.begin(), o.frozen_params.end(),
                                                             std::make_pair(u, i)) != o.frozen_params.end();
  return listed && (o.unfreeze_at < 0 || step < o.unfreeze_at);
}

struct RefResult {
  Params params;
  std::vector<double> norms;  // per step, before clipping
  int clipped_steps = 0;
};

inline bool is_bias(const Model& m, size_t u, size_t i) {
  const std::string n = m.unit_params(u)[i].name;
  return n.size() >= 4 && n.compare(n.size() - 4, 4, "bias") == 0;
}

// A PyTorch param group's hyperparameters.
struct Hyper {
  double lr = kLr, beta1 = kBeta1, beta2 = kBeta2;
};

// PyTorch's AdamW in fp32 at step t (1-based).
inline void adamw_update(Tensor& p, Tensor& mom, Tensor& var, const Tensor& g, int t, double wd, const Hyper& h = {}) {
  const float bc1 = float(1.0 - std::pow(h.beta1, t));
  const float bc2_sqrt = float(std::sqrt(1.0 - std::pow(h.beta2, t)));
  const float step_size = float(h.lr) / bc1;
  for (size_t i = 0; i < p.size(); ++i) {
    p[i] *= float(1.0 - h.lr * wd);
    mom[i] = float(h.beta1) * mom[i] + float(1.0 - h.beta1) * g[i];
    var[i] = float(h.beta2) * var[i] + float(1.0 - h.beta2) * g[i] * g[i];
    p[i] -= step_size * mom[i] / (std::sqrt(var[i]) / bc2_sqrt + float(kEps));
  }
}

// The grad a step sees. fp32: the whole batch's mean-loss grad. Low precision:
// each rank's grad rounded to the dtype (as the host writes it), averaged,
// rounded to the reduce dtype.
inline Params quantized_step_grads(const Model& m, const Params& p_round, const Data& d, const RefOptions& o);

inline Params step_grads(const Model& m, const Params& p_round, const Data& d, const RefOptions& o) {
  if (o.quant >= 0) return quantized_step_grads(m, p_round, d, o);
  if (o.dtype == FSDP_DTYPE_FP32) return grads_on_rows(m, p_round, d, 0, kBatch, 1.f);
  const int rows = kBatch / o.world;
  Params sum;
  for (int r = 0; r < o.world; ++r) {
    Params g = grads_on_rows(m, p_round, d, r * rows, rows, 1.f);
    g = rounded(g, o.dtype);
    if (r == 0) {
      sum = g;
      continue;
    }
    for (size_t u = 0; u < g.size(); ++u)
      for (size_t i = 0; i < g[u].size(); ++i)
        for (size_t k = 0; k < g[u][i].size(); ++k) sum[u][i][k] += g[u][i][k];
  }
  for (auto& unit : sum)
    for (auto& t : unit)
      for (auto& v : t) v = round_to(o.reduce_dtype, v / float(o.world));
  return sum;
}

// The quantized reduction (reduce_dtype=int8|fp8_e4m3) of the ranks' grads
// (each rounded to the dtype as the host writes them), per unit on its flat
// layout: inside each shard group, rank j's part s of the trainable block
// quantized in blocks and dequantized (quant_ref.h), the parts for shard s
// added in rank order in fp32 and scaled by 1 / group size; across the
// groups (HYBRID) each shard cut into one part per group, part t of every
// group's shard reduced the same way (1 / groups), then quantized once more.
inline Params quantized_step_grads(const Model& m, const Params& p_round, const Data& d, const RefOptions& o) {
  const int rows = kBatch / o.world, sw = o.shard_world, groups = o.world / sw;
  std::vector<Params> per_rank;
  for (int r = 0; r < o.world; ++r)
    per_rank.push_back(rounded(grads_on_rows(m, p_round, d, r * rows, rows, 1.f), o.dtype));
  if (o.world == 1) return per_rank[0];  // alone: nothing to reduce, the grads added exactly
  const auto qt = static_cast<fsdp::kernels::QType>(o.quant);
  Params out = per_rank[0];
  for (size_t u = 0; u < m.n_units(); ++u) {
    std::vector<fsdp::ParamSpec> specs;
    for (const ParamSpec& s : m.unit_params(u)) specs.push_back({s.name, s.shape, numel_of(s.shape)});
    const fsdp::FlatLayout layout(specs, o.align_elems, sw);
    const size_t padded = layout.trainable_padded_numel(), n = padded / size_t(sw);
    auto flat_of = [&](int r) {
      Tensor f(padded, 0.0f);
      for (size_t i = 0; i < specs.size(); ++i) {
        std::copy(per_rank[size_t(r)][u][i].begin(), per_rank[size_t(r)][u][i].end(),
                  f.begin() + long(layout.param_offset(i)));
      }
      return f;
    };
    std::vector<Tensor> flats;
    for (int r = 0; r < o.world; ++r) flats.push_back(flat_of(r));
    Tensor reduced(padded, 0.0f);
    // Parts quantized, added in order, scaled once: x[k] holds part k's values.
    auto sum_of_quantized = [&](const std::vector<const float*>& x, size_t len, float scale) {
      Tensor sum;
      for (size_t j = 0; j < x.size(); ++j) {
        const Tensor dq = ref_round_trip(x[j], len, o.quant_block, qt);
        if (j == 0) {
          sum = dq;
        } else {
          for (size_t i = 0; i < len; ++i) sum[i] = sum[i] + dq[i];
        }
      }
      for (float& v : sum) v = v * scale;
      return sum;
    };
    const size_t per = (n + size_t(groups) - 1) / size_t(groups);  // HYBRID: each replica's part of a shard
    for (int s = 0; s < sw; ++s) {
      std::vector<Tensor> group_sums;
      for (int q = 0; q < groups; ++q) {
        std::vector<const float*> parts;
        for (int j = 0; j < sw; ++j) parts.push_back(flats[size_t(q * sw + j)].data() + size_t(s) * n);
        group_sums.push_back(sum_of_quantized(parts, n, 1.0f / float(sw)));
        group_sums.back().resize(per * size_t(groups), 0.0f);
      }
      Tensor acc = group_sums[0];
      // Across the replicas (Unit::all_reduce_quantized): part t of every
      // group's shard summed quantized, then quantized once more.
      for (size_t t = 0; groups > 1 && t < size_t(groups); ++t) {
        std::vector<const float*> parts;
        for (const Tensor& g : group_sums) parts.push_back(g.data() + t * per);
        const Tensor sum = sum_of_quantized(parts, per, 1.0f / float(groups));
        const Tensor back = ref_round_trip(sum.data(), per, o.quant_block, qt);
        std::copy(back.begin(), back.end(), acc.begin() + long(t * per));
      }
      std::copy(acc.begin(), acc.begin() + long(n), reduced.begin() + long(size_t(s) * n));
    }
    for (size_t i = 0; i < specs.size(); ++i) {
      const size_t off = layout.param_offset(i);
      std::copy(reduced.begin() + long(off), reduced.begin() + long(off + specs[i].numel), out[u][i].begin());
    }
  }
  return out;
}

// torch.nn.utils.clip_grad_norm_: returns the norm before clipping.
inline double clip_grads(Params& g, double max_norm, bool* clipped) {
  double sq = 0;
  for (const auto& unit : g)
    for (const auto& t : unit)
      for (float v : t) sq += double(v) * double(v);
  const double norm = std::sqrt(sq);
  *clipped = false;
  if (max_norm > 0) {
    const double coef = std::min(1.0, max_norm / (norm + 1e-6));
    *clipped = coef < 1.0;
    for (auto& unit : g)
      for (auto& t : unit)
        for (auto& v : t) v = float(double(v) * coef);
  }
  return norm;
}

inline RefResult reference_train(const Model& m, const Params& init, const Data& d, const RefOptions& o) {
  RefResult res;
  res.params = init;
  Params mom = init, var = init;
  for (auto* s : {&mom, &var})
    for (auto& unit : *s)
      for (auto& t : unit) std::fill(t.begin(), t.end(), 0.f);
  std::vector<std::vector<int>> t(m.n_units());  // each param's AdamW steps (PyTorch's per-param step count)
  for (size_t u = 0; u < m.n_units(); ++u) t[u].assign(init[u].size(), 0);
  for (int step = 1; step <= kSteps; ++step) {
    Params g = step_grads(m, rounded(res.params, o.dtype), d, o);
    // A frozen param has no grad: it is not in the norm, and not updated.
    for (size_t u = 0; u < m.n_units(); ++u) {
      for (size_t i = 0; i < g[u].size(); ++i) {
        if (frozen_at(o, u, i, step)) g[u][i].clear();
      }
    }
    bool clipped = false;
    res.norms.push_back(clip_grads(g, o.max_grad_norm, &clipped));
    res.clipped_steps += clipped ? 1 : 0;
    for (size_t u = 0; u < m.n_units(); ++u) {
      for (size_t i = 0; i < g[u].size(); ++i) {
        if (g[u][i].empty()) continue;
        const int steps = ++t[u][i];
        Hyper h;
        double wd = is_bias(m, u, i) ? 0.0 : o.weight_decay;
        for (const RefOptions::Group& grp : o.groups) {
          if (fnmatch(grp.glob.c_str(), m.unit_params(u)[i].name.c_str(), 0) != 0) continue;
          if (grp.lr_scale >= 0) h.lr = kLr * grp.lr_scale;
          if (grp.beta1 >= 0) h.beta1 = grp.beta1;
          if (grp.beta2 >= 0) h.beta2 = grp.beta2;
          if (grp.weight_decay >= 0) wd = grp.weight_decay;
        }
        adamw_update(res.params[u][i], mom[u][i], var[u][i], g[u][i], steps, wd, h);
      }
    }
  }
  return res;
}

}  // namespace fsdp_test::equivalence

#endif  // FSDP_TESTS_EQUIVALENCE_REFERENCE_H
