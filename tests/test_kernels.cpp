// Proves the kernels/ conversions round to nearest even exactly, comparing with
// an independent reference (exact rational rounding done in double), that
// Adam's bias corrections match glibc's in fp32, and that the step's decision
// (skip, clip, loss scale) follows GradScaler and clip_grad_norm_.
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

namespace {

// Reference: round `x` to a binary float with `mant_bits` explicit mantissa
// bits, minimum normal exponent `emin` and max finite `max`, ties to even, via
// double arithmetic (exact for fp32 inputs).
double ref_round(double x, int mant_bits, int emin, double max) {
  if (std::isnan(x) || std::isinf(x)) return x;
  double a = std::fabs(x);
  if (a == 0) return x;
  int e = std::max(static_cast<int>(std::floor(std::log2(a))), emin);
  double ulp = std::ldexp(1.0, e - mant_bits);
  double q = a / ulp;
  double fl = std::floor(q);
  double r = q - fl;
  double n = r > 0.5 ? fl + 1 : (r < 0.5 ? fl : (std::fmod(fl, 2.0) == 0 ? fl : fl + 1));
  double v = n * ulp;
  double limit = max + std::ldexp(1.0, static_cast<int>(std::floor(std::log2(max))) - mant_bits) / 2;
  if (v > max || a >= limit) v = std::numeric_limits<double>::infinity();
  return std::copysign(v, x);
}

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

TEST(Cast, Fp16RoundsToNearestEvenOverAllExponents) {
  // Every fp32 exponent that matters for fp16, with mantissas that hit ties,
  // just-below and just-above ties, and random bits.
  uint32_t lcg = 12345;
  for (uint32_t exp = 90; exp < 160; ++exp) {
    for (int k = 0; k < 400; ++k) {
      lcg = lcg * 1664525u + 1013904223u;
      uint32_t mant = k < 8 ? (0x1000u * static_cast<uint32_t>(k)) | (k & 1 ? 0xfffu : 0u) : (lcg & 0x7fffffu);
      for (uint32_t sign : {0u, 0x80000000u}) {
        float x = from_bits(sign | (exp << 23) | mant);
        double want = ref_round(x, 10, -14, 65504.0);
        float got = fp16_bits_to_f32(f32_to_fp16_bits(x));
        ASSERT_EQ(static_cast<double>(got), want) << "x=" << x;
      }
    }
  }
}

TEST(Cast, Bf16RoundsToNearestEven) {
  uint32_t lcg = 777;
  for (uint32_t exp = 1; exp < 255; exp += 3) {
    for (int k = 0; k < 200; ++k) {
      lcg = lcg * 1664525u + 1013904223u;
      uint32_t mant = k < 4 ? 0x8000u * static_cast<uint32_t>(k) : (lcg & 0x7fffffu);
      float x = from_bits((exp << 23) | mant);
      double want = ref_round(x, 7, -126, 3.3895313892515355e38);
      ASSERT_EQ(static_cast<double>(bf16_bits_to_f32(f32_to_bf16_bits(x))), want) << "x=" << x;
    }
  }
}

TEST(Cast, SpecialValuesSurvive) {
  float nan = std::numeric_limits<float>::quiet_NaN();
  float inf = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isnan(bf16_bits_to_f32(f32_to_bf16_bits(nan))));
  EXPECT_TRUE(std::isnan(fp16_bits_to_f32(f32_to_fp16_bits(nan))));
  EXPECT_TRUE(std::isnan(bf16_bits_to_f32(f32_to_bf16_bits(from_bits(0x7f800001u)))))
      << "a signalling NaN whose payload is in the low bits must not become inf";
  EXPECT_EQ(fp16_bits_to_f32(f32_to_fp16_bits(inf)), inf);
  EXPECT_EQ(fp16_bits_to_f32(f32_to_fp16_bits(-inf)), -inf);
  EXPECT_EQ(fp16_bits_to_f32(f32_to_fp16_bits(65519.0f)), 65504.0f);
  EXPECT_EQ(fp16_bits_to_f32(f32_to_fp16_bits(65520.0f)), inf);
  EXPECT_EQ(f32_to_fp16_bits(-0.0f), 0x8000u);
  // Every fp16 bit pattern converts to fp32 and back unchanged (NaNs stay NaN).
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    float f = fp16_bits_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_fp16_bits(f), h) << std::hex << h;
  }
}

// Adam's bias corrections come from bias_pow (squaring in double) on every
// device. Against glibc's pow, the fp32 values the update uses (lr / bc1 and
// 1 / sqrt(bc2)) are the same for the betas training uses, at every step up
// to 2e5 and for lrs across six decades; the doubles themselves may differ
// in their last bits, which is why a GPU's pow is not used at all.
TEST(BiasPow, GivesGlibcsFp32BiasCorrections) {
  for (double beta : {0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 0.999}) {
    long mismatches = 0;
    for (long t = 1; t <= 200000; ++t) {
      const double a = 1.0 - std::pow(beta, double(t)), b = 1.0 - bias_pow(beta, t);
      for (float lr : {1e-6f, 3e-5f, 1e-4f, 6e-4f, 3e-3f, 0.1f}) mismatches += float(lr / a) != float(lr / b);
      mismatches += float(1.0 / std::sqrt(a)) != float(1.0 / std::sqrt(b));
    }
    EXPECT_EQ(mismatches, 0) << "beta " << beta;
  }
  EXPECT_EQ(bias_pow(0.9, 0), 1.0);
  EXPECT_EQ(bias_pow(0.5, 10), 1.0 / 1024);  // exact in binary
}

namespace {

StepRule rule_with(double max_grad_norm, bool dynamic, long interval = 3) {
  StepRule r{};
  r.max_grad_norm = max_grad_norm;
  r.dynamic = dynamic ? 1 : 0;
  r.growth = 2.0;
  r.backoff = 0.5;
  r.growth_interval = interval;
  r.count = 1;
  return r;
}

}  // namespace

// The step's verdict on the device follows torch's rules: the norm is that
// of the unscaled grads; inf/nan skips the step (not counted, the scale
// halves when dynamic); growth_interval clean steps double a dynamic scale;
// clipping multiplies the unscale by max_norm / (norm + 1e-6) when below 1.
TEST(StepDecide, FollowsGradScalerAndClipGradNormRules) {
  StepState s{};
  s.loss_scale = 8.0;
  const double unit_sq[3] = {64.0 * 9, 0.0, 64.0 * 16};  // grads scaled by 8: unscaled norm sqrt(9 + 16) = 5
  step_sum_units(s, unit_sq, 3);
  EXPECT_EQ(s.sq, 64.0 * 25);
  EXPECT_EQ(s.sq_rank, s.sq);
  step_decide(s, rule_with(0.0, true));
  EXPECT_EQ(s.norm, 5.0);
  EXPECT_EQ(s.skip, 0);
  EXPECT_EQ(s.t, 1);
  EXPECT_EQ(s.grad_scale, 0.125f) << "no clipping: the unscale alone";
  EXPECT_EQ(s.loss_scale, 8.0) << "one clean step of three";
  // Clipping to 2.5: coef = 2.5 / (5 + 1e-6), folded into the unscale.
  StepState c = s;
  c.t = 0;
  step_decide(c, rule_with(2.5, false));
  EXPECT_EQ(c.grad_scale, float((2.5 / (5.0 + 1e-6)) / 8.0));
  // A norm under the limit: no clipping.
  c = s;
  step_decide(c, rule_with(10.0, false));
  EXPECT_EQ(c.grad_scale, 0.125f);
  // Two more clean steps: the third grows the dynamic scale and restarts the count.
  step_decide(s, rule_with(0.0, true));
  EXPECT_EQ(s.loss_scale, 8.0);
  step_decide(s, rule_with(0.0, true));
  EXPECT_EQ(s.loss_scale, 16.0);
  EXPECT_EQ(s.clean, 0);
  EXPECT_EQ(s.t, 3);
  // inf anywhere: skipped, not counted, the scale backs off (not when static).
  for (double bad : {std::numeric_limits<double>::infinity(), std::nan("")}) {
    StepState d = s;
    d.clean = 2;
    const double sq[2] = {1.0, bad};
    step_sum_units(d, sq, 2);
    step_decide(d, rule_with(1.0, true));
    EXPECT_EQ(d.skip, 1);
    EXPECT_EQ(d.t, 3);
    EXPECT_EQ(d.skipped, 1);
    EXPECT_EQ(d.clean, 0);
    EXPECT_EQ(d.loss_scale, 8.0);
    EXPECT_TRUE(std::isnan(d.norm) || std::isinf(d.norm));
    StepState e = s;
    step_sum_units(e, sq, 2);
    step_decide(e, rule_with(0.0, false));
    EXPECT_EQ(e.loss_scale, 16.0) << "a static scale does not back off";
  }
  // optimizer=host: the verdict without the count.
  StepState h = s;
  StepRule no_count = rule_with(0.0, false);
  no_count.count = 0;
  step_decide(h, no_count);
  EXPECT_EQ(h.t, s.t);
}
