// src/device/cuda/cuda_check.h - CUDA runtime errors as libfsdp Errors, and
// the calling thread bound to a device before it issues work there.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "../../base/error.h"

namespace fsdp::device::cuda {

// The status a CUDA error maps to: out of memory, a handle or value the host
// passed that CUDA refuses, no usable device; anything else is a device fault
// (a kernel that failed, a lost device), which CUDA makes sticky.
inline fsdp_status_t status_of(cudaError_t e) {
  switch (e) {
    case cudaErrorMemoryAllocation:
      return FSDP_ERR_OUT_OF_MEMORY;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidDevice:
      return FSDP_ERR_INVALID_ARGUMENT;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
      return FSDP_ERR_UNSUPPORTED;
    default:
      return FSDP_ERR_INTERNAL;
  }
}

inline std::string describe(cudaError_t e) { return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e); }

// Throws the Error of `e` (if it is one), naming `what` was being done; the
// message is built only then (the hot path passes literals).
[[noreturn]] inline void fail_cuda(cudaError_t e, const std::string& what) {
  fail(status_of(e), "cuda device: " + what + " failed (" + describe(e) + ")");
}
inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail_cuda(e, what);
}
inline void check(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) fail_cuda(e, what);
}

// Makes `ordinal` the calling thread's current device (each host thread has
// its own; the API's caller may be any thread). Asks CUDA every time rather
// than remembering: the host, NCCL and other libraries set the device too.
inline void bind(int ordinal) {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current == ordinal) return;
  cudaError_t e = cudaSetDevice(ordinal);
  if (e != cudaSuccess) fail_cuda(e, "cudaSetDevice(" + std::to_string(ordinal) + ")");
}
// bind() for paths that may not throw (frees, destructors): false when the
// device cannot be made current.
inline bool try_bind(int ordinal) noexcept {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current == ordinal) return true;
  return cudaSetDevice(ordinal) == cudaSuccess;
}

// A query of work outside any CUDA graph capture (cudaEventQuery,
// cudaStreamQuery, an event's synchronize) is one of the calls CUDA deems
// unsafe during a capture: where the calling thread's capture mode is global
// or thread-local (the default, and what a host that captures usually
// picks), it fails and invalidates the capture under way, even though what
// it asks about is not in it. libfsdp queries only work it knows to lie
// outside every capture (an event recorded inside one is never queried), so
// it makes such a call in this scope: the thread's mode relaxed, and put back.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() noexcept { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

}  // namespace fsdp::device::cuda
