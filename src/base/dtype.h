// src/base/dtype.h - element types of the buffers the library owns.
#pragma once

#include <cstddef>
#include <string>

#include "fsdp.h"

namespace fsdp {

enum class DType { kFp32 = FSDP_DTYPE_FP32, kBf16 = FSDP_DTYPE_BF16, kFp16 = FSDP_DTYPE_FP16 };

inline size_t dtype_size(DType t) { return t == DType::kFp32 ? 4 : 2; }
inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFp32:
      return "fp32";
    case DType::kBf16:
      return "bf16";
    case DType::kFp16:
      return "fp16";
  }
  return "?";
}

}  // namespace fsdp
