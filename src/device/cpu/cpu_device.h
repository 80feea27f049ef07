// src/device/cpu/cpu_device.h - the CPU Device: host memory, memcpy, and the
// kernels/ functors run in vectorisable loops over a per-context thread pool.
#pragma once

#include <memory>

#include "../device.h"
#include "thread_pool.h"

namespace fsdp::device {

class CpuDevice final : public Device {
 public:
  explicit CpuDevice(int n_threads) : pool_(n_threads) {}
  const char* name() const override { return "cpu"; }

  void* alloc(size_t nbytes) override;
  void free(void* ptr) noexcept override;
  void zero(void* ptr, size_t nbytes) override;
  void copy(void* dst, const void* src, size_t nbytes) override;
  void copy_from_host(void* dst, const void* host_src, size_t nbytes) override;
  void copy_to_host(void* host_dst, const void* src, size_t nbytes) override;

  void cast(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t numel) override;
  void accumulate(float* acc, const void* src, DType src_dtype, float scale, size_t numel) override;
  void adam(const AdamArgs& args) override;
  void sgd(const SgdArgs& args) override;
  double sum_squares(const float* x, size_t numel) override;

 private:
  ThreadPool pool_;
};

}  // namespace fsdp::device
