// benchmarks/bench_optimizer.cpp - the AdamW step of the CPU device on fp32
// elements, as elements/s and as a fraction of the roof: a trivial loop with the
// same memory traffic (read p, g, m, v; write p, m, v: 28 bytes per element) on
// the same threads, timed in the same run. Prints one JSON object per line.
//
//   bench_optimizer [numel [reps [threads,...]]]   (defaults: 2^24, 5, "1,2")
//   bench_optimizer --serve numel threads
//
// --serve allocates once, prints "ready", then for each line "adam" or "roof"
// on stdin runs one AdamW step or one roof pass and prints its seconds, so
// that benchmarks/bench_adamw_torch.py can alternate it step by step with
// torch's fused AdamW in one run (this process waits on stdin meanwhile).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "base/simd.h"
#include "bench_util.h"
#include "device/cpu/cpu_device.h"

using fsdp::DType;
using fsdp::bench::JsonLine;
using fsdp::device::AdamArgs;
using fsdp::device::CpuDevice;
using fsdp::device::ThreadPool;

namespace {

// The roof: the same arrays, the same 28 bytes of traffic per element, the
// least arithmetic that keeps the compiler from eliding any of it, compiled
// with the same instruction-set clones and the same software prefetch as the
// library's loops.
FSDP_SIMD_CLONES void roof_loop(float* __restrict p, const float* __restrict g, float* __restrict m,
                                float* __restrict v, size_t b, size_t e) {
  for (size_t lo = b; lo < e; lo += fsdp::base::kStreamStep) {
    size_t hi = std::min(lo + fsdp::base::kStreamStep, e);
    fsdp::base::prefetch_next_step(hi, e, p, g, m, v);
    for (size_t i = lo; i < hi; ++i) {
      float gi = g[i];
      p[i] = p[i] + 1e-30f * gi;
      m[i] = m[i] + gi;
      v[i] = v[i] + gi;
    }
  }
}

// Best and median of `reps` timings of fn(), after one warm-up call: the best
// estimates the machine's capability, the median how steady it is.
struct Timing {
  double best;
  double median;
};
Timing time_reps(int reps, const std::function<void()>& fn) {
  fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return {t.front(), t[t.size() / 2]};
}

void print(const char* name, int threads, size_t n, Timing t, double bytes_per_element, Timing roof) {
  double roof_gbs = 28.0 * static_cast<double>(n) / roof.best / 1e9;
  double gbs = bytes_per_element * static_cast<double>(n) / t.best / 1e9;
  std::printf("%s\n", JsonLine()
                          .add("benchmark", name)
                          .add("threads", threads)
                          .add("numel", static_cast<double>(n))
                          .add("seconds", t.best)
                          .add("median_seconds", t.median)
                          .add("elements_per_s", static_cast<double>(n) / t.best)
                          .add("median_elements_per_s", static_cast<double>(n) / t.median)
                          .add("bytes_per_element", bytes_per_element)
                          .add("gb_per_s", gbs)
                          .add("roof_gb_per_s", roof_gbs)
                          .add("fraction_of_roof", gbs / roof_gbs)
                          .str()
                          .c_str());
}

// The four fp32 arrays of an AdamW step and a bf16 params copy, first touched
// on the threads that use them.
struct Arrays {
  CpuDevice& dev;
  size_t n;
  float *p, *g, *m, *v;
  void* out;
  Arrays(CpuDevice& d, ThreadPool& pool, size_t numel) : dev(d), n(numel) {
    auto alloc = [&](float init) {
      float* a = static_cast<float*>(dev.alloc(n * sizeof(float)));
      pool.parallel_for(n, 1024, [&](size_t b, size_t e) {
        for (size_t i = b; i < e; ++i) a[i] = init + 1e-7f * static_cast<float>(i % 1000);
      });
      return a;
    };
    p = alloc(0.5f);
    g = alloc(0.01f);
    m = alloc(0.0f);
    v = alloc(0.0f);
    out = dev.alloc(n * 2);
  }
  ~Arrays() {
    for (float* a : {p, g, m, v}) dev.free(a);
    dev.free(out);
  }
  Arrays(const Arrays&) = delete;
  Arrays& operator=(const Arrays&) = delete;
};

const fsdp::kernels::AdamOp kOp =
    fsdp::kernels::AdamOp::make(1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, /*decoupled=*/true, 1, 1.0f);

void roof_pass(ThreadPool& pool, const Arrays& a) {
  pool.parallel_for(a.n, 1024, [&](size_t b, size_t e) { roof_loop(a.p, a.g, a.m, a.v, b, e); });
}

int serve(size_t n, int threads) {
  CpuDevice dev(threads, fsdp::device::Pool::kDevice);
  ThreadPool pool(threads);
  Arrays a(dev, pool, n);
  std::printf("ready\n");
  std::fflush(stdout);
  char line[64];
  while (std::fgets(line, sizeof line, stdin) != nullptr) {
    std::string cmd(line);
    auto t0 = std::chrono::steady_clock::now();
    if (cmd == "adam\n") {
      dev.adam(AdamArgs{kOp, a.p, a.g, a.m, a.v, nullptr, DType::kFp32, n});
    } else if (cmd == "roof\n") {
      roof_pass(pool, a);
    } else {
      return cmd == "quit\n" ? 0 : 1;
    }
    std::printf("%.9g\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    std::fflush(stdout);
  }
  return 0;
}

std::vector<int> parse_threads(const char* s) {
  std::vector<int> out;
  for (const char* c = s; *c != '\0';) {
    char* end = nullptr;
    long t = std::strtol(c, &end, 10);
    if (end == c || t < 1) break;
    out.push_back(static_cast<int>(t));
    c = *end == ',' ? end + 1 : end;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "--serve") {
    return serve(static_cast<size_t>(std::atof(argv[2])), std::max(1, std::atoi(argv[3])));
  }
  size_t n = size_t{1} << 24;
  int reps = 5;
  std::vector<int> thread_counts = {1, 2};
  if (argc > 1) n = static_cast<size_t>(std::atof(argv[1]));
  if (argc > 2) reps = std::max(1, std::atoi(argv[2]));
  if (argc > 3) thread_counts = parse_threads(argv[3]);
  for (int threads : thread_counts) {
    CpuDevice dev(threads, fsdp::device::Pool::kDevice);
    ThreadPool pool(threads);
    Arrays a(dev, pool, n);
    Timing roof = time_reps(reps, [&] { roof_pass(pool, a); });
    Timing adam = time_reps(reps, [&] { dev.adam(AdamArgs{kOp, a.p, a.g, a.m, a.v, nullptr, DType::kFp32, n}); });
    Timing adam_bf16 = time_reps(reps, [&] { dev.adam(AdamArgs{kOp, a.p, a.g, a.m, a.v, a.out, DType::kBf16, n}); });
    // The step as the engine runs it: the grads' sum of squares (for the next
    // clipping decision) and their zeroing in the same pass; 32 bytes/element.
    // Last, as it leaves the grads zero.
    double sq = 0.0;
    Timing adam_fused = time_reps(reps, [&] {
      dev.adam(AdamArgs{kOp, a.p, a.g, a.m, a.v, a.out, DType::kBf16, n, true, &sq});
    });

    print("adamw_step_fp32", threads, n, adam, 28, roof);
    // With the fused bf16 copy of the params the traffic is 30 bytes/element;
    // its roof is the 28-byte roof's bandwidth.
    print("adamw_step_fp32_with_bf16_copy", threads, n, adam_bf16, 30, roof);
    print("adamw_step_fp32_bf16_copy_zero_grads_grad_sq", threads, n, adam_fused, 32, roof);
  }
  return 0;
}
