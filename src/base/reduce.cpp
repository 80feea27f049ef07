// src/base/reduce.cpp - see reduce.h. Compiled with -O3 and SIMD clones: the
// block passes must vectorise.
#include "reduce.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../../kernels/cast.h"
#include "dtype_dispatch.h"
#include "simd.h"

namespace fsdp::base {
namespace {

constexpr size_t kBlock = 512;

// The three passes of a block, each a plain loop over restrict pointers so that
// it vectorises (one loop nest over ranks and elements does not).
template <typename T>
inline void acc_init(float* __restrict acc, const T* __restrict a, const T* __restrict b, size_t n) {
  if (b == nullptr) {
    for (size_t i = 0; i < n; ++i) acc[i] = kernels::load(a, i);
  } else {
    for (size_t i = 0; i < n; ++i) acc[i] = kernels::load(a, i) + kernels::load(b, i);
  }
}
template <typename T>
inline void acc_add(float* __restrict acc, const T* __restrict a, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += kernels::load(a, i);
}
template <typename T>
inline void acc_store(T* __restrict out, const float* __restrict acc, float scale, size_t n) {
  for (size_t i = 0; i < n; ++i) kernels::store(out, i, acc[i] * scale);
}

// out[i] = scale * sum_k ins[k][i], summed in fp32 in rank order over blocks
// that stay in L1, rounded once to T.
// With kClear, each input block is zeroed once the block's sum is taken.
template <bool kClear, typename T>
FSDP_SIMD_CLONES void reduce_blocks(T* out, const std::vector<const T*>& ins, size_t numel, float scale) {
  alignas(64) float acc[kBlock];
  for (size_t b = 0; b < numel; b += kBlock) {
    size_t n = std::min(kBlock, numel - b);
    acc_init(acc, ins[0] + b, ins.size() > 1 ? ins[1] + b : nullptr, n);
    for (size_t k = 2; k < ins.size(); ++k) acc_add(acc, ins[k] + b, n);
    acc_store(out + b, acc, scale, n);
    if constexpr (kClear) {
      for (const T* in : ins) std::memset(const_cast<T*>(in) + b, 0, n * sizeof(T));
    }
  }
}

template <bool kClear>
void reduce_sum_impl(void* out, const void* const* ins, size_t n_ins, size_t numel, DType dtype, float scale) {
  with_dtype(dtype, out, [&](auto* typed_out) {
    using T = std::remove_pointer_t<decltype(typed_out)>;
    thread_local std::vector<const T*> typed;  // kept: a reduction allocates nothing once warm
    typed.resize(n_ins);
    for (size_t k = 0; k < n_ins; ++k) typed[k] = static_cast<const T*>(ins[k]);
    reduce_blocks<kClear>(typed_out, typed, numel, scale);
  });
}

}  // namespace

void reduce_sum(void* out, const void* const* ins, size_t n_ins, size_t numel, DType dtype, float scale) {
  reduce_sum_impl<false>(out, ins, n_ins, numel, dtype, scale);
}

void reduce_sum_clear(void* out, void* const* ins, size_t n_ins, size_t numel, DType dtype, float scale) {
  reduce_sum_impl<true>(out, ins, n_ins, numel, dtype, scale);
}

}  // namespace fsdp::base
