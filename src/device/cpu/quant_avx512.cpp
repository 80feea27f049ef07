// src/device/cpu/quant_avx512.cpp - see quant_avx512.h: the unpacks, the
// sums and what the CPU has (the packs are quant_avx512_pack.cpp's; what
// both share, quant_avx512_simd.h's). Each function is compiled for AVX-512
// by attribute (the rest of the library keeps its baseline target) and only
// called after quant_available() said yes.
// Contraction is off for this file (-ffp-contract=off, src/CMakeLists.txt):
// GCC writes these intrinsics as vector arithmetic, which it would otherwise
// fuse into FMAs with other bits. (Not FSDP_NO_CONTRACT: GCC's optimize
// attribute here left every constant broadcast inside the loops.)
#include "quant_avx512.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include <unistd.h>

#include "quant_avx512_simd.h"

namespace fsdp::device::avx512 {

#if FSDP_HAVE_AVX512_LOOPS

namespace {

namespace k = kernels;
using simd::prefetch_ahead;

// Stores of 16 values; Stream: non-temporal (the caller checked alignment:
// 64 bytes for fp32, 32 for 16-bit values).
template <bool Stream>
FSDP_AVX512_INLINE void store_bits(void* p, __m256i h) {
  if (Stream) {
    _mm256_stream_si256(static_cast<__m256i*>(p), h);
  } else {
    _mm256_storeu_si256(static_cast<__m256i*>(p), h);
  }
}
template <bool Stream>
FSDP_AVX512_INLINE void store16(float* p, __m512 v) {
  if (Stream) {
    _mm512_stream_ps(p, v);
  } else {
    _mm512_storeu_ps(p, v);
  }
}
// kernels::f32_to_bf16_bits' rounding to nearest even, in each lane's low
// 16 bits; wrong for a NaN whose low bits carry (store16 below handles it).
FSDP_AVX512_INLINE __m512i bf16_round_top(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
}
// kernels::f32_to_bf16_bits, 16 at a time.
template <bool Stream>
FSDP_AVX512_INLINE void store16(k::bf16_t* p, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x0040));
  store_bits<Stream>(p, _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, bf16_round_top(v), quiet)));
}
// store16's bf16 rounding of 32 values, for lanes that are not NaN or are a
// NaN whose low 16 bits are clear (which stays that NaN, quiet): the
// two halves' rounded top bits packed to words (vpackusdw interleaves the
// halves by 128-bit lane; the qword permutation puts them back in order), so
// that 32 values cost two shuffles where two vpmovdw take four.
template <bool Stream>
FSDP_AVX512_INLINE void store32_bf16(k::bf16_t* p, __m512 lo, __m512 hi) {
  const __m512i words = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7),
                                                 _mm512_packus_epi32(bf16_round_top(lo), bf16_round_top(hi)));
  if (Stream) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), words);
  } else {
    _mm512_storeu_si512(p, words);
  }
}
// kernels::f32_to_fp16_bits: the conversion instruction rounds to nearest
// even with subnormals and infinities as IEEE says, and keeps a NaN's sign and
// top mantissa bits with the quiet bit set, as the functor does.
template <bool Stream>
FSDP_AVX512_INLINE void store16(k::fp16_t* p, __m512 v) {
  store_bits<Stream>(p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// kernels::e4m3_bits_to_f32 of 16 codes. Codes 8..126 (the normal values)
// are their bits moved to fp32's sign, exponent and mantissa with the bias
// changed (the sign-extended byte shifted left by 20 holds the sign at bit 31
// and the magnitude at bits 20-26); the others (zero, subnormals, NaN) take
// the functor's full arithmetic, only where a lane has one. AllNormal: the
// caller found none among them (e4m3_all_normal), so nothing is checked.
template <bool AllNormal = false>
FSDP_AVX512_INLINE __m512 e4m3_values(__m128i bytes) {
  const __m512i shifted = _mm512_slli_epi32(_mm512_cvtepi8_epi32(bytes), 20);
  __m512i bits =
      _mm512_add_epi32(_mm512_and_si512(shifted, _mm512_set1_epi32(int(0x87f00000u))), _mm512_set1_epi32(120 << 23));
  if (AllNormal) return _mm512_castsi512_ps(bits);
  const __m512i mag20 = _mm512_and_si512(shifted, _mm512_set1_epi32(0x07f00000));
  // mag - 8 >= 119 (unsigned): mag < 8 or mag == 127.
  const __mmask16 odd =
      _mm512_cmpge_epu32_mask(_mm512_sub_epi32(mag20, _mm512_set1_epi32(8 << 20)), _mm512_set1_epi32(119 << 20));
  if (odd != 0) {
    const __m512i mag = _mm512_srli_epi32(mag20, 20);
    const __m512i sign = _mm512_and_si512(shifted, _mm512_set1_epi32(int(0x80000000u)));
    const __m512i m = _mm512_and_si512(mag, _mm512_set1_epi32(7));
    const __m512i sub =
        _mm512_or_si512(sign, _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(0.001953125f))));
    bits = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(8)), bits, sub);
    bits = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f)), bits,
                                   _mm512_or_si512(sign, _mm512_set1_epi32(0x7fc00000)));
  }
  return _mm512_castsi512_ps(bits);
}

FSDP_AVX512_INLINE __m512 values(__m128i bytes, k::QType t) {
  return t == k::QType::kInt8 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)) : e4m3_values(bytes);
}

// Whether the 64 E4M3 codes at p are all normal values (magnitude 8..126:
// no zero, subnormal or NaN), checked on the bytes (three operations per 64
// codes) so that e4m3_values<true> can skip its check per 16.
FSDP_AVX512_INLINE bool e4m3_all_normal(const uint8_t* p) {
  const __m512i mag = _mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi8(0x7f));
  return _mm512_cmpge_epu8_mask(_mm512_sub_epi8(mag, _mm512_set1_epi8(8)), _mm512_set1_epi8(119)) == 0;
}

FSDP_AVX512_INLINE __m128i load_bytes(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// AVX512-BF16's conversion rounds as kernels::f32_to_bf16_bits does (to
// nearest even; a NaN keeps its top bits with the quiet bit set) but reads an
// fp32 subnormal as zero. With a block scale of at least 2^-117 every product
// is zero or at least 2^-9 * 2^-117 = 2^-126, a normal number, so the
// instruction gives the functor's bits; smaller scales (and NaN ones) take
// store16's integer rounding.
constexpr float kHwBf16MinScale = 0x1p-117f;

bool bf16_instruction() {
  static const bool on = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return on;
}

template <bool Stream>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"))) void dequantize_block_bf16_hw(
    const uint8_t* slice, size_t b, size_t block, k::QType t, float sc, k::bf16_t* o) {
  const __m512 scale = _mm512_set1_ps(sc);
  for (size_t i = b; i < b + block; i += 16) {
    if (i % 64 == 0) prefetch_ahead(slice + i);
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(values(load_bytes(slice + i), t), scale));
    store_bits<Stream>(o + i, reinterpret_cast<const __m256i&>(h));
  }
}

template <bool Stream, typename T>
FSDP_AVX512_INLINE void dequantize_whole_block(const uint8_t* slice, size_t b, size_t block, k::QType t, float sc,
                                               T* o) {
  if constexpr (std::is_same_v<T, k::bf16_t>) {
    if (sc >= kHwBf16MinScale && bf16_instruction()) {
      dequantize_block_bf16_hw<Stream>(slice, b, block, t, sc, o);
      return;
    }
  }
  const __m512 scale = _mm512_set1_ps(sc);
  if constexpr (std::is_same_v<T, k::bf16_t>) {
    // A finite scale times int8 codes is never NaN. fp8's codes 0x7f and
    // 0xff (which the quantizer writes only under a NaN scale) decode to the
    // quiet NaN 0x7fc00000 with its sign, and a product with a finite scale
    // keeps that NaN (x86 returns the NaN operand): low 16 bits clear, which
    // the rounding add leaves a NaN, the functor's bits (tested).
    if (block % 32 == 0 && std::isfinite(sc)) {
      for (size_t i = b; i < b + block; i += 32) {
        if (i % 64 == 0) prefetch_ahead(slice + i);
        const __m512 lo = _mm512_mul_ps(values(load_bytes(slice + i), t), scale);
        const __m512 hi = _mm512_mul_ps(values(load_bytes(slice + i + 16), t), scale);
        store32_bf16<Stream>(o + i, lo, hi);
      }
      return;
    }
  }
  for (size_t i = b; i < b + block; i += 16) {
    if (i % 64 == 0) prefetch_ahead(slice + i);
    store16<Stream>(o + i, _mm512_mul_ps(values(load_bytes(slice + i), t), scale));
  }
}

template <typename T>
FSDP_AVX512 void dequantize_loop(const uint8_t* packed, size_t n, size_t block, k::QType t, T* out, size_t kb,
                                 size_t ke, bool stream) {
  const size_t blocks = k::quant_blocks(n, block), stride = k::quant_packed_bytes(n, block);
  for (size_t j = kb; j < ke; ++j) {
    const size_t s = j / blocks, kk = j % blocks, b = kk * block;
    const uint8_t* slice = packed + s * stride;
    if (b + block > n || block % 16 != 0) {
      k::dequantize_block(slice, n, block, kk, t, out + s * n);
      continue;
    }
    const float sc = reinterpret_cast<const float*>(slice + k::quant_scales_offset(n))[kk];
    T* o = out + s * n;
    // Streamed stores need their width's alignment: 64 bytes for fp32 and for
    // bf16's 32-value stores, 32 for fp16's 16.
    constexpr size_t kAlign = std::is_same_v<T, k::fp16_t> ? 32 : 64;
    if (stream && reinterpret_cast<uintptr_t>(o + b) % kAlign == 0) {
      dequantize_whole_block<true>(slice, b, block, t, sc, o);
    } else {
      dequantize_whole_block<false>(slice, b, block, t, sc, o);
    }
  }
}

}  // namespace

bool quant_available() {
  static const bool on = [] {
    const char* env = std::getenv("FSDP_CPU_SIMD");
    if (env != nullptr && std::strcmp(env, "generic") == 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return on;
}

bool dequantize(const uint8_t* packed, size_t n, size_t block, kernels::QType t, void* out, DType out_dtype, size_t kb,
                size_t ke, bool stream) {
  switch (out_dtype) {
    case DType::kFp32:
      dequantize_loop(packed, n, block, t, static_cast<float*>(out), kb, ke, stream);
      break;
    case DType::kBf16:
      dequantize_loop(packed, n, block, t, static_cast<k::bf16_t*>(out), kb, ke, stream);
      break;
    case DType::kFp16:
      dequantize_loop(packed, n, block, t, static_cast<k::fp16_t*>(out), kb, ke, stream);
      break;
    default:
      return false;
  }
  if (stream) _mm_sfence();  // the streamed stores ordered before what this thread does next
  return true;
}

size_t stream_store_bytes() {
  static const size_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? static_cast<size_t>(l2) : size_t(2) << 20;
  }();
  return bytes;
}

namespace {

// kernels::dequantize_sum_block's order per value: the first slice, then each
// next one added, then the scale. A tile of 128 values keeps its 8 sums in
// registers while each slice's 128 codes are read in a row (4 KiB ahead
// prefetched), so that many slices (one per rank of the group) are streams
// the prefetchers follow rather than 16-byte visits to each in turn.
template <k::QType T, bool Stream>
FSDP_AVX512_INLINE void sum_tile(const uint8_t* packed, size_t n_slices, size_t stride, size_t scales, size_t kk,
                                 size_t i0, __m512 sc_all, float* out) {
  constexpr int kChunks = 8;
  __m512 acc[kChunks];
  for (size_t s = 0; s < n_slices; ++s) {
    const uint8_t* slice = packed + s * stride;
    prefetch_ahead(slice + i0);
    prefetch_ahead(slice + i0 + 64);
    const __m512 sc = _mm512_set1_ps(reinterpret_cast<const float*>(slice + scales)[kk]);
    if (T == k::QType::kFp8E4m3 && e4m3_all_normal(slice + i0) && e4m3_all_normal(slice + i0 + 64)) {
      for (int c = 0; c < kChunks; ++c) {
        const __m512 v = _mm512_mul_ps(e4m3_values<true>(load_bytes(slice + i0 + 16 * c)), sc);
        acc[c] = s == 0 ? v : _mm512_add_ps(acc[c], v);
      }
      continue;
    }
    for (int c = 0; c < kChunks; ++c) {
      const __m512 v = _mm512_mul_ps(values(load_bytes(slice + i0 + 16 * c), T), sc);
      acc[c] = s == 0 ? v : _mm512_add_ps(acc[c], v);
    }
  }
  for (int c = 0; c < kChunks; ++c) store16<Stream>(out + i0 + 16 * c, _mm512_mul_ps(acc[c], sc_all));
}

}  // namespace

FSDP_AVX512 void dequantize_sum(const uint8_t* packed, size_t n_slices, size_t stride, size_t n, size_t block,
                                kernels::QType t, float scale, float* out, size_t kb, size_t ke, bool stream) {
  const size_t scales = k::quant_scales_offset(n);
  const __m512 sc_all = _mm512_set1_ps(scale);
  for (size_t kk = kb; kk < ke; ++kk) {
    const size_t b = kk * block;
    if (b + block > n || block % 128 != 0 || n_slices == 0) {
      k::dequantize_sum_block(packed, n_slices, stride, n, block, kk, t, scale, out);
      continue;
    }
    const bool nt = stream && reinterpret_cast<uintptr_t>(out + b) % 64 == 0;
    for (size_t i0 = b; i0 < b + block; i0 += 128) {
      if (t == k::QType::kInt8) {
        nt ? sum_tile<k::QType::kInt8, true>(packed, n_slices, stride, scales, kk, i0, sc_all, out)
           : sum_tile<k::QType::kInt8, false>(packed, n_slices, stride, scales, kk, i0, sc_all, out);
      } else {
        nt ? sum_tile<k::QType::kFp8E4m3, true>(packed, n_slices, stride, scales, kk, i0, sc_all, out)
           : sum_tile<k::QType::kFp8E4m3, false>(packed, n_slices, stride, scales, kk, i0, sc_all, out);
      }
    }
  }
  if (stream) _mm_sfence();
}

#else  // no AVX-512 loops in this build (not x86-64 GCC)

bool quant_available() { return false; }
bool dequantize(const uint8_t*, size_t, size_t, kernels::QType, void*, DType, size_t, size_t, bool) { return false; }
size_t stream_store_bytes() { return size_t(2) << 20; }
void dequantize_sum(const uint8_t* packed, size_t n_slices, size_t stride, size_t n, size_t block, kernels::QType t,
                    float scale, float* out, size_t kb, size_t ke, bool) {
  for (size_t kk = kb; kk < ke; ++kk) {
    kernels::dequantize_sum_block(packed, n_slices, stride, n, block, kk, t, scale, out);
  }
}

#endif

}  // namespace fsdp::device::avx512
