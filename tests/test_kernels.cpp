// Proves the kernels/ conversions round to nearest even exactly, comparing with
// an independent reference: exact rational rounding done in double.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cast.h"

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
