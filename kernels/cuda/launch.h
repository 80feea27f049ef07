// kernels/cuda/launch.h - the CUDA kernels' host launchers. Each kernel runs
// the kernels/ functor that the CPU loops run, one element per thread
// iteration, with 16-byte loads and stores (8-byte for 16-bit arrays) in a
// grid-stride loop and a scalar tail; the kernels are compiled with
// --fmad=false, so they compute the CPU's bits (tests/test_cuda.cpp). Every
// launcher queues its work on `s` and returns the launch's error (it never
// synchronizes); the device (src/device/cuda) turns errors into Error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "../optim.h"
#include "../quant.h"
#include "../step.h"
#include "fsdp.h"

namespace fsdp::kernels::cuda {

// out = cast(in); with `clear`, in[i] = 0 once read.
cudaError_t cast(void* out, fsdp_dtype_t out_dtype, void* in, fsdp_dtype_t in_dtype, size_t n, bool clear,
                 cudaStream_t s);
// The quantized all-gather's ends (kernels/quant.h, Device::quantize and
// dequantize): x[0, n) packed, n_slices packed slices unpacked into out. A
// warp per block where the block is 128, 256, 512 or 1024 values and the
// values are aligned for 4-element vectors, else a thread block per block
// (quantize) or a thread per value. Packed slices hold fp32 scales: a packed
// buffer that is not 4-byte aligned is cudaErrorInvalidValue, nothing
// launched.
cudaError_t quantize(void* packed, const void* x, fsdp_dtype_t x_dtype, size_t n, size_t block, QType t,
                     cudaStream_t s);
cudaError_t dequantize(void* out, fsdp_dtype_t out_dtype, const void* packed, size_t n_slices, size_t n, size_t block,
                       QType t, cudaStream_t s);
// The quantized reduction's end (Device::dequantize_sum): the n_slices
// slices' dequantized values summed in slice order (a warp per block, as
// above, else a thread per value); packed and slice_stride 4-byte aligned.
cudaError_t dequantize_sum(float* out, const void* packed, size_t n_slices, size_t slice_stride, size_t n, size_t block,
                           QType t, float scale, cudaStream_t s);
// acc[i] = acc[i] + src[i] in fp32, rounded once to acc's type (AddOp).
cudaError_t add(void* acc, fsdp_dtype_t acc_dtype, const void* src, fsdp_dtype_t src_dtype, size_t n,
                cudaStream_t s);
// acc[i] += scale * src[i] (AccumulateOp); with `clear`, src[i] = 0 once read.
cudaError_t accumulate(float* acc, void* src, fsdp_dtype_t src_dtype, float scale, size_t n, bool clear,
                       cudaStream_t s);
// One AdamOp / SgdOp pass; `out` (may be null) receives the updated params in
// `out_dtype`; with `zero_grads`, grads[i] = 0 once read. `momentum` null: SGD
// without state.
cudaError_t adam(const AdamOp& op, float* params, float* grads, float* exp_avg, float* exp_avg_sq, void* out,
                 fsdp_dtype_t out_dtype, size_t n, bool zero_grads, cudaStream_t s);
cudaError_t sgd(const SgdOp& op, float* params, float* grads, float* momentum, void* out, fsdp_dtype_t out_dtype,
                size_t n, bool zero_grads, cudaStream_t s);

// out[i] = scale * the sum over k < n_ins of ins[k][i] (ReduceSumOp of
// kernels/reduce.h: fp32 in rank order, one rounding); with `clear`, every
// ins[k][i] = 0 once read. At most kMaxReduceInputs inputs, passed by value
// (no device array of pointers to keep alive); more is cudaErrorInvalidValue.
constexpr size_t kMaxReduceInputs = 64;
cudaError_t reduce_sum(void* out, void* const* ins, size_t n_ins, fsdp_dtype_t dtype, size_t n, float scale, bool clear,
                       cudaStream_t s);

// Multi-tensor optimizer passes: one launch over many spans (OptimSpan, in
// device memory), each block taking one chunk of at most kSpanChunk elements
// of one span (the chunk table, in device memory too, says which), with the
// per-range passes' 16-byte accesses where that span's arrays are aligned
// (the scalar path otherwise; the same bits either way). Each span gets its
// group's op for this step, made on the device from the step's scalars `st`
// (kernels::step_adam_op / step_sgd_op over groups[span.group] and `rule`),
// with its own weight decay; where st->skip, the pass only clears the
// grads (with `zero_grads`). `has_out`: every span has a params copy in
// `out_dtype` (else none has); SGD's `momentum`: every span has state1.
struct SpanChunk {
  uint64_t span;
  uint64_t begin;
};
constexpr size_t kSpanChunk = 16384;
// The chunks of spans[0, n) (host memory), in span order.
std::vector<SpanChunk> span_chunks(const OptimSpan* spans, size_t n);
cudaError_t adam_spans(const OptimSpan* spans, const SpanChunk* chunks, size_t n_chunks, const StepGroup* groups,
                       const StepRule& rule, const StepState* st, bool has_out, fsdp_dtype_t out_dtype,
                       bool zero_grads, cudaStream_t s);
cudaError_t sgd_spans(const OptimSpan* spans, const SpanChunk* chunks, size_t n_chunks, const StepGroup* groups,
                      const StepRule& rule, const StepState* st, bool momentum, bool has_out, fsdp_dtype_t out_dtype,
                      bool zero_grads, cudaStream_t s);

// The squares of x[0, n) summed in the order of kernels/norm.h into *out (a
// device double): each step's fp32 sum is the CPU's bit for bit; the steps'
// sums are added in double in a fixed tree, so every run gives the same bits.
// `scratch` is device memory of sum_squares_scratch_nbytes(n) bytes.
size_t sum_squares_scratch_nbytes(size_t n);
cudaError_t sum_squares(const float* x, size_t n, double* out, void* scratch, cudaStream_t s);
// accumulate() whose pass also sums the squares of the values it wrote into
// *out (a device double), with sum_squares' bits for them: the grad shard is
// not read again for its norm. `scratch` as sum_squares'.
cudaError_t accumulate_sq(float* acc, void* src, fsdp_dtype_t src_dtype, float scale, size_t n, bool clear,
                          double* out, void* scratch, cudaStream_t s);
// sum_squares of many arrays: the pass that reads them is one launch (each
// block one run of steps of one array: the chunk table), then each array's
// steps are folded into its `out` as sum_squares folds them (its bits).
// `scratch`: device memory of sum_squares_scratch_nbytes(numel), each array
// its own.
struct SquaresEntry {
  const float* x;
  size_t numel;
  double* out;
  void* scratch;
};
struct SquaresChunk {
  uint64_t entry;
  uint64_t first_step;
};
std::vector<SquaresChunk> squares_chunks(const SquaresEntry* entries, size_t n);
// `entries_dev` and `chunks_dev` in device memory; `entries` (host) the same.
cudaError_t sum_squares_table(const SquaresEntry* entries_dev, const SquaresChunk* chunks_dev, size_t n_chunks,
                              const SquaresEntry* entries, size_t n, cudaStream_t s);
// out[i] = the sum over k < n_ins of ins[k][i] in double in rank order (at
// most kMaxReduceInputs, passed by value).
cudaError_t reduce_sum_f64(double* out, const double* const* ins, size_t n_ins, size_t n, cudaStream_t s);
// The step's scalars (kernels/step.h): with `unit_sq`, st->sq = the units'
// sums in order; then with `rule`, the verdict. One thread.
cudaError_t step_scalars(StepState* st, const double* unit_sq, size_t n_units, const StepRule* rule, cudaStream_t s);

// *flag (a device int) is set to 1 when some x[i] is an infinity or a NaN;
// left as it is otherwise (the caller clears it once per step).
cudaError_t flag_non_finite(const float* x, size_t n, int* flag, cudaStream_t s);

// Loads every kernel above into the current device's context. Under lazy
// loading (CUDA_MODULE_LOADING=LAZY, the default since CUDA 12.2) a kernel is
// otherwise loaded at its first launch, and loading may wait for the whole
// context: for every stream's queued work, the application's included (seen
// on the first H100 run: a first launch on a non-blocking stream waited for
// the legacy default stream). The device calls this once when it is made.
// On an error, `what` says which step failed.
cudaError_t load_kernels(const char** what);

// One kernel of each translation unit above, for load_kernels: a unit's
// kernels are one CUDA module, found through any of its kernels.
const void* elementwise_module_kernel();
const void* norm_module_kernel();

}  // namespace fsdp::kernels::cuda
