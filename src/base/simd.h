// src/base/simd.h - FSDP_SIMD_CLONES: compile a hot loop three times,
// for x86-64-v4 (AVX-512 with BW and VL, so that the bf16/fp16 conversions
// vectorise 16 wide too; AVX-512F alone leaves them 8 wide), for AVX2 and for
// the baseline, and pick at load time, so one binary is fast on new machines
// and still runs on old ones. Contraction into FMA is turned off in the loops
// themselves: GCC contracts by default in C++ (even with -std=c++17) wherever
// the target has FMA, as x86-64-v4 does, and a contracted clone would not
// compute the same bits as the others, as a CUDA kernel or as the references.
#pragma once

#include <cstddef>
#include <type_traits>

#include "../../kernels/common.h"

// FSDP_NO_CONTRACT makes GCC decline to inline ordinary helpers into the loops
// (their optimisation options differ), which would then run them for the
// baseline target: helpers and lambdas that a loop calls are always_inline
// (FSDP_HD from kernels/common.h, FSDP_LAMBDA_INLINE).
#define FSDP_LAMBDA_INLINE __attribute__((always_inline))

#if defined(__GNUC__) && !defined(__clang__)
#define FSDP_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define FSDP_NO_CONTRACT  // clang contracts only where the target has FMA, and no clone enables it there
#endif

// Not under sanitizers: the ifunc resolver runs during relocation, before the
// sanitizer runtime is up, and instrumented resolver code crashes there.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__SANITIZE_THREAD__) && \
    !defined(__SANITIZE_ADDRESS__)
#define FSDP_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default"))) FSDP_NO_CONTRACT
#else
#define FSDP_SIMD_CLONES FSDP_NO_CONTRACT
#endif

namespace fsdp::base {

// Streaming loops over fp32 arrays run in steps of kStreamStep elements; each
// step first prefetches the next step's lines of every array it streams, then
// runs its vectorised loop. The hardware prefetchers alone left 5-10% of the
// bandwidth unused with the 4 to 7 streams per thread of the optimizer loops
// (measured with benchmarks/bench_optimizer on Sapphire Rapids, 1 and 2
// threads); a step of 1 KiB per array measured as well as 512 B or 2 KiB, and
// prefetching a whole 4 KiB block at once measured worse than none.
constexpr size_t kStreamStep = 256;

template <typename... Floats>
FSDP_HD void prefetch_next_step(size_t hi, size_t end, const Floats*... arrays) {
  static_assert((std::is_same_v<Floats, float> && ...), "steps count fp32 elements");
  size_t stop = hi + kStreamStep < end ? hi + kStreamStep : end;
  for (size_t k = hi; k < stop; k += 64 / sizeof(float)) (__builtin_prefetch(arrays + k), ...);
}

}  // namespace fsdp::base
