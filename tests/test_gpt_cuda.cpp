// The GPU GPT (examples/gpt/cuda) against the CPU GPT (examples/gpt), on the
// same params and tokens. Skips, saying so, without a GPU.
//
// - CudaGpt.OneStepMatchesTheCpuModel: one forward and backward of the GPU
//   model (bf16 params and GEMM inputs, fp32 accumulation, cuDNN's attention)
//   beside gpt::Model<float> on the same bf16-valued params, at the full
//   context and at a shorter sequence: the loss to 0.5%, every param's grad
//   to 5% of its norm (bf16 activations; a wrong product, transpose or index
//   gives errors near 100%).
// - CudaGpt.TrainsThroughLibfsdpLikeTheCpuGpt: 6 steps of FsdpGptCuda on
//   device=cuda beside FsdpGpt on device=cpu (both param_dtype bf16, AdamW,
//   the same batches of the demo's text): the losses to 2% at every step, and
//   falling on both.
// - CudaGpt.ATrainerReleasesItsModelBeforeItsStream: train_gpt's GPU trainer
//   leaves no CUDA error behind when it goes (its model syncs and frees on
//   the trainer's stream, which must outlive it).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "fsdp.h"
#include "gpt_cuda.h"
#include "gpt_fsdp.h"
#include "gpt_model.h"
#include "gpu_presence.h"

namespace {

// Skips without a GPU; fails where nvidia-smi lists one that CUDA cannot use (gpu_presence.h).
#define SKIP_WITHOUT_GPU() FSDP_SKIP_WITHOUT_GPU("GPT test not run")

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

// Every param of the model in model_units order, as bf16 bits and their fp32 values.
struct Params {
  std::vector<gpt::UnitSpec> specs;
  std::vector<std::vector<std::vector<uint16_t>>> bits;  // [unit][param][element]
  std::vector<std::vector<std::vector<float>>> values;
};

// init_param's values, with noise on the biases and norms (zero and one at
// init) so that their paths carry something, rounded to bf16.
Params make_params(const gpt::Shape& s) {
  Params p;
  p.specs = gpt::model_units(s);
  std::mt19937 rng(7);
  std::normal_distribution<float> noise(0.0f, 0.05f);
  for (const gpt::UnitSpec& u : p.specs) {
    p.bits.emplace_back(), p.values.emplace_back();
    for (const gpt::ParamSpec& ps : u.params) {
      std::vector<float> v(ps.numel());
      gpt::init_param(s, ps, 1234, v.data());
      if (ps.dims.size() == 1)
        for (float& x : v) x += noise(rng);
      std::vector<uint16_t> b(v.size());
      for (size_t i = 0; i < v.size(); ++i) {
        b[i] = gpt::float_to_bf16(v[i]);
        v[i] = gpt::bf16_to_float(b[i]);
      }
      p.bits.back().push_back(std::move(b));
      p.values.back().push_back(std::move(v));
    }
  }
  return p;
}

double rel_error(const std::vector<float>& got, const std::vector<float>& want) {
  double d = 0, n = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    d += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
    n += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(d / std::max(n, 1e-30));
}

void one_step_matches(int t) {
  const gpt::Shape s{2, 64, 4, 32};
  const int batch = 3;
  const Params p = make_params(s);
  const size_t units = p.specs.size(), L = static_cast<size_t>(s.layers);
  std::mt19937 rng(11);
  std::vector<uint8_t> tokens(static_cast<size_t>(batch) * t), targets(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<uint8_t>(rng());
    targets[i] = static_cast<uint8_t>(rng());
  }

  // The CPU model in fp32 on the bf16 values.
  std::vector<std::vector<std::vector<float>>> cpu_grads;
  std::vector<gpt::UnitView<float>> cv(units);
  for (size_t u = 0; u < units; ++u) {
    cpu_grads.emplace_back();
    for (size_t i = 0; i < p.values[u].size(); ++i) {
      cpu_grads[u].emplace_back(p.values[u][i].size(), 0.0f);
      cv[u].p.push_back(p.values[u][i].data());
      cv[u].g.push_back(cpu_grads[u][i].data());
    }
  }
  gpt::Model<float> cm(s, batch, false);
  cm.embed_forward(cv[0], tokens.data(), t);
  for (size_t l = 0; l < L; ++l) cm.block_forward(static_cast<int>(l), cv[1 + l]);
  cm.final_forward(cv[1 + L]);
  const double cpu_loss = cm.head_forward(cv[0], targets.data());
  cm.head_backward(cv[0]);
  cm.final_backward(cv[1 + L]);
  for (size_t l = L; l-- > 0;) cm.block_backward(static_cast<int>(l), cv[1 + l]);
  cm.embed_backward(cv[0]);

  // The GPU model on the same bits; both uses of embed add into one buffer.
  CUDA_OK(cudaSetDevice(0));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  std::vector<void*> allocations;
  std::vector<gpt::cuda::DeviceView> gv(units);
  for (size_t u = 0; u < units; ++u)
    for (const std::vector<uint16_t>& b : p.bits[u]) {
      void *dp = nullptr, *dg = nullptr;
      CUDA_OK(cudaMalloc(&dp, b.size() * 2));
      CUDA_OK(cudaMalloc(&dg, b.size() * 2));
      allocations.push_back(dp), allocations.push_back(dg);
      CUDA_OK(cudaMemcpy(dp, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemset(dg, 0, b.size() * 2));
      gv[u].p.push_back(static_cast<const uint16_t*>(dp));
      gv[u].g.push_back(static_cast<uint16_t*>(dg));
    }
  double gpu_loss = 0;
  {
    gpt::cuda::Model gm(s, batch, stream);
    gm.embed_forward(gv[0], tokens.data(), t);
    for (size_t l = 0; l < L; ++l) gm.block_forward(static_cast<int>(l), gv[1 + l]);
    gm.final_forward(gv[1 + L]);
    gm.head_forward(gv[0], targets.data());
    gpu_loss = gm.loss();
    gm.head_backward(gv[0]);
    gm.final_backward(gv[1 + L]);
    for (size_t l = L; l-- > 0;) gm.block_backward(static_cast<int>(l), gv[1 + l]);
    gm.embed_backward(gv[0]);
    CUDA_OK(cudaStreamSynchronize(stream));
  }
  EXPECT_NEAR(gpu_loss, cpu_loss, 5e-3 * cpu_loss);
  for (size_t u = 0; u < units; ++u)
    for (size_t i = 0; i < p.bits[u].size(); ++i) {
      std::vector<uint16_t> raw(p.bits[u][i].size());
      CUDA_OK(cudaMemcpy(raw.data(), gv[u].g[i], raw.size() * 2, cudaMemcpyDeviceToHost));
      std::vector<float> got(raw.size());
      for (size_t k = 0; k < raw.size(); ++k) got[k] = gpt::bf16_to_float(raw[k]);
      EXPECT_LT(rel_error(got, cpu_grads[u][i]), 0.05) << p.specs[u].params[i].name << " (t " << t << ")";
    }
  for (void* a : allocations) cudaFree(a);
  cudaStreamDestroy(stream);
}

fsdp_ctx_t* make_ctx(const char* device) {
  fsdp_config_t* cfg = nullptr;
  EXPECT_EQ(fsdp_config_create(&cfg), FSDP_OK);
  for (auto [k, v] : {std::pair<const char*, const char*>{"device", device},
                      {"sharding", "FULL_SHARD"},
                      {"param_dtype", "bf16"},
                      {"reduce_dtype", "fp32"},
                      {"optimizer", "adamw"},
                      {"lr", "0.003"},
                      {"beta2", "0.95"},
                      {"weight_decay", "0.1"},
                      {"no_weight_decay", gpt::kNoWeightDecay},
                      {"max_grad_norm", "1.0"}})
    EXPECT_EQ(fsdp_config_set(cfg, k, v), FSDP_OK) << k << ": " << fsdp_last_error();
  fsdp_ctx_t* ctx = nullptr;
  EXPECT_EQ(fsdp_ctx_create(cfg, nullptr, 0, &ctx), FSDP_OK) << fsdp_last_error();
  fsdp_config_destroy(cfg);
  return ctx;
}

}  // namespace

TEST(CudaGpt, OneStepMatchesTheCpuModel) {
  SKIP_WITHOUT_GPU();
  for (int t : {32, 20}) {
    SCOPED_TRACE("t " + std::to_string(t));
    one_step_matches(t);
  }
}

TEST(CudaGpt, TrainsThroughLibfsdpLikeTheCpuGpt) {
  SKIP_WITHOUT_GPU();
  const gpt::Shape s{2, 64, 4, 32};
  const int batch = 4, steps = 6;
  const gpt::Corpus corpus = gpt::load_corpus(std::string(FSDP_GPT_SOURCE_DIR) + "/data/alice29.txt");
  fsdp_ctx_t* cpu_ctx = make_ctx("cpu");
  fsdp_ctx_t* gpu_ctx = make_ctx("cuda:0");
  ASSERT_TRUE(cpu_ctx && gpu_ctx);
  CUDA_OK(cudaSetDevice(0));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  std::vector<double> cpu_losses, gpu_losses;
  {
    gpt::FsdpGpt cpu(cpu_ctx, s, batch, false, 1234);
    gpt::cuda::FsdpGptCuda gpu(gpu_ctx, s, batch, 1234, stream);
    std::vector<uint8_t> window(static_cast<size_t>(s.context) + 1), in(static_cast<size_t>(batch) * s.context),
        tg(in.size());
    for (int step = 1; step <= steps; ++step) {
      for (int i = 0; i < batch; ++i) {
        gpt::sample_window(corpus.train, 1234, step, i, s.context, window.data());
        std::copy(window.begin(), window.end() - 1, in.begin() + static_cast<ptrdiff_t>(i) * s.context);
        std::copy(window.begin() + 1, window.end(), tg.begin() + static_cast<ptrdiff_t>(i) * s.context);
      }
      cpu_losses.push_back(cpu.train_step(in.data(), tg.data()));
      gpu_losses.push_back(gpu.train_step(in.data(), tg.data()));
      EXPECT_NEAR(gpu_losses.back(), cpu_losses.back(), 0.02 * cpu_losses.back()) << "step " << step;
    }
  }
  EXPECT_LT(cpu_losses.back(), cpu_losses.front());
  EXPECT_LT(gpu_losses.back(), gpu_losses.front());
  EXPECT_EQ(fsdp_ctx_finalize(gpu_ctx), FSDP_OK) << fsdp_last_error();
  EXPECT_EQ(fsdp_ctx_finalize(cpu_ctx), FSDP_OK) << fsdp_last_error();
  fsdp_ctx_destroy(gpu_ctx);
  fsdp_ctx_destroy(cpu_ctx);
  cudaStreamDestroy(stream);
}

// train_gpt's GPU trainer owns the stream its model runs on: the model (which
// syncs and frees on that stream when it goes) must go first. Using a
// destroyed stream leaves a CUDA error behind (or worse).
TEST(CudaGpt, ATrainerReleasesItsModelBeforeItsStream) {
  SKIP_WITHOUT_GPU();
  const gpt::Shape s{2, 64, 4, 32};
  const int batch = 2;
  fsdp_ctx_t* ctx = make_ctx("cuda:0");
  ASSERT_TRUE(ctx);
  std::unique_ptr<gpt::Trainer> trainer = gpt::cuda::make_cuda_trainer(ctx, 0, s, batch, false, 1234);
  std::vector<uint8_t> in(static_cast<size_t>(batch) * s.context), tg(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    in[i] = static_cast<uint8_t>('a' + i % 26);
    tg[i] = static_cast<uint8_t>('a' + (i + 1) % 26);
  }
  EXPECT_TRUE(std::isfinite(trainer->train_step(in.data(), tg.data())));
  (void)cudaGetLastError();  // nothing of the step's own
  trainer.reset();
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the model used its stream after the stream was destroyed";
  EXPECT_EQ(fsdp_ctx_finalize(ctx), FSDP_OK) << fsdp_last_error();
  fsdp_ctx_destroy(ctx);
}
