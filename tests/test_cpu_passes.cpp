// Proves that the CPU device's optimizer passes compute the scalar functors'
// bits in every variant: with the params copy, with the grads cleared and
// their squares summed in the same pass; that its sums of squares follow
// kernels/norm.h's order; and that the host's reduction over ranks computes
// kernels/reduce.h's bits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "base/reduce.h"
#include "device/cpu/cpu_device.h"
#include "kernels/cast.h"
#include "kernels/norm.h"
#include "kernels/reduce.h"
#include "kernels/step.h"

using namespace fsdp::kernels;

// ---- the CPU device's optimizer passes ------------------------------------

namespace {

using fsdp::DType;
using fsdp::device::AdamArgs;
using fsdp::device::CpuDevice;
using fsdp::device::SgdArgs;

// One optimizer's arrays; `out` holds the params copy in `out_dtype` (as raw
// 16- or 32-bit words) when `with_out` is set.
struct PassState {
  std::vector<float> p, g, m, v;
  std::vector<uint32_t> out32;
  std::vector<uint16_t> out16;
};

PassState make_state(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> sym(-1.f, 1.f), pos(0.f, 1e-2f);
  PassState s;
  for (size_t i = 0; i < n; ++i) {
    s.p.push_back(sym(rng));
    s.g.push_back(i % 7 == 3 ? 0.f : sym(rng) * 3.f);  // some grads exactly zero
    s.m.push_back(sym(rng) * 1e-2f);
    s.v.push_back(pos(rng));
  }
  s.out32.assign(n, 0xdeadbeefu);
  s.out16.assign(n, 0xbeefu);
  return s;
}

// Optimizer configurations covering every loop instance: AdamW and Adam (L2),
// SGD without and with (Nesterov) momentum, the first step included.
enum class Opt { kAdamW, kAdam, kSgd, kSgdMomentum, kSgdNesterovFirst };
const Opt kOpts[] = {Opt::kAdamW, Opt::kAdam, Opt::kSgd, Opt::kSgdMomentum, Opt::kSgdNesterovFirst};
const char* opt_name(Opt o) {
  const char* names[] = {"adamw", "adam", "sgd", "sgd_momentum", "sgd_nesterov_first"};
  return names[static_cast<int>(o)];
}
bool is_adam(Opt o) { return o == Opt::kAdamW || o == Opt::kAdam; }
bool has_momentum(Opt o) { return o == Opt::kSgdMomentum || o == Opt::kSgdNesterovFirst; }

fsdp::kernels::AdamOp adam_op(Opt o) {
  return fsdp::kernels::AdamOp::make(1e-3f, 0.9f, 0.999f, 1e-8f, 0.1f, o == Opt::kAdamW, 3, 0.75f);
}
fsdp::kernels::SgdOp sgd_op(Opt o) {
  bool first = o == Opt::kSgdNesterovFirst;
  return fsdp::kernels::SgdOp{0.05f, 0.01f, has_momentum(o) ? 0.9f : 0.f, 0.75f, first, first};
}

// Where the params copy goes: none, fp32 or bf16.
enum class OutKind { kNone, kFp32, kBf16 };

void* out_ptr(PassState& s, OutKind k) {
  return k == OutKind::kNone ? nullptr : k == OutKind::kFp32 ? static_cast<void*>(s.out32.data()) : s.out16.data();
}
DType out_dtype(OutKind k) { return k == OutKind::kBf16 ? DType::kBf16 : DType::kFp32; }

// The scalar reference: one functor call per element, in order.
void reference_pass(Opt o, PassState& s, OutKind k) {
  for (size_t i = 0; i < s.p.size(); ++i) {
    if (is_adam(o)) {
      adam_op(o)(s.p[i], s.g[i], s.m[i], s.v[i]);
    } else if (has_momentum(o)) {
      sgd_op(o)(s.p[i], s.g[i], s.m[i]);
    } else {
      sgd_op(o)(s.p[i], s.g[i]);
    }
    if (k == OutKind::kFp32) s.out32[i] = f32_bits(s.p[i]);
    if (k == OutKind::kBf16) s.out16[i] = f32_to_bf16_bits(s.p[i]);
  }
}

void device_pass(CpuDevice& dev, Opt o, PassState& s, OutKind k, bool zero_grads, double* grad_sq) {
  size_t n = s.p.size();
  if (is_adam(o)) {
    dev.adam(AdamArgs{adam_op(o), s.p.data(), s.g.data(), s.m.data(), s.v.data(), out_ptr(s, k), out_dtype(k), n,
                      zero_grads, grad_sq});
  } else {
    float* buf = has_momentum(o) ? s.m.data() : nullptr;
    dev.sgd(SgdArgs{sgd_op(o), s.p.data(), s.g.data(), buf, out_ptr(s, k), out_dtype(k), n, zero_grads, grad_sq});
  }
}

// Index of the first element whose bits differ, or -1.
template <typename T>
long first_difference(const std::vector<T>& a, const std::vector<T>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return static_cast<long>(i);
  }
  return a.size() == b.size() ? -1 : static_cast<long>(a.size());
}

// Params, moments and the params copy have the same bits in both states.
void expect_same_update(const PassState& want, const PassState& got) {
  EXPECT_EQ(first_difference(want.p, got.p), -1) << "params";
  EXPECT_EQ(first_difference(want.m, got.m), -1) << "exp_avg / momentum";
  EXPECT_EQ(first_difference(want.v, got.v), -1) << "exp_avg_sq";
  EXPECT_EQ(first_difference(want.out32, got.out32), -1) << "fp32 copy";
  EXPECT_EQ(first_difference(want.out16, got.out16), -1) << "bf16 copy";
}

// Sizes below a vector, over several steps (256) and grains (1024), two
// chunks at two threads, and none a multiple of any vector width; one and two
// threads. (A 65541-element case found nothing more and took a minute under
// ThreadSanitizer.)
const size_t kSizes[] = {13, 3 * 1024 + 37, 8 * 1024 + 37};
const int kThreads[] = {1, 2};
const OutKind kOuts[] = {OutKind::kNone, OutKind::kFp32, OutKind::kBf16};

std::string trace(Opt o, OutKind k, size_t n, int threads) {
  return std::string(opt_name(o)) + " out=" + std::to_string(static_cast<int>(k)) + " n=" + std::to_string(n) +
         " threads=" + std::to_string(threads);
}

}  // namespace

// fn(dev, opt, out kind, n) for every optimizer, output, size and thread
// count the pass tests cover, with a trace naming the case.
template <typename Fn>
void each_pass_case(Fn&& fn) {
  for (int threads : kThreads) {
    CpuDevice dev(threads, fsdp::device::Pool::kDevice);
    for (Opt o : kOpts) {
      for (OutKind k : kOuts) {
        for (size_t n : kSizes) {
          SCOPED_TRACE(trace(o, k, n, threads));
          fn(dev, o, k, n);
        }
      }
    }
  }
}

TEST(CpuOptimizerPass, MatchesTheScalarFunctorsBitwise) {
  each_pass_case([](CpuDevice& dev, Opt o, OutKind k, size_t n) {
    PassState want = make_state(n, 1), got = make_state(n, 1);
    reference_pass(o, want, k);
    device_pass(dev, o, got, k, false, nullptr);
    expect_same_update(want, got);
    EXPECT_EQ(first_difference(make_state(n, 1).g, got.g), -1) << "grads must stay as they were";
  });
}

TEST(CpuOptimizerPass, ZeroGradsClearsGradsAndUpdatesLikeTheUnfusedPass) {
  each_pass_case([](CpuDevice& dev, Opt o, OutKind k, size_t n) {
    PassState want = make_state(n, 2), got = make_state(n, 2);
    device_pass(dev, o, want, k, false, nullptr);
    device_pass(dev, o, got, k, true, nullptr);
    expect_same_update(want, got);
    EXPECT_EQ(first_difference(std::vector<float>(n, 0.f), got.g), -1) << "grads must read +0";
  });
}

TEST(CpuOptimizerPass, GradSqIsSumSquaresOfTheRawGradsBitwise) {
  each_pass_case([](CpuDevice& dev, Opt o, OutKind k, size_t n) {
    for (bool zero_grads : {false, true}) {
      SCOPED_TRACE("zero_grads=" + std::to_string(zero_grads));
      PassState want = make_state(n, 3), got = make_state(n, 3);
      double expected = dev.sum_squares(want.g.data(), n);
      device_pass(dev, o, want, k, false, nullptr);
      double sq = -1.0;
      device_pass(dev, o, got, k, zero_grads, &sq);
      EXPECT_EQ(sq, expected);  // the same bits: grad_sq can stand in for sum_squares
      expect_same_update(want, got);
      if (!zero_grads) {
        EXPECT_EQ(first_difference(make_state(n, 3).g, got.g), -1);
      }
    }
  });
}

TEST(CpuSumSquares, IsReproducibleAndCloseToTheExactSum) {
  for (int threads : kThreads) {
    CpuDevice dev(threads, fsdp::device::Pool::kDevice);
    for (size_t n : kSizes) {
      std::vector<float> g = make_state(n, 4).g;
      double exact = 0.0;
      for (float x : g) exact += static_cast<double>(x) * x;
      double s = dev.sum_squares(g.data(), n);
      EXPECT_NEAR(s, exact, 1e-6 * exact) << "n=" << n;
      EXPECT_EQ(dev.sum_squares(g.data(), n), s) << "n=" << n;
    }
    double sq = -1.0;
    dev.adam(AdamArgs{adam_op(Opt::kAdamW), nullptr, nullptr, nullptr, nullptr, nullptr, DType::kFp32, 0, true, &sq});
    EXPECT_EQ(sq, 0.0) << "an empty pass still writes its sum of squares";
    EXPECT_EQ(dev.sum_squares(nullptr, 0), 0.0);
  }
}

// kernels/norm.h fixes the order of a step's sum (16 lanes, folded pairwise),
// which the CUDA kernel follows too: the CPU's vectorised loop must give the
// scalar reference's bits for every length a step can have.
TEST(CpuSumSquares, FollowsTheOrderOfKernelsNorm) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> wide(-1e3f, 1e3f);
  std::vector<float> x(fsdp::kernels::kSqStep);
  for (float& v : x) v = wide(rng);
  for (int threads : kThreads) {
    CpuDevice dev(threads, fsdp::device::Pool::kDevice);
    for (size_t n = 1; n <= x.size(); ++n) {
      double want = fsdp::kernels::step_sum_squares(x.data(), 0, n);
      ASSERT_EQ(dev.sum_squares(x.data(), n), want) << "n=" << n << " threads=" << threads;
    }
  }
}

TEST(CpuAccumulate, SumOfSquaresOfTheResultIsSumSquaresBitwise) {
  // The reduction's accumulation into a grad shard also measures it (the
  // step's grad norm): the same bits as a sum_squares pass after it.
  for (int threads : kThreads) {
    CpuDevice dev(threads, fsdp::device::Pool::kDevice);
    for (size_t n : kSizes) {
      for (DType src_dtype : {DType::kFp32, DType::kBf16}) {
        SCOPED_TRACE("n=" + std::to_string(n) + " threads=" + std::to_string(threads) +
                     " src=" + fsdp::dtype_name(src_dtype));
        std::vector<float> base = make_state(n, 5).g, src32 = make_state(n, 6).g;
        std::vector<uint16_t> src16(n);
        for (size_t i = 0; i < n; ++i) src16[i] = f32_to_bf16_bits(src32[i]);
        const void* src = src_dtype == DType::kFp32 ? static_cast<const void*>(src32.data()) : src16.data();
        std::vector<float> want = base, got = base;
        dev.accumulate(want.data(), src, src_dtype, 0.5f, n, nullptr);
        double sq = -1.0;
        dev.accumulate(got.data(), src, src_dtype, 0.5f, n, &sq);
        EXPECT_EQ(first_difference(want, got), -1);
        EXPECT_EQ(sq, dev.sum_squares(want.data(), n));
      }
    }
  }
}

// The grads' source in each storage dtype, as raw words, and a pointer to it.
struct Source {
  DType dtype;
  std::vector<float> f32;
  std::vector<uint16_t> u16;
  void* data() { return dtype == DType::kFp32 ? static_cast<void*>(f32.data()) : u16.data(); }
  bool all_zero() const {
    return dtype == DType::kFp32 ? std::all_of(f32.begin(), f32.end(), [](float x) { return f32_bits(x) == 0u; })
                                 : std::all_of(u16.begin(), u16.end(), [](uint16_t x) { return x == 0u; });
  }
};

Source make_source(DType dtype, size_t n, unsigned seed) {
  Source s{dtype, make_state(n, seed).g, {}};
  if (dtype != DType::kFp32) {
    for (float x : s.f32) s.u16.push_back(dtype == DType::kBf16 ? f32_to_bf16_bits(x) : f32_to_fp16_bits(x));
    s.f32.clear();
  }
  return s;
}

float load_source(const Source& s, size_t i) {
  if (s.dtype == DType::kFp32) return s.f32[i];
  return s.dtype == DType::kBf16 ? bf16_bits_to_f32(s.u16[i]) : fp16_bits_to_f32(s.u16[i]);
}

TEST(CpuClearingPasses, AccumulateClearAddsLikeTheScalarFunctorAndLeavesZeros) {
  // The reduction's last pass over NO_SHARD grads clears them as it reads them.
  for (int threads : kThreads) {
    CpuDevice dev(threads, fsdp::device::Pool::kDevice);
    for (size_t n : kSizes) {
      for (DType src_dtype : {DType::kFp32, DType::kBf16, DType::kFp16}) {
        for (bool with_sq : {false, true}) {
          SCOPED_TRACE("n=" + std::to_string(n) + " threads=" + std::to_string(threads) +
                       " src=" + fsdp::dtype_name(src_dtype) + " sq=" + std::to_string(with_sq));
          Source src = make_source(src_dtype, n, 7);
          std::vector<float> want = make_state(n, 8).g, got = want;
          std::vector<float> loaded(n);
          for (size_t i = 0; i < n; ++i) loaded[i] = load_source(src, i);
          for (size_t i = 0; i < n; ++i) AccumulateOp{0.5f}(want.data(), loaded.data(), i);
          double sq = -1.0;
          dev.accumulate_clear(got.data(), src.data(), src_dtype, 0.5f, n, with_sq ? &sq : nullptr);
          EXPECT_EQ(first_difference(want, got), -1);
          EXPECT_TRUE(src.all_zero()) << "the source reads as zeros after the pass";
          if (with_sq) {
            EXPECT_EQ(sq, dev.sum_squares(want.data(), n));
          }
        }
      }
    }
  }
}

TEST(CpuClearingPasses, CastClearConvertsLikeCastAndLeavesZeros) {
  // The cast of the grads to reduce_dtype clears them as it reads them; the
  // same dtype on both sides is a copy that clears.
  const std::pair<DType, DType> kPairs[] = {{DType::kFp32, DType::kBf16}, {DType::kFp32, DType::kFp16},
                                            {DType::kBf16, DType::kFp32}, {DType::kFp16, DType::kFp32},
                                            {DType::kFp32, DType::kFp32}, {DType::kBf16, DType::kBf16}};
  for (int threads : kThreads) {
    CpuDevice dev(threads, fsdp::device::Pool::kDevice);
    for (size_t n : kSizes) {
      for (auto [from, to] : kPairs) {
        SCOPED_TRACE("n=" + std::to_string(n) + " threads=" + std::to_string(threads) + " " + fsdp::dtype_name(from) +
                     "->" + fsdp::dtype_name(to));
        Source src = make_source(from, n, 9);
        Source want = make_source(to, n, 10), got = want;
        for (size_t i = 0; i < n; ++i) {
          float x = load_source(src, i);
          if (to == DType::kFp32) want.f32[i] = x;
          if (to == DType::kBf16) want.u16[i] = f32_to_bf16_bits(x);
          if (to == DType::kFp16) want.u16[i] = f32_to_fp16_bits(x);
        }
        dev.cast_clear(got.data(), to, src.data(), from, n);
        EXPECT_EQ(first_difference(want.f32, got.f32), -1);
        EXPECT_EQ(first_difference(want.u16, got.u16), -1);
        EXPECT_TRUE(src.all_zero()) << "the source reads as zeros after the pass";
      }
    }
  }
}

// The reduction over ranks: the host's block loops (what the CPU
// communicators run, and the CPU device's reduce_sum over threads) compute
// kernels/reduce.h's scalar functor bit for bit, which the CUDA reduce kernel
// runs too; the clearing variant leaves every input zero.
TEST(CpuReduceSum, MatchesTheRankOrderFunctorBitwiseAndClearsItsInputs) {
  for (int threads : kThreads) {
    CpuDevice dev(threads, fsdp::device::Pool::kDevice);
    for (size_t n : kSizes) {
      for (size_t n_ins : {1, 2, 3, 5}) {
        for (DType dtype : {DType::kFp32, DType::kBf16, DType::kFp16}) {
          for (bool through_device : {false, true}) {
            for (bool clear : {false, true}) {
              SCOPED_TRACE("n=" + std::to_string(n) + " inputs=" + std::to_string(n_ins) + " " +
                           fsdp::dtype_name(dtype) + (through_device ? " CpuDevice" : " base") +
                           (clear ? " clear" : "") + " threads=" + std::to_string(threads));
              std::vector<Source> ins;
              std::vector<void*> ptrs;
              for (size_t k = 0; k < n_ins; ++k) ins.push_back(make_source(dtype, n, 20 + unsigned(k)));
              for (Source& s : ins) ptrs.push_back(s.data());
              Source want = make_source(dtype, n, 40), got = want;
              const ReduceSumOp op{0.125f};
              for (size_t i = 0; i < n; ++i) {
                if (dtype == DType::kFp32) {
                  op(want.f32.data(), reinterpret_cast<float* const*>(ptrs.data()), n_ins, i);
                } else if (dtype == DType::kBf16) {
                  op(reinterpret_cast<bf16_t*>(want.u16.data()), reinterpret_cast<bf16_t* const*>(ptrs.data()), n_ins,
                     i);
                } else {
                  op(reinterpret_cast<fp16_t*>(want.u16.data()), reinterpret_cast<fp16_t* const*>(ptrs.data()), n_ins,
                     i);
                }
              }
              if (through_device) {
                dev.reduce_sum(got.data(), ptrs.data(), n_ins, n, dtype, 0.125f, clear);
              } else if (clear) {
                fsdp::base::reduce_sum_clear(got.data(), ptrs.data(), n_ins, n, dtype, 0.125f);
              } else {
                fsdp::base::reduce_sum(got.data(), const_cast<const void* const*>(ptrs.data()), n_ins, n, dtype,
                                       0.125f);
              }
              EXPECT_EQ(first_difference(want.f32, got.f32), -1);
              EXPECT_EQ(first_difference(want.u16, got.u16), -1);
              for (size_t k = 0; k < n_ins; ++k) {
                EXPECT_EQ(ins[k].all_zero(), clear) << "input " << k;
              }
            }
          }
        }
      }
    }
  }
}

// The CPU device's multi-tensor passes (what the optimizer runs every step)
// update each span as adam / sgd does with the op of the span's param group
// for the step in the StepState (its lr scale, betas and age) and the span's
// own weight decay, and leave the gaps between spans (a layout's padding)
// untouched; a skipped step only clears the grads.
TEST(CpuOptimizerPass, MultiTensorPassesUpdateEachSpanWithItsGroupsOpAndItsOwnWeightDecay) {
  CpuDevice dev(2, fsdp::device::Pool::kDevice);
  const std::vector<size_t> sizes = {13, 1024, 1, 3000};
  const std::vector<float> wds = {0.1f, 0.0f, 0.5f, 0.0f};
  // Group 1 started two steps later: its Adam bias correction and SGD's
  // first-step momentum count from there.
  const std::vector<fsdp::kernels::StepGroup> groups = {{0, 1.0f, 0.9f, 0.999f}, {2, 0.5f, 0.8f, 0.99f}};
  fsdp::kernels::StepRule rule{};
  rule.eps = 1e-8f;
  rule.momentum = 0.9f;
  rule.decoupled = 1;
  for (bool sgd : {false, true}) {
    for (bool skip : {false, true}) {
      SCOPED_TRACE(std::string(sgd ? "sgd" : "adamw") + (skip ? ", skipped" : ""));
      fsdp::kernels::StepState st{};
      st.lr = sgd ? 0.05 : 1e-3;
      st.t = 3;
      st.grad_scale = 0.5f;
      st.skip = skip ? 1 : 0;
      size_t total = 0;
      for (size_t n : sizes) total += n + 8;
      PassState all = make_state(total, 31), want = all;
      std::vector<fsdp::device::ShardSpan> spans;
      size_t at = 0;
      for (size_t k = 0; k < sizes.size(); ++k) {
        const uint32_t gi = static_cast<uint32_t>(k % 2);
        const fsdp::kernels::StepGroup& g = groups[gi];
        spans.push_back({all.p.data() + at, all.g.data() + at, all.m.data() + at, sgd ? nullptr : all.v.data() + at,
                         nullptr, sizes[k], wds[k], gi});
        // The reference: the scalar functor, span by span, with the group's
        // lr (scaled in double, rounded once), betas and step, and the span's
        // weight decay.
        const float lr = g.lr_scale == 1.0f ? float(st.lr) : float(st.lr * g.lr_scale);
        const long t = st.t - g.fresh_at;
        for (size_t i = at; i < at + sizes[k]; ++i) {
          if (skip) {
          } else if (sgd) {
            SgdOp{lr, wds[k], 0.9f, 0.5f, false, t == 1}(want.p[i], want.g[i], want.m[i]);
          } else {
            AdamOp::make(lr, g.beta1, g.beta2, 1e-8f, wds[k], true, t, 0.5f)(want.p[i], want.g[i], want.m[i],
                                                                             want.v[i]);
          }
          want.g[i] = 0.0f;
        }
        at += sizes[k] + 8;
      }
      auto table = dev.make_span_table(spans, groups);
      if (sgd) {
        dev.sgd_spans(*table, rule, &st, DType::kFp32, true);
      } else {
        dev.adam_spans(*table, rule, &st, DType::kFp32, true);
      }
      EXPECT_EQ(first_difference(want.p, all.p), -1);
      EXPECT_EQ(first_difference(want.g, all.g), -1);
      EXPECT_EQ(first_difference(want.m, all.m), -1);
      if (!sgd) {
        EXPECT_EQ(first_difference(want.v, all.v), -1);
      }
    }
  }
}

// The multi-tensor sum of squares gives each array sum_squares' bits, and
// the rank-order sum of doubles adds in rank order.
TEST(CpuSumSquares, ATableGivesEachSpanSumSquaresBitwise) {
  CpuDevice dev(2, fsdp::device::Pool::kDevice);
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  const std::vector<size_t> sizes = {1, 255, 256, 70000, 0, 1000};
  std::vector<std::vector<float>> xs;
  for (size_t n : sizes) {
    xs.emplace_back(n);
    for (float& v : xs.back()) v = dist(rng);
  }
  std::vector<double> out(sizes.size(), -1.0);
  std::vector<fsdp::device::SquaresSpan> spans;
  for (size_t k = 0; k < sizes.size(); ++k) spans.push_back({xs[k].data(), sizes[k], &out[k]});
  auto table = dev.make_squares_table(spans);
  dev.sum_squares_table(*table);
  for (size_t k = 0; k < sizes.size(); ++k) EXPECT_EQ(out[k], dev.sum_squares(xs[k].data(), sizes[k])) << "span " << k;
  // 1e16 + 1 rounds back to 1e16 (ties to even); 1 + 1 first would keep 2.
  const double a[2] = {1e16, 1.0}, b[2] = {1.0, 2.0}, c[2] = {1.0, 3.0};
  const double* ins[3] = {a, b, c};
  double sum[2];
  dev.reduce_sum_f64(sum, ins, 3, 2);
  EXPECT_EQ(sum[0], 1e16) << "not in rank order (1 + 1 first gives 1e16 + 2)";
  EXPECT_EQ(sum[1], 6.0);
}
