// examples/cuda/train_mlp.cu - an MLP trained on GPUs: cuBLAS does the matrix
// products (bf16 inputs, fp32 accumulation), a few kernels of this file do
// the rest of the model, and libfsdp does everything else: sharded params,
// grads and AdamW state, the collectives and their overlap. One process per
// GPU, started torchrun style (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
// MASTER_PORT: examples/cuda/launch_local.sh does it on one host), by
// mpirun, or alone; the GPU is LOCAL_RANK's. All work is queued on one CUDA
// stream of this program that it passes to libfsdp (docs/gpu.md).
//
//   train_mlp_cuda [--steps 200] [--width 1024] [--layers 4] [--batch 64] [--fp32] [--check]
//
// The model: h[k+1] = tanh(h[k] W_k^T + b_k), loss = mean over the batch of
// 0.5 |h[L] - y|^2 on a fixed synthetic task (a random teacher network), each
// rank its own rows. --check exits 1 unless the loss fell by half.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fsdp.h"

namespace {

#define FSDP_TRY(call)                                                                      \
  do {                                                                                      \
    fsdp_status_t s_ = (call);                                                              \
    if (s_ != FSDP_OK) {                                                                    \
      std::fprintf(stderr, "%s: %s: %s\n", #call, fsdp_status_name(s_), fsdp_last_error()); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)
#define CUDA_TRY(call)                                                 \
  do {                                                                 \
    cudaError_t e_ = (call);                                           \
    if (e_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                    \
    }                                                                  \
  } while (0)
#define BLAS_TRY(call)                                                             \
  do {                                                                             \
    cublasStatus_t b_ = (call);                                                    \
    if (b_ != CUBLAS_STATUS_SUCCESS) {                                             \
      std::fprintf(stderr, "%s: cuBLAS status %d\n", #call, static_cast<int>(b_)); \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

struct Args {
  int steps = 200, width = 1024, layers = 4, batch = 64;
  bool bf16 = true, check = false;
};

// ---- the model's kernels (everything but the matrix products) ----

constexpr int kThreads = 256;
int blocks(size_t n) { return static_cast<int>((n + kThreads - 1) / kThreads); }

// Element i of a param of `bf16` or fp32 storage, as fp32.
__device__ float load_param(const void* p, size_t i, bool bf16) {
  return bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]) : static_cast<const float*>(p)[i];
}

// z[r][c] = tanh(z[r][c] + b[c]) in place; `zb` gets its bf16 copy (the next GEMM's input).
__global__ void bias_tanh(float* z, __nv_bfloat16* zb, const void* b, bool bf16, int rows, int cols) {
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<size_t>(rows) * cols) return;
  float v = tanhf(z[i] + load_param(b, i % cols, bf16));
  z[i] = v;
  zb[i] = __float2bfloat16(v);
}

__global__ void to_bf16(const float* x, __nv_bfloat16* out, size_t n) {
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __float2bfloat16(x[i]);
}

// dz = dh * (1 - h^2) (the tanh's backward), in fp32 and bf16.
__global__ void tanh_backward(const float* dh, const float* h, float* dz, __nv_bfloat16* dzb, size_t n) {
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float v = dh[i] * (1.0f - h[i] * h[i]);
  dz[i] = v;
  dzb[i] = __float2bfloat16(v);
}

// db[c] += sum over rows of dz[r][c] (the grad buffer is in param_dtype).
__global__ void bias_grad(const float* dz, void* db, bool bf16, int rows, int cols) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float s = 0.0f;
  for (int r = 0; r < rows; ++r) s += dz[static_cast<size_t>(r) * cols + c];
  if (bf16) {
    auto* g = static_cast<__nv_bfloat16*>(db);
    g[c] = __float2bfloat16(__bfloat162float(g[c]) + s);
  } else {
    static_cast<float*>(db)[c] += s;
  }
}

// dh = (h - y) / rows; *loss += 0.5 sum (h - y)^2 / rows.
__global__ void mse(const float* h, const float* y, float* dh, float* loss, int rows, size_t n) {
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float d = h[i] - y[i];
  dh[i] = d / rows;
  atomicAdd(loss, 0.5f * d * d / rows);
}

cudaDataType_t storage(bool bf16) { return bf16 ? CUDA_R_16BF : CUDA_R_32F; }

// ---- the training loop ----

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto next = [&] { return i + 1 < argc ? std::atoi(argv[++i]) : 0; };
    if (k == "--steps") {
      a.steps = next();
    } else if (k == "--width") {
      a.width = next();
    } else if (k == "--layers") {
      a.layers = next();
    } else if (k == "--batch") {
      a.batch = next();
    } else if (k == "--fp32") {
      a.bf16 = false;
    } else if (k == "--check") {
      a.check = true;
    } else {
      std::fprintf(stderr, "usage: %s [--steps N] [--width N] [--layers N] [--batch N] [--fp32] [--check]\n", argv[0]);
      std::exit(2);
    }
  }
  if (a.steps < 1 || a.width < 1 || a.layers < 1 || a.batch < 1) {
    std::fprintf(stderr, "train_mlp_cuda: every size must be positive\n");
    std::exit(2);
  }
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  fsdp_config_t* cfg = nullptr;
  FSDP_TRY(fsdp_config_create(&cfg));
  FSDP_TRY(fsdp_config_set(cfg, "device", "cuda"));  // LOCAL_RANK's GPU
  FSDP_TRY(fsdp_config_set(cfg, "sharding", "FULL_SHARD"));
  FSDP_TRY(fsdp_config_set(cfg, "param_dtype", a.bf16 ? "bf16" : "fp32"));
  FSDP_TRY(fsdp_config_set(cfg, "reduce_dtype", "fp32"));
  FSDP_TRY(fsdp_config_set(cfg, "optimizer", "adamw"));
  FSDP_TRY(fsdp_config_set(cfg, "lr", "1e-3"));
  FSDP_TRY(fsdp_config_set(cfg, "weight_decay", "0.01"));
  FSDP_TRY(fsdp_config_set(cfg, "no_weight_decay", "*.bias"));
  FSDP_TRY(fsdp_config_set(cfg, "max_grad_norm", "1.0"));
  FSDP_TRY(fsdp_config_set(cfg, "forward_prefetch", "1"));
  FSDP_TRY(fsdp_config_from_env(cfg));  // FSDP_* variables override
  fsdp_ctx_t* ctx = nullptr;
  FSDP_TRY(fsdp_ctx_create(cfg, nullptr, -1, &ctx));  // the launcher's rank, or a world of one
  fsdp_config_destroy(cfg);
  int rank = 0, world = 1;
  FSDP_TRY(fsdp_ctx_rank(ctx, &rank));
  FSDP_TRY(fsdp_ctx_world_size(ctx, &world));

  const int w = a.width, b = a.batch, L = a.layers;
  const size_t wn = static_cast<size_t>(w) * w, hn = static_cast<size_t>(w) * b;
  std::vector<fsdp_unit_t*> units(static_cast<size_t>(L));
  std::mt19937 init_rng(1234);  // every rank draws the same init: rank 0's values are kept
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int k = 0; k < L; ++k) {
    std::string name = "layer" + std::to_string(k);
    std::string wname = name + ".weight", bname = name + ".bias";
    const char* names[] = {wname.c_str(), bname.c_str()};
    const int32_t ndims[] = {2, 1};
    const int64_t dims[] = {w, w, w};
    FSDP_TRY(fsdp_unit_register(ctx, name.c_str(), 2, names, ndims, dims, &units[static_cast<size_t>(k)]));
    std::vector<float> wv(wn), bv(static_cast<size_t>(w), 0.0f);
    for (float& x : wv) x = normal(init_rng) / std::sqrt(static_cast<float>(w));
    FSDP_TRY(fsdp_param_set_values(units[static_cast<size_t>(k)], 0, wv.data(), wv.size()));
    FSDP_TRY(fsdp_param_set_values(units[static_cast<size_t>(k)], 1, bv.data(), bv.size()));
  }

  // The data: each rank its own rows; the targets come from a fixed random
  // teacher, y = tanh(x T^T).
  std::mt19937 data_rng(99 + static_cast<unsigned>(rank));
  std::mt19937 teacher_rng(7);
  std::vector<float> x(hn), teacher(wn), y(hn, 0.0f);
  for (float& v : x) v = normal(data_rng);
  for (float& v : teacher) v = normal(teacher_rng) / std::sqrt(static_cast<float>(w));
  for (int r = 0; r < b; ++r) {
    for (int o = 0; o < w; ++o) {
      float s = 0.0f;
      for (int i = 0; i < w; ++i) s += x[static_cast<size_t>(r) * w + i] * teacher[static_cast<size_t>(o) * w + i];
      y[static_cast<size_t>(r) * w + o] = std::tanh(s);
    }
  }
  cudaStream_t s;
  CUDA_TRY(cudaStreamCreate(&s));
  cublasHandle_t blas;
  BLAS_TRY(cublasCreate(&blas));
  BLAS_TRY(cublasSetStream(blas, s));
  auto dev_alloc = [](size_t nbytes) {
    void* p = nullptr;
    CUDA_TRY(cudaMalloc(&p, nbytes));
    return p;
  };
  // Activations (fp32 and a bf16 copy each), the output grad, a scratch.
  std::vector<float*> h(static_cast<size_t>(L) + 1);
  std::vector<__nv_bfloat16*> hb(static_cast<size_t>(L) + 1);
  for (int k = 0; k <= L; ++k) {
    h[static_cast<size_t>(k)] = static_cast<float*>(dev_alloc(hn * 4));
    hb[static_cast<size_t>(k)] = static_cast<__nv_bfloat16*>(dev_alloc(hn * 2));
  }
  auto* dh = static_cast<float*>(dev_alloc(hn * 4));
  auto* dz = static_cast<float*>(dev_alloc(hn * 4));
  auto* dzb = static_cast<__nv_bfloat16*>(dev_alloc(hn * 2));
  auto* y_dev = static_cast<float*>(dev_alloc(hn * 4));
  auto* loss_dev = static_cast<float*>(dev_alloc(4));
  CUDA_TRY(cudaMemcpyAsync(h[0], x.data(), hn * 4, cudaMemcpyHostToDevice, s));
  CUDA_TRY(cudaMemcpyAsync(y_dev, y.data(), hn * 4, cudaMemcpyHostToDevice, s));
  to_bf16<<<blocks(hn), kThreads, 0, s>>>(h[0], hb[0], hn);

  const float one = 1.0f, zero = 0.0f;
  const cudaDataType_t pt = storage(a.bf16);
  // The matrix products take bf16 activations; with fp32 params, the params
  // take fp32 and so do the activations (h, dz as fp32).
  auto act = [&](int k) -> const void* {
    return a.bf16 ? static_cast<const void*>(hb[static_cast<size_t>(k)]) : h[static_cast<size_t>(k)];
  };
  float first_loss = -1.0f, loss = 0.0f;
  std::vector<double> step_ms;  // host time of each step (fsdp_step returns when its update is done)
  for (int step = 1; step <= a.steps; ++step) {
    auto t0 = std::chrono::steady_clock::now();
    CUDA_TRY(cudaMemsetAsync(loss_dev, 0, 4, s));
    for (int k = 0; k < L; ++k) {
      fsdp_unit_t* u = units[static_cast<size_t>(k)];
      FSDP_TRY(fsdp_forward_begin(u, s));  // s waits for the gather; the host does not
      void *W, *B;
      FSDP_TRY(fsdp_param_ptr(u, 0, &W));
      FSDP_TRY(fsdp_param_ptr(u, 1, &B));
      // Column-major: h[k+1]^T (w x b) = W (row-major, = W^T column-major)^T * h[k]^T.
      BLAS_TRY(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, w, b, w, &one, W, pt, w, act(k), pt, w, &zero,
                            h[static_cast<size_t>(k) + 1], CUDA_R_32F, w, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      bias_tanh<<<blocks(hn), kThreads, 0, s>>>(h[static_cast<size_t>(k) + 1], hb[static_cast<size_t>(k) + 1], B,
                                                a.bf16, b, w);
      FSDP_TRY(fsdp_forward_end(u, s));  // the gathered params go once s is past this point
    }
    mse<<<blocks(hn), kThreads, 0, s>>>(h[static_cast<size_t>(L)], y_dev, dh, loss_dev, b, hn);
    for (int k = L - 1; k >= 0; --k) {
      fsdp_unit_t* u = units[static_cast<size_t>(k)];
      FSDP_TRY(fsdp_backward_begin(u, s));
      void *W, *gW, *gB;
      FSDP_TRY(fsdp_param_ptr(u, 0, &W));
      FSDP_TRY(fsdp_grad_ptr(u, 0, &gW));
      FSDP_TRY(fsdp_grad_ptr(u, 1, &gB));
      tanh_backward<<<blocks(hn), kThreads, 0, s>>>(dh, h[static_cast<size_t>(k) + 1], dz, dzb, hn);
      const void* dz_in = a.bf16 ? static_cast<const void*>(dzb) : dz;
      // dW (w x w, row-major) += dz^T h[k]: column-major dW^T = h[k]^T-ish product.
      BLAS_TRY(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_T, w, w, b, &one, act(k), pt, w, dz_in, pt, w, &one, gW, pt, w,
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      bias_grad<<<blocks(static_cast<size_t>(w)), kThreads, 0, s>>>(dz, gB, a.bf16, b, w);
      // dh[k] = dz W (the input's grad), into dh for the next unit down.
      BLAS_TRY(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, w, b, w, &one, W, pt, w, dz_in, pt, w, &zero, dh,
                            CUDA_R_32F, w, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      FSDP_TRY(fsdp_backward_end(u, s));  // the reduce-scatter starts after s's backward
    }
    FSDP_TRY(fsdp_step(ctx, s));
    step_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    if (step == 1 || step % 20 == 0 || step == a.steps) {
      CUDA_TRY(cudaMemcpyAsync(&loss, loss_dev, 4, cudaMemcpyDeviceToHost, s));
      CUDA_TRY(cudaStreamSynchronize(s));
      double mine = loss;
      FSDP_TRY(fsdp_metrics_reduce(ctx, &mine, 1, FSDP_REDUCE_AVG));
      if (first_loss < 0) first_loss = static_cast<float>(mine);
      loss = static_cast<float>(mine);
      fsdp_memory_stats_t m;
      m.struct_size = sizeof m;
      FSDP_TRY(fsdp_memory_stats(ctx, &m));
      if (rank == 0) {
        std::printf("step %4d  loss %.6f  (world %d)  rank 0 GPU: %.1f MiB now, %.1f MiB peak\n", step, mine, world,
                    m.device_nbytes / 1048576.0, m.device_peak_nbytes / 1048576.0);
      }
    }
  }
  FSDP_TRY(fsdp_ctx_finalize(ctx));
  fsdp_ctx_destroy(ctx);
  bool learned = loss < 0.5f * first_loss;
  std::sort(step_ms.begin(), step_ms.end());
  if (rank == 0) std::printf("step time: %.3f ms (median of %zu steps)\n", step_ms[step_ms.size() / 2], step_ms.size());
  if (rank == 0) std::printf("loss %.6f -> %.6f: %s\n", first_loss, loss, learned ? "it learned" : "it did not learn");
  return a.check && !learned ? 1 : 0;
}
