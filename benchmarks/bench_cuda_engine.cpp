// benchmarks/bench_cuda_engine.cpp - the engine on one GPU: the host time of
// each transition call (goal below 5 us: the host is never blocked on the GPU),
// and a training step of a deep linear MLP (cuBLAS sgemm on the host's stream)
// through libfsdp beside the same step on plain cudaMalloc'd buffers with the
// same AdamW kernel (one launch over the flat model), measured in the same run:
// the ratio is libfsdp's overhead. One JSON object per line; without a GPU it
// prints one line saying it was skipped and exits 0.
//
//   bench_cuda_engine [--width 2048] [--layers 8] [--batch 256] [--steps 20]
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_util.h"
#include "device/cuda/cuda_device.h"
#include "fsdp.h"

using fsdp::bench::JsonLine;
using fsdp::device::cuda::CudaDevice;
using Clock = std::chrono::steady_clock;

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
  CUDA(cudaMemcpyAsync(dh, h[sh.layers], sizeof(float) * w * b, cudaMemcpyDeviceToDevice, nullptr));
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

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

}  // namespace

int main(int argc, char** argv) {
  Shape sh;
  for (int i = 1; i + 1 < argc; i += 2) {
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
  cublasHandle_t blas;
  BLAS(cublasCreate(&blas));
  // The legacy default stream for both runs: the API's NULL stream.
  BLAS(cublasSetStream(blas, nullptr));
  std::vector<float*> h(static_cast<size_t>(sh.layers) + 1);
  for (float*& x : h) x = device_floats(hn);
  float *dh = device_floats(hn), *dprev = device_floats(hn), *y = device_floats(hn);
  std::vector<float> host(hn);
  for (size_t i = 0; i < hn; ++i) host[i] = static_cast<float>((i * 7919) % 1000) / 1000.0f - 0.5f;
  CUDA(cudaMemcpy(h[0], host.data(), hn * sizeof(float), cudaMemcpyHostToDevice));
  CUDA(cudaMemcpy(y, host.data(), hn * sizeof(float), cudaMemcpyHostToDevice));
  std::vector<float> init(wn);
  for (size_t i = 0; i < wn; ++i) init[i] = (static_cast<float>((i * 104729) % 2001) / 1000.0f - 1.0f) / sh.width;

  // The plain loop: the model in one flat cudaMalloc'd buffer, AdamW in one launch.
  CudaDevice dev(0);
  size_t total = wn * static_cast<size_t>(sh.layers);
  float *p = device_floats(total), *g = device_floats(total), *m = device_floats(total), *v = device_floats(total);
  for (int k = 0; k < sh.layers; ++k) CUDA(cudaMemcpy(p + k * wn, init.data(), wn * 4, cudaMemcpyHostToDevice));
  for (float* x : {g, m, v}) CUDA(cudaMemset(x, 0, total * sizeof(float)));
  long adam_step = 0;
  auto plain_step = [&] {
    mlp_step(
        blas, sh, h, dh, dprev, y, [&](int k) { return p + k * wn; }, [&](int k) { return g + k * wn; },
        [](int, bool, bool) {});
    // As fsdp_step does: the host's stream is done, then one optimizer pass.
    CUDA(cudaStreamSynchronize(nullptr));
    auto op = fsdp::kernels::AdamOp::make(1e-4f, 0.9f, 0.999f, 1e-8f, 0.0f, true, ++adam_step, 1.0f);
    dev.adam({op, p, g, m, v, nullptr, fsdp::DType::kFp32, total, /*zero_grads=*/true});  // synchronous
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
        OK(begin ? fsdp_forward_begin(u, nullptr) : fsdp_forward_end(u, nullptr));
      } else {
        OK(begin ? fsdp_backward_begin(u, nullptr) : fsdp_backward_end(u, nullptr));
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
    OK(fsdp_step(ctx, nullptr));
  };

  // Alternate the two, best of `steps` each after a warm-up, so that clock
  // and thermal drift reach both alike.
  auto timed = [](const auto& fn) {
    CUDA(cudaDeviceSynchronize());
    auto t0 = Clock::now();
    fn();
    CUDA(cudaDeviceSynchronize());
    return ms_since(t0);
  };
  plain_step();
  fsdp_step_once();
  call_ms = 0;
  calls = 0;
  double plain_best = 1e30, fsdp_best = 1e30;
  for (int i = 0; i < sh.steps; ++i) {
    plain_best = std::min(plain_best, timed(plain_step));
    fsdp_best = std::min(fsdp_best, timed(fsdp_step_once));
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("%s\n", JsonLine()
                          .add("bench", "cuda_engine")
                          .add("what", "mlp_step")
                          .add("gpu", prop.name)
                          .add("width", sh.width)
                          .add("layers", sh.layers)
                          .add("batch", sh.batch)
                          .add("plain_ms", plain_best)
                          .add("fsdp_ms", fsdp_best)
                          .add("overhead_ratio", fsdp_best / plain_best)
                          .str()
                          .c_str());
  std::printf("%s\n", JsonLine()
                          .add("bench", "cuda_engine")
                          .add("what", "transition_call_host_time")
                          .add("calls", static_cast<double>(calls))
                          .add("us_per_call", 1e3 * call_ms / static_cast<double>(calls))
                          .add("goal_us", 5.0)
                          .str()
                          .c_str());
  OK(fsdp_ctx_finalize(ctx));
  fsdp_ctx_destroy(ctx);
  for (float* x : {p, g, m, v, dh, dprev, y}) cudaFree(x);
  for (float* x : h) cudaFree(x);
  cublasDestroy(blas);
  return 0;
}
