// benchmarks/bench_cuda_util.h - the GPU timing the CUDA benchmarks share:
// best of several runs of work queued as a task of a CudaStream, timed by
// CUDA events on that stream.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <functional>

#include "device/cuda/cuda_stream.h"

namespace fsdp::bench {

// Best of `reps` GPU timings of fn() run as a task of `s` (so that the
// device's operations and libfsdp's collectives go to it), between CUDA
// events on `s`, after one warm-up; in seconds.
inline double best_gpu_seconds(device::cuda::CudaStream& s, int reps, const std::function<void()>& fn) {
  static const device::Label kWarmUp = device::make_label("warm-up"), kTimed = device::make_label("timed");
  cudaStream_t native = s.native();
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  s.submit(kWarmUp, fn)->wait(0);
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a, native);
    s.submit(kTimed, fn);
    cudaEventRecord(b, native);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    best = std::min(best, ms * 1e-3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return best;
}

}  // namespace fsdp::bench
