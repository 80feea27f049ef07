// kernels/cuda/norm.cu - the sum of squares in the order of kernels/norm.h:
// one half-warp per step (thread l sums lane l, the lanes are folded with
// shuffles in fold_lanes' order), then the steps' fp32 sums added in double
// by blocks of a fixed shape, level after level, until one is left; the same
// fused into the accumulation into a grad shard, and over many arrays in one
// launch; and the step's scalars (kernels/step.h) and the rank-order sum of
// doubles that the step's norm needs on the device.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "../cast.h"
#include "../norm.h"
#include "../optim.h"
#include "../step.h"
#include "launch.h"

namespace fsdp::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr size_t kStepsPerBlock = kThreads / kSqLanes;  // one half-warp per step
constexpr size_t kPerThread = 8;                        // doubles a thread adds in a level
constexpr size_t kFanIn = kThreads * kPerThread;        // a level's block folds this many sums into one

size_t steps_of(size_t n) { return (n + kSqStep - 1) / kSqStep; }
// The steps' fp32 sums at the start of the scratch, in whole doubles.
size_t partial_doubles(size_t steps) { return (steps * sizeof(float) + sizeof(double) - 1) / sizeof(double); }
size_t blocks_of(size_t n, size_t per_block) { return (n + per_block - 1) / per_block; }

__global__ void __launch_bounds__(kThreads) step_sums(const float* x, size_t n, float* out) {
  size_t step = static_cast<size_t>(blockIdx.x) * kStepsPerBlock + threadIdx.x / kSqLanes;
  unsigned lane = threadIdx.x % kSqLanes;
  size_t b = step * kSqStep;
  size_t e = b + kSqStep < n ? b + kSqStep : n;
  float acc = b < n ? lane_sum_squares(x, b, e, lane) : 0.0f;
  // fold_lanes: lane[l] += lane[l + w] for w = 8, 4, 2, 1 (lane 0 ends with the step's sum).
  for (unsigned w = kSqLanes / 2; w > 0; w /= 2) acc += __shfl_down_sync(0xffffffffu, acc, w, kSqLanes);
  if (lane == 0 && b < n) out[step] = acc;
}

// out[blockIdx.x] = the sum of in[blockIdx.x * kFanIn, ...+kFanIn) in double:
// each thread adds its kPerThread consecutive values in order, then the block
// adds the threads' sums in a fixed tree.
template <typename In>
__global__ void __launch_bounds__(kThreads) fold(const In* in, size_t n, double* out) {
  __shared__ double sh[kThreads];
  size_t b = static_cast<size_t>(blockIdx.x) * kFanIn + threadIdx.x * kPerThread;
  double acc = 0.0;
  for (size_t k = 0; k < kPerThread && b + k < n; ++k) acc += static_cast<double>(in[b + k]);
  sh[threadIdx.x] = acc;
  __syncthreads();
  for (unsigned w = kThreads / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = sh[0];
}

// accumulate's pass with the squares of what it wrote: acc[i] += scale *
// src[i] (AccumulateOp's arithmetic; with kClear src[i] = 0 once read), and
// each step's sum of the new acc in lane order into out[step], as step_sums
// would compute it from acc: the grad shard is read and written once, not
// read again for its norm. A lane loads all its elements of a whole step
// before it stores any: with the stores between the loads (which the
// compiler may not reorder, acc and src could alias) every element waited
// for its load in turn, and the pass ran at 0.13 of copy bandwidth on an
// H100 (docs/gpu.md, "GPU runs"). The arithmetic and its order are the same.
template <typename In, bool kClear>
__global__ void __launch_bounds__(kThreads)
    accumulate_step_sums(float* __restrict__ acc, In* __restrict__ src, float scale, size_t n,
                         float* __restrict__ out) {
  constexpr size_t kPerLane = kSqStep / kSqLanes;
  size_t step = static_cast<size_t>(blockIdx.x) * kStepsPerBlock + threadIdx.x / kSqLanes;
  unsigned lane = threadIdx.x % kSqLanes;
  size_t b = step * kSqStep;
  float sq = 0.0f;
  if (b + kSqStep <= n) {
    float a[kPerLane], v[kPerLane];
#pragma unroll
    for (size_t k = 0; k < kPerLane; ++k) {
      a[k] = acc[b + lane + k * kSqLanes];
      v[k] = load(src, b + lane + k * kSqLanes);
    }
#pragma unroll
    for (size_t k = 0; k < kPerLane; ++k) {
      a[k] = a[k] + scale * v[k];
      sq = add_square(sq, a[k]);
    }
#pragma unroll
    for (size_t k = 0; k < kPerLane; ++k) {
      acc[b + lane + k * kSqLanes] = a[k];
      if (kClear) store(src, b + lane + k * kSqLanes, 0.0f);
    }
  } else if (b < n) {  // the last, partial step
    for (size_t i = b + lane; i < n; i += kSqLanes) {
      float a = acc[i] + scale * load(src, i);
      acc[i] = a;
      if (kClear) store(src, i, 0.0f);
      sq = add_square(sq, a);
    }
  }
  for (unsigned w = kSqLanes / 2; w > 0; w /= 2) sq += __shfl_down_sync(0xffffffffu, sq, w, kSqLanes);
  if (lane == 0 && b < n) out[step] = sq;
}

// step_sums over many arrays in one launch: block c takes kStepsPerBlock
// steps of entry chunks[c].entry, writing them where that entry's steps go.
__global__ void __launch_bounds__(kThreads)
    step_sums_table(const SquaresEntry* entries, const SquaresChunk* chunks) {
  const SquaresChunk c = chunks[blockIdx.x];
  const SquaresEntry en = entries[c.entry];
  size_t step = c.first_step + threadIdx.x / kSqLanes;
  unsigned lane = threadIdx.x % kSqLanes;
  size_t b = step * kSqStep;
  size_t e = b + kSqStep < en.numel ? b + kSqStep : en.numel;
  float acc = b < en.numel ? lane_sum_squares(en.x, b, e, lane) : 0.0f;
  for (unsigned w = kSqLanes / 2; w > 0; w /= 2) acc += __shfl_down_sync(0xffffffffu, acc, w, kSqLanes);
  if (lane == 0 && b < en.numel) static_cast<float*>(en.scratch)[step] = acc;
}

// out[i] = the sum over k of ins[k][i] in double, in rank order.
struct F64Inputs {
  const double* p[kMaxReduceInputs];
};
__global__ void __launch_bounds__(kThreads) sum_f64_kernel(double* out, F64Inputs ins, size_t n_ins, size_t n) {
  size_t i = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n) return;
  double acc = ins.p[0][i];
  for (size_t k = 1; k < n_ins; ++k) acc += ins.p[k][i];
  out[i] = acc;
}

// The step's scalars: one thread runs kernels/step.h's functors.
__global__ void step_scalars_kernel(StepState* st, const double* unit_sq, size_t n_units, StepRule rule,
                                    int has_rule) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  if (unit_sq != nullptr) step_sum_units(*st, unit_sq, n_units);
  if (has_rule != 0) step_decide(*st, rule);
}

// The steps' fp32 sums (at the start of `scratch`) folded into *out by the
// fixed tree of sum_squares.
cudaError_t fold_partials(size_t steps, double* out, void* scratch, cudaStream_t s) {
  auto* partial = static_cast<float*>(scratch);
  double* level = static_cast<double*>(scratch) + partial_doubles(steps);
  size_t m = blocks_of(steps, kFanIn);
  fold<float><<<static_cast<unsigned>(m), kThreads, 0, s>>>(partial, steps, m == 1 ? out : level);
  const double* in = level;
  while (m > 1) {
    size_t next = blocks_of(m, kFanIn);
    double* dst = next == 1 ? out : level + m;
    fold<double><<<static_cast<unsigned>(next), kThreads, 0, s>>>(in, m, dst);
    in = dst;
    level += m;
    m = next;
  }
  return cudaGetLastError();
}

}  // namespace

size_t sum_squares_scratch_nbytes(size_t n) {
  size_t steps = steps_of(n);
  size_t bytes = partial_doubles(steps) * sizeof(double);
  for (size_t m = blocks_of(steps, kFanIn); m > 1; m = blocks_of(m, kFanIn)) bytes += m * sizeof(double);
  return bytes;
}

cudaError_t sum_squares(const float* x, size_t n, double* out, void* scratch, cudaStream_t s) {
  if (n == 0) return cudaMemsetAsync(out, 0, sizeof(double), s);
  size_t steps = steps_of(n);
  step_sums<<<static_cast<unsigned>(blocks_of(steps, kStepsPerBlock)), kThreads, 0, s>>>(x, n,
                                                                                         static_cast<float*>(scratch));
  return fold_partials(steps, out, scratch, s);
}

cudaError_t accumulate_sq(float* acc, void* src, fsdp_dtype_t src_dtype, float scale, size_t n, bool clear,
                          double* out, void* scratch, cudaStream_t s) {
  if (n == 0) return cudaMemsetAsync(out, 0, sizeof(double), s);
  size_t steps = steps_of(n);
  auto grid = static_cast<unsigned>(blocks_of(steps, kStepsPerBlock));
  auto* partial = static_cast<float*>(scratch);
  auto go = [&](auto* in) {
    using I = std::remove_pointer_t<decltype(in)>;
    if (clear) {
      accumulate_step_sums<I, true><<<grid, kThreads, 0, s>>>(acc, in, scale, n, partial);
    } else {
      accumulate_step_sums<I, false><<<grid, kThreads, 0, s>>>(acc, in, scale, n, partial);
    }
  };
  switch (src_dtype) {
    case FSDP_DTYPE_FP32:
      go(static_cast<float*>(src));
      break;
    case FSDP_DTYPE_BF16:
      go(static_cast<bf16_t*>(src));
      break;
    case FSDP_DTYPE_FP16:
      go(static_cast<fp16_t*>(src));
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return fold_partials(steps, out, scratch, s);
}

std::vector<SquaresChunk> squares_chunks(const SquaresEntry* entries, size_t n) {
  std::vector<SquaresChunk> chunks;
  for (size_t k = 0; k < n; ++k) {
    size_t steps = steps_of(entries[k].numel);
    for (size_t st = 0; st < steps; st += kStepsPerBlock) chunks.push_back({static_cast<uint64_t>(k), st});
  }
  return chunks;
}

cudaError_t sum_squares_table(const SquaresEntry* entries_dev, const SquaresChunk* chunks_dev, size_t n_chunks,
                              const SquaresEntry* entries, size_t n, cudaStream_t s) {
  if (n_chunks > 0) step_sums_table<<<static_cast<unsigned>(n_chunks), kThreads, 0, s>>>(entries_dev, chunks_dev);
  cudaError_t e = cudaGetLastError();
  for (size_t k = 0; k < n && e == cudaSuccess; ++k) {
    e = entries[k].numel == 0 ? cudaMemsetAsync(entries[k].out, 0, sizeof(double), s)
                              : fold_partials(steps_of(entries[k].numel), entries[k].out, entries[k].scratch, s);
  }
  return e;
}

cudaError_t reduce_sum_f64(double* out, const double* const* ins, size_t n_ins, size_t n, cudaStream_t s) {
  if (n_ins == 0 || n_ins > kMaxReduceInputs) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  F64Inputs in{};
  for (size_t k = 0; k < n_ins; ++k) in.p[k] = ins[k];
  sum_f64_kernel<<<static_cast<unsigned>(blocks_of(n, kThreads)), kThreads, 0, s>>>(out, in, n_ins, n);
  return cudaGetLastError();
}

cudaError_t step_scalars(StepState* st, const double* unit_sq, size_t n_units, const StepRule* rule, cudaStream_t s) {
  StepRule r{};
  if (rule != nullptr) r = *rule;
  step_scalars_kernel<<<1, 32, 0, s>>>(st, unit_sq, n_units, r, rule != nullptr ? 1 : 0);
  return cudaGetLastError();
}

const void* norm_module_kernel() { return reinterpret_cast<const void*>(&step_sums); }

}  // namespace fsdp::kernels::cuda
