// kernels/reduce.h - one element of a reduction over ranks: the ranks' values
// summed in fp32 in rank order (the first two added, then each next one),
// scaled, and rounded once to the storage type. The CPU communicators' block
// loops (src/base/reduce.cpp), the CPU device's reduce_sum and the CUDA
// reduce kernel (kernels/cuda) all compute these bits, so a reduction gives
// the same result on every device and rank (tests/test_kernels.cpp,
// tests/test_cuda.cpp).
#pragma once

#include <cstddef>

#include "cast.h"

namespace fsdp::kernels {

// The sum over k < n_ins of ins[k][i]; `Ptrs` is anything indexable by k
// that yields a T* (an array of pointers, or a kernel's array member).
template <typename T, typename Ptrs>
FSDP_HD float rank_sum(const Ptrs& ins, size_t n_ins, size_t i) {
  float acc = load(static_cast<const T*>(ins[0]), i);
  if (n_ins > 1) acc = acc + load(static_cast<const T*>(ins[1]), i);
  for (size_t k = 2; k < n_ins; ++k) acc += load(static_cast<const T*>(ins[k]), i);
  return acc;
}

// out[i] = scale * rank_sum(ins, i), rounded once to T.
struct ReduceSumOp {
  float scale;
  template <typename T, typename Ptrs>
  FSDP_HD void operator()(T* out, const Ptrs& ins, size_t n_ins, size_t i) const {
    store(out, i, rank_sum<T>(ins, n_ins, i) * scale);
  }
};

}  // namespace fsdp::kernels
