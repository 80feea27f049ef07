// benchmarks/bench_cuda_engine.cpp - the engine on one GPU: the host time of
// each transition call (goal below 5 us: the host is never blocked on the GPU),
// and a training step of a deep linear MLP (cuBLAS sgemm on the host's stream)
// through libfsdp beside the same step on plain cudaMalloc'd buffers,
// measured in the same run, alternating, as the median of the per-round ratios:
//   plain       the GEMMs and the per-range AdamW pass that clears the grads,
//               queued on the stream (the least a step can do);
//   fair        plain plus what a correct trainer must do anyway: one
//               on-device sum of squares of the grads, the inf/NaN verdict
//               (kernels/step.h) and an AdamW pass that reads it (skips on
//               inf): the same kernels libfsdp's step runs, with no wrapper;
//   fsdp        the same step through libfsdp's brackets and fsdp_step;
//   fsdp_graph  (--graph) that step captured once in a CUDA graph and
//               replayed (goal: at or below plain).
// One JSON object per line; without a GPU it prints one line saying it was
// skipped and exits 0.
//
//   bench_cuda_engine [--width 2048] [--layers 8] [--batch 256] [--steps 20] [--graph]
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../kernels/cuda/launch.h"
#include "bench_util.h"
#include "device/cuda/cuda_device.h"
#include "fsdp.h"

using fsdp::bench::JsonLine;
using fsdp::device::cuda::CudaDevice;
using Clock = std::chrono::steady_clock;
namespace kc = fsdp::kernels::cuda;

namespace {

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "bench_cuda_engine: %s failed: %s\n", what, fsdp_last_error());
    std::exit(1);
  }
}
#define OK(call) check((call) == FSDP_OK, #call)
#define CUDA(call) check((call) == cudaSuccess, #call)
#define BLAS(call) check((call) == CUBLAS_STATUS_SUCCESS, #call)

struct Shape {
  int width = 2048, layers = 8, batch = 256, steps = 20;
  bool graph = false;
};

// One deep linear MLP step's GEMMs: h[k+1] = h[k] W_k^T (row-major batch x
// width), loss 0.5 |h[L] - y|^2, dW_k += dh[k+1]^T h[k], dh[k] = dh[k+1] W_k.
// `weight(k)` / `grad(k)` give the unit's buffers; begin/end bracket each use.
template <typename Weight, typename Grad, typename Bracket>
void mlp_step(cublasHandle_t blas, const Shape& sh, std::vector<float*>& h, float* dh, float* dprev, const float* y,
              Weight weight, Grad grad, Bracket bracket) {
  const float one = 1.0f, zero = 0.0f, minus = -1.0f;
  const int w = sh.width, b = sh.batch;
  for (int k = 0; k < sh.layers; ++k) {
    bracket(k, true, true);
    // Column-major view: H[k+1]^T (w x b) = W (w x w, row-major = W^T col-major)^T ... as sgemm(T, N).
    BLAS(cublasSgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, w, b, w, &one, weight(k), w, h[k], w, &zero, h[k + 1], w));
    bracket(k, true, false);
  }
  cudaStream_t s = nullptr;
  BLAS(cublasGetStream(blas, &s));
  CUDA(cudaMemcpyAsync(dh, h[sh.layers], sizeof(float) * w * b, cudaMemcpyDeviceToDevice, s));
  BLAS(cublasSaxpy(blas, w * b, &minus, y, 1, dh, 1));
  for (int k = sh.layers - 1; k >= 0; --k) {
    bracket(k, false, true);
    BLAS(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_T, w, w, b, &one, h[k], w, dh, w, &one, grad(k), w));
    BLAS(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, w, b, w, &one, weight(k), w, dh, w, &zero, dprev, w));
    bracket(k, false, false);
    std::swap(dh, dprev);
  }
}

float* device_floats(size_t n) {
  void* p = nullptr;
  CUDA(cudaMalloc(&p, n * sizeof(float)));
  return static_cast<float*>(p);
}

template <typename T>
T* device_copy(const std::vector<T>& host) {
  void* p = nullptr;
  CUDA(cudaMalloc(&p, std::max<size_t>(1, host.size() * sizeof(T))));
  CUDA(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return static_cast<T*>(p);
}

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  Shape sh;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--graph")) sh.graph = true;
    if (i + 1 >= argc) continue;
    if (!std::strcmp(argv[i], "--width")) sh.width = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--layers")) sh.layers = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--batch")) sh.batch = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--steps")) sh.steps = std::atoi(argv[i + 1]);
  }
  if (CudaDevice::count() == 0) {
    std::printf("%s\n",
                JsonLine().add("bench", "cuda_engine").add("skipped", "no CUDA device can be used here").str().c_str());
    return 0;
  }
  const size_t wn = size_t(sh.width) * sh.width, hn = size_t(sh.width) * sh.batch;
  // Every run on one non-blocking stream of the host's (a graph cannot
  // capture the legacy default stream).
  cudaStream_t s = nullptr;
  CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cublasHandle_t blas;
  BLAS(cublasCreate(&blas));
  BLAS(cublasSetStream(blas, s));
  std::vector<float*> h(static_cast<size_t>(sh.layers) + 1);
  for (float*& x : h) x = device_floats(hn);
  float *dh = device_floats(hn), *dprev = device_floats(hn), *y = device_floats(hn);
  std::vector<float> host(hn);
  for (size_t i = 0; i < hn; ++i) host[i] = static_cast<float>((i * 7919) % 1000) / 1000.0f - 0.5f;
  CUDA(cudaMemcpy(h[0], host.data(), hn * sizeof(float), cudaMemcpyHostToDevice));
  CUDA(cudaMemcpy(y, host.data(), hn * sizeof(float), cudaMemcpyHostToDevice));
  std::vector<float> init(wn);
  for (size_t i = 0; i < wn; ++i) init[i] = (static_cast<float>((i * 104729) % 2001) / 1000.0f - 1.0f) / sh.width;

  // The plain loops: the model in one flat cudaMalloc'd buffer each.
  CudaDevice dev(0);
  const size_t total = wn * static_cast<size_t>(sh.layers);
  struct Plain {
    float *p, *g, *m, *v;
  };
  auto plain_model = [&] {
    Plain m{device_floats(total), device_floats(total), device_floats(total), device_floats(total)};
    for (int k = 0; k < sh.layers; ++k) CUDA(cudaMemcpy(m.p + k * wn, init.data(), wn * 4, cudaMemcpyHostToDevice));
    for (float* x : {m.g, m.m, m.v}) CUDA(cudaMemset(x, 0, total * sizeof(float)));
    return m;
  };
  Plain plain = plain_model(), fair = plain_model();
  long adam_step = 0;
  auto gemms = [&](const Plain& m) {
    mlp_step(
        blas, sh, h, dh, dprev, y, [&](int k) { return m.p + k * wn; }, [&](int k) { return m.g + k * wn; },
        [](int, bool, bool) {});
  };
  // plain: the GEMMs, then one AdamW pass over the flat model that clears the grads.
  auto plain_step = [&] {
    gemms(plain);
    auto op = fsdp::kernels::AdamOp::make(1e-4f, 0.9f, 0.999f, 1e-8f, 0.0f, true, ++adam_step, 1.0f);
    CUDA(kc::adam(op, plain.p, plain.g, plain.m, plain.v, nullptr, FSDP_DTYPE_FP32, total, true, s));
  };
  // fair: the same plus the grads' sum of squares on the device, the verdict
  // and an AdamW pass that reads it (one span over the flat model).
  std::vector<fsdp::kernels::OptimSpan> span = {{fair.p, fair.g, fair.m, fair.v, nullptr, total, 0.0f, 0}};
  const std::vector<kc::SpanChunk> chunks_host = kc::span_chunks(span.data(), span.size());
  const std::vector<fsdp::kernels::StepGroup> groups_host = {{0, 1.0f, 0.9f, 0.999f, 0.0f}};
  fsdp::kernels::StepState st_host{};
  st_host.loss_scale = 1.0;
  st_host.lr = 1e-4;
  auto* span_dev = device_copy(span);
  auto* chunks_dev = device_copy(chunks_host);
  auto* groups_dev = device_copy(groups_host);
  auto* st = device_copy(std::vector<fsdp::kernels::StepState>{st_host});
  void* scratch = nullptr;
  CUDA(cudaMalloc(&scratch, kc::sum_squares_scratch_nbytes(total)));
  fsdp::kernels::StepRule rule{};
  rule.count = 1;
  rule.eps = 1e-8f;
  rule.decoupled = 1;
  auto fair_step = [&] {
    gemms(fair);
    CUDA(kc::sum_squares(fair.g, total, &st->sq, scratch, s));
    CUDA(kc::step_scalars(st, nullptr, 0, &rule, s));
    CUDA(kc::adam_spans(span_dev, chunks_dev, chunks_host.size(), groups_dev, rule, st, false, FSDP_DTYPE_FP32, true,
                        s));
  };

  // The same through libfsdp: a unit per layer, FULL_SHARD at a world of one.
  fsdp_config_t* cfg;
  OK(fsdp_config_create(&cfg));
  OK(fsdp_config_set(cfg, "device", "cuda:0"));
  OK(fsdp_config_set(cfg, "optimizer", "adamw"));
  OK(fsdp_config_set(cfg, "lr", "1e-4"));
  OK(fsdp_config_set(cfg, "weight_decay", "0"));
  fsdp_ctx_t* ctx;
  OK(fsdp_ctx_create(cfg, nullptr, 0, &ctx));
  fsdp_config_destroy(cfg);
  std::vector<fsdp_unit_t*> units(static_cast<size_t>(sh.layers));
  for (int k = 0; k < sh.layers; ++k) {
    const char* names[] = {"weight"};
    int32_t ndims[] = {2};
    int64_t dims[] = {sh.width, sh.width};
    OK(fsdp_unit_register(ctx, ("layer" + std::to_string(k)).c_str(), 1, names, ndims, dims, &units[k]));
    OK(fsdp_param_set_values(units[k], 0, init.data(), wn));
  }
  double call_ms = 0;
  long calls = 0;
  auto fsdp_step_once = [&] {
    std::vector<float*> wp(static_cast<size_t>(sh.layers)), gp(static_cast<size_t>(sh.layers));
    auto bracket = [&](int k, bool forward, bool begin) {
      fsdp_unit_t* u = units[static_cast<size_t>(k)];
      auto t0 = Clock::now();
      if (forward) {
        OK(begin ? fsdp_forward_begin(u, s) : fsdp_forward_end(u, s));
      } else {
        OK(begin ? fsdp_backward_begin(u, s) : fsdp_backward_end(u, s));
      }
      call_ms += ms_since(t0);
      ++calls;
      if (begin) {
        void* w;
        OK(fsdp_param_ptr(u, 0, &w));
        wp[static_cast<size_t>(k)] = static_cast<float*>(w);
        if (!forward) {
          void* gr;
          OK(fsdp_grad_ptr(u, 0, &gr));
          gp[static_cast<size_t>(k)] = static_cast<float*>(gr);
        }
      }
    };
    mlp_step(
        blas, sh, h, dh, dprev, y, [&](int k) { return wp[static_cast<size_t>(k)]; },
        [&](int k) { return gp[static_cast<size_t>(k)]; }, bracket);
    OK(fsdp_step(ctx, s));
  };

  // A round: each step queued on the stream, the host waiting for it once
  // (as a training loop that reads its loss does).
  auto timed = [&](const auto& fn) {
    CUDA(cudaStreamSynchronize(s));
    auto t0 = Clock::now();
    fn();
    CUDA(cudaStreamSynchronize(s));
    return ms_since(t0);
  };
  plain_step();
  fair_step();
  fsdp_step_once();
  fsdp_step_once();  // the second step is the first of the recorded schedule
  cudaGraphExec_t exec = nullptr;
  if (sh.graph) {
    CUDA(cudaStreamSynchronize(s));
    cudaGraph_t g = nullptr;
    CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    fsdp_step_once();
    CUDA(cudaStreamEndCapture(s, &g));
    CUDA(cudaGraphInstantiate(&exec, g, 0));
    cudaGraphDestroy(g);
    CUDA(cudaGraphLaunch(exec, s));  // its first launch uploads it
  }
  call_ms = 0;
  calls = 0;
  OK(fsdp_comm_stats_reset(ctx));  // the host waits of the timed steps alone
  std::vector<double> plain_ms, fair_ms, fsdp_ms, graph_ms, r_plain, r_fair, r_graph;
  for (int i = 0; i < sh.steps; ++i) {
    plain_ms.push_back(timed(plain_step));
    fair_ms.push_back(timed(fair_step));
    fsdp_ms.push_back(timed(fsdp_step_once));
    r_plain.push_back(fsdp_ms.back() / plain_ms.back());
    r_fair.push_back(fsdp_ms.back() / fair_ms.back());
    if (exec != nullptr) {
      graph_ms.push_back(timed([&] { CUDA(cudaGraphLaunch(exec, s)); }));
      r_graph.push_back(graph_ms.back() / plain_ms.back());
    }
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  auto row = [&](const char* what) {
    JsonLine l;
    l.add("bench", "cuda_engine")
        .add("what", what)
        .add("gpu", prop.name)
        .add("width", sh.width)
        .add("layers", sh.layers)
        .add("batch", sh.batch)
        .add("rounds", sh.steps);
    return l;
  };
  // Medians of the rounds, and of the per-round ratios (each round's pair ran
  // back to back: drift reaches both alike).
  std::printf("%s\n", row("mlp_step")
                          .add("plain_ms", median(plain_ms))
                          .add("fsdp_ms", median(fsdp_ms))
                          .add("overhead_ratio", median(r_plain))
                          .str()
                          .c_str());
  std::printf("%s\n", row("mlp_step_vs_fair")
                          .add("fair_ms", median(fair_ms))
                          .add("fsdp_ms", median(fsdp_ms))
                          .add("ratio_to_fair", median(r_fair))
                          .str()
                          .c_str());
  if (exec != nullptr) {
    std::printf("%s\n", row("mlp_step_graph")
                            .add("plain_ms", median(plain_ms))
                            .add("fsdp_graph_ms", median(graph_ms))
                            .add("graph_ratio_to_plain", median(r_graph))
                            .str()
                            .c_str());
  }
  std::printf("%s\n", JsonLine()
                          .add("bench", "cuda_engine")
                          .add("what", "transition_call_host_time")
                          .add("calls", static_cast<double>(calls))
                          .add("us_per_call", 1e3 * call_ms / static_cast<double>(calls))
                          .add("goal_us", 5.0)
                          .str()
                          .c_str());
  fsdp_comm_stats_t cs{};
  cs.struct_size = sizeof cs;
  OK(fsdp_comm_stats(ctx, &cs));
  std::printf("%s\n", JsonLine()
                          .add("bench", "cuda_engine")
                          .add("what", "host_waits")
                          .add("steps", static_cast<double>(sh.steps))
                          .add("host_waits", static_cast<double>(cs.host_waits))
                          .add("per_step", static_cast<double>(cs.host_waits) / sh.steps)
                          .str()
                          .c_str());
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  OK(fsdp_ctx_finalize(ctx));
  fsdp_ctx_destroy(ctx);
  for (const Plain& m : {plain, fair}) {
    for (float* x : {m.p, m.g, m.m, m.v}) cudaFree(x);
  }
  for (void* x : std::vector<void*>{dh, dprev, y, span_dev, chunks_dev, groups_dev, st, scratch}) cudaFree(x);
  for (float* x : h) cudaFree(x);
  cublasDestroy(blas);
  cudaStreamDestroy(s);
  return 0;
}
