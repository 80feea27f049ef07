// src/device/cpu/quant_avx512_pack.cpp - quantize() of quant_avx512.h: the
// packs of fp32, bf16 and fp16 values into int8 or E4M3 codes and block
// scales, in AVX-512 where the build has the loops (quant_avx512_simd.h).
// The unpacks and sums are in quant_avx512.cpp. Contraction is off for this
// file too (-ffp-contract=off, src/CMakeLists.txt), for the same reason.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "quant_avx512.h"
#include "quant_avx512_simd.h"

namespace fsdp::device::avx512 {

#if FSDP_HAVE_AVX512_LOOPS

namespace {

namespace k = kernels;
using simd::prefetch_ahead;

// A product closer than this to a half-step is recomputed by division.
constexpr float kTieMargin = 0x1p-14f;

FSDP_AVX512_INLINE __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
FSDP_AVX512_INLINE __m512 load16(const k::bf16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
FSDP_AVX512_INLINE __m512 load16(const k::fp16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// kernels::block_scale's largest magnitude (as bits) of x[b, b + len); with
// `least`, also the smallest there. 16 values per vector, as fp32.
template <typename T>
FSDP_AVX512_INLINE uint32_t absmax_bits_by16(const T* x, size_t b, size_t len, uint32_t* least) {
  const __m512i mask = _mm512_set1_epi32(0x7fffffff);
  __m512i m = _mm512_setzero_si512(), lo = mask;
  for (size_t i = b; i < b + len; i += 16) {
    const __m512i a = _mm512_and_si512(_mm512_castps_si512(load16(x + i)), mask);
    m = _mm512_max_epu32(m, a);
    if (least != nullptr) lo = _mm512_min_epu32(lo, a);
  }
  if (least != nullptr) *least = _mm512_reduce_min_epu32(lo);
  return _mm512_reduce_max_epu32(m);
}
template <typename T>
FSDP_AVX512_INLINE uint32_t absmax_bits(const T* x, size_t b, size_t len, uint32_t* least = nullptr) {
  return absmax_bits_by16(x, b, len, least);
}
// bf16: 32 magnitudes per vector, in their own 16 bits.
template <>
FSDP_AVX512_INLINE uint32_t absmax_bits(const k::bf16_t* x, size_t b, size_t len, uint32_t* least) {
  if (len % 32 != 0) return absmax_bits_by16(x, b, len, least);
  const __m512i mask = _mm512_set1_epi16(0x7fff);
  __m512i m = _mm512_setzero_si512(), lo = mask;
  for (size_t i = b; i < b + len; i += 32) {
    const __m512i a = _mm512_and_si512(_mm512_loadu_si512(x + i), mask);
    m = _mm512_max_epu16(m, a);
    if (least != nullptr) lo = _mm512_min_epu16(lo, a);
  }
  if (least != nullptr) {
    const __m512i wide = _mm512_min_epu32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(lo)),
                                          _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(lo, 1)));
    *least = _mm512_reduce_min_epu32(wide) << 16;
  }
  const __m512i wide = _mm512_max_epu32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(m)),
                                        _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(m, 1)));
  return _mm512_reduce_max_epu32(wide) << 16;
}

// int8 codes of m (already x * (1 / scale)); `near` collects the lanes within
// the margin of a half-step. The conversion rounds to nearest even (MXCSR's
// default, which nothing in libfsdp changes). No clamp to +-127: |m| is at
// most 127 * (1 + 2^-22) (|x| <= absmax, scale = absmax / 127 rounded), so
// its code is within +-127 already.
FSDP_AVX512_INLINE __m512i int8_codes(__m512 m, __mmask16& near) {
  const __m512i c = _mm512_cvtps_epi32(m);
  const __m512 q = _mm512_cvtepi32_ps(c);
  near |= _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(m, q)), _mm512_set1_ps(0.5f - kTieMargin), _CMP_GT_OQ);
  return c;
}

// kernels::f32_to_e4m3_bits of m, 16 at a time, for finite m (a block that
// reaches here has no NaN or infinity and |m| <= 448 * (1 + 2^-22), whose
// code is 448's: no saturation needed). From 2^-6 up, E4M3's codes are the
// fp32 bits' exponent and top 3 mantissa bits less 120 << 3, so the
// magnitude rounds in the integer bits, half up at bit 20 (a carry moves
// into the exponent as it should): the same code as the functor's ties to
// even wherever the 20 dropped bits are not within 2^6 of 2^19, and those
// lanes are flagged. Below 2^-6 the codes 0..8 count steps of 2^-9, which
// is the spacing of fp32's binade [2^-6, 2^-5) at 3 mantissa bits: so
// m + 2^-6 (one rounding at 2^-29, far inside the flagged margin) rounds in
// the same integer bits, 8 codes up, with no branch on zeros.
// The division's fallback (TiesToEven) rounds as the functor does: half a
// step less one, plus the kept lowest bit; below 2^-6 it scales by 2^9
// exactly instead, since there the sum's own rounding could land a value
// next to a tie on it.
// AllNormal: the caller knows every |m| is at least 2^-6 (quantize_loop).
template <bool TiesToEven, bool AllNormal = false>
FSDP_AVX512_INLINE __m512i e4m3_codes(__m512 m, __mmask16& near) {
  __m512i a = _mm512_and_si512(_mm512_castps_si512(m), _mm512_set1_epi32(0x7fffffff));
  const __mmask16 is_normal = _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(0x3c800000));  // 2^-6
  if (!TiesToEven && !AllNormal) {
    const __m512 shifted = _mm512_add_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(0x1p-6f));
    a = _mm512_mask_sub_epi32(a, static_cast<__mmask16>(~is_normal), _mm512_castps_si512(shifted),
                              _mm512_set1_epi32(8 << 20));
  }
  // + half a step, - the exponent's rebias (120 << 3 codes, at bit 20).
  __m512i up;
  if (TiesToEven) {
    const __m512i kept_lsb = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
    up = _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(0x80000 - 1 - (960 << 20))), kept_lsb);
  } else {
    // 64 more, for the flag: (up + 64) mod 2^20 < 128 (no bit of 0xfff80
    // set) is within 2^6 of the half-step. The extra 64 changes the code's
    // bits only within 64 below a carry, a lane the flag sends to the
    // fallback anyway: one add serves both.
    up = _mm512_add_epi32(a, _mm512_set1_epi32(0x80000 + 64 - (960 << 20)));
    near |= _mm512_testn_epi32_mask(up, _mm512_set1_epi32(0xfff80));
  }
  __m512i mag = _mm512_srli_epi32(up, 20);
  if (TiesToEven && is_normal != 0xffff) {  // zeros and the few values below 2^-6
    const __m512 y = _mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(512.0f));
    const __m512i c = _mm512_cvtps_epi32(y);
    const __m512 ry = _mm512_cvtepi32_ps(c);
    near |= _mm512_mask_cmp_ps_mask(static_cast<__mmask16>(~is_normal), _mm512_abs_ps(_mm512_sub_ps(y, ry)),
                                    _mm512_set1_ps(0.5f - kTieMargin), _CMP_GT_OQ);
    mag = _mm512_mask_blend_epi32(is_normal, c, mag);
  }
  return _mm512_mask_or_epi32(mag, _mm512_movepi32_mask(_mm512_castps_si512(m)), mag, _mm512_set1_epi32(0x80));
}

// The codes of 16 values, one per 32-bit lane (int8's sign-extended, fp8's
// 0..255). The format is a template argument, as in every pack loop below:
// a branch on it per vector kept GCC from unrolling the loops over 64
// values, whose code vectors then went through the stack.
template <k::QType Q, bool TiesToEven = false, bool AllNormal = false>
FSDP_AVX512_INLINE __m512i codes(__m512 m, __mmask16& near) {
  if constexpr (Q == k::QType::kInt8) {
    return int8_codes(m, near);
  } else {
    return e4m3_codes<TiesToEven, AllNormal>(m, near);
  }
}

// 64 codes from four vectors of them, in order: two word packs and a byte
// pack (signed saturation for int8, unsigned for fp8: both exact on codes)
// leave 128-bit lane L holding each vector's values 4L..4L+3, which one
// dword permutation puts back, where four vpmovdb take eight shuffles.
// Interleaved: the vectors are load64's of bf16 (lane L of c[0] and c[1]
// holding values 8L..8L+7, of c[2] and c[3] values 32 + 8L..), whose word
// packs are already in order: a qword permutation then.
template <k::QType Q, bool Interleaved>
FSDP_AVX512_INLINE __m512i pack64(const __m512i (&c)[4]) {
  const __m512i w01 = _mm512_packs_epi32(c[0], c[1]), w23 = _mm512_packs_epi32(c[2], c[3]);
  const __m512i b = Q == k::QType::kInt8 ? _mm512_packs_epi16(w01, w23) : _mm512_packus_epi16(w01, w23);
  const __m512i order = Interleaved ? _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15)
                                    : _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_epi32(order, b);
}

// 64 values as fp32, in four vectors: in order, except bf16's, which are
// widened by unpacking against zero (one shuffle per 16 values, no shift)
// into pack64<true>'s interleaved layout.
template <typename T>
FSDP_AVX512_INLINE void load64(const T* x, __m512 (&v)[4]) {
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) v[j] = load16(x + 16 * j);
}
template <>
FSDP_AVX512_INLINE void load64(const k::bf16_t* x, __m512 (&v)[4]) {
  const __m512i zero = _mm512_setzero_si512();
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const __m512i w = _mm512_loadu_si512(x + 32 * h);
    v[2 * h] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, w));
    v[2 * h + 1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, w));
  }
}

// One block of a finite scale of at least 2^-126. Blocks of a multiple of 64
// values store 64 codes at a time (streamed where the caller says so: the
// packed output is 64-byte aligned and larger than the caches), so that the
// bytes written cost no read of their line first.
// AllNormal: every value's quotient is at least fp8's smallest normal, 2^-6,
// in magnitude (int8 ignores it).
template <k::QType Q, bool Stream, bool AllNormal, typename T>
FSDP_AVX512_INLINE void quantize_whole_block(const T* x, size_t b, size_t block, float scale, float inv, uint8_t* out) {
  const __m512 r = _mm512_set1_ps(inv);
  if (block % 64 == 0) {
    for (size_t i = b; i < b + block; i += 64) {
      for (size_t p = 0; p < 64 * sizeof(T); p += 64) prefetch_ahead(reinterpret_cast<const char*>(x + i) + p);
      __m512 v[4];
      __m512i c[4];
      __mmask16 near = 0;
      load64(x + i, v);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) c[j] = codes<Q, false, AllNormal>(_mm512_mul_ps(v[j], r), near);
      if (near != 0) {  // near a half-step: the functor's quotient itself
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) c[j] = codes<Q, true>(_mm512_div_ps(v[j], _mm512_set1_ps(scale)), near);
      }
      const __m512i bytes = pack64<Q, std::is_same_v<T, k::bf16_t>>(c);
      if (Stream) {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(out + i), bytes);
      } else {
        _mm512_storeu_si512(out + i, bytes);
      }
    }
    return;
  }
  for (size_t i = b; i < b + block; i += 16) {
    prefetch_ahead(x + i);
    const __m512 v = load16(x + i);
    __mmask16 near = 0;
    __m512i c = codes<Q, false, AllNormal>(_mm512_mul_ps(v, r), near);
    // Near a half-step: the functor's quotient itself (near is not read again).
    if (near != 0) c = codes<Q, true>(_mm512_div_ps(v, _mm512_set1_ps(scale)), near);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(c));
  }
}

template <k::QType Q, typename T>
FSDP_AVX512 void quantize_loop(const T* x, size_t n, size_t block, uint8_t* out, size_t kb, size_t ke, bool stream) {
  float* scales = reinterpret_cast<float*>(out + k::quant_scales_offset(n));
  const bool nt = stream && reinterpret_cast<uintptr_t>(out) % 64 == 0;
  // Blocks go in groups of 8: their magnitudes first, then their scales and
  // the scales' reciprocals by two vector divisions (each lane the scalar
  // division's bits), then their codes, whose values the first pass left in
  // the caches. A division per block waited for its block's largest value,
  // and the codes for it.
  constexpr size_t kGroup = 8;
  for (size_t k0 = kb; k0 < ke; k0 += kGroup) {
    const size_t g = std::min(kGroup, ke - k0);
    // fp8: also the least magnitude, to skip the codes' subnormal arithmetic
    // where every quotient is a normal value (x * (1 / scale) is monotonic
    // in |x|, so the least one's quotient bounds them all).
    alignas(32) uint32_t most[kGroup] = {}, least[kGroup] = {};
    for (size_t j = 0; j < g; ++j) {
      const size_t b = (k0 + j) * block;
      if (b + block <= n && block % 16 == 0)
        most[j] = absmax_bits(x, b, block, Q == k::QType::kInt8 ? nullptr : &least[j]);
    }
    const __m256i m = _mm256_load_si256(reinterpret_cast<const __m256i*>(most));
    const __m256 finite = _mm256_div_ps(_mm256_castsi256_ps(m), _mm256_set1_ps(k::qmax(Q)));
    alignas(32) float scale[kGroup], inv[kGroup];
    const __m256 sc = _mm256_mask_blend_ps(_mm256_cmpge_epu32_mask(m, _mm256_set1_epi32(0x7f800000)), finite,
                                           _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)));
    _mm256_store_ps(scale, sc);
    _mm256_store_ps(inv, _mm256_div_ps(_mm256_set1_ps(1.0f), sc));
    for (size_t j = 0; j < g; ++j) {
      const size_t kk = k0 + j, b = kk * block;
      // A short last block, or a scale of 0, NaN or a subnormal: the functor's rules.
      if (b + block > n || block % 16 != 0 || !(scale[j] >= 0x1p-126f)) {
        k::quantize_block(x, n, block, kk, Q, out);
        continue;
      }
      scales[kk] = scale[j];
      if (Q != k::QType::kInt8 && k::f32_from_bits(least[j]) * inv[j] >= 0x1p-6f) {
        nt ? quantize_whole_block<Q, true, true>(x, b, block, scale[j], inv[j], out)
           : quantize_whole_block<Q, false, true>(x, b, block, scale[j], inv[j], out);
      } else {
        nt ? quantize_whole_block<Q, true, false>(x, b, block, scale[j], inv[j], out)
           : quantize_whole_block<Q, false, false>(x, b, block, scale[j], inv[j], out);
      }
    }
  }
}

}  // namespace

namespace {

template <typename T>
void quantize_as(const void* x, size_t n, size_t block, kernels::QType t, uint8_t* out, size_t kb, size_t ke,
                 bool stream) {
  const T* in = static_cast<const T*>(x);
  t == k::QType::kInt8 ? quantize_loop<k::QType::kInt8>(in, n, block, out, kb, ke, stream)
                       : quantize_loop<k::QType::kFp8E4m3>(in, n, block, out, kb, ke, stream);
}

}  // namespace

bool quantize(const void* x, DType x_dtype, size_t n, size_t block, kernels::QType t, uint8_t* out, size_t kb,
              size_t ke, bool stream) {
  switch (x_dtype) {
    case DType::kFp32:
      quantize_as<float>(x, n, block, t, out, kb, ke, stream);
      break;
    case DType::kBf16:
      quantize_as<k::bf16_t>(x, n, block, t, out, kb, ke, stream);
      break;
    case DType::kFp16:
      quantize_as<k::fp16_t>(x, n, block, t, out, kb, ke, stream);
      break;
    default:
      return false;
  }
  if (stream) _mm_sfence();
  return true;
}

#else  // no AVX-512 loops in this build (not x86-64 GCC)

bool quantize(const void*, DType, size_t, size_t, kernels::QType, uint8_t*, size_t, size_t, bool) { return false; }

#endif

}  // namespace fsdp::device::avx512
