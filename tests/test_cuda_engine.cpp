// The engine on device=cuda against the same engine on device=cpu: a small
// tanh MLP trained through the public API, the host's compute done on the CPU
// over copies of the unit buffers (cudaMemcpy on the legacy default stream,
// the API's NULL stream), same data and init. The CUDA kernels compute the CPU
// loops' bits, so without clipping the params must match bit for bit; with
// clipping the grad norm is a double sum in another order (docs/gpu.md), so
// they match to 1e-6. A checkpoint saved on the GPU loads on the CPU bit for
// bit. Skips, saying so, without a GPU.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include "device/cuda/cuda_device.h"
#include "fsdp.h"
#include "kernels/cast.h"

namespace {

constexpr int kDim = 24, kBatch = 8, kUnits = 3, kSteps = 5;

struct TrainedRun {
  std::vector<std::vector<float>> params;  // per unit, the full fp32 weights after training
  fsdp_ctx_t* ctx = nullptr;               // kept open when asked (for a save)
  std::vector<fsdp_unit_t*> units;
};

std::string error_text(fsdp_status_t s) { return std::string(fsdp_status_name(s)) + ": " + fsdp_last_error(); }

#define CHECK_OK(call)                                           \
  do {                                                           \
    fsdp_status_t s_ = (call);                                   \
    ASSERT_EQ(s_, FSDP_OK) << #call << " -> " << error_text(s_); \
  } while (0)

// Host <-> unit buffer copies, whichever memory the buffer is in.
void to_host(void* dst, const void* src, size_t n, bool gpu) {
  if (gpu) {
    ASSERT_EQ(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost), cudaSuccess);
  } else {
    std::memcpy(dst, src, n);
  }
}
void from_host(void* dst, const void* src, size_t n, bool gpu) {
  if (gpu) {
    ASSERT_EQ(cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice), cudaSuccess);
  } else {
    std::memcpy(dst, src, n);
  }
}

// The unit's weights as fp32, read through fsdp_param_ptr.
std::vector<float> read_param(fsdp_unit_t* u, fsdp_dtype_t dt, bool gpu) {
  void* p = nullptr;
  EXPECT_EQ(fsdp_param_ptr(u, 0, &p), FSDP_OK) << fsdp_last_error();
  std::vector<float> w(kDim * kDim);
  if (dt == FSDP_DTYPE_FP32) {
    to_host(w.data(), p, w.size() * 4, gpu);
  } else {
    std::vector<uint16_t> raw(w.size());
    to_host(raw.data(), p, raw.size() * 2, gpu);
    for (size_t i = 0; i < w.size(); ++i) w[i] = fsdp::kernels::bf16_bits_to_f32(raw[i]);
  }
  return w;
}

void write_grad(fsdp_unit_t* u, fsdp_dtype_t dt, const std::vector<float>& g, bool gpu) {
  void* p = nullptr;
  ASSERT_EQ(fsdp_grad_ptr(u, 0, &p), FSDP_OK) << fsdp_last_error();
  if (dt == FSDP_DTYPE_FP32) {
    from_host(p, g.data(), g.size() * 4, gpu);
  } else {
    std::vector<uint16_t> raw(g.size());
    for (size_t i = 0; i < g.size(); ++i) raw[i] = fsdp::kernels::f32_to_bf16_bits(g[i]);
    from_host(p, raw.data(), raw.size() * 2, gpu);
  }
}

// The model's units: kUnits square weights named layer0, layer1, ...
void register_units(fsdp_ctx_t* ctx, std::vector<fsdp_unit_t*>* units) {
  units->assign(kUnits, nullptr);
  for (int k = 0; k < kUnits; ++k) {
    const char* names[] = {"weight"};
    int32_t ndims[] = {2};
    int64_t dims[] = {kDim, kDim};
    std::string name = "layer" + std::to_string(k);
    CHECK_OK(fsdp_unit_register(ctx, name.c_str(), 1, names, ndims, dims, &(*units)[k]));
  }
}

// Trains kSteps of AdamW on a fixed batch; `opts` plus device=cpu or cuda:0.
void train(const std::map<std::string, std::string>& opts, bool gpu, bool keep_open, TrainedRun* out) {
  fsdp_config_t* cfg = nullptr;
  CHECK_OK(fsdp_config_create(&cfg));
  std::map<std::string, std::string> all = opts;
  all["device"] = gpu ? "cuda:0" : "cpu";
  all["optimizer"] = "adamw";
  all["lr"] = "0.01";
  all["weight_decay"] = "0.01";
  for (const auto& kv : all) CHECK_OK(fsdp_config_set(cfg, kv.first.c_str(), kv.second.c_str()));
  fsdp_ctx_t* ctx = nullptr;
  fsdp_status_t created = fsdp_ctx_create(cfg, nullptr, 0, &ctx);
  fsdp_config_destroy(cfg);
  CHECK_OK(created);
  fsdp_dtype_t dt = FSDP_DTYPE_FP32;
  CHECK_OK(fsdp_ctx_param_dtype(ctx, &dt));
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<fsdp_unit_t*> units;
  register_units(ctx, &units);
  if (::testing::Test::HasFatalFailure()) return;
  for (int k = 0; k < kUnits; ++k) {
    std::vector<float> w(kDim * kDim);
    for (float& x : w) x = nd(rng) / std::sqrt(float(kDim));
    CHECK_OK(fsdp_param_set_values(units[k], 0, w.data(), w.size()));
  }
  std::vector<float> x(kBatch * kDim), y(kBatch * kDim);
  for (float& v : x) v = nd(rng);
  for (float& v : y) v = 0.5f * nd(rng);
  for (int step = 0; step < kSteps; ++step) {
    // Forward: h[k+1] = tanh(h[k] W_k^T), row-major batch x dim.
    std::vector<std::vector<float>> h(kUnits + 1);
    h[0] = x;
    for (int k = 0; k < kUnits; ++k) {
      CHECK_OK(fsdp_forward_begin(units[k], nullptr));
      std::vector<float> w = read_param(units[k], dt, gpu);
      CHECK_OK(fsdp_forward_end(units[k], nullptr));
      h[k + 1].assign(kBatch * kDim, 0.0f);
      for (int b = 0; b < kBatch; ++b) {
        for (int o = 0; o < kDim; ++o) {
          float acc = 0.0f;
          for (int i = 0; i < kDim; ++i) acc += h[k][b * kDim + i] * w[o * kDim + i];
          h[k + 1][b * kDim + o] = std::tanh(acc);
        }
      }
    }
    // Backward of 0.5 * mean over the batch of |h - y|^2.
    std::vector<float> dh(kBatch * kDim);
    for (size_t i = 0; i < dh.size(); ++i) dh[i] = (h[kUnits][i] - y[i]) / kBatch;
    for (int k = kUnits - 1; k >= 0; --k) {
      CHECK_OK(fsdp_backward_begin(units[k], nullptr));
      std::vector<float> w = read_param(units[k], dt, gpu);
      std::vector<float> dz(kBatch * kDim), dw(kDim * kDim, 0.0f), dprev(kBatch * kDim, 0.0f);
      for (size_t i = 0; i < dz.size(); ++i) dz[i] = dh[i] * (1.0f - h[k + 1][i] * h[k + 1][i]);
      for (int b = 0; b < kBatch; ++b) {
        for (int o = 0; o < kDim; ++o) {
          for (int i = 0; i < kDim; ++i) {
            dw[o * kDim + i] += dz[b * kDim + o] * h[k][b * kDim + i];
            dprev[b * kDim + i] += dz[b * kDim + o] * w[o * kDim + i];
          }
        }
      }
      write_grad(units[k], dt, dw, gpu);
      CHECK_OK(fsdp_backward_end(units[k], nullptr));
      dh = dprev;
    }
    CHECK_OK(fsdp_step(ctx, nullptr));
  }
  out->params.assign(kUnits, std::vector<float>(kDim * kDim));
  for (int k = 0; k < kUnits; ++k) {
    CHECK_OK(fsdp_gather_param(units[k], 0, out->params[k].data(), out->params[k].size()));
  }
  if (keep_open) {
    out->ctx = ctx;
    out->units = units;
  } else {
    CHECK_OK(fsdp_ctx_finalize(ctx));
    fsdp_ctx_destroy(ctx);
  }
}

long first_difference(const std::vector<float>& a, const std::vector<float>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], 4) != 0) return static_cast<long>(i);
  }
  return -1;
}

#define SKIP_WITHOUT_GPU()                                                 \
  do {                                                                     \
    if (fsdp::device::cuda::CudaDevice::count() == 0)                      \
      GTEST_SKIP() << "no CUDA device can be used here: GPU test not run"; \
  } while (0)

}  // namespace

TEST(CudaEngine, TrainsBitwiseLikeTheCpuDevice) {
  SKIP_WITHOUT_GPU();
  for (const char* sharding : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"}) {
    for (const char* dtype : {"fp32", "bf16"}) {
      SCOPED_TRACE(std::string(sharding) + " " + dtype);
      std::map<std::string, std::string> opts = {{"sharding", sharding}, {"param_dtype", dtype}};
      TrainedRun cpu, gpu;
      train(opts, false, false, &cpu);
      train(opts, true, false, &gpu);
      if (::testing::Test::HasFatalFailure()) return;
      for (int k = 0; k < kUnits; ++k) EXPECT_EQ(first_difference(cpu.params[k], gpu.params[k]), -1) << "unit " << k;
    }
  }
}

TEST(CudaEngine, ClippingMatchesTheCpuDeviceClosely) {
  SKIP_WITHOUT_GPU();
  std::map<std::string, std::string> opts = {{"sharding", "FULL_SHARD"}, {"max_grad_norm", "0.05"}};
  TrainedRun cpu, gpu;
  train(opts, false, false, &cpu);
  train(opts, true, false, &gpu);
  if (::testing::Test::HasFatalFailure()) return;
  // The clip coefficient differs in its last bits at most (a double sum's
  // order); after 5 AdamW steps that is far below fp32 resolution of 1e-6.
  for (int k = 0; k < kUnits; ++k) {
    for (size_t i = 0; i < cpu.params[k].size(); ++i) {
      ASSERT_NEAR(gpu.params[k][i], cpu.params[k][i], 1e-6f * (1.0f + std::fabs(cpu.params[k][i])))
          << "unit " << k << " element " << i;
    }
  }
}

TEST(CudaEngine, ACheckpointSavedOnTheGpuLoadsOnTheCpuBitwise) {
  SKIP_WITHOUT_GPU();
  std::string dir = (std::filesystem::temp_directory_path() / ("fsdp_cuda_ckpt_" + std::to_string(getpid()))).string();
  std::filesystem::remove_all(dir);
  TrainedRun gpu;
  train({{"sharding", "FULL_SHARD"}}, true, true, &gpu);
  if (::testing::Test::HasFatalFailure()) return;
  CHECK_OK(fsdp_save(gpu.ctx, dir.c_str(), "sharded"));
  CHECK_OK(fsdp_ctx_finalize(gpu.ctx));
  fsdp_ctx_destroy(gpu.ctx);
  // The same model on the CPU, loaded from it.
  fsdp_config_t* cfg = nullptr;
  CHECK_OK(fsdp_config_create(&cfg));
  CHECK_OK(fsdp_config_set(cfg, "optimizer", "adamw"));
  fsdp_ctx_t* ctx = nullptr;
  fsdp_status_t created = fsdp_ctx_create(cfg, nullptr, 0, &ctx);
  fsdp_config_destroy(cfg);
  CHECK_OK(created);
  std::vector<fsdp_unit_t*> units;
  register_units(ctx, &units);
  if (::testing::Test::HasFatalFailure()) return;
  CHECK_OK(fsdp_load(ctx, dir.c_str()));
  for (int k = 0; k < kUnits; ++k) {
    std::vector<float> w(kDim * kDim);
    CHECK_OK(fsdp_gather_param(units[k], 0, w.data(), w.size()));
    EXPECT_EQ(first_difference(gpu.params[k], w), -1) << "unit " << k;
  }
  CHECK_OK(fsdp_ctx_finalize(ctx));
  fsdp_ctx_destroy(ctx);
  std::filesystem::remove_all(dir);
}
