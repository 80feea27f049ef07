// benchmarks/bench_optimizer.cpp - the AdamW step of the CPU device on 2^24 fp32
// elements, as elements/s and as a fraction of the roof: a trivial loop with the
// same memory traffic (read p, g, m, v; write p, m, v: 28 bytes per element) on
// the same threads, timed in the same run. Prints one JSON object per line.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "bench_util.h"
#include "device/cpu/cpu_device.h"
#include "device/cpu/simd.h"

using fsdp::DType;
using fsdp::bench::best_seconds;
using fsdp::bench::JsonLine;
using fsdp::device::AdamArgs;
using fsdp::device::CpuDevice;
using fsdp::device::ThreadPool;

namespace {

// The roof: the same arrays, the same 28 bytes of traffic per element, the
// least arithmetic that keeps the compiler from eliding any of it, compiled
// with the same instruction-set clones as the library's loops.
FSDP_SIMD_CLONES void roof_loop(float* __restrict p, const float* __restrict g, float* __restrict m,
                                float* __restrict v, size_t b, size_t e) {
  for (size_t i = b; i < e; ++i) {
    float gi = g[i];
    p[i] = p[i] + 1e-30f * gi;
    m[i] = m[i] + gi;
    v[i] = v[i] + gi;
  }
}

}  // namespace

int main(int argc, char** argv) {
  size_t n = size_t{1} << 24;
  int reps = 5;
  if (argc > 1) n = static_cast<size_t>(std::atof(argv[1]));
  if (argc > 2) reps = std::atoi(argv[2]);
  for (int threads : {1, 2}) {
    CpuDevice dev(threads, fsdp::device::Pool::kDevice);
    ThreadPool pool(threads);
    auto alloc = [&](float init) {
      float* p = static_cast<float*>(dev.alloc(n * sizeof(float)));
      pool.parallel_for(n, 1024, [&](size_t b, size_t e) {  // first touch on the threads that use it
        for (size_t i = b; i < e; ++i) p[i] = init + 1e-7f * static_cast<float>(i % 1000);
      });
      return p;
    };
    float* p = alloc(0.5f);
    float* g = alloc(0.01f);
    float* m = alloc(0.0f);
    float* v = alloc(0.0f);
    void* out = dev.alloc(n * 2);

    double t_roof = best_seconds(
        reps, [&] { pool.parallel_for(n, 1024, [&](size_t b, size_t e) { roof_loop(p, g, m, v, b, e); }); });

    auto op = fsdp::kernels::AdamOp::make(1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, /*decoupled=*/true, 1, 1.0f);
    double t_adam = best_seconds(reps, [&] { dev.adam(AdamArgs{op, p, g, m, v, nullptr, DType::kFp32, n}); });
    double t_adam_bf16 = best_seconds(reps, [&] { dev.adam(AdamArgs{op, p, g, m, v, out, DType::kBf16, n}); });

    double roof_gbs = 28.0 * static_cast<double>(n) / t_roof / 1e9;
    std::printf("%s\n", JsonLine()
                            .add("benchmark", "adamw_step_fp32")
                            .add("threads", threads)
                            .add("numel", static_cast<double>(n))
                            .add("seconds", t_adam)
                            .add("elements_per_s", static_cast<double>(n) / t_adam)
                            .add("bytes_per_element", 28)
                            .add("gb_per_s", 28.0 * static_cast<double>(n) / t_adam / 1e9)
                            .add("roof_gb_per_s", roof_gbs)
                            .add("fraction_of_roof", t_roof / t_adam)
                            .str()
                            .c_str());
    // With the fused bf16 copy of the params the traffic is 30 bytes/element;
    // its roof is the 28-byte roof's bandwidth.
    std::printf("%s\n", JsonLine()
                            .add("benchmark", "adamw_step_fp32_with_bf16_copy")
                            .add("threads", threads)
                            .add("numel", static_cast<double>(n))
                            .add("seconds", t_adam_bf16)
                            .add("elements_per_s", static_cast<double>(n) / t_adam_bf16)
                            .add("bytes_per_element", 30)
                            .add("gb_per_s", 30.0 * static_cast<double>(n) / t_adam_bf16 / 1e9)
                            .add("roof_gb_per_s", roof_gbs)
                            .add("fraction_of_roof", 30.0 * static_cast<double>(n) / t_adam_bf16 / 1e9 / roof_gbs)
                            .str()
                            .c_str());
    for (float* a : {p, g, m, v}) dev.free(a);
    dev.free(out);
  }
  return 0;
}
