// src/device/cpu/cpu_device.h - the CPU Device: host memory, memcpy, and the
// kernels/ functors run in vectorisable loops over a per-context thread pool.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <vector>

#include "../device.h"
#include "block_cache.h"
#include "cpu_stream.h"
#include "thread_pool.h"

namespace fsdp::device {

class CpuDevice final : public Device {
 public:
  // `mem_pool` labels the memory for accounting: with offload=cpu a context
  // has two CPU devices, so that the device <-> host copy path really runs.
  // `memory`: where its blocks come from (a GPU's pinned host memory when
  // this device holds offload=cpu's state for a CUDA context).
  CpuDevice(int n_threads, Pool mem_pool, HostMemory memory = plain_host_memory())
      : pool_(n_threads), mem_pool_(mem_pool), memory_(memory), cache_(kCacheBlocks, memory) {}
  const char* name() const override { return "cpu"; }
  bool host_visible() const override { return true; }
  HostMemory host_memory() const override { return memory_; }
  Pool pool() const override { return mem_pool_; }

  std::unique_ptr<Stream> create_stream(std::string name, int priority, StreamHooks hooks) override;
  // NULL: the calling thread (synchronous); otherwise a stream made by
  // create_host_stream on this device.
  Stream& caller_stream(void* native, const char* call) override;
  // A stream for a host's compute that runs its tasks on a worker thread,
  // `delay` late each: a host passes it as the API's `stream` and queues its
  // compute on it. Owned by the device. Tests use it to show that the engine
  // orders its work after the host's through events, not by returning late.
  Stream* create_host_stream(std::chrono::microseconds delay);

  void* alloc(size_t nbytes) override;
  void free(void* ptr) noexcept override;
  void* alloc_zeroed(size_t nbytes) override;
  void free_zeroed(void* ptr) noexcept override;
  void zero(void* ptr, size_t nbytes) override;
  void fill_nan(void* ptr, size_t nbytes) override;
  void copy(void* dst, const void* src, size_t nbytes) override;
  void copy_from_host(void* dst, const void* host_src, size_t nbytes) override;
  void copy_to_host(void* host_dst, const void* src, size_t nbytes) override;

  void cast(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t numel) override;
  void accumulate(float* acc, const void* src, DType src_dtype, float scale, size_t numel, double* acc_sq) override;
  void add(void* acc, DType acc_dtype, const void* src, DType src_dtype, size_t numel) override;
  bool readable(const void* ptr) const override { return ptr != nullptr; }
  void quantize(void* packed, const void* x, DType x_dtype, size_t n, size_t block, kernels::QType t) override;
  void dequantize(void* out, DType out_dtype, const void* packed, size_t n_slices, size_t n, size_t block,
                  kernels::QType t) override;
  void dequantize_sum(float* out, const void* packed, size_t n_slices, size_t slice_stride, size_t n, size_t block,
                      kernels::QType t, float scale) override;
  void cast_clear(void* dst, DType dst_dtype, void* src, DType src_dtype, size_t numel) override;
  void accumulate_clear(float* acc, void* src, DType src_dtype, float scale, size_t numel, double* acc_sq) override;
  void adam(const AdamArgs& args) override;
  void sgd(const SgdArgs& args) override;
  double sum_squares(const float* x, size_t numel) override;
  // The host's passes span by span (adam / sgd per span).
  std::unique_ptr<SpanTable> make_span_table(std::vector<ShardSpan> spans,
                                             std::vector<kernels::StepGroup> groups) override;
  void adam_spans(const SpanTable& table, const kernels::StepRule& rule, const kernels::StepState* st, DType out_dtype,
                  bool zero_grads) override;
  void sgd_spans(const SpanTable& table, const kernels::StepRule& rule, const kernels::StepState* st, DType out_dtype,
                 bool zero_grads) override;
  void step_scalars(kernels::StepState* st, const double* unit_sq, size_t n_units,
                    const kernels::StepRule* rule) override;
  std::unique_ptr<SquaresTable> make_squares_table(std::vector<SquaresSpan> spans) override;
  void sum_squares_table(const SquaresTable& table) override;
  void reduce_sum(void* out, void* const* ins, size_t n_ins, size_t numel, DType dtype, float scale,
                  bool clear) override;
  void reduce_sum_f64(double* out, const double* const* ins, size_t n_ins, size_t n) override;
  // The host reads all of this device's memory, and its operations are done
  // when they return: a mark has completed, and waiting for one blocks.
  bool device_only(const void*) const override { return false; }
  EventPtr mark() override;
  void wait_mark(const EventPtr& ev) override;
  void* native_stream() override { return nullptr; }

 private:
  template <bool kClear>
  void cast_pass(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t numel);
  template <bool kClear>
  void accumulate_pass(float* acc, const void* src, DType src_dtype, float scale, size_t numel, double* acc_sq);

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  static constexpr bool kCacheBlocks = false;  // each free reaches the sanitizer
#else
  static constexpr bool kCacheBlocks = true;
#endif
  ThreadPool pool_;
  InlineStream inline_;
  std::mutex host_streams_mu_;
  std::vector<std::unique_ptr<WorkerStream>> host_streams_;
  Pool mem_pool_;
  HostMemory memory_;
  BlockCache cache_;
};

}  // namespace fsdp::device
