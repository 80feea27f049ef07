// src/comm/nccl/nccl_check.h - NCCL and CUDA runtime results as fsdp::Error,
// for the nccl communicator (which calls the CUDA runtime itself: a
// communicator never sees the device layer).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

#include "../../base/error.h"
#include "nccl_lib.h"

namespace fsdp::comm {

// "ncclSystemError: <NCCL's last message>".
inline std::string nccl_describe(ncclResult_t r, ncclComm_t comm) {
  std::string s = nccl().GetErrorString(r);
  const char* last = nccl().GetLastError(comm);
  if (last != nullptr && *last != '\0') s += ": " + std::string(last);
  return s;
}

inline void nccl_check(ncclResult_t r, const std::string& what) {
  if (r != ncclSuccess) fail(FSDP_ERR_COMM, "nccl: " + what + " failed: " + nccl_describe(r, nullptr));
}

inline void cuda_check(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return;
  fail(e == cudaErrorMemoryAllocation ? FSDP_ERR_OUT_OF_MEMORY : FSDP_ERR_COMM,
       "nccl communicator: " + what + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

}  // namespace fsdp::comm
