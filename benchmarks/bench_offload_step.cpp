// benchmarks/bench_offload_step.cpp - the AdamW step of an offload=cpu
// context (master shard, grads and moments in host memory, the optimizer on
// the host's SIMD kernels and thread pool), through the public API, as
// elements per second and as a fraction of the STREAM triad bandwidth of as
// many threads measured in the same run. Prints one JSON object per line.
//
//   bench_offload_step [M elements (16)] [threads (1)] [reps (5)]
//
// Traffic per element of fsdp_step, counted like STREAM (no write-allocate):
// the grad norm reads g (4 B); AdamW reads p, g, m, v and writes p, m, v
// (28 B) and the bf16 param copy (2 B); zeroing g writes 4 B: 38 B. The grad
// reductions of the backward pass (device -> host copy and accumulation on the
// copy stream) are finished before fsdp_step is timed: they overlap backward.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "fsdp.h"

using fsdp::bench::JsonLine;

namespace {

constexpr double kStepBytesPerElement = 38.0;

void check(fsdp_status_t s, const char* what) {
  if (s != FSDP_OK) {
    std::fprintf(stderr, "%s: %s: %s\n", what, fsdp_status_name(s), fsdp_last_error());
    std::exit(1);
  }
}

// a = b + s * c over n floats, split over `threads` threads; best seconds.
double triad_seconds(size_t n, int threads, int reps) {
  std::vector<float> a(n, 0.f), b(n, 1.f), c(n, 2.f);
  auto run = [&] {
    std::vector<std::thread> ts;
    size_t chunk = (n + threads - 1) / threads;
    for (int t = 0; t < threads; ++t) {
      ts.emplace_back([&, t] {
        size_t lo = std::min(n, t * chunk), hi = std::min(n, lo + chunk);
        float* __restrict pa = a.data();
        const float* __restrict pb = b.data();
        const float* __restrict pc = c.data();
        for (size_t i = lo; i < hi; ++i) pa[i] = pb[i] + 3.0f * pc[i];
      });
    }
    for (auto& t : ts) t.join();
  };
  return fsdp::bench::best_seconds(reps, run);
}

}  // namespace

int main(int argc, char** argv) {
  size_t n = static_cast<size_t>((argc > 1 ? std::atof(argv[1]) : 16.0) * 1048576.0);
  int threads = argc > 2 ? std::atoi(argv[2]) : 1;
  int reps = argc > 3 ? std::atoi(argv[3]) : 5;

  fsdp_config_t* cfg = nullptr;
  check(fsdp_config_create(&cfg), "config");
  check(fsdp_config_set(cfg, "offload", "cpu"), "offload");
  check(fsdp_config_set(cfg, "param_dtype", "bf16"), "param_dtype");
  check(fsdp_config_set(cfg, "reduce_dtype", "fp32"), "reduce_dtype");
  check(fsdp_config_set(cfg, "optimizer", "adamw"), "optimizer");
  check(fsdp_config_set(cfg, "weight_decay", "0.01"), "weight_decay");
  check(fsdp_config_set(cfg, "threads", std::to_string(threads).c_str()), "threads");
  fsdp_ctx_t* ctx = nullptr;
  check(fsdp_ctx_create(cfg, nullptr, 0, &ctx), "ctx");
  fsdp_config_destroy(cfg);
  const char* names[] = {"w"};
  const int32_t ndims[] = {1};
  const int64_t dims[] = {static_cast<int64_t>(n)};
  fsdp_unit_t* unit = nullptr;
  check(fsdp_unit_register(ctx, "big", 1, names, ndims, dims, &unit), "register");
  std::vector<float> init(n, 0.5f);
  check(fsdp_param_set_values(unit, 0, init.data(), n), "set_values");

  // One iteration: backward writes grads (bf16 ones), its reduction and the
  // device -> host copy run on the streams, then the step is timed alone.
  double best = 1e30;
  for (int i = 0; i <= reps; ++i) {
    check(fsdp_backward_begin(unit, nullptr), "backward_begin");
    void* g = nullptr;
    check(fsdp_grad_ptr(unit, 0, &g), "grad_ptr");
    std::memset(g, 0x3f, n * 2);  // bf16 0x3f3f ~ 0.75
    check(fsdp_backward_end(unit, nullptr), "backward_end");
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // reductions finish meanwhile
    auto t0 = std::chrono::steady_clock::now();
    check(fsdp_step(ctx, nullptr), "step");
    double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i > 0) best = std::min(best, t);  // the first step is a warm-up
  }
  fsdp_memory_stats_t m;
  m.struct_size = sizeof m;
  check(fsdp_memory_stats(ctx, &m), "memory_stats");
  check(fsdp_ctx_finalize(ctx), "finalize");
  fsdp_ctx_destroy(ctx);

  double triad = triad_seconds(n, threads, reps);
  double triad_gbs = 12.0 * static_cast<double>(n) / triad / 1e9;
  double elems = static_cast<double>(n) / best;
  std::printf("%s\n", JsonLine()
                          .add("benchmark", "triad")
                          .add("threads", threads)
                          .add("elements", static_cast<double>(n))
                          .add("gb_per_s", triad_gbs)
                          .str()
                          .c_str());
  std::printf("%s\n", JsonLine()
                          .add("benchmark", "offload_adamw_step")
                          .add("threads", threads)
                          .add("elements", static_cast<double>(n))
                          .add("seconds", best)
                          .add("elements_per_s", elems)
                          .add("gb_per_s", elems * kStepBytesPerElement / 1e9)
                          .add("fraction_of_triad", elems * kStepBytesPerElement / 1e9 / triad_gbs)
                          .add("host_nbytes", static_cast<double>(m.host_nbytes))
                          .add("device_nbytes", static_cast<double>(m.device_nbytes))
                          .str()
                          .c_str());
  return 0;
}
