// src/device/cuda/cuda_device.h - the CUDA Device: memory from libfsdp's own
// stream-ordered pool on the device (cudaMallocFromPoolAsync; a private
// cudaMemPool_t that keeps freed blocks cached, so the device's default pool,
// which torch, CuPy or JAX may use, keeps its settings), the engine's streams
// as CUDA streams (cuda_stream.h), and the kernels of kernels/cuda, which run
// the CPU device's functors.
//
// Where work goes: an operation called inside a CudaStream's task is queued on
// that stream and returns at once (its results, sums of squares included,
// stay in device memory and are there once the task's event completes);
// called outside any task, it runs on the device's own stream and returns
// when it is done, as the CPU device's operations do.
#pragma once

#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "../device.h"
#include "cuda_stream.h"

namespace fsdp::device::cuda {

class MemPool;  // cuda_device.cpp

class CudaDevice final : public Device {
 public:
  // Device `ordinal` (as CUDA numbers them after CUDA_VISIBLE_DEVICES).
  // Throws UNSUPPORTED when no CUDA device can be used, INVALID_ARGUMENT for
  // an ordinal out of range.
  explicit CudaDevice(int ordinal);
  ~CudaDevice() override;
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  // How many CUDA devices this process can use (0 when there is no driver or
  // no GPU): what GPU tests check before they run.
  static int count();

  const char* name() const override { return "cuda"; }
  Pool pool() const override { return Pool::kDevice; }
  bool host_visible() const override { return false; }
  // Pinned (page-locked, portable) host memory: copies to and from it are
  // asynchronous on the copy streams. The CPU device that holds offload=cpu's
  // state takes its blocks from here and caches them.
  HostMemory host_memory() const override;
  int ordinal() const { return ordinal_; }

  std::unique_ptr<Stream> create_stream(std::string name, int priority, StreamHooks hooks) override;
  // `native` is a cudaStream_t of this device (NULL: the legacy default stream).
  Stream& caller_stream(void* native, const char* call) override;

  void* alloc(size_t nbytes) override;
  void free(void* ptr) noexcept override;
  void* alloc_zeroed(size_t nbytes) override;
  void free_zeroed(void* ptr) noexcept override { free(ptr); }
  void zero(void* ptr, size_t nbytes) override;
  void fill_nan(void* ptr, size_t nbytes) override;
  void copy(void* dst, const void* src, size_t nbytes) override;
  void copy_from_host(void* dst, const void* host_src, size_t nbytes) override;
  void copy_to_host(void* host_dst, const void* src, size_t nbytes) override;

  void cast(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t numel) override;
  void accumulate(float* acc, const void* src, DType src_dtype, float scale, size_t numel, double* acc_sq) override;
  void add(void* acc, DType acc_dtype, const void* src, DType src_dtype, size_t numel) override;
  bool readable(const void* ptr) const override;
  void quantize(void* packed, const void* x, DType x_dtype, size_t n, size_t block, kernels::QType t) override;
  void dequantize(void* out, DType out_dtype, const void* packed, size_t n_slices, size_t n, size_t block,
                  kernels::QType t) override;
  void dequantize_sum(float* out, const void* packed, size_t n_slices, size_t slice_stride, size_t n, size_t block,
                      kernels::QType t, float scale) override;
  void cast_clear(void* dst, DType dst_dtype, void* src, DType src_dtype, size_t numel) override;
  void accumulate_clear(float* acc, void* src, DType src_dtype, float scale, size_t numel, double* acc_sq) override;
  void adam(const AdamArgs& args) override;
  void sgd(const SgdArgs& args) override;
  // Reads the sum on the host: waits for the stream it was queued on.
  double sum_squares(const float* x, size_t numel) override;
  void reduce_sum(void* out, void* const* ins, size_t n_ins, size_t numel, DType dtype, float scale,
                  bool clear) override;
  void reduce_sum_f64(double* out, const double* const* ins, size_t n_ins, size_t n) override;
  // The spans, their groups and their chunks uploaded to device memory where
  // the next operation goes (in a task: on its stream, in order before the
  // launches queued after it; outside: synchronously), from a host copy the
  // table keeps; one launch per pass. A table is made at registration or
  // after a change of the spans, not per step. A launch on another stream
  // waits for the upload (an event).
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
  // Device memory (cudaMalloc*, the pool) is; host memory, pinned or not, and
  // managed memory are not.
  bool device_only(const void* ptr) const override;
  // A CUDA event recorded where the next operation goes; waiting for it is
  // cudaStreamWaitEvent there (outside a task, operations are synchronous and
  // the host waits).
  EventPtr mark() override;
  void wait_mark(const EventPtr& ev) override;
  void* native_stream() override { return target(); }

  // libfsdp's memory pool on this device (shared by the devices of one GPU).
  cudaMemPool_t mem_pool() const;

 private:
  // The stream an operation is queued on, and what follows its queueing: a
  // check of the launch, and outside a task a wait for it to finish.
  cudaStream_t target() const;
  void issued(cudaError_t e, const char* what);
  // accumulate (with `clear`: accumulate_clear).
  void accumulate_pass(float* acc, void* src, DType src_dtype, float scale, size_t numel, bool clear, double* acc_sq);
  // Queues on `s`: *out (device memory) = the sum of squares of x.
  void squares_into(const float* x, size_t numel, double* out, cudaStream_t s);

  int ordinal_;
  std::shared_ptr<MemPool> pool_;
  std::unique_ptr<CudaStream> ops_;                              // operations called outside any task
  std::mutex mu_;                                                // callers_; never held across a CUDA call
  std::map<cudaStream_t, std::unique_ptr<CudaStream>> callers_;  // the host's streams, wrapped
};

}  // namespace fsdp::device::cuda
