// kernels/common.h - the qualifier that lets one functor run in CPU loops and
// CUDA kernels alike, and the 16-bit storage types the kernels convert.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FSDP_HD __host__ __device__ __forceinline__
#else
#define FSDP_HD inline __attribute__((always_inline))
#endif

namespace fsdp::kernels {

// 16-bit floats are stored as raw bits; conversions live in cast.h so that the
// rounding rule is written exactly once.
struct bf16_t {
  uint16_t bits;
};
struct fp16_t {
  uint16_t bits;
};

}  // namespace fsdp::kernels
