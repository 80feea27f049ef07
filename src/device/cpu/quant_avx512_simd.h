// src/device/cpu/quant_avx512_simd.h - what quant_avx512.cpp (the unpacks
// and sums) and quant_avx512_pack.cpp (the packs) share: whether this build
// has the AVX-512 loops, the attribute that compiles a function for
// AVX-512, and the prefetch of the passes' inputs. Private to those two
// files.
#pragma once

#include <cstddef>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FSDP_HAVE_AVX512_LOOPS 1
#include <immintrin.h>
// GCC 12 reports the intrinsics' own _mm512_undefined_* placeholders as
// maybe-uninitialized once they are inlined here (a known false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace fsdp::device::avx512::simd {

#if FSDP_HAVE_AVX512_LOOPS

#define FSDP_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define FSDP_AVX512_INLINE FSDP_AVX512 inline __attribute__((always_inline))

// The passes prefetch this far ahead of what they read.
constexpr size_t kAheadBytes = 4096;
FSDP_AVX512_INLINE void prefetch_ahead(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + kAheadBytes, _MM_HINT_T0);
}

#endif

}  // namespace fsdp::device::avx512::simd
