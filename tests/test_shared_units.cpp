// A unit used twice in one iteration, as tied input/output embeddings are:
// the embedding unit's forward runs at the input and again at the output
// head, and its backward runs twice too (head first, input last). libfsdp
// gathers it for each use and adds both uses' grads into its grad shard
// (docs/architecture.md, "A unit used twice"). A tiny tied-embedding model
// trained at worlds 1-3 under every strategy, with prefetch on and off, must
// land where a single-process AdamW on the whole batch lands (computed here in
// double, without libfsdp). The host's compute goes through
// tests/host_stream.h's Host: at once, or late on a host stream (the .late
// CTests), where the second gather of the embedding, the reductions of both
// uses' grads and the reuse of its buffers are ordered by libfsdp's events alone.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "host_stream.h"
#include "rank_runner.h"

using namespace fsdp_test;

namespace {

constexpr int kVocab = 12, kDim = 8, kTokens = 6, kSteps = 5;
constexpr double kLr = 0.01, kB1 = 0.9, kB2 = 0.999, kEps = 1e-8, kWd = 0.01;

struct Data {
  std::vector<int> x, y;  // input token and target token of each row
};

Data make_data() {
  Data d;
  Rng rng(5);
  for (int t = 0; t < kTokens; ++t) {
    d.x.push_back(static_cast<int>(rng.next() % kVocab));
    d.y.push_back(static_cast<int>(rng.next() % kVocab));
  }
  return d;
}

// The model on rows [lo, hi): h0 = E[x]; h1 = tanh(W h0); logits = E h1;
// loss = 0.5 |logits - onehot(y)|^2 averaged over the rows. Adds the grads
// of E (both uses) and W, each split into the head's and the input's part.
template <typename T>
struct Grads {
  std::vector<T> e_head, e_input, w;
};

template <typename T>
Grads<T> backprop(const std::vector<T>& E, const std::vector<T>& W, const Data& d, int lo, int hi) {
  Grads<T> g{std::vector<T>(kVocab * kDim, 0), std::vector<T>(kVocab * kDim, 0), std::vector<T>(kDim * kDim, 0)};
  const T n = static_cast<T>(hi - lo);
  for (int t = lo; t < hi; ++t) {
    std::vector<T> h0(kDim), h1(kDim), logits(kVocab), dl(kVocab), dh1(kDim, 0), dz(kDim), dh0(kDim, 0);
    for (int i = 0; i < kDim; ++i) h0[i] = E[d.x[t] * kDim + i];
    for (int o = 0; o < kDim; ++o) {
      T s = 0;
      for (int i = 0; i < kDim; ++i) s += W[o * kDim + i] * h0[i];
      h1[o] = std::tanh(s);
    }
    for (int v = 0; v < kVocab; ++v) {
      T s = 0;
      for (int i = 0; i < kDim; ++i) s += E[v * kDim + i] * h1[i];
      logits[v] = s;
      dl[v] = (s - (v == d.y[t] ? T(1) : T(0))) / n;
    }
    for (int v = 0; v < kVocab; ++v) {
      for (int i = 0; i < kDim; ++i) {
        g.e_head[v * kDim + i] += dl[v] * h1[i];
        dh1[i] += dl[v] * E[v * kDim + i];
      }
    }
    for (int o = 0; o < kDim; ++o) dz[o] = dh1[o] * (1 - h1[o] * h1[o]);
    for (int o = 0; o < kDim; ++o) {
      for (int i = 0; i < kDim; ++i) {
        g.w[o * kDim + i] += dz[o] * h0[i];
        dh0[i] += dz[o] * W[o * kDim + i];
      }
    }
    for (int i = 0; i < kDim; ++i) g.e_input[d.x[t] * kDim + i] += dh0[i];
  }
  return g;
}

void adamw(std::vector<double>& p, std::vector<double>& m, std::vector<double>& v, const std::vector<double>& g,
           int step) {
  const double bc1 = 1 - std::pow(kB1, step), bc2 = 1 - std::pow(kB2, step);
  for (size_t i = 0; i < p.size(); ++i) {
    p[i] *= 1 - kLr * kWd;
    m[i] = kB1 * m[i] + (1 - kB1) * g[i];
    v[i] = kB2 * v[i] + (1 - kB2) * g[i] * g[i];
    p[i] -= kLr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + kEps);
  }
}

std::vector<float> init(size_t n, uint64_t seed) { return Rng(seed).uniform_vec(n, -0.5f, 0.5f); }

// The single-process reference, in double: E and W after kSteps.
std::pair<std::vector<double>, std::vector<double>> reference() {
  Data d = make_data();
  std::vector<float> e0 = init(kVocab * kDim, 1), w0 = init(kDim * kDim, 2);
  std::vector<double> E(e0.begin(), e0.end()), W(w0.begin(), w0.end());
  std::vector<double> me(E.size(), 0), ve(E.size(), 0), mw(W.size(), 0), vw(W.size(), 0);
  for (int step = 1; step <= kSteps; ++step) {
    Grads<double> g = backprop(E, W, d, 0, kTokens);
    std::vector<double> ge(E.size());
    for (size_t i = 0; i < ge.size(); ++i) ge[i] = g.e_head[i] + g.e_input[i];
    adamw(E, me, ve, ge, step);
    adamw(W, mw, vw, g.w, step);
  }
  return {E, W};
}

// A unit's only param (fp32) and grad, through fsdp_param_ptr and
// fsdp_grad_ptr: taken on the calling thread, used by the host's compute.
const float* param_of(fsdp_unit_t* u) {
  void* p = nullptr;
  EXPECT_OK(fsdp_param_ptr(u, 0, &p));
  return static_cast<const float*>(p);
}
float* grad_of(fsdp_unit_t* u) {
  void* p = nullptr;
  EXPECT_OK(fsdp_grad_ptr(u, 0, &p));
  return static_cast<float*>(p);
}

// What the host's compute of one step keeps from forward to backward.
struct StepState {
  std::vector<float> E, W;
  Grads<float> g;
};

}  // namespace

class SharedUnit : public ::testing::TestWithParam<std::tuple<int, const char*, bool>> {};

TEST_P(SharedUnit, TiedEmbeddingsTrainLikeOneProcess) {
  const auto [world, sharding, prefetch] = GetParam();
  const auto [ref_e, ref_w] = reference();
  std::vector<std::vector<float>> got_e(static_cast<size_t>(world)), got_w(static_cast<size_t>(world));
  run_ranks(world, [&, world = world, sharding = sharding, prefetch = prefetch](int rank, fsdp_local_group_t* group) {
    ConfigPtr cfg = make_config({{"sharding", sharding},
                                 {"optimizer", "adamw"},
                                 {"lr", "0.01"},
                                 {"weight_decay", "0.01"},
                                 {"forward_prefetch", prefetch ? "1" : "0"},
                                 {"backward_prefetch", prefetch ? "pre" : "none"},
                                 {"timeout_s", "30"}});
    ASSERT_TRUE(cfg);
    fsdp_ctx_t* raw = nullptr;
    ASSERT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
    CtxPtr ctx(raw);
    fsdp_unit_t *embed = nullptr, *block = nullptr;
    ASSERT_OK(register_unit(raw, "embed", {{"weight", {kVocab, kDim}}}, &embed));
    ASSERT_OK(register_unit(raw, "block", {{"weight", {kDim, kDim}}}, &block));
    std::vector<float> e0 = init(kVocab * kDim, 1), w0 = init(kDim * kDim, 2);
    ASSERT_OK(fsdp_param_set_values(embed, 0, e0.data(), e0.size()));
    ASSERT_OK(fsdp_param_set_values(block, 0, w0.data(), w0.size()));
    const Data d = make_data();
    const int rows = kTokens / world, lo = rank * rows, hi = lo + rows;
    const size_t ne = e0.size(), nw = w0.size();
    Host host(raw);
    for (int step = 0; step < kSteps; ++step) {
      auto st = std::make_shared<StepState>();
      // Forward: the embedding at the input, the block, the embedding again
      // at the output head. The host keeps what backward needs.
      ASSERT_OK(fsdp_forward_begin(embed, host.stream()));
      const float* pe = param_of(embed);
      host.run([st, pe, ne] { st->E.assign(pe, pe + ne); });
      ASSERT_OK(fsdp_forward_end(embed, host.stream()));
      ASSERT_OK(fsdp_forward_begin(block, host.stream()));
      const float* pw = param_of(block);
      host.run([st, pw, nw] { st->W.assign(pw, pw + nw); });
      ASSERT_OK(fsdp_forward_end(block, host.stream()));
      ASSERT_OK(fsdp_forward_begin(embed, host.stream()));
      const float* pe2 = param_of(embed);
      host.run([st, pe2, ne, step, rank] {
        EXPECT_EQ(std::vector<float>(pe2, pe2 + ne), st->E)
            << "the second use sees the same params (rank " << rank << ", step " << step << ")";
      });
      ASSERT_OK(fsdp_forward_end(embed, host.stream()));
      host.run([st, d, lo, hi] { st->g = backprop(st->E, st->W, d, lo, hi); });
      // Backward in reverse: the head's use, the block, the input's use.
      const auto add = [&host, st](float* to, std::vector<float> Grads<float>::*part) {
        if (to == nullptr) return;  // fsdp_grad_ptr failed (reported)
        host.run([st, to, part] {
          const std::vector<float>& g = (st->g).*part;
          for (size_t i = 0; i < g.size(); ++i) to[i] += g[i];
        });
      };
      ASSERT_OK(fsdp_backward_begin(embed, host.stream()));
      add(grad_of(embed), &Grads<float>::e_head);
      ASSERT_OK(fsdp_backward_end(embed, host.stream()));
      ASSERT_OK(fsdp_backward_begin(block, host.stream()));
      add(grad_of(block), &Grads<float>::w);
      ASSERT_OK(fsdp_backward_end(block, host.stream()));
      ASSERT_OK(fsdp_backward_begin(embed, host.stream()));
      add(grad_of(embed), &Grads<float>::e_input);
      ASSERT_OK(fsdp_backward_end(embed, host.stream()));
      ASSERT_OK(fsdp_step(raw, host.stream()));
    }
    got_e[static_cast<size_t>(rank)].resize(e0.size());
    got_w[static_cast<size_t>(rank)].resize(w0.size());
    ASSERT_OK(fsdp_gather_param(embed, 0, got_e[static_cast<size_t>(rank)].data(), e0.size()));
    ASSERT_OK(fsdp_gather_param(block, 0, got_w[static_cast<size_t>(rank)].data(), w0.size()));
    ASSERT_OK(fsdp_ctx_finalize(raw));
  });
  // fp32 against a double reference: the grads' sums differ in order (per
  // rank, per use), which Adam's normalisation can amplify to ~1e-6 after a
  // few steps; 2e-5 leaves room and still fails if either use's grads were lost.
  for (int r = 0; r < world; ++r) {
    for (size_t i = 0; i < ref_e.size(); ++i) {
      ASSERT_NEAR(got_e[static_cast<size_t>(r)][i], ref_e[i], 2e-5 * (1 + std::fabs(ref_e[i]))) << "E[" << i << "]";
    }
    for (size_t i = 0; i < ref_w.size(); ++i) {
      ASSERT_NEAR(got_w[static_cast<size_t>(r)][i], ref_w[i], 2e-5 * (1 + std::fabs(ref_w[i]))) << "W[" << i << "]";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldsAndStrategies, SharedUnit,
                         ::testing::Combine(::testing::Values(1, 2, 3),
                                            ::testing::Values("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"),
                                            ::testing::Bool()),
                         [](const auto& p) {
                           return std::string(std::get<1>(p.param)) + "_world" + std::to_string(std::get<0>(p.param)) +
                                  (std::get<2>(p.param) ? "_prefetch" : "");
                         });
