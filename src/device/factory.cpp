// src/device/factory.cpp - see factory.h.
#include "factory.h"

#include "../base/error.h"
#include "cpu/cpu_device.h"
#ifdef FSDP_HAVE_CUDA
#include "cuda/cuda_device.h"
#endif

namespace fsdp::device {

std::unique_ptr<Device> make_compute_device(int cuda_ordinal, int cpu_threads) {
  if (cuda_ordinal < 0) return std::make_unique<CpuDevice>(cpu_threads, Pool::kDevice);
#ifdef FSDP_HAVE_CUDA
  return std::make_unique<cuda::CudaDevice>(cuda_ordinal);
#else
  fail(FSDP_ERR_UNSUPPORTED, "device=cuda: this build has no CUDA device (see fsdp_build_info())");
#endif
}

}  // namespace fsdp::device
