// gpt_model.cpp - the GPT's forward and backward (see gpt_model.h).
#include "gpt_model.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>

namespace gpt {
namespace {

// Row-major C = alpha op(A) op(B) + beta C through OpenBLAS.
void gemm(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
          float beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b,
              ldb, beta, c, ldc);
}
void gemm(bool ta, bool tb, int m, int n, int k, double alpha, const double* a, int lda, const double* b, int ldb,
          double beta, double* c, int ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b,
              ldb, beta, c, ldc);
}

// y[n, out] = x[n, in] W[out, in]^T + b (beta 1: added to what y holds).
template <typename T>
void linear(const T* x, const T* w, const T* b, T* y, int n, int in, int out, bool add) {
  if (!add)
    for (int r = 0; r < n; ++r) std::copy(b, b + out, y + static_cast<size_t>(r) * out);
  else
    for (int r = 0; r < n; ++r)
      for (int o = 0; o < out; ++o) y[static_cast<size_t>(r) * out + o] += b[o];
  gemm(false, true, n, out, in, T(1), x, in, w, in, T(1), y, out);
}
// dx (= or +=) dy W; dW += dy^T x; db += column sums of dy. Null dw, db:
// frozen params, only the input grad.
template <typename T>
void linear_backward(const T* dy, const T* x, const T* w, T* dx, T* dw, T* db, int n, int in, int out, bool add_dx) {
  gemm(false, false, n, in, out, T(1), dy, out, w, in, add_dx ? T(1) : T(0), dx, in);
  if (dw) gemm(true, false, out, in, n, T(1), dy, out, x, in, T(1), dw, in);
  if (db)
    for (int r = 0; r < n; ++r)
      for (int o = 0; o < out; ++o) db[o] += dy[static_cast<size_t>(r) * out + o];
}

// LoRA beside a linear: u = x A^T [n, rank] (kept for backward), y += s u B^T.
template <typename T>
void lora_forward(const T* x, const T* a, const T* b, T* u, T* y, int n, int in, int out, int rank, T s) {
  gemm(false, true, n, rank, in, T(1), x, in, a, in, T(0), u, rank);
  gemm(false, true, n, out, rank, s, u, rank, b, rank, T(1), y, out);
}
// dB += s dy^T u; du = s dy B; dA += du^T x; dx += du A. `du` is scratch [n, rank];
// null dA, dB: frozen adapters.
template <typename T>
void lora_backward(const T* dy, const T* x, const T* a, const T* b, const T* u, T* da, T* db, T* dx, T* du, int n,
                   int in, int out, int rank, T s) {
  if (db) gemm(true, false, out, rank, n, s, dy, out, u, rank, T(1), db, rank);
  gemm(false, false, n, rank, out, s, dy, out, b, rank, T(0), du, rank);
  if (da) gemm(true, false, rank, in, n, T(1), du, rank, x, in, T(1), da, in);
  gemm(false, false, n, in, rank, T(1), du, rank, a, in, T(1), dx, in);
}

constexpr double kLnEps = 1e-5;

template <typename T>
void layernorm(const T* x, const T* w, const T* b, T* y, T* mean, T* rstd, int n, int c) {
  for (int r = 0; r < n; ++r) {
    const T* xr = x + static_cast<size_t>(r) * c;
    T* yr = y + static_cast<size_t>(r) * c;
    double m = 0, v = 0;
    for (int i = 0; i < c; ++i) m += xr[i];
    m /= c;
    for (int i = 0; i < c; ++i) v += (xr[i] - m) * (xr[i] - m);
    v /= c;
    const double s = 1.0 / std::sqrt(v + kLnEps);
    for (int i = 0; i < c; ++i) yr[i] = static_cast<T>((xr[i] - m) * s) * w[i] + b[i];
    mean[r] = static_cast<T>(m);
    rstd[r] = static_cast<T>(s);
  }
}
// dx += the input grad; dw, db += the param grads (null: frozen, none).
template <typename T>
void layernorm_backward(const T* dy, const T* x, const T* mean, const T* rstd, const T* w, T* dx, T* dw, T* db, int n,
                        int c) {
  for (int r = 0; r < n; ++r) {
    const T* dyr = dy + static_cast<size_t>(r) * c;
    const T* xr = x + static_cast<size_t>(r) * c;
    T* dxr = dx + static_cast<size_t>(r) * c;
    double sum_d = 0, sum_dx = 0;
    for (int i = 0; i < c; ++i) {
      const T xhat = (xr[i] - mean[r]) * rstd[r];
      const T d = dyr[i] * w[i];
      sum_d += d;
      sum_dx += d * xhat;
      if (dw) dw[i] += dyr[i] * xhat;
      if (db) db[i] += dyr[i];
    }
    const T md = static_cast<T>(sum_d / c), mdx = static_cast<T>(sum_dx / c);
    for (int i = 0; i < c; ++i) {
      const T xhat = (xr[i] - mean[r]) * rstd[r];
      dxr[i] += rstd[r] * (dyr[i] * w[i] - md - xhat * mdx);
    }
  }
}

// GELU, tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
constexpr double kGeluK = 0.7978845608028654;
template <typename T>
T gelu(T x) {
  return static_cast<T>(0.5) * x * (1 + std::tanh(static_cast<T>(kGeluK) * (x + static_cast<T>(0.044715) * x * x * x)));
}
template <typename T>
T gelu_grad(T x) {
  const T u = static_cast<T>(kGeluK) * (x + static_cast<T>(0.044715) * x * x * x);
  const T th = std::tanh(u);
  const T du = static_cast<T>(kGeluK) * (1 + static_cast<T>(3 * 0.044715) * x * x);
  return static_cast<T>(0.5) * (1 + th) + static_cast<T>(0.5) * x * (1 - th * th) * du;
}

uint64_t splitmix(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return h;
}
double uniform01(uint64_t& state) { return (static_cast<double>(splitmix(state) >> 11) + 0.5) / 9007199254740992.0; }

bool ends_with(const std::string& s, const char* tail) {
  const size_t n = std::strlen(tail);
  return s.size() >= n && s.compare(s.size() - n, n, tail) == 0;
}

}  // namespace

const char* const kNoWeightDecay = "*bias,*ln*,wte,wpe";

std::string shape_error(const Shape& s) {
  if (s.layers < 1 || s.width < 1 || s.heads < 1 || s.context < 1)
    return "layers, width, heads and context must be >= 1";
  if (s.width % s.heads) return "the width must be a multiple of the heads";
  return "";
}

size_t ParamSpec::numel() const {
  size_t n = 1;
  for (int64_t d : dims) n *= static_cast<size_t>(d);
  return n;
}

std::vector<UnitSpec> model_units(const Shape& s) {
  const int64_t c = s.width;
  std::vector<UnitSpec> units;
  units.push_back({"embed", {{"wte", {kVocab, c}}, {"wpe", {s.context, c}}}});
  for (int l = 0; l < s.layers; ++l) {
    const std::string p = "h" + std::to_string(l) + ".";
    units.push_back({"h" + std::to_string(l),
                     {{p + "ln1.weight", {c}},
                      {p + "ln1.bias", {c}},
                      {p + "attn.qkv.weight", {3 * c, c}},
                      {p + "attn.qkv.bias", {3 * c}},
                      {p + "attn.proj.weight", {c, c}},
                      {p + "attn.proj.bias", {c}},
                      {p + "ln2.weight", {c}},
                      {p + "ln2.bias", {c}},
                      {p + "mlp.fc.weight", {4 * c, c}},
                      {p + "mlp.fc.bias", {4 * c}},
                      {p + "mlp.fc2.weight", {c, 4 * c}},
                      {p + "mlp.fc2.bias", {c}}}});
  }
  units.push_back({"lnf", {{"lnf.weight", {c}}, {"lnf.bias", {c}}}});
  return units;
}

std::vector<UnitSpec> lora_units(const Shape& s, int rank) {
  const int64_t c = s.width, r = rank;
  std::vector<UnitSpec> units;
  for (int l = 0; l < s.layers; ++l) {
    const std::string p = "h" + std::to_string(l) + ".";
    units.push_back({"h" + std::to_string(l) + ".lora",
                     {{p + "attn.qkv.lora_A", {r, c}},
                      {p + "attn.qkv.lora_B", {3 * c, r}},
                      {p + "attn.proj.lora_A", {r, c}},
                      {p + "attn.proj.lora_B", {c, r}},
                      {p + "mlp.fc.lora_A", {r, c}},
                      {p + "mlp.fc.lora_B", {4 * c, r}},
                      {p + "mlp.fc2.lora_A", {r, 4 * c}},
                      {p + "mlp.fc2.lora_B", {c, r}}}});
  }
  return units;
}

size_t param_count(const Shape& s) {
  size_t n = 0;
  for (const UnitSpec& u : model_units(s))
    for (const ParamSpec& p : u.params) n += p.numel();
  return n;
}

void init_param(const Shape& s, const ParamSpec& p, uint64_t seed, float* out) {
  const size_t n = p.numel();
  uint64_t state = fnv1a(p.name) ^ (seed * 0x9e3779b97f4a7c15ull);
  if (ends_with(p.name, ".lora_B")) {
    std::fill(out, out + n, 0.0f);
    return;
  }
  if (ends_with(p.name, ".lora_A")) {  // U(-1/sqrt(in), 1/sqrt(in)), in = dims[1]
    const double bound = 1.0 / std::sqrt(static_cast<double>(p.dims.at(1)));
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(bound * (2 * uniform01(state) - 1));
    return;
  }
  if (ends_with(p.name, ".bias")) {
    std::fill(out, out + n, 0.0f);
    return;
  }
  if (ends_with(p.name, "ln1.weight") || ends_with(p.name, "ln2.weight") || p.name == "lnf.weight") {
    std::fill(out, out + n, 1.0f);
    return;
  }
  double std_dev = 0.02;
  if (ends_with(p.name, "attn.proj.weight") || ends_with(p.name, "mlp.fc2.weight"))
    std_dev /= std::sqrt(2.0 * s.layers);
  for (size_t i = 0; i < n; ++i) {  // Box-Muller
    const double u1 = uniform01(state), u2 = uniform01(state);
    out[i] = static_cast<float>(std_dev * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
}

// ---- the model -------------------------------------------------------------------

template <typename T>
Model<T>::Model(const Shape& s, int batch, bool recompute, Lora lora)
    : s_(s), b_(batch), recompute_(recompute), lora_(lora) {
  const std::string why = shape_error(s);
  if (!why.empty()) throw std::invalid_argument("gpt shape: " + why);
  if (lora.rank < 0) throw std::invalid_argument("gpt: the LoRA rank must be >= 0");
  const size_t n = static_cast<size_t>(batch) * s.context, c = static_cast<size_t>(s.width);
  x_.assign(static_cast<size_t>(s.layers) + 1, std::vector<T>(n * c));
  auto size_acts = [&](BlockActs& a) {
    a.ln1.resize(n * c), a.mean1.resize(n), a.rstd1.resize(n), a.qkv.resize(3 * n * c);
    a.att.resize(static_cast<size_t>(batch) * s.heads * s.context * s.context);
    a.y.resize(n * c), a.xmid.resize(n * c), a.ln2.resize(n * c), a.mean2.resize(n), a.rstd2.resize(n);
    a.fc.resize(4 * n * c), a.act.resize(4 * n * c);
    for (auto& u : a.lora) u.resize(n * static_cast<size_t>(lora.rank));
  };
  dlora_.resize(n * static_cast<size_t>(lora.rank));
  if (recompute) {
    size_acts(scratch_);
  } else {
    acts_.resize(static_cast<size_t>(s.layers));
    for (BlockActs& a : acts_) size_acts(a);
  }
  lnf_.resize(n * c), meanf_.resize(n), rstdf_.resize(n), probs_.resize(n * kVocab), dlogits_.resize(n * kVocab);
  dx_.resize(n * c), dx2_.resize(n * c), dtmp_.resize(n * c), dqkv_.resize(3 * n * c);
  datt_.resize(static_cast<size_t>(s.context) * s.context), dbig_.resize(4 * n * c);
}

template <typename T>
size_t Model<T>::activation_bytes() const {
  size_t n = 0;
  auto add = [&](const std::vector<T>& v) { n += v.size() * sizeof(T); };
  for (const auto& v : x_) add(v);
  auto add_acts = [&](const BlockActs& a) {
    for (const auto* v :
         {&a.ln1, &a.mean1, &a.rstd1, &a.qkv, &a.att, &a.y, &a.xmid, &a.ln2, &a.mean2, &a.rstd2, &a.fc, &a.act})
      add(*v);
    for (const auto& u : a.lora) add(u);
  };
  add(dlora_);
  for (const BlockActs& a : acts_) add_acts(a);
  add_acts(scratch_);
  for (const auto* v : {&lnf_, &meanf_, &rstdf_, &probs_, &dlogits_, &dx_, &dx2_, &dtmp_, &dqkv_, &datt_, &dbig_})
    add(*v);
  return n;
}

template <typename T>
void Model<T>::embed_forward(const UnitView<T>& u, const uint8_t* tokens, int t) {
  if (t < 1 || t > s_.context) throw std::invalid_argument("gpt: sequence length out of range");
  t_ = t;
  tokens_ = tokens;
  const int c = s_.width;
  T* x = x_[0].data();
  for (int b = 0; b < b_; ++b)
    for (int i = 0; i < t; ++i) {
      const size_t row = static_cast<size_t>(b) * t + i;
      const T* e = u.p[kWte] + static_cast<size_t>(tokens[row]) * c;
      const T* pe = u.p[kWpe] + static_cast<size_t>(i) * c;
      for (int k = 0; k < c; ++k) x[row * c + k] = e[k] + pe[k];
    }
}

template <typename T>
const UnitView<T>* Model<T>::check_lora(const UnitView<T>* lora) const {
  if (lora_.on() != (lora != nullptr))
    throw std::invalid_argument(lora_.on() ? "gpt: a model with LoRA needs each block's adapter unit"
                                           : "gpt: adapters given to a model without LoRA");
  return lora;
}

template <typename T>
void Model<T>::run_block(int layer, const UnitView<T>& u, const UnitView<T>* lora, BlockActs& a, T* out) {
  const int c = s_.width, n = b_ * t_, h = s_.heads, hd = s_.head_dim(), t = t_, r = lora_.rank;
  const T* x = x_[static_cast<size_t>(layer)].data();
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(hd)));
  const T ls = static_cast<T>(lora_.scale());
  // The adapter of projection k (LoraParam / 2) beside its linear.
  auto adapter = [&](int k, const T* in_x, T* y, int in, int out_dim) {
    if (lora) lora_forward(in_x, lora->p[2 * k], lora->p[2 * k + 1], a.lora[k].data(), y, n, in, out_dim, r, ls);
  };
  layernorm(x, u.p[kLn1W], u.p[kLn1B], a.ln1.data(), a.mean1.data(), a.rstd1.data(), n, c);
  linear(a.ln1.data(), u.p[kQkvW], u.p[kQkvB], a.qkv.data(), n, c, 3 * c, false);
  adapter(0, a.ln1.data(), a.qkv.data(), c, 3 * c);
  for (int b = 0; b < b_; ++b)
    for (int hh = 0; hh < h; ++hh) {
      const T* q = a.qkv.data() + static_cast<size_t>(b) * t * 3 * c + static_cast<size_t>(hh) * hd;
      T* att = a.att.data() + (static_cast<size_t>(b) * h + hh) * t * t;
      gemm(false, true, t, t, hd, scale, q, 3 * c, q + c, 3 * c, T(0), att, t);
      for (int i = 0; i < t; ++i) {  // causal softmax over j <= i
        T* row = att + static_cast<size_t>(i) * t;
        T mx = row[0];
        for (int j = 1; j <= i; ++j) mx = std::max(mx, row[j]);
        double sum = 0;
        for (int j = 0; j <= i; ++j) sum += (row[j] = std::exp(row[j] - mx));
        const T inv = static_cast<T>(1.0 / sum);
        for (int j = 0; j <= i; ++j) row[j] *= inv;
        std::fill(row + i + 1, row + t, T(0));
      }
      gemm(false, false, t, hd, t, T(1), att, t, q + 2 * c, 3 * c, T(0),
           a.y.data() + static_cast<size_t>(b) * t * c + static_cast<size_t>(hh) * hd, c);
    }
  std::copy(x, x + static_cast<size_t>(n) * c, a.xmid.data());
  linear(a.y.data(), u.p[kProjW], u.p[kProjB], a.xmid.data(), n, c, c, true);
  adapter(1, a.y.data(), a.xmid.data(), c, c);
  layernorm(a.xmid.data(), u.p[kLn2W], u.p[kLn2B], a.ln2.data(), a.mean2.data(), a.rstd2.data(), n, c);
  linear(a.ln2.data(), u.p[kFcW], u.p[kFcB], a.fc.data(), n, c, 4 * c, false);
  adapter(2, a.ln2.data(), a.fc.data(), c, 4 * c);
  for (size_t i = 0; i < static_cast<size_t>(n) * 4 * c; ++i) a.act[i] = gelu(a.fc[i]);
  std::copy(a.xmid.data(), a.xmid.data() + static_cast<size_t>(n) * c, out);
  linear(a.act.data(), u.p[kFc2W], u.p[kFc2B], out, n, 4 * c, c, true);
  adapter(3, a.act.data(), out, 4 * c, c);
}

template <typename T>
void Model<T>::block_forward(int layer, const UnitView<T>& u, const UnitView<T>* lora) {
  run_block(layer, u, check_lora(lora), acts_of(layer), x_[static_cast<size_t>(layer) + 1].data());
}

template <typename T>
void Model<T>::final_forward(const UnitView<T>& u) {
  layernorm(x_.back().data(), u.p[kLnfW], u.p[kLnfB], lnf_.data(), meanf_.data(), rstdf_.data(), b_ * t_, s_.width);
}

template <typename T>
double Model<T>::head_forward(const UnitView<T>& u, const uint8_t* targets, double scale) {
  const int n = b_ * t_, c = s_.width;
  gemm(false, true, n, kVocab, c, T(1), lnf_.data(), c, u.p[kWte], c, T(0), probs_.data(), kVocab);
  with_targets_ = targets != nullptr;
  if (!targets) return 0.0;
  double loss = 0;
  for (int r = 0; r < n; ++r) {
    T* row = probs_.data() + static_cast<size_t>(r) * kVocab;
    T* drow = dlogits_.data() + static_cast<size_t>(r) * kVocab;
    const T mx = *std::max_element(row, row + kVocab);
    double sum = 0;
    for (int v = 0; v < kVocab; ++v) sum += (row[v] = std::exp(row[v] - mx));
    loss -= std::log(row[targets[r]] / sum);
    const double k = scale / n;
    for (int v = 0; v < kVocab; ++v) drow[v] = static_cast<T>((row[v] / sum - (v == targets[r] ? 1.0 : 0.0)) * k);
  }
  return loss / n;
}

template <typename T>
const T* Model<T>::last_logits() const {
  return probs_.data() + static_cast<size_t>(t_ - 1) * kVocab;
}

template <typename T>
void Model<T>::head_backward(const UnitView<T>& u) {
  if (!with_targets_) throw std::logic_error("gpt: head_backward without targets");
  const int n = b_ * t_, c = s_.width;
  gemm(false, false, n, c, kVocab, T(1), dlogits_.data(), kVocab, u.p[kWte], c, T(0), dx_.data(), c);
  if (T* dwte = u.grad(kWte)) gemm(true, false, kVocab, c, n, T(1), dlogits_.data(), kVocab, lnf_.data(), c, T(1), dwte, c);
}

template <typename T>
void Model<T>::final_backward(const UnitView<T>& u) {
  const int n = b_ * t_, c = s_.width;
  std::fill(dx2_.begin(), dx2_.begin() + static_cast<ptrdiff_t>(n) * c, T(0));
  layernorm_backward(dx_.data(), x_.back().data(), meanf_.data(), rstdf_.data(), u.p[kLnfW], dx2_.data(),
                     u.grad(kLnfW), u.grad(kLnfB), n, c);
  dx_.swap(dx2_);
}

template <typename T>
void Model<T>::block_backward(int layer, const UnitView<T>& u, const UnitView<T>* lora) {
  check_lora(lora);
  BlockActs& a = acts_of(layer);
  if (recompute_) run_block(layer, u, lora, a, x_[static_cast<size_t>(layer) + 1].data());
  const int c = s_.width, n = b_ * t_, h = s_.heads, hd = s_.head_dim(), t = t_;
  const size_t nc = static_cast<size_t>(n) * c;
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(hd)));
  const T ls = static_cast<T>(lora_.scale());
  // The adapter of projection k: its grads, and its share of the input grad dx.
  auto adapter = [&](int k, const T* dy, const T* in_x, T* dx, int in, int out) {
    if (lora)
      lora_backward(dy, in_x, lora->p[2 * k], lora->p[2 * k + 1], a.lora[k].data(), lora->grad(2 * k),
                    lora->grad(2 * k + 1), dx, dlora_.data(), n, in, out, lora_.rank, ls);
  };
  T* dout = dx_.data();  // d loss / d (block output), becomes d loss / d (block input)
  // MLP: dact = dout Wfc2, then through the GELU, then dln2 = dfc Wfc.
  linear_backward(dout, a.act.data(), u.p[kFc2W], dbig_.data(), u.grad(kFc2W), u.grad(kFc2B), n, 4 * c, c, false);
  adapter(3, dout, a.act.data(), dbig_.data(), 4 * c, c);
  for (size_t i = 0; i < 4 * nc; ++i) dbig_[i] *= gelu_grad(a.fc[i]);
  linear_backward(dbig_.data(), a.ln2.data(), u.p[kFcW], dtmp_.data(), u.grad(kFcW), u.grad(kFcB), n, c, 4 * c, false);
  adapter(2, dbig_.data(), a.ln2.data(), dtmp_.data(), c, 4 * c);
  // dxmid = dout + LN2's input grad (added into dout in place).
  layernorm_backward(dtmp_.data(), a.xmid.data(), a.mean2.data(), a.rstd2.data(), u.p[kLn2W], dout, u.grad(kLn2W),
                     u.grad(kLn2B), n, c);
  // Attention projection: dy = dxmid Wproj.
  linear_backward(dout, a.y.data(), u.p[kProjW], dtmp_.data(), u.grad(kProjW), u.grad(kProjB), n, c, c, false);
  adapter(1, dout, a.y.data(), dtmp_.data(), c, c);
  for (int b = 0; b < b_; ++b)
    for (int hh = 0; hh < h; ++hh) {
      const size_t off = static_cast<size_t>(b) * t * 3 * c + static_cast<size_t>(hh) * hd;
      const T* q = a.qkv.data() + off;
      T* dq = dqkv_.data() + off;
      const T* att = a.att.data() + (static_cast<size_t>(b) * h + hh) * t * t;
      const T* dy = dtmp_.data() + static_cast<size_t>(b) * t * c + static_cast<size_t>(hh) * hd;
      T* dp = datt_.data();
      gemm(false, true, t, t, hd, T(1), dy, c, q + 2 * c, 3 * c, T(0), dp, t);    // dP = dy V^T
      gemm(true, false, t, hd, t, T(1), att, t, dy, c, T(0), dq + 2 * c, 3 * c);  // dV = P^T dy
      for (int i = 0; i < t; ++i) {                                               // dS = P (dP - sum P dP)
        const T* pr = att + static_cast<size_t>(i) * t;
        T* dr = dp + static_cast<size_t>(i) * t;
        double s = 0;
        for (int j = 0; j <= i; ++j) s += pr[j] * dr[j];
        for (int j = 0; j <= i; ++j) dr[j] = pr[j] * (dr[j] - static_cast<T>(s));
        std::fill(dr + i + 1, dr + t, T(0));
      }
      gemm(false, false, t, hd, t, scale, dp, t, q + c, 3 * c, T(0), dq, 3 * c);  // dQ = scale dS K
      gemm(true, false, t, hd, t, scale, dp, t, q, 3 * c, T(0), dq + c, 3 * c);   // dK = scale dS^T Q
    }
  linear_backward(dqkv_.data(), a.ln1.data(), u.p[kQkvW], dtmp_.data(), u.grad(kQkvW), u.grad(kQkvB), n, c, 3 * c,
                  false);
  adapter(0, dqkv_.data(), a.ln1.data(), dtmp_.data(), c, 3 * c);
  layernorm_backward(dtmp_.data(), x_[static_cast<size_t>(layer)].data(), a.mean1.data(), a.rstd1.data(), u.p[kLn1W],
                     dout, u.grad(kLn1W), u.grad(kLn1B), n, c);
}

template <typename T>
void Model<T>::embed_backward(const UnitView<T>& u) {
  if (u.g.empty()) return;  // frozen: the first unit has no input to pass a grad to
  const int c = s_.width;
  const T* dx = dx_.data();
  for (int b = 0; b < b_; ++b)
    for (int i = 0; i < t_; ++i) {
      const size_t row = static_cast<size_t>(b) * t_ + i;
      T* de = u.g[kWte] + static_cast<size_t>(tokens_[row]) * c;
      T* dpe = u.g[kWpe] + static_cast<size_t>(i) * c;
      for (int k = 0; k < c; ++k) {
        de[k] += dx[row * c + k];
        dpe[k] += dx[row * c + k];
      }
    }
}

template class Model<float>;
template class Model<double>;

// ---- data ----------------------------------------------------------------------

Corpus load_corpus(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read the corpus " + path);
  std::vector<uint8_t> text;
  for (auto it = std::istreambuf_iterator<char>(in); it != std::istreambuf_iterator<char>(); ++it)
    if (*it != '\r') text.push_back(static_cast<uint8_t>(*it));
  if (text.size() < 1024) throw std::runtime_error("the corpus " + path + " holds fewer than 1024 bytes");
  Corpus c;
  const size_t split = text.size() / 10 * 9;
  c.train.assign(text.begin(), text.begin() + static_cast<ptrdiff_t>(split));
  c.val.assign(text.begin() + static_cast<ptrdiff_t>(split), text.end());
  return c;
}

Corpus random_corpus(size_t n, uint64_t seed) {
  Corpus c;
  uint64_t state = seed;
  for (size_t i = 0; i < n; ++i) (i < n / 10 * 9 ? c.train : c.val).push_back(static_cast<uint8_t>(splitmix(state)));
  return c;
}

double unigram_loss(const std::vector<uint8_t>& train, const std::vector<uint8_t>& text) {
  std::vector<double> count(kVocab, 1.0);
  for (uint8_t ch : train) count[ch] += 1;
  const double total = static_cast<double>(train.size()) + kVocab;
  double loss = 0;
  for (uint8_t ch : text) loss -= std::log(count[ch] / total);
  return loss / static_cast<double>(text.size());
}

namespace {

// Where sample_window's window starts in `data`.
const uint8_t* window_start(const std::vector<uint8_t>& data, uint64_t seed, int64_t step, int index, int t) {
  uint64_t state = seed ^ (static_cast<uint64_t>(step) * 0xd1b54a32d192ed03ull) ^
                   (static_cast<uint64_t>(index) * 0x8cb92ba72f3d8dd7ull);
  const size_t span = data.size() - static_cast<size_t>(t) - 1;
  return data.data() + static_cast<size_t>(splitmix(state) % span);
}

}  // namespace

void sample_window(const std::vector<uint8_t>& data, uint64_t seed, int64_t step, int index, int t, uint8_t* out) {
  std::memcpy(out, window_start(data, seed, step, index, t), static_cast<size_t>(t) + 1);
}

void load_batch(const std::vector<uint8_t>& data, uint64_t seed, int64_t step, int first, int count, int t,
                uint8_t* inputs, uint8_t* targets) {
  for (int i = 0; i < count; ++i) {
    const uint8_t* w = window_start(data, seed, step, first + i, t);
    std::memcpy(inputs + static_cast<size_t>(i) * t, w, static_cast<size_t>(t));
    std::memcpy(targets + static_cast<size_t>(i) * t, w + 1, static_cast<size_t>(t));
  }
}

double lr_schedule(double base, int64_t step, int64_t total) {
  const double warm = std::max(1.0, 0.05 * static_cast<double>(total));
  if (static_cast<double>(step) <= warm) return base * static_cast<double>(step) / warm;
  const double f = std::min(1.0, (static_cast<double>(step) - warm) / std::max(1.0, static_cast<double>(total) - warm));
  return base * (0.1 + 0.9 * 0.5 * (1 + std::cos(3.141592653589793 * f)));
}

float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN stays NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace gpt
