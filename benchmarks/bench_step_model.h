// benchmarks/bench_step_model.h - bench_step's MLP (OpenBLAS sgemm, ReLU,
// the same init for every way and rank) and the plain baseline loop it is
// compared with: plain buffers, memset grads, a hand-written AdamW.
// Private to bench_step.cpp.
#pragma once

#include "bench_step_cli.h"

namespace bench_step {

// ---- the model ----------------------------------------------------------------
// Layer l: a[l+1] = relu(a[l] W_l^T + b_l), W_l [W, W] row-major [out, in];
// loss = 0.5 / B * sum over the batch of |a[L] - y|^2.

float uniform(uint64_t* state) {  // splitmix64 -> [-1, 1)
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

// The same init for every way and rank; each rank's data from its own seed,
// so rank 0 of any world sees the baseline's batch.
struct Init {
  std::vector<std::vector<float>> weight, bias;
  Init(int width, int layers) {
    size_t n = static_cast<size_t>(width) * width;
    for (int l = 0; l < layers; ++l) {
      uint64_t rng = 1000 + static_cast<uint64_t>(l);
      float scale = std::sqrt(6.0f / static_cast<float>(width));  // Kaiming uniform for ReLU
      weight.emplace_back(n);
      for (float& w : weight.back()) w = uniform(&rng) * scale;
      bias.emplace_back(static_cast<size_t>(width), 0.0f);
    }
  }
};

struct Batch {
  std::vector<float> x, y;
  Batch(int width, int batch, int rank) : x(static_cast<size_t>(width) * batch), y(x.size()) {
    uint64_t rng = 77 + 1000003ull * static_cast<uint64_t>(rank);
    for (float& v : x) v = uniform(&rng);
    for (float& v : y) v = 0.5f * (uniform(&rng) + 1.0f);  // a ReLU output can reach [0, 1)
  }
};

void forward_layer(const float* w, const float* b, const float* in, float* out, int batch, int width) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, batch, width, width, 1.0f, in, width, w, width, 0.0f, out,
              width);
  for (int r = 0; r < batch; ++r) {
    float* o = out + static_cast<size_t>(r) * width;
    for (int j = 0; j < width; ++j) o[j] = std::max(o[j] + b[j], 0.0f);
  }
}

// Returns the loss and writes its gradient with respect to `out` into dout.
double loss_grad(const float* out, const float* y, float* dout, int batch, int width) {
  double loss = 0.0;
  size_t n = static_cast<size_t>(batch) * width;
  float inv_b = 1.0f / static_cast<float>(batch);
  for (size_t i = 0; i < n; ++i) {
    float d = out[i] - y[i];
    loss += 0.5 * static_cast<double>(d) * d;
    dout[i] = d * inv_b;
  }
  return loss / batch;
}

// Adds the layer's grads into gw, gb; dout becomes the pre-ReLU grad; din
// (NULL for the first layer) receives the grad of the layer's input.
void backward_layer(const float* w, float* gw, float* gb, const float* in, const float* out, float* dout, float* din,
                    int batch, int width) {
  size_t n = static_cast<size_t>(batch) * width;
  for (size_t i = 0; i < n; ++i)
    if (out[i] <= 0.0f) dout[i] = 0.0f;
  for (int r = 0; r < batch; ++r)
    for (int j = 0; j < width; ++j) gb[j] += dout[static_cast<size_t>(r) * width + j];
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, width, width, batch, 1.0f, dout, width, in, width, 1.0f, gw,
              width);
  if (din)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, batch, width, width, 1.0f, dout, width, w, width, 0.0f, din,
                width);
}

struct Activations {
  std::vector<std::vector<float>> a, da;
  Activations(int width, int batch, int layers) {
    for (int l = 0; l <= layers; ++l) {
      a.emplace_back(static_cast<size_t>(width) * batch);
      da.emplace_back(a.back().size());
    }
  }
};

// ---- the baseline: plain buffers and a plain AdamW ---------------------------

// fn(begin, end) over [0, n) split across `threads` threads, the caller being
// one; the helpers live as long as the object, as an optimizer's pool would.
class ParallelFor {
 public:
  explicit ParallelFor(int threads) {
    for (int i = 1; i < threads; ++i) helpers_.emplace_back([this, i] { serve(i); });
  }
  ~ParallelFor() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : helpers_) t.join();
  }
  ParallelFor(const ParallelFor&) = delete;
  ParallelFor& operator=(const ParallelFor&) = delete;

  void run(size_t n, const std::function<void(size_t, size_t)>& fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      n_ = n;
      pending_ = helpers_.size();
      ++generation_;
    }
    wake_.notify_all();
    chunk(0);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return pending_ == 0; });
  }

 private:
  void chunk(size_t i) {
    size_t parts = helpers_.size() + 1, per = (n_ + parts - 1) / parts;
    size_t b = std::min(n_, i * per), e = std::min(n_, b + per);
    if (b < e) (*fn_)(b, e);
  }
  void serve(size_t i) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      chunk(i);
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::vector<std::thread> helpers_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(size_t, size_t)>* fn_ = nullptr;
  size_t n_ = 0, pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

// torch.optim.AdamW, written as kernels/optim.h's AdamOp writes it, and
// compiled as the library's loops are (an AVX2 clone, -fno-math-errno), as a
// framework's vectorised optimizer would be.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
void adamw(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v, size_t b, size_t e,
           long step) {
  double bc1 = 1.0 - std::pow(static_cast<double>(kBeta1), static_cast<double>(step));
  double bc2 = 1.0 - std::pow(static_cast<double>(kBeta2), static_cast<double>(step));
  const float param_decay = 1.0f - kLr * kWeightDecay, step_size = static_cast<float>(kLr / bc1);
  const float inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  for (size_t i = b; i < e; ++i) {
    float gi = g[i];
    float pi = p[i] * param_decay;
    m[i] = kBeta1 * m[i] + (1.0f - kBeta1) * gi;
    v[i] = kBeta2 * v[i] + (1.0f - kBeta2) * gi * gi;
    float denom = std::sqrt(v[i]) * inv_bc2_sqrt + kEps;
    p[i] = pi - step_size * (m[i] / denom);
  }
}

Summary run_baseline(const Options& o, const Init& init, int threads) {
  const int W = o.width, L = o.layers, B = o.batch;
  const size_t wn = static_cast<size_t>(W) * W, per_layer = wn + W, total = per_layer * L;
  // One flat buffer per kind: layer l's weight at l * per_layer, its bias after it.
  std::vector<float> p(total), g(total), m(total, 0.0f), v(total, 0.0f);
  for (int l = 0; l < L; ++l) {
    std::copy(init.weight[l].begin(), init.weight[l].end(), p.begin() + l * per_layer);
    std::copy(init.bias[l].begin(), init.bias[l].end(), p.begin() + l * per_layer + wn);
  }
  auto wp = [&](std::vector<float>& buf, int l) { return buf.data() + l * per_layer; };
  Batch data(W, B, 0);
  Activations act(W, B, L);
  ParallelFor pool(threads);
  std::vector<Times> timed;
  double cpu0 = 0, wall0 = 0;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    if (s == o.warmup) {
      cpu0 = cpu_ms();
      wall0 = now_ms();
    }
    Times t{};
    double t0 = now_ms(), c = t0;
    std::copy(data.x.begin(), data.x.end(), act.a[0].begin());
    for (int l = 0; l < L; ++l) forward_layer(wp(p, l), wp(p, l) + wn, act.a[l].data(), act.a[l + 1].data(), B, W);
    loss_grad(act.a[L].data(), data.y.data(), act.da[L].data(), B, W);
    t[kCompute] += now_ms() - c;
    c = now_ms();
    std::memset(g.data(), 0, total * sizeof(float));
    t[kZeroGrad] = now_ms() - c;
    c = now_ms();
    for (int l = L - 1; l >= 0; --l)
      backward_layer(wp(p, l), wp(g, l), wp(g, l) + wn, act.a[l].data(), act.a[l + 1].data(), act.da[l + 1].data(),
                     l > 0 ? act.da[l].data() : nullptr, B, W);
    t[kCompute] += now_ms() - c;
    c = now_ms();
    pool.run(total, [&](size_t b, size_t e) { adamw(p.data(), g.data(), m.data(), v.data(), b, e, s + 1); });
    t[kStepCall] = now_ms() - c;
    t[kStep] = now_ms() - t0;
    t[kOther] = t[kStep] - t[kCompute] - t[kZeroGrad] - t[kStepCall];
    if (s >= o.warmup) timed.push_back(t);
  }
  double cpu_total = cpu_ms() - cpu0, wall_total = now_ms() - wall0;
  std::copy(data.x.begin(), data.x.end(), act.a[0].begin());
  for (int l = 0; l < L; ++l) forward_layer(wp(p, l), wp(p, l) + wn, act.a[l].data(), act.a[l + 1].data(), B, W);
  double loss = loss_grad(act.a[L].data(), data.y.data(), act.da[L].data(), B, W);
  return summarize(timed, cpu_total, wall_total, loss);
}

}  // namespace bench_step
