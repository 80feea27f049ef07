// kernels/cast.h - fp32 <-> bf16 / fp16 conversions with round-to-nearest-even,
// NaN kept quiet, fp16 overflow to infinity and subnormals rounded correctly.
// Branch-light integer code so that CPU loops vectorise and CUDA gets the same
// bits as the CPU.
#pragma once

#include <cstring>

#include "common.h"

namespace fsdp::kernels {

FSDP_HD uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
FSDP_HD float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

FSDP_HD uint16_t f32_to_bf16_bits(float f) {
  uint32_t u = f32_bits(f);
  // NaN: keep sign and make sure a mantissa bit survives truncation.
  uint32_t is_nan = ((u & 0x7fffffffu) > 0x7f800000u);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = (u >> 16) | 0x0040u;
  return static_cast<uint16_t>(is_nan ? nan : rounded);
}
FSDP_HD float bf16_bits_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

FSDP_HD uint16_t f32_to_fp16_bits(float f) {
  uint32_t u = f32_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);                        // rounds to >= 65520: inf
  if (a >= 0x38800000u) {
    // Normal fp16: rebias exponent (127 -> 15) and round the 13 dropped bits.
    uint32_t v = a - 0x38000000u;
    v = (v + 0xfffu + ((v >> 13) & 1u)) >> 13;
    return static_cast<uint16_t>(sign | v);
  }
  if (a < 0x33000000u) return static_cast<uint16_t>(sign);  // below half the smallest subnormal
  // Subnormal fp16: shift the full mantissa right and round to nearest even.
  uint32_t exp = a >> 23;
  uint32_t mant = (a & 0x7fffffu) | 0x800000u;
  uint32_t shift = 126u - exp;  // 14..24
  uint32_t half = 1u << (shift - 1);
  uint32_t rest = mant & ((1u << shift) - 1u);
  uint32_t v = mant >> shift;
  if (rest > half || (rest == half && (v & 1u))) ++v;
  return static_cast<uint16_t>(sign | v);
}

FSDP_HD float fp16_bits_to_f32(uint16_t h) {
  uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return f32_from_bits(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
  // Zero or subnormal: value = mant * 2^-24, exact in fp32.
  float v = static_cast<float>(mant) * 5.9604644775390625e-08f;
  return sign ? -v : v;
}

// Typed load/store so that templated loops read and write any storage dtype.
FSDP_HD float load(const float* p, size_t i) { return p[i]; }
FSDP_HD float load(const bf16_t* p, size_t i) { return bf16_bits_to_f32(p[i].bits); }
FSDP_HD float load(const fp16_t* p, size_t i) { return fp16_bits_to_f32(p[i].bits); }
FSDP_HD void store(float* p, size_t i, float v) { p[i] = v; }
FSDP_HD void store(bf16_t* p, size_t i, float v) { p[i].bits = f32_to_bf16_bits(v); }
FSDP_HD void store(fp16_t* p, size_t i, float v) { p[i].bits = f32_to_fp16_bits(v); }

// out[i] = cast(in[i])
struct CastOp {
  template <typename Out, typename In>
  FSDP_HD void operator()(Out* out, const In* in, size_t i) const {
    store(out, i, load(in, i));
  }
};

// acc[i] = acc[i] + src[i], added in fp32 and rounded once to acc's type:
// what a host does that adds its grad into a param_dtype grad buffer element
// by element (fsdp_grad_accumulate). Any pair of storage types.
struct AddOp {
  template <typename Acc, typename Src>
  FSDP_HD void operator()(Acc* acc, const Src* src, size_t i) const {
    store(acc, i, load(acc, i) + load(src, i));
  }
};

}  // namespace fsdp::kernels
