// kernels/quant.h - block-wise quantization of params to 8 bits, for the
// quantized all-gather (gather_dtype = int8 | fp8_e4m3, issue 37): a rank's
// slice of n values is cut into blocks of `block` values (the last one
// shorter); each block gets one fp32 scale, absmax / qmax, and each value
// the 8-bit code of value / scale (round to nearest, ties to even). The
// gathered side multiplies each code by its block's scale in fp32 and rounds
// once to param_dtype. CPU loops and CUDA kernels run these functions, so a
// quantization gives the same bits on every device (tests/test_quant.cpp).
//
// Rules at the edges, which the tests check and docs/configuration.md states:
// - A block whose values are all zero (or so small that absmax / qmax is 0 in
//   fp32, below 1.8e-43) has scale 0 and dequantizes to zeros.
// - A block holding a NaN or an infinity has a NaN scale: every value of it
//   dequantizes to NaN (propagated, loudly: the loss turns NaN), never to a
//   finite number that would train differently in silence.
// - int8 codes are -127..127 (the symmetric range; -128 is never made);
//   fp8 is OCP FP8 E4M3FN (bias 7, no infinities, max 448, 0x7f/0xff NaN),
//   saturating at +-448.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "cast.h"
#include "common.h"

namespace fsdp::kernels {

enum class QType : uint8_t { kInt8 = 0, kFp8E4m3 = 1 };

constexpr float kInt8Max = 127.0f;
constexpr float kE4m3Max = 448.0f;

FSDP_HD float qmax(QType t) { return t == QType::kInt8 ? kInt8Max : kE4m3Max; }

// fp32 -> E4M3FN bits, round to nearest even, +-448 for anything beyond
// (infinities included), NaN kept (0x7f with the sign). The magnitude is
// rounded in float arithmetic, all of it exact but the one rintf: scaled by
// a power of two so that its E4M3 quantum (2^(e-3) for a normal exponent e,
// 2^-9 below 2^-6) is 1, rounded to an integer (ties to even), scaled back;
// the rounded value's bits then are the code's. Only selects, no branches:
// CPU loops over it vectorise.
FSDP_HD uint8_t f32_to_e4m3_bits(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a_bits = u & 0x7fffffffu;
  const bool nan = a_bits > 0x7f800000u;
  const float a = f32_from_bits(a_bits >= 0x43e00000u ? 0x43e00000u : a_bits);  // saturate at 448 (and inf)
  const uint32_t exp = a_bits >= 0x43e00000u ? 135u : a_bits >> 23;             // biased; 448's is 135
  const uint32_t q = (exp < 121u ? 121u : exp) - 3u;  // the quantum's biased exponent: 118 (2^-9) .. 132
  const float r = rintf(a * f32_from_bits((254u - q) << 23)) * f32_from_bits(q << 23);
  const uint32_t rb = f32_bits(r);
  const uint32_t re = rb >> 23;
  const uint32_t normal = ((re - 120u) << 3) | ((rb >> 20) & 7u);
  const uint32_t sub = static_cast<uint32_t>(r * 512.0f);  // 0..8 units of 2^-9 (8: the smallest normal, 0x08)
  const uint32_t v = nan ? 0x7fu : (re >= 121u ? normal : sub);
  return static_cast<uint8_t>(sign | v);
}

// Branch-free (selects), so that CPU loops over it vectorise.
FSDP_HD float e4m3_bits_to_f32(uint8_t b) {
  const uint32_t sign = (static_cast<uint32_t>(b) & 0x80u) << 24;
  const uint32_t e = (b >> 3) & 0xfu;
  const uint32_t m = b & 0x7u;
  const uint32_t normal = sign | ((e + 120u) << 23) | (m << 20);
  const uint32_t sub = sign | f32_bits(static_cast<float>(m) * 0.001953125f);  // m * 2^-9, exact
  const uint32_t bits = e == 0 ? sub : normal;
  const bool nan = (static_cast<uint32_t>(e == 0xfu) & static_cast<uint32_t>(m == 0x7u)) != 0u;  // 0x7f / 0xff
  return f32_from_bits(nan ? (sign | 0x7fc00000u) : bits);
}

// The scale of the block x[b, e) of any storage type: absmax / qmax in fp32;
// NaN when the block holds a NaN or an infinity. The largest magnitude is the
// largest of the values' bits without their sign (an order that holds for
// every non-negative float), which also tells a non-finite value (at least
// 0x7f800000) apart.
template <typename T>
FSDP_HD float block_scale(const T* x, size_t b, size_t e, QType t) {
  uint32_t most = 0;
  for (size_t i = b; i < e; ++i) {
    const uint32_t a = f32_bits(load(x, i)) & 0x7fffffffu;
    most = a > most ? a : most;
  }
  return most < 0x7f800000u ? f32_from_bits(most) / qmax(t) : f32_from_bits(0x7fc00000u);
}

// The int8 code of a value already divided by its scale: -127..127.
FSDP_HD uint8_t int8_code(float v) {
  float r = rintf(v);
  r = r > kInt8Max ? kInt8Max : (r < -kInt8Max ? -kInt8Max : r);
  return static_cast<uint8_t>(static_cast<int8_t>(r));
}

// One value's code with its block's scale (0 where the scale is 0 or NaN:
// the NaN scale alone carries the block's NaN through dequantize).
FSDP_HD uint8_t quantize(float x, float scale, QType t) {
  if (!(scale > 0.0f)) return 0;
  return t == QType::kFp8E4m3 ? f32_to_e4m3_bits(x / scale) : int8_code(x / scale);
}

// quantize()'s code from a product instead of the division, for loops where
// the division is the cost (the GPU's packs of 16-bit grads: issue-bound).
// q = v * inv with inv = 1 / scale (each one IEEE rounding) is within
// 3.01 * 2^-24 * |q| of v / scale rounded once, so both round to the same
// code unless a rounding boundary of the code grid lies that close to q;
// near_code_boundary() says so with a margin of at least 5, and there the
// division decides:
// - int8: within 2^-13 of a half-integer (q's distance from its nearest
//   integer at least 0.5 - 2^-13; from |q| = 128 on both clamp to +-127);
// - E4M3 from 2^-6 on: within 16 fp32 ulps of a midpoint between two codes
//   (the low 20 bits of q near 0x80000; 3 mantissa bits are the code's);
// - E4M3 below 2^-6 (its subnormal quantum 2^-9): within 2^-16 of a
//   midpoint, in units of the quantum.
// A zero or NaN scale gives 0 codes; an infinite inv (scale below 2^-128)
// the division. The same bits as quantize() (tests/test_quant_reduce.cpp,
// on and around every boundary).
FSDP_HD bool near_code_boundary(float q, QType t) {
  if (t == QType::kInt8) return fabsf(q - rintf(q)) >= 0.5f - 0x1p-13f;
  const uint32_t b = f32_bits(q) & 0x7fffffffu;
  if (b >= 0x3c800000u) return (b & 0xfffffu) - 0x7fff0u <= 32u;  // unsigned wrap: 0x7fff0..0x80010
  const float s = f32_from_bits(b) * 512.0f;                      // exact
  return fabsf(s - rintf(s)) >= 0.5f - 0x1p-16f;
}

FSDP_HD uint8_t quantize_by_reciprocal(float x, float scale, float inv, QType t) {
  if (!(scale > 0.0f)) return 0;
  float q = x * inv;
  if (!(inv <= 0x1.fffffep127f) || near_code_boundary(q, t)) q = x / scale;
  return t == QType::kFp8E4m3 ? f32_to_e4m3_bits(q) : int8_code(q);
}

FSDP_HD float dequantize(uint8_t q, float scale, QType t) {
  const float v = t == QType::kInt8 ? static_cast<float>(static_cast<int8_t>(q)) : e4m3_bits_to_f32(q);
  return v * scale;
}

// The blocks of a slice of n values.
FSDP_HD size_t quant_blocks(size_t n, size_t block) { return (n + block - 1) / block; }

// The packed bytes of a slice of n values as the all-gather moves them: the
// n codes, then (from the next multiple of 4 bytes) one fp32 scale per block.
FSDP_HD size_t quant_scales_offset(size_t n) { return (n + 3) / 4 * 4; }
FSDP_HD size_t quant_packed_bytes(size_t n, size_t block) {
  return quant_scales_offset(n) + quant_blocks(n, block) * sizeof(float);
}

// Quantizes the block k of x[0, n) into a packed slice `out` (quantize()
// per value, with the tests of the scale and the type taken out of the
// loops, which then vectorise on the CPU).
template <typename T>
FSDP_HD void quantize_block(const T* x, size_t n, size_t block, size_t k, QType t, uint8_t* out) {
  const size_t b = k * block;
  const size_t e = b + block < n ? b + block : n;
  const float scale = block_scale(x, b, e, t);
  reinterpret_cast<float*>(out + quant_scales_offset(n))[k] = scale;
  if (!(scale > 0.0f)) {
    for (size_t i = b; i < e; ++i) out[i] = 0;
  } else if (t == QType::kInt8) {
    for (size_t i = b; i < e; ++i) out[i] = int8_code(load(x, i) / scale);
  } else {
    for (size_t i = b; i < e; ++i) out[i] = f32_to_e4m3_bits(load(x, i) / scale);
  }
}

// Dequantizes the block k of a packed slice of n values into out[0, n)
// (any storage type: each value rounded once to it).
template <typename T>
FSDP_HD void dequantize_block(const uint8_t* packed, size_t n, size_t block, size_t k, QType t, T* out) {
  const size_t b = k * block;
  const size_t e = b + block < n ? b + block : n;
  const float scale = reinterpret_cast<const float*>(packed + quant_scales_offset(n))[k];
  if (t == QType::kInt8) {
    for (size_t i = b; i < e; ++i) store(out, i, static_cast<float>(static_cast<int8_t>(packed[i])) * scale);
  } else {
    for (size_t i = b; i < e; ++i) store(out, i, e4m3_bits_to_f32(packed[i]) * scale);
  }
}

// The quantized reduction's end (reduce_dtype = int8 | fp8_e4m3): the block
// k of out[0, n) = scale * the sum over the n_slices packed slices (each of n
// values, `slice_stride` bytes apart: quant_packed_bytes(n, block) where laid
// one after another) of their dequantized values, added in fp32
// in slice order as kernels/reduce.h adds ranks (the first two, then each
// next one), scaled once. Each slice is one rank's quantized part of the
// same n grads, so this is a reduce-scatter's sum over dequantized inputs.
FSDP_HD void dequantize_sum_block(const uint8_t* packed, size_t n_slices, size_t slice_stride, size_t n, size_t block,
                                  size_t k, QType t, float scale, float* out) {
  const size_t b = k * block;
  const size_t e = b + block < n ? b + block : n;
  const size_t scales = quant_scales_offset(n);
  for (size_t s = 0; s < n_slices; ++s) {
    const uint8_t* slice = packed + s * slice_stride;
    const float sc = reinterpret_cast<const float*>(slice + scales)[k];
    if (s == 0) {
      for (size_t i = b; i < e; ++i) out[i] = dequantize(slice[i], sc, t);
    } else {
      for (size_t i = b; i < e; ++i) out[i] = out[i] + dequantize(slice[i], sc, t);
    }
  }
  for (size_t i = b; i < e; ++i) out[i] = out[i] * scale;
}

}  // namespace fsdp::kernels
