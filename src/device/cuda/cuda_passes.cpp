// src/device/cuda/cuda_passes.cpp - CudaDevice's element-wise passes: casts,
// adds and accumulations (with their fused sums of squares), the quantized
// gather's pack and unpack, the per-range optimizer passes, the reductions
// over ranks sharing the GPU and the step's scalars; each queued on the
// stream the next operation goes to (CudaDevice::target) through the
// launchers of kernels/cuda. The memory, streams and multi-tensor tables are
// cuda_device.cpp's; see cuda_device.h.
#include <string>

#include "../../../kernels/cuda/launch.h"
#include "../../base/error.h"
#include "../../base/host_waits.h"
#include "cuda_check.h"
#include "cuda_device.h"

namespace fsdp::device::cuda {
namespace {

namespace k = fsdp::kernels::cuda;

fsdp_dtype_t code(DType t) { return static_cast<fsdp_dtype_t>(t); }

}  // namespace

void CudaDevice::cast(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t numel) {
  bind(ordinal_);
  issued(k::cast(dst, code(dst_dtype), const_cast<void*>(src), code(src_dtype), numel, false, target()), "cast");
}

void CudaDevice::add(void* acc, DType acc_dtype, const void* src, DType src_dtype, size_t numel) {
  bind(ordinal_);
  issued(k::add(acc, code(acc_dtype), src, code(src_dtype), numel, target()), "add");
}

void CudaDevice::quantize(void* packed, const void* x, DType x_dtype, size_t n, size_t block, kernels::QType t) {
  bind(ordinal_);
  issued(k::quantize(packed, x, code(x_dtype), n, block, t, target()), "quantize");
}

void CudaDevice::dequantize(void* out, DType out_dtype, const void* packed, size_t n_slices, size_t n, size_t block,
                            kernels::QType t) {
  bind(ordinal_);
  issued(k::dequantize(out, code(out_dtype), packed, n_slices, n, block, t, target()), "dequantize");
}

void CudaDevice::dequantize_sum(float* out, const void* packed, size_t n_slices, size_t slice_stride, size_t n,
                                size_t block, kernels::QType t, float scale) {
  bind(ordinal_);
  issued(k::dequantize_sum(out, packed, n_slices, slice_stride, n, block, t, scale, target()), "dequantize_sum");
}

void CudaDevice::cast_clear(void* dst, DType dst_dtype, void* src, DType src_dtype, size_t numel) {
  bind(ordinal_);
  issued(k::cast(dst, code(dst_dtype), src, code(src_dtype), numel, true, target()), "cast_clear");
}

namespace {

// A scratch block of the pool for one pass, on the stream the pass goes to;
// freed there after it (stream-ordered: in a captured graph, memory nodes).
class PassScratch {
 public:
  PassScratch(cudaMemPool_t pool, size_t nbytes, cudaStream_t s) : s_(s) {
    check(cudaMallocFromPoolAsync(&p_, nbytes == 0 ? 1 : nbytes, pool, s), "cudaMallocFromPoolAsync (scratch)");
  }
  ~PassScratch() {
    if (p_ != nullptr) cudaFreeAsync(p_, s_);
  }
  PassScratch(const PassScratch&) = delete;
  PassScratch& operator=(const PassScratch&) = delete;
  void* get() const { return p_; }

 private:
  cudaStream_t s_;
  void* p_ = nullptr;
};

}  // namespace

void CudaDevice::accumulate_pass(float* acc, void* src, DType src_dtype, float scale, size_t numel, bool clear,
                                 double* acc_sq) {
  bind(ordinal_);
  cudaStream_t s = target();
  if (acc_sq == nullptr) {
    issued(k::accumulate(acc, src, code(src_dtype), scale, numel, clear, s), "accumulate");
    return;
  }
  // The sums of squares of what the pass writes, in the same pass: the grad
  // shard is not read again for its norm, and the sum stays on the device.
  {
    PassScratch scratch(mem_pool(), k::sum_squares_scratch_nbytes(numel), s);
    check(k::accumulate_sq(acc, src, code(src_dtype), scale, numel, clear, acc_sq, scratch.get(), s),
          "accumulate (with the sum of squares)");
  }
  issued(cudaSuccess, "accumulate");
}

void CudaDevice::accumulate(float* acc, const void* src, DType src_dtype, float scale, size_t numel, double* acc_sq) {
  accumulate_pass(acc, const_cast<void*>(src), src_dtype, scale, numel, false, acc_sq);
}

void CudaDevice::accumulate_clear(float* acc, void* src, DType src_dtype, float scale, size_t numel, double* acc_sq) {
  accumulate_pass(acc, src, src_dtype, scale, numel, true, acc_sq);
}

void CudaDevice::squares_into(const float* x, size_t numel, double* out, cudaStream_t s) {
  PassScratch scratch(mem_pool(), k::sum_squares_scratch_nbytes(numel), s);
  check(k::sum_squares(x, numel, out, scratch.get(), s), "sum of squares");
}

void CudaDevice::adam(const AdamArgs& a) {
  bind(ordinal_);
  cudaStream_t s = target();
  if (a.grad_sq != nullptr) squares_into(a.grads, a.numel, a.grad_sq, s);  // the raw grads', before the pass clears them
  issued(k::adam(a.op, a.params, a.grads, a.exp_avg, a.exp_avg_sq, a.out, code(a.out_dtype), a.numel, a.zero_grads, s),
         "adam");
}

void CudaDevice::sgd(const SgdArgs& a) {
  bind(ordinal_);
  cudaStream_t s = target();
  if (a.grad_sq != nullptr) squares_into(a.grads, a.numel, a.grad_sq, s);
  issued(k::sgd(a.op, a.params, a.grads, a.momentum_buf, a.out, code(a.out_dtype), a.numel, a.zero_grads, s), "sgd");
}

double CudaDevice::sum_squares(const float* x, size_t numel) {
  bind(ordinal_);
  cudaStream_t s = target();
  double v = 0.0;
  {
    PassScratch out(mem_pool(), sizeof(double), s);
    squares_into(x, numel, static_cast<double*>(out.get()), s);
    check(cudaMemcpyAsync(&v, out.get(), sizeof v, cudaMemcpyDeviceToHost, s), "copying a sum of squares to the host");
  }
  base::note_host_wait();
  check(cudaStreamSynchronize(s), "sum of squares");
  return v;
}

void CudaDevice::reduce_sum(void* out, void* const* ins, size_t n_ins, size_t numel, DType dtype, float scale,
                            bool clear) {
  if (n_ins > k::kMaxReduceInputs) {
    fail(FSDP_ERR_UNSUPPORTED, "cuda device: a reduction over " + std::to_string(n_ins) +
                                   " ranks sharing one GPU; at most " + std::to_string(k::kMaxReduceInputs) +
                                   " ranks can share a GPU");
  }
  bind(ordinal_);
  issued(k::reduce_sum(out, ins, n_ins, code(dtype), numel, scale, clear, target()), "reduce_sum");
}

void CudaDevice::reduce_sum_f64(double* out, const double* const* ins, size_t n_ins, size_t n) {
  if (n_ins > k::kMaxReduceInputs) {
    fail(FSDP_ERR_UNSUPPORTED, "cuda device: a sum over " + std::to_string(n_ins) + " ranks sharing one GPU; at most " +
                                   std::to_string(k::kMaxReduceInputs) + " ranks can share a GPU");
  }
  bind(ordinal_);
  issued(k::reduce_sum_f64(out, ins, n_ins, n, target()), "reduce_sum_f64");
}

void CudaDevice::step_scalars(kernels::StepState* st, const double* unit_sq, size_t n_units,
                              const kernels::StepRule* rule) {
  bind(ordinal_);
  issued(k::step_scalars(st, unit_sq, n_units, rule, target()), "the step's scalars");
}

}  // namespace fsdp::device::cuda
