// kernels/cuda/dispatch.cuh - a runtime fsdp_dtype_t as the storage type the
// kernels are templates on (inside the .cu files only).
#pragma once

#include <cuda_runtime_api.h>

#include "../common.h"
#include "fsdp.h"

namespace fsdp::kernels::cuda {

// Calls fn(typed pointer) with `p` cast to the storage type of `dtype`;
// cudaErrorInvalidValue for another dtype.
template <typename Fn>
cudaError_t with_dtype(fsdp_dtype_t dtype, void* p, Fn&& fn) {
  switch (dtype) {
    case FSDP_DTYPE_FP32:
      return fn(static_cast<float*>(p));
    case FSDP_DTYPE_BF16:
      return fn(static_cast<bf16_t*>(p));
    case FSDP_DTYPE_FP16:
      return fn(static_cast<fp16_t*>(p));
  }
  return cudaErrorInvalidValue;
}

}  // namespace fsdp::kernels::cuda
