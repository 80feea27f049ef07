// A training step captured in a CUDA graph and replayed gives the eager
// steps' results bit for bit: the brackets and fsdp_step queued on a stream
// the host captures (the engine's streams join the capture), the step
// decided on the device (kernels/step.h) from the grads the replay wrote,
// through an lr change between replays (fsdp_set_lr writes in stream order),
// a skipped step (inf grads: the host's factor, read from device memory, set
// to inf for one replay) and the dynamic loss scale's growth and backoff
// (the scale lives in device memory: fsdp_loss_scale_device), in fp32 and
// bf16 (whose grads the test writes in bf16). At a world of one, alone and
// with comm=nccl. What cannot be captured is refused, naming the call:
// offload=cpu, a call that would wait on the host during the capture, and
// (for now) ranks that are threads sharing the GPU. Skips, saying so,
// without a GPU.
#include <gtest/gtest.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "fsdp.h"
#include "gpu_presence.h"

namespace {

constexpr int kDim = 64, kUnits = 3, kSteps = 10;
constexpr int kCaptureAt = 3;  // steps before it run eagerly (warm-up: slots and tables made)
constexpr int kLrAt = 5, kInfAt = 7;

#define SKIP_WITHOUT_GPU() FSDP_SKIP_WITHOUT_GPU("CUDA graph test not run")

std::string error_text(fsdp_status_t s) { return std::string(fsdp_status_name(s)) + ": " + fsdp_last_error(); }

#define CHECK_OK(call)                                           \
  do {                                                           \
    fsdp_status_t s_ = (call);                                   \
    ASSERT_EQ(s_, FSDP_OK) << #call << " -> " << error_text(s_); \
  } while (0)
#define CHECK_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call << ": " << cudaGetErrorString(cudaGetLastError())
#define CHECK_BLAS(call) ASSERT_EQ((call), CUBLAS_STATUS_SUCCESS) << #call

// One rank's training: its context, units, stream, cuBLAS handle and the
// factor (device memory) its grads are made with.
struct Rank {
  fsdp_ctx_t* ctx = nullptr;
  std::vector<fsdp_unit_t*> units;
  cudaStream_t s = nullptr;
  cublasHandle_t blas = nullptr;
  float* factor = nullptr;  // device: grad = factor * param (+ the rank's offset)
  void* offset = nullptr;   // device: a rank-dependent constant grad, in the params' dtype
  cudaDataType_t type = CUDA_R_32F;  // the params' and grads' dtype (fp32 or bf16)
};

// x rounded to the nearest bf16 (ties to even), as its bits.
uint16_t to_bf16(float x) {
  uint32_t b = 0;
  std::memcpy(&b, &x, sizeof b);
  b += 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

struct Result {
  std::vector<std::vector<float>> params;
  double scale = 0.0;
  uint64_t skipped = 0, step = 0;
};

void open(Rank& r, const std::map<std::string, std::string>& extra, fsdp_local_group_t* group, int rank) {
  fsdp_config_t* cfg = nullptr;
  CHECK_OK(fsdp_config_create(&cfg));
  std::map<std::string, std::string> opts = {
      {"device", "cuda:0"},       {"optimizer", "adamw"},           {"lr", "0.01"},
      {"weight_decay", "0.01"},   {"max_grad_norm", "0.5"},         {"loss_scale", "dynamic"},
      {"loss_scale_init", "256"}, {"loss_scale_growth_interval", "2"}, {"timeout_s", "60"}};
  for (const auto& kv : extra) opts[kv.first] = kv.second;
  for (const auto& kv : opts) CHECK_OK(fsdp_config_set(cfg, kv.first.c_str(), kv.second.c_str()));
  fsdp_status_t created = fsdp_ctx_create(cfg, group, rank, &r.ctx);
  fsdp_config_destroy(cfg);
  CHECK_OK(created);
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 0.1f);
  r.units.assign(kUnits, nullptr);
  for (int k = 0; k < kUnits; ++k) {
    const char* names[] = {"weight"};
    int32_t ndims[] = {2};
    int64_t dims[] = {kDim, kDim};
    const std::string name = "layer" + std::to_string(k);
    CHECK_OK(fsdp_unit_register(r.ctx, name.c_str(), 1, names, ndims, dims, &r.units[k]));
    std::vector<float> w(kDim * kDim);
    for (float& x : w) x = nd(rng);
    CHECK_OK(fsdp_param_set_values(r.units[k], 0, w.data(), w.size()));
  }
  CHECK_CUDA(cudaStreamCreateWithFlags(&r.s, cudaStreamNonBlocking));
  CHECK_BLAS(cublasCreate(&r.blas));
  CHECK_BLAS(cublasSetStream(r.blas, r.s));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&r.factor), sizeof(float)));
  fsdp_dtype_t dtype = FSDP_DTYPE_FP32;
  CHECK_OK(fsdp_ctx_param_dtype(r.ctx, &dtype));
  ASSERT_TRUE(dtype == FSDP_DTYPE_FP32 || dtype == FSDP_DTYPE_BF16) << "the test makes fp32 or bf16 grads";
  r.type = dtype == FSDP_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F;
  std::vector<float> off(kDim * kDim);
  for (size_t i = 0; i < off.size(); ++i) off[i] = 0.01f * static_cast<float>((i * 7 + static_cast<size_t>(rank)) % 13);
  std::vector<uint16_t> off16(off.size());
  for (size_t i = 0; i < off.size(); ++i) off16[i] = to_bf16(off[i]);
  const bool bf16 = r.type == CUDA_R_16BF;
  const size_t nbytes = off.size() * (bf16 ? sizeof(uint16_t) : sizeof(float));
  CHECK_CUDA(cudaMalloc(&r.offset, nbytes));
  CHECK_CUDA(cudaMemcpy(r.offset, bf16 ? static_cast<const void*>(off16.data()) : off.data(), nbytes,
                        cudaMemcpyHostToDevice));
}

void close(Rank& r) {
  cudaStreamSynchronize(r.s);
  fsdp_ctx_finalize(r.ctx);
  fsdp_ctx_destroy(r.ctx);
  cublasDestroy(r.blas);
  cudaFree(r.factor);
  cudaFree(r.offset);
  cudaStreamDestroy(r.s);
}

// One step's calls and the host's compute, all queued on r.s: grads =
// factor * params + offset, the factor read from device memory (so that a
// replay sees the value the host wrote before launching it).
void step_calls(Rank& r) {
  for (fsdp_unit_t* u : r.units) {
    CHECK_OK(fsdp_forward_begin(u, r.s));
    CHECK_OK(fsdp_forward_end(u, r.s));
  }
  for (int k = kUnits; k-- > 0;) {
    fsdp_unit_t* u = r.units[static_cast<size_t>(k)];
    CHECK_OK(fsdp_backward_begin(u, r.s));
    void *p = nullptr, *g = nullptr;
    CHECK_OK(fsdp_param_ptr(u, 0, &p));
    CHECK_OK(fsdp_grad_ptr(u, 0, &g));
    const float one = 1.0f;
    // In the params' dtype (bf16 grads for bf16 params), computed in fp32.
    CHECK_BLAS(cublasSetPointerMode(r.blas, CUBLAS_POINTER_MODE_HOST));
    CHECK_BLAS(cublasAxpyEx(r.blas, kDim * kDim, &one, CUDA_R_32F, r.offset, r.type, 1, g, r.type, 1, CUDA_R_32F));
    CHECK_BLAS(cublasSetPointerMode(r.blas, CUBLAS_POINTER_MODE_DEVICE));
    CHECK_BLAS(cublasAxpyEx(r.blas, kDim * kDim, r.factor, CUDA_R_32F, p, r.type, 1, g, r.type, 1, CUDA_R_32F));
    CHECK_OK(fsdp_backward_end(u, r.s));
  }
  CHECK_OK(fsdp_step(r.ctx, r.s));
}

// What the host writes before step i: the factor (inf at kInfAt), and the lr at kLrAt.
float factor_at(int i) { return i == kInfAt ? std::numeric_limits<float>::infinity() : 0.5f + 0.05f * i; }

void set_factor(Rank& r, int i) {
  const float f = factor_at(i);
  // Stream-ordered before the step (or the replay) queued after it.
  ASSERT_EQ(cudaMemcpyAsync(r.factor, &f, sizeof f, cudaMemcpyHostToDevice, r.s), cudaSuccess);
}

void read_result(Rank& r, Result* out) {
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  out->params.assign(kUnits, std::vector<float>(kDim * kDim));
  for (int k = 0; k < kUnits; ++k) {
    CHECK_OK(fsdp_gather_param(r.units[k], 0, out->params[k].data(), out->params[k].size()));
  }
  CHECK_OK(fsdp_loss_scale(r.ctx, &out->scale, &out->skipped));
  CHECK_OK(fsdp_ctx_step(r.ctx, &out->step));
}

// A world of one: kSteps eager steps, or kCaptureAt eager ones and the rest
// as replays of one captured step.
void train_one(const std::map<std::string, std::string>& extra, bool graph, Result* out) {
  Rank r;
  open(r, extra, nullptr, 0);
  if (::testing::Test::HasFatalFailure()) return;
  cudaGraphExec_t exec = nullptr;
  for (int i = 0; i < kSteps; ++i) {
    set_factor(r, i);
    if (i == kLrAt) CHECK_OK(fsdp_set_lr(r.ctx, 0.003));
    if (!graph || i < kCaptureAt) {
      step_calls(r);
    } else {
      if (exec == nullptr) {
        CHECK_CUDA(cudaStreamSynchronize(r.s));  // the warm-up is done: nothing crosses into the capture
        cudaGraph_t g = nullptr;
        CHECK_CUDA(cudaStreamBeginCapture(r.s, cudaStreamCaptureModeGlobal));
        step_calls(r);
        CHECK_CUDA(cudaStreamEndCapture(r.s, &g));
        CHECK_CUDA(cudaGraphInstantiate(&exec, g, 0));
        cudaGraphDestroy(g);
      }
      CHECK_CUDA(cudaGraphLaunch(exec, r.s));
    }
    if (::testing::Test::HasFatalFailure()) return;
  }
  read_result(r, out);
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  close(r);
}

void expect_same(const Result& eager, const Result& graph) {
  for (int k = 0; k < kUnits; ++k) {
    EXPECT_EQ(std::memcmp(eager.params[k].data(), graph.params[k].data(), eager.params[k].size() * 4), 0)
        << "unit " << k << " differs between the eager steps and the graph's replays";
  }
  EXPECT_EQ(graph.scale, eager.scale);
  EXPECT_EQ(graph.skipped, eager.skipped);
  EXPECT_EQ(graph.step, eager.step);
  // The schedule did what it is for: one skip (its backoff), growth, and
  // the count of the updates that ran.
  EXPECT_EQ(eager.skipped, 1u);
  EXPECT_EQ(eager.step, static_cast<uint64_t>(kSteps - 1));
  EXPECT_NE(eager.scale, 256.0) << "the loss scale never moved";
}

}  // namespace

TEST(CudaGraph, ACapturedStepReplaysTheEagerStepsBitwise) {
  SKIP_WITHOUT_GPU();
  for (const char* sharding : {"FULL_SHARD", "NO_SHARD"}) {
    for (const char* dtype : {"fp32", "bf16"}) {
      SCOPED_TRACE(std::string(sharding) + " " + dtype);
      std::map<std::string, std::string> opts = {{"sharding", sharding}, {"param_dtype", dtype}};
      Result eager, graph;
      train_one(opts, false, &eager);
      train_one(opts, true, &graph);
      if (::testing::Test::HasFatalFailure()) return;
      expect_same(eager, graph);
    }
  }
}

TEST(CudaGraph, ACapturedStepWithNcclAtAWorldOfOneReplaysTheEagerSteps) {
  SKIP_WITHOUT_GPU();
  if (std::string(fsdp_build_info()).find("nccl") == std::string::npos) {
    GTEST_SKIP() << "this build has no NCCL communicator";
  }
  std::map<std::string, std::string> opts = {{"sharding", "FULL_SHARD"}, {"comm", "nccl"}};
  Result eager, graph;
  train_one(opts, false, &eager);
  train_one(opts, true, &graph);
  if (::testing::Test::HasFatalFailure()) return;
  expect_same(eager, graph);
}

// Ranks that are threads sharing the GPU (the local communicator on device
// memory) are not captured yet: two of them captured into one graph hung on
// an H100 (docs/gpu.md, "GPU runs", 2026-11-27). The first call inside the
// capture is refused, naming why, before it queues anything: once the
// capture ended, both ranks train on eagerly, bitwise as a world that never
// tried.
TEST(CudaGraph, ThreadRanksSharingTheGpuAreRefusedACaptureAndTrainOnUnchanged) {
  SKIP_WITHOUT_GPU();
  auto run = [](bool try_capture, std::vector<Result>* out) {
    fsdp_local_group_t* group = nullptr;
    CHECK_OK(fsdp_local_group_create(2, &group));
    std::vector<Rank> ranks(2);
    out->assign(2, Result{});
    auto body = [&](int rank) {
      Rank& r = ranks[static_cast<size_t>(rank)];
      open(r, {{"sharding", "FULL_SHARD"}}, group, rank);
      if (::testing::Test::HasFatalFailure()) return;
      for (int i = 0; i < kSteps; ++i) {
        if (try_capture && rank == 0 && i == kCaptureAt) {
          CHECK_CUDA(cudaStreamSynchronize(r.s));
          CHECK_CUDA(cudaStreamBeginCapture(r.s, cudaStreamCaptureModeThreadLocal));
          EXPECT_EQ(fsdp_forward_begin(r.units[0], r.s), FSDP_ERR_UNSUPPORTED);
          EXPECT_NE(std::string(fsdp_last_error()).find("threads sharing one GPU"), std::string::npos)
              << fsdp_last_error();
          cudaGraph_t g = nullptr;
          EXPECT_EQ(cudaStreamEndCapture(r.s, &g), cudaSuccess) << "the refusal queued something into the capture";
          if (g != nullptr) cudaGraphDestroy(g);
        }
        const float f = factor_at(i);
        ASSERT_EQ(cudaMemcpyAsync(r.factor, &f, sizeof f, cudaMemcpyHostToDevice, r.s), cudaSuccess);
        step_calls(r);
        if (::testing::Test::HasFatalFailure()) return;
      }
      read_result(r, &(*out)[static_cast<size_t>(rank)]);
    };
    std::thread t1(body, 1);
    body(0);
    t1.join();
    // Each rank closes on a thread of its own: fsdp_ctx_finalize is a
    // collective (closing them one after the other on one thread hung).
    auto close_rank = [&](int rank) {
      if (ranks[static_cast<size_t>(rank)].ctx != nullptr) close(ranks[static_cast<size_t>(rank)]);
    };
    std::thread c1(close_rank, 1);
    close_rank(0);
    c1.join();
    fsdp_local_group_destroy(group);
  };
  std::vector<Result> eager, tried;
  run(false, &eager);
  run(true, &tried);
  if (::testing::Test::HasFatalFailure()) return;
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const Result &e = eager[static_cast<size_t>(rank)], &t = tried[static_cast<size_t>(rank)];
    for (int k = 0; k < kUnits; ++k) {
      EXPECT_EQ(std::memcmp(e.params[k].data(), t.params[k].data(), e.params[k].size() * 4), 0) << "unit " << k;
    }
    EXPECT_EQ(t.scale, e.scale);
    EXPECT_EQ(t.skipped, e.skipped);
    EXPECT_EQ(e.skipped, 1u);
  }
}

// What a graph cannot hold is refused while the capture is open, naming the
// call and saying why, and the capture ends cleanly: offload=cpu's host-side
// optimizer, and a call that waits for the step on the host.
TEST(CudaGraph, WhatAGraphCannotHoldIsRefusedDuringTheCapture) {
  SKIP_WITHOUT_GPU();
  {
    Rank r;
    open(r, {{"offload", "cpu"}}, nullptr, 0);
    if (::testing::Test::HasFatalFailure()) return;
    set_factor(r, 0);
    step_calls(r);  // eager: fine
    CHECK_CUDA(cudaStreamSynchronize(r.s));
    CHECK_CUDA(cudaStreamBeginCapture(r.s, cudaStreamCaptureModeGlobal));
    EXPECT_EQ(fsdp_forward_begin(r.units[0], r.s), FSDP_ERR_UNSUPPORTED);
    EXPECT_NE(std::string(fsdp_last_error()).find("offload=cpu"), std::string::npos) << fsdp_last_error();
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(r.s, &g);
    if (g != nullptr) cudaGraphDestroy(g);
    cudaGetLastError();
    close(r);
  }
  {
    Rank r;
    open(r, {}, nullptr, 0);
    if (::testing::Test::HasFatalFailure()) return;
    set_factor(r, 0);
    step_calls(r);
    CHECK_CUDA(cudaStreamSynchronize(r.s));
    CHECK_CUDA(cudaStreamBeginCapture(r.s, cudaStreamCaptureModeGlobal));
    step_calls(r);
    double norm = 0.0;
    EXPECT_EQ(fsdp_last_grad_norm(r.ctx, &norm), FSDP_ERR_INVALID_STATE);
    EXPECT_NE(std::string(fsdp_last_error()).find("CUDA graph"), std::string::npos) << fsdp_last_error();
    EXPECT_EQ(fsdp_set_lr(r.ctx, 0.1), FSDP_ERR_INVALID_STATE) << "an lr set inside the graph would be baked in";
    cudaGraph_t g = nullptr;
    CHECK_CUDA(cudaStreamEndCapture(r.s, &g));
    cudaGraphDestroy(g);
    EXPECT_EQ(fsdp_last_grad_norm(r.ctx, &norm), FSDP_OK) << "after the capture the read is fine";
    close(r);
  }
}
