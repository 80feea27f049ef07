// When a GPU test may skip: only where no GPU is there to use. CUDA finding
// no device is not enough. A driver older than the toolkit
// (cudaErrorInsufficientDriver), or a container without the device files,
// also gives no device, and a machine with a GPU would then pass the GPU
// suite by skipping all of it. So when nvidia-smi -L lists a GPU that CUDA
// cannot use, the test fails and says why. CUDA_VISIBLE_DEVICES set to ""
// or -1 hides the GPUs on purpose, and then the test skips. With
// FSDP_REQUIRE_GPU=1 (tools/gpu-check.sh sets it) it fails instead of any
// skip, as the Python and Go bindings' GPU tests do.
// tests/test_gpu_check.py checks this rule with a stand-in nvidia-smi.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

namespace fsdp_test {

// How many GPUs nvidia-smi -L lists: its lines that start with "GPU ". 0 when
// nvidia-smi is missing or fails.
inline int gpus_listed_by_nvidia_smi() {
  std::unique_ptr<FILE, int (*)(FILE*)> p(popen("nvidia-smi -L 2>/dev/null", "r"), pclose);
  if (!p) return 0;
  int n = 0;
  char line[512];
  bool at_line_start = true;
  while (std::fgets(line, sizeof line, p.get()) != nullptr) {
    if (at_line_start && std::strncmp(line, "GPU ", 4) == 0) ++n;
    at_line_start = std::strchr(line, '\n') != nullptr;
  }
  return n;
}

// Why CUDA finds no device although nvidia-smi lists one; "" when CUDA can
// use a device, when no GPU is listed, or when CUDA_VISIBLE_DEVICES hides them.
inline std::string listed_gpu_unusable() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaSuccess && n > 0) return "";
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");  // NOLINT(concurrency-mt-unsafe): read-only
  if (visible != nullptr && (visible[0] == '\0' || visible[0] == '-')) return "";
  const int listed = gpus_listed_by_nvidia_smi();
  if (listed == 0) return "";
  std::string why =
      "nvidia-smi -L lists " + std::to_string(listed) + " GPU(s), but CUDA can use none (cudaGetDeviceCount: ";
  why += e == cudaSuccess ? std::string("0 devices") : std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
  why += ")";
  if (visible != nullptr) why += std::string(" with CUDA_VISIBLE_DEVICES=") + visible;
  why +=
      ". Is the driver older than this CUDA toolkit needs (R580+ for CUDA 13), or are the device files missing? "
      "A GPU test fails here rather than skip";
  return why;
}

// Whether every GPU test must run (FSDP_REQUIRE_GPU=1).
inline bool gpu_required() {
  const char* v = std::getenv("FSDP_REQUIRE_GPU");  // NOLINT(concurrency-mt-unsafe): read-only
  return v != nullptr && std::strcmp(v, "1") == 0;
}

}  // namespace fsdp_test

// Skips the test, saying "no CUDA device can be used here: <what>", where no
// GPU is there to use; fails it where nvidia-smi lists a GPU that CUDA
// cannot use, or with FSDP_REQUIRE_GPU=1. Either way the test returns.
#define FSDP_SKIP_WITHOUT_GPU(what)                                                                               \
  do {                                                                                                            \
    int fsdp_n_ = 0;                                                                                              \
    if (cudaGetDeviceCount(&fsdp_n_) != cudaSuccess || fsdp_n_ == 0) {                                            \
      const std::string fsdp_why_ = ::fsdp_test::listed_gpu_unusable();                                           \
      if (!fsdp_why_.empty()) GTEST_FAIL() << fsdp_why_;                                                          \
      if (::fsdp_test::gpu_required()) GTEST_FAIL() << "no CUDA device can be used here, and FSDP_REQUIRE_GPU=1"; \
      GTEST_SKIP() << "no CUDA device can be used here: " << (what);                                              \
    }                                                                                                             \
  } while (0)
