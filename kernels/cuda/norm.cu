// kernels/cuda/norm.cu - the sum of squares in the order of kernels/norm.h:
// one half-warp per step (thread l sums lane l, the lanes are folded with
// shuffles in fold_lanes' order), then the steps' fp32 sums added in double
// by blocks of a fixed shape, level after level, until one is left.
#include <algorithm>

#include "../norm.h"
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
  auto* partial = static_cast<float*>(scratch);
  step_sums<<<static_cast<unsigned>(blocks_of(steps, kStepsPerBlock)), kThreads, 0, s>>>(x, n, partial);
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

const void* norm_module_kernel() { return reinterpret_cast<const void*>(&step_sums); }

}  // namespace fsdp::kernels::cuda
