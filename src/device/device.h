// src/device/device.h - Device: the memory, copies and element-wise kernels the
// engine needs, behind one interface so that the engine (src/core) never sees
// CUDA. The CPU device implements it with threads; a CUDA device runs the same
// functors from kernels/ as CUDA kernels.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../../kernels/optim.h"
#include "../../kernels/quant.h"
#include "../../kernels/step.h"
#include "../base/dtype.h"
#include "stream.h"

namespace fsdp::device {

// One fused optimizer pass over `numel` fp32 elements. `out` (may be null)
// receives the updated params in `out_dtype`: the next step's gather source.
// The same pass can clear the grads it has read (no separate memset pass over
// them) and sum their squares (the grad norm of the next clipping decision,
// or a finiteness check), as stored, before `grad_scale`; the sum is the one
// Device::sum_squares returns for the same grads, bit for bit.
struct AdamArgs {
  kernels::AdamOp op;
  float* params;
  float* grads;
  float* exp_avg;
  float* exp_avg_sq;
  void* out;
  DType out_dtype;
  size_t numel;
  bool zero_grads = false;    // grads[i] = 0 once read
  double* grad_sq = nullptr;  // if set, receives sum(grads[i]^2)
};

struct SgdArgs {
  kernels::SgdOp op;
  float* params;
  float* grads;
  float* momentum_buf;  // null when momentum == 0
  void* out;
  DType out_dtype;
  size_t numel;
  bool zero_grads = false;    // grads[i] = 0 once read
  double* grad_sq = nullptr;  // if set, receives sum(grads[i]^2)
};

// Host memory as a device copies to and from it fastest: plain aligned
// memory for the CPU; page-locked (pinned) memory for a GPU, which its copy
// engines reach asynchronously. Plain functions, so that any allocator (the
// CPU device's block cache) can take them. `alloc` returns 64-byte aligned
// memory, or null when there is none left.
struct HostMemory {
  void* (*alloc)(size_t nbytes);
  void (*free)(void* ptr);
};
// 64-byte aligned memory from the system (std::aligned_alloc / std::free).
HostMemory plain_host_memory();

// A model's param ranges (kernels::OptimSpan) as a device keeps them for its
// multi-tensor optimizer passes, with the param groups (kernels::StepGroup)
// the spans' `group` indexes: on a GPU also a table in device memory,
// uploaded once and reused for every step while the ranges stay the same.
using ShardSpan = kernels::OptimSpan;
class SpanTable {
 public:
  SpanTable(std::vector<ShardSpan> spans, std::vector<kernels::StepGroup> groups)
      : spans_(std::move(spans)), groups_(std::move(groups)) {}
  virtual ~SpanTable() = default;
  const std::vector<ShardSpan>& spans() const { return spans_; }
  const std::vector<kernels::StepGroup>& groups() const { return groups_; }

 private:
  std::vector<ShardSpan> spans_;
  std::vector<kernels::StepGroup> groups_;
};

// Grads whose sums of squares one multi-tensor pass writes, each into its
// own double in the device's memory (the units whose grad shard the host
// wrote in place, whose sums no accumulation computed).
struct SquaresSpan {
  const float* x;
  size_t numel;
  double* out;
};
class SquaresTable {
 public:
  explicit SquaresTable(std::vector<SquaresSpan> spans) : spans_(std::move(spans)) {}
  virtual ~SquaresTable() = default;
  const std::vector<SquaresSpan>& spans() const { return spans_; }

 private:
  std::vector<SquaresSpan> spans_;
};

// Where a Device's memory lives: the accelerator's (or, for the CPU device,
// the pool standing in for it) or the host's, where offload=cpu keeps state.
enum class Pool { kDevice, kHost };

// What a stream of the device's own reports: each task's start and end (the
// trace's tracks), and how to make a running task fail at once (abort the
// communicators it may wait on) when the stream is destroyed with work queued.
struct StreamHooks {
  std::function<void(const std::string& name, bool begin)> observer;
  std::function<void(const std::string& reason)> abort;
  // How long a task may wait for an event of another stream before it fails
  // with FSDP_ERR_TIMEOUT naming that event (0: no limit).
  double timeout_s = 0;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual const char* name() const = 0;
  virtual Pool pool() const = 0;
  // Whether the host can read and write this device's memory through its
  // pointers (checkpoint files are then written from and read into it
  // directly, with no staging copy).
  virtual bool host_visible() const = 0;
  // The host memory this device's copies to and from the host want: where
  // offload=cpu keeps the state it copies from and into every step.
  virtual HostMemory host_memory() const = 0;

  // A stream of the engine's own (the comm stream, the offload copy
  // streams); `priority` > 0 runs ahead of compute where the device can.
  virtual std::unique_ptr<Stream> create_stream(std::string name, int priority, StreamHooks hooks) = 0;
  // The stream a host passed to the API as `native` (a cudaStream_t on CUDA;
  // on the CPU, NULL is the calling thread). Throws INVALID_ARGUMENT naming
  // `call` for a handle this device cannot use.
  virtual Stream& caller_stream(void* native, const char* call) = 0;

  // Throws Error(FSDP_ERR_OUT_OF_MEMORY) when the allocation fails.
  virtual void* alloc(size_t nbytes) = 0;
  virtual void free(void* ptr) noexcept = 0;
  // An all-zero block: one released by free_zeroed if there is one (no pass
  // over it), else a block zeroed now.
  virtual void* alloc_zeroed(size_t nbytes) = 0;
  // Releases a block the caller knows to be all zero (for alloc_zeroed).
  virtual void free_zeroed(void* ptr) noexcept = 0;
  virtual void zero(void* ptr, size_t nbytes) = 0;
  // Every bit set: NaN in fp32, bf16 and fp16 (debug_poison's fill).
  virtual void fill_nan(void* ptr, size_t nbytes) = 0;
  virtual void copy(void* dst, const void* src, size_t nbytes) = 0;
  virtual void copy_from_host(void* dst, const void* host_src, size_t nbytes) = 0;
  virtual void copy_to_host(void* host_dst, const void* src, size_t nbytes) = 0;

  virtual void cast(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t numel) = 0;
  // acc[i] += scale * src[i]; with `acc_sq` (a double in this device's
  // memory), in the same pass, *acc_sq = the sum of acc[i]^2 afterwards
  // (sum_squares of acc, bit for bit): the grad norm of a grad shard, taken
  // while the reduction writes it.
  virtual void accumulate(float* acc, const void* src, DType src_dtype, float scale, size_t numel, double* acc_sq) = 0;
  // acc[i] = acc[i] + src[i] in fp32, rounded once to acc_dtype
  // (kernels::AddOp): a framework's grad added into a grad buffer of the
  // param dtype (fsdp_grad_accumulate). `src` overlaps `acc` only as itself.
  virtual void add(void* acc, DType acc_dtype, const void* src, DType src_dtype, size_t numel) = 0;
  // Whether this device's kernels can read `ptr` (on a GPU: its own memory,
  // managed memory, or host memory mapped for it), for the pointers a host
  // hands in; a bad one would fault the device, not fail a call.
  virtual bool readable(const void* ptr) const = 0;
  // The quantized all-gather's two ends (kernels/quant.h): `packed` receives
  // x[0, n) of x_dtype as a packed slice (kernels::quant_packed_bytes(n,
  // block) bytes: the codes, then a scale per block); dequantize unpacks
  // `n_slices` such slices, laid one after another, into out (n_slices * n
  // values of out_dtype, slice after slice).
  virtual void quantize(void* packed, const void* x, DType x_dtype, size_t n, size_t block, kernels::QType t) = 0;
  virtual void dequantize(void* out, DType out_dtype, const void* packed, size_t n_slices, size_t n, size_t block,
                          kernels::QType t) = 0;
  // The quantized reduction's end (kernels::dequantize_sum_block): out[i] =
  // scale * the sum over the n_slices packed slices, in slice (rank) order
  // in fp32, of their dequantized values (n values each; a slice starts
  // slice_stride bytes after the one before, at least its packed bytes).
  virtual void dequantize_sum(float* out, const void* packed, size_t n_slices, size_t slice_stride, size_t n,
                              size_t block, kernels::QType t, float scale) = 0;
  // cast and accumulate that also set src[i] = 0 once read: the grads read as
  // zeros again after the pass that consumes them, with no memset pass of
  // their own (the next backward adds into them as they are).
  virtual void cast_clear(void* dst, DType dst_dtype, void* src, DType src_dtype, size_t numel) = 0;
  virtual void accumulate_clear(float* acc, void* src, DType src_dtype, float scale, size_t numel, double* acc_sq) = 0;
  // Per-range passes (tests and benchmarks; the engine runs the span
  // passes); `grad_sq`, where set, is a double in this device's memory.
  virtual void adam(const AdamArgs& args) = 0;
  virtual void sgd(const SgdArgs& args) = 0;
  // Multi-tensor passes: one pass over every span of `table` (made by this
  // device), each span with its group's op for this step
  // (kernels::step_adam_op / step_sgd_op of the StepState `st`, in this
  // device's memory, and its own weight decay: AdamOp::with_weight_decay;
  // SGD's as op.weight_decay), the params copy in `out_dtype` where a span
  // has `out`, the grads cleared with `zero_grads`: the bits of adam / sgd per
  // span, in one launch on a GPU instead of one per param. Where the step
  // was skipped (st->skip), the pass only clears the grads.
  virtual std::unique_ptr<SpanTable> make_span_table(std::vector<ShardSpan> spans,
                                                     std::vector<kernels::StepGroup> groups) = 0;
  virtual void adam_spans(const SpanTable& table, const kernels::StepRule& rule, const kernels::StepState* st,
                          DType out_dtype, bool zero_grads) = 0;
  virtual void sgd_spans(const SpanTable& table, const kernels::StepRule& rule, const kernels::StepState* st,
                         DType out_dtype, bool zero_grads) = 0;
  // The step's scalars (kernels/step.h) where they live: with `unit_sq`,
  // st->sq = the n_units sums added in order (step_sum_units); then with
  // `rule`, the verdict (step_decide). One kernel of one thread on a GPU.
  virtual void step_scalars(kernels::StepState* st, const double* unit_sq, size_t n_units,
                            const kernels::StepRule* rule) = 0;
  // Sum of x[i]^2 in double, the same bits on every run, read by the host
  // (waits for the device outside a stream's task).
  virtual double sum_squares(const float* x, size_t numel) = 0;
  // Each span's sum_squares into its `out` (this device's memory), in one
  // pass over them all: the bits of sum_squares per span.
  virtual std::unique_ptr<SquaresTable> make_squares_table(std::vector<SquaresSpan> spans) = 0;
  virtual void sum_squares_table(const SquaresTable& table) = 0;
  // out[i] = scale * the sum over k of ins[k][i], in fp32 in the order of
  // kernels/reduce.h, rounded once to `dtype`; with `clear`, every input
  // element is zeroed once read. `out` overlaps no input. What a communicator
  // runs over its ranks' buffers when the host cannot read them.
  virtual void reduce_sum(void* out, void* const* ins, size_t n_ins, size_t numel, DType dtype, float scale,
                          bool clear) = 0;
  // out[i] = the sum over k of ins[k][i] in double, in rank order (the small
  // reductions of comm::Communicator::sum_f64 over a GPU's memory).
  virtual void reduce_sum_f64(double* out, const double* const* ins, size_t n_ins, size_t n) = 0;

  // What a communicator needs to move this device's memory itself (ranks as
  // threads of one process sharing a GPU): which pointers only the device
  // reaches, and points in the work queued so far that the other ranks'
  // streams wait for. An operation goes where the next one would: inside a
  // stream's task, that stream; elsewhere the operations are synchronous.
  // Whether `ptr` is memory the host cannot read through (a GPU's).
  virtual bool device_only(const void* ptr) const = 0;
  // An event that completes after the operations queued so far.
  virtual EventPtr mark() = 0;
  // The operations queued from now on start after `ev` (the host does not
  // block where the device can order them itself).
  virtual void wait_mark(const EventPtr& ev) = 0;
  // The stream the next operation goes to, as the device's own handle (a
  // cudaStream_t); null on the CPU.
  virtual void* native_stream() = 0;
};

}  // namespace fsdp::device
