// tests/quant_ref.h - references for the block quantization of
// kernels/quant.h, written from the formats' definitions (E4M3FN decoded by
// its formula, the nearest code found by search, int8 by nearbyint), shared
// by the quantized gather's and the quantized reduction's tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "../kernels/quant.h"
#include "rank_runner.h"

namespace fsdp_test {

// ---- references from the formats' definitions ----

// E4M3FN: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
// subnormal (m / 8 * 2^-6); 0x7f and 0xff are NaN; no infinities.
inline double e4m3_value(int code) {
  const int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return NAN;
  const double v = e == 0 ? m / 8.0 * std::ldexp(1.0, -6) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
  return s ? -v : v;
}

// The nearest E4M3 code to x (saturating at +-448), ties to the even code.
inline int e4m3_nearest(float x) {
  if (std::isnan(x)) return 0x7f;
  const double a = std::min(std::fabs(double(x)), 448.0);
  int best = 0;
  double best_d = INFINITY;
  for (int c = 0; c < 0x7f; ++c) {  // the finite non-negative codes, in increasing value
    const double d = std::fabs(e4m3_value(c) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) best = c, best_d = d;
  }
  return (std::signbit(x) ? 0x80 : 0) | best;
}

inline float qmax_of(fsdp::kernels::QType t) { return t == fsdp::kernels::QType::kInt8 ? 127.0f : 448.0f; }

// One value's code and its dequantized fp32 value, with the block's scale.
inline float ref_dequantized(float x, float scale, fsdp::kernels::QType t) {
  if (std::isnan(scale)) return NAN;
  if (!(scale > 0.0f)) return 0.0f;
  const float v = x / scale;
  double code;
  if (t == fsdp::kernels::QType::kInt8) {
    // An integer code: a negative value that rounds to 0 is +0 (int8 has no -0).
    code = static_cast<int>(std::min(127.0, std::max(-127.0, std::nearbyint(double(v)))));
  } else {
    code = e4m3_value(e4m3_nearest(v));
  }
  return static_cast<float>(code) * scale;
}

// A slice of n fp32 values quantized in blocks and dequantized, in fp32.
inline std::vector<float> ref_round_trip(const float* x, size_t n, size_t block, fsdp::kernels::QType t) {
  std::vector<float> out(n);
  for (size_t b = 0; b < n; b += block) {
    const size_t e = std::min(n, b + block);
    float amax = 0.0f;
    bool finite = true;
    for (size_t i = b; i < e; ++i) {
      finite = finite && std::isfinite(x[i]);
      amax = std::max(amax, std::fabs(x[i]));
    }
    const float scale = finite ? amax / qmax_of(t) : NAN;
    for (size_t i = b; i < e; ++i) out[i] = ref_dequantized(x[i], scale, t);
  }
  return out;
}

inline bool same_value(float a, float b) { return (std::isnan(a) && std::isnan(b)) || f32_bits(a) == f32_bits(b); }

inline const fsdp::kernels::QType kTypes[] = {fsdp::kernels::QType::kInt8, fsdp::kernels::QType::kFp8E4m3};
inline const char* type_name(fsdp::kernels::QType t) { return t == fsdp::kernels::QType::kInt8 ? "int8" : "fp8_e4m3"; }

}  // namespace fsdp_test
