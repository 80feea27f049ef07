// The helpers test_cuda.cpp (the kernels) and test_cuda_streams.cpp (streams,
// memory and what the review of the GPU path found) share: one binary,
// test_cuda, whose name and filters tools/gpu-check.sh's stages use.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "base/error.h"
#include "device/cpu/cpu_device.h"
#include "device/cuda/cuda_device.h"
#include "gpu_presence.h"

// Skips without a GPU; fails where nvidia-smi lists one that CUDA cannot use (gpu_presence.h).
#define SKIP_WITHOUT_GPU() FSDP_SKIP_WITHOUT_GPU("GPU test not run")

namespace fsdp_test::cuda {

using fsdp::DType;
using fsdp::device::CpuDevice;
using fsdp::device::cuda::CudaDevice;

// Sizes: below a vector, a vector plus a tail, over a norm step (256), and
// over a level of the norm's fold (2048 steps); none a multiple of 4.
inline const size_t kSizes[] = {1, 7, 257, 3 * 256 + 5, 2048 * 256 + 1027};

inline std::vector<float> random_floats(size_t n, unsigned seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-scale, scale);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = i % 11 == 5 ? 0.0f : d(rng);
  return x;
}

// A device copy of host bytes, freed with the device.
struct DeviceArray {
  CudaDevice* dev;
  void* ptr;
  size_t nbytes;
  DeviceArray(CudaDevice& d, const void* host, size_t n) : dev(&d), ptr(d.alloc(n)), nbytes(n) {
    if (host != nullptr) d.copy_from_host(ptr, host, n);
  }
  ~DeviceArray() { dev->free(ptr); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  template <typename T>
  std::vector<T> read() const {
    std::vector<T> out(nbytes / sizeof(T));
    dev->copy_to_host(out.data(), ptr, nbytes);
    return out;
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
};

template <typename T>
DeviceArray upload(CudaDevice& d, const std::vector<T>& v) {
  return DeviceArray(d, v.data(), v.size() * sizeof(T));
}

template <typename T>
inline long first_difference(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return static_cast<long>(std::min(a.size(), b.size()));
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return static_cast<long>(i);
  }
  return -1;
}

// Raw storage of `n` elements of `t` filled from fp32 values.
inline std::vector<uint8_t> storage(CpuDevice& cpu, DType t, const std::vector<float>& values) {
  std::vector<uint8_t> out(values.size() * fsdp::dtype_size(t));
  cpu.cast(out.data(), t, values.data(), DType::kFp32, values.size());
  return out;
}

inline const DType kDtypes[] = {DType::kFp32, DType::kBf16, DType::kFp16};

// fn() throws an fsdp::Error of `status` whose message holds `text`.
template <typename Fn>
inline void expect_error(fsdp_status_t status, const std::string& text, Fn&& fn) {
  try {
    fn();
    ADD_FAILURE() << "expected an error holding '" << text << "'";
  } catch (const fsdp::Error& e) {
    EXPECT_EQ(e.status(), status) << e.what();
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

// An optimizer pass's arrays on the CPU (params, grads, the two states and the
// params copy, empty when there is none) against the GPU's, bit for bit.
inline void expect_same_pass(const std::vector<float>& p, const std::vector<float>& g, const std::vector<float>& m,
                             const std::vector<float>& v, const std::vector<uint8_t>& out, const DeviceArray& dp,
                             const DeviceArray& dg, const DeviceArray& dm, const DeviceArray& dv,
                             const DeviceArray& dout) {
  EXPECT_EQ(first_difference(p, dp.read<float>()), -1) << "params";
  EXPECT_EQ(first_difference(g, dg.read<float>()), -1) << "grads";
  EXPECT_EQ(first_difference(m, dm.read<float>()), -1) << "exp_avg / momentum";
  EXPECT_EQ(first_difference(v, dv.read<float>()), -1) << "exp_avg_sq";
  if (!out.empty()) {
    EXPECT_EQ(first_difference(out, dout.read<uint8_t>()), -1) << "params copy";
  }
}

}  // namespace fsdp_test::cuda
