// src/base/dtype_dispatch.h - with_dtype(): turns a runtime DType into the
// storage type of kernels/ (float, bf16_t, fp16_t), so that one template loop
// serves every dtype.
#pragma once

#include "../../kernels/common.h"
#include "dtype.h"

namespace fsdp::base {

// Calls fn(p cast to a pointer to the storage type of `t`).
template <typename Fn>
void with_dtype(DType t, void* p, Fn&& fn) {
  switch (t) {
    case DType::kFp32:
      fn(static_cast<float*>(p));
      break;
    case DType::kBf16:
      fn(static_cast<kernels::bf16_t*>(p));
      break;
    case DType::kFp16:
      fn(static_cast<kernels::fp16_t*>(p));
      break;
  }
}

}  // namespace fsdp::base
