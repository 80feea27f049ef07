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
#include <thread>
#include <vector>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "device/cuda/cuda_device.h"
#include "fsdp.h"
#include "gpu_presence.h"
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

// The unit's weights as fp32 (from fp32, bf16 or fp16), read through fsdp_param_ptr.
std::vector<float> read_param(fsdp_unit_t* u, fsdp_dtype_t dt, bool gpu) {
  void* p = nullptr;
  EXPECT_EQ(fsdp_param_ptr(u, 0, &p), FSDP_OK) << fsdp_last_error();
  std::vector<float> w(kDim * kDim);
  if (dt == FSDP_DTYPE_FP32) {
    to_host(w.data(), p, w.size() * 4, gpu);
  } else {
    std::vector<uint16_t> raw(w.size());
    to_host(raw.data(), p, raw.size() * 2, gpu);
    for (size_t i = 0; i < w.size(); ++i) {
      w[i] = dt == FSDP_DTYPE_BF16 ? fsdp::kernels::bf16_bits_to_f32(raw[i]) : fsdp::kernels::fp16_bits_to_f32(raw[i]);
    }
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
    for (size_t i = 0; i < g.size(); ++i) {
      raw[i] = dt == FSDP_DTYPE_BF16 ? fsdp::kernels::f32_to_bf16_bits(g[i]) : fsdp::kernels::f32_to_fp16_bits(g[i]);
    }
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

// Rank `rank` of `world` (in `group`; null for a world of one) trains
// kSteps of AdamW on its rows of a fixed batch; `opts` plus device=cpu or
// cuda:0 (every rank of a world on the one GPU).
void train_rank(const std::map<std::string, std::string>& opts, bool gpu, fsdp_local_group_t* group, int rank,
                int world, bool keep_open, TrainedRun* out) {
  fsdp_config_t* cfg = nullptr;
  CHECK_OK(fsdp_config_create(&cfg));
  std::map<std::string, std::string> all = opts;
  if (!gpu || all.count("device") == 0) all["device"] = gpu ? "cuda:0" : "cpu";
  // test_host_sgd=1: optimizer=host, the test's SGD with momentum run on the
  // host over copies of the shards fsdp_shard_tensors hands out.
  const bool host_sgd = all.count("test_host_sgd") != 0;
  all.erase("test_host_sgd");
  all["optimizer"] = host_sgd ? "host" : "adamw";
  if (host_sgd) all["host_state"] = "1";
  all["lr"] = "0.01";
  all["weight_decay"] = "0.01";
  for (const auto& kv : all) CHECK_OK(fsdp_config_set(cfg, kv.first.c_str(), kv.second.c_str()));
  fsdp_ctx_t* ctx = nullptr;
  fsdp_status_t created = fsdp_ctx_create(cfg, group, rank, &ctx);
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
  // This rank's rows of the batch (every rank drew the whole batch).
  const int rows = kBatch / world;
  x.erase(x.begin(), x.begin() + rank * rows * kDim);
  x.resize(static_cast<size_t>(rows) * kDim);
  y.erase(y.begin(), y.begin() + rank * rows * kDim);
  y.resize(static_cast<size_t>(rows) * kDim);
  for (int step = 0; step < kSteps; ++step) {
    // Forward: h[k+1] = tanh(h[k] W_k^T), row-major batch x dim.
    std::vector<std::vector<float>> h(kUnits + 1);
    h[0] = x;
    for (int k = 0; k < kUnits; ++k) {
      CHECK_OK(fsdp_forward_begin(units[k], nullptr));
      std::vector<float> w = read_param(units[k], dt, gpu);
      CHECK_OK(fsdp_forward_end(units[k], nullptr));
      h[k + 1].assign(rows * kDim, 0.0f);
      for (int b = 0; b < rows; ++b) {
        for (int o = 0; o < kDim; ++o) {
          float acc = 0.0f;
          for (int i = 0; i < kDim; ++i) acc += h[k][b * kDim + i] * w[o * kDim + i];
          h[k + 1][b * kDim + o] = std::tanh(acc);
        }
      }
    }
    // Backward of 0.5 * mean over the batch of |h - y|^2.
    std::vector<float> dh(rows * kDim);
    for (size_t i = 0; i < dh.size(); ++i) dh[i] = (h[kUnits][i] - y[i]) / rows;
    for (int k = kUnits - 1; k >= 0; --k) {
      CHECK_OK(fsdp_backward_begin(units[k], nullptr));
      std::vector<float> w = read_param(units[k], dt, gpu);
      std::vector<float> dz(rows * kDim), dw(kDim * kDim, 0.0f), dprev(rows * kDim, 0.0f);
      for (size_t i = 0; i < dz.size(); ++i) dz[i] = dh[i] * (1.0f - h[k + 1][i] * h[k + 1][i]);
      for (int b = 0; b < rows; ++b) {
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
    if (!host_sgd) {
      CHECK_OK(fsdp_step(ctx, nullptr));
      continue;
    }
    int update = 0;
    float scale = 0.0f;
    CHECK_OK(fsdp_step_begin(ctx, nullptr, &update, &scale));
    for (int k = 0; update == 1 && k < kUnits; ++k) {
      float *p = nullptr, *g = nullptr, *m = nullptr;
      size_t n = 0;
      CHECK_OK(fsdp_shard_tensors(ctx, units[k], &p, &g, &m, 1, &n));
      std::vector<float> hp(n), hg(n), hm(n);
      to_host(hp.data(), p, n * 4, gpu);
      to_host(hg.data(), g, n * 4, gpu);
      to_host(hm.data(), m, n * 4, gpu);
      for (size_t i = 0; i < n; ++i) {
        hm[i] = 0.9f * hm[i] + hg[i] * scale;
        hp[i] -= 0.01f * hm[i];
      }
      from_host(p, hp.data(), n * 4, gpu);
      from_host(m, hm.data(), n * 4, gpu);
    }
    CHECK_OK(fsdp_step_end(ctx, nullptr));
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

// train_rank on `world` ranks (threads sharing the device); `out` gets rank
// 0's result (every rank gathers the same full params).
void train(const std::map<std::string, std::string>& opts, bool gpu, int world, bool keep_open, TrainedRun* out) {
  if (world == 1) {
    train_rank(opts, gpu, nullptr, 0, 1, keep_open, out);
    return;
  }
  fsdp_local_group_t* group = nullptr;
  CHECK_OK(fsdp_local_group_create(world, &group));
  std::vector<TrainedRun> runs(static_cast<size_t>(world));
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] { train_rank(opts, gpu, group, r, world, false, &runs[static_cast<size_t>(r)]); });
  }
  for (auto& t : ranks) t.join();
  fsdp_local_group_destroy(group);
  *out = runs[0];
}

long first_difference(const std::vector<float>& a, const std::vector<float>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], 4) != 0) return static_cast<long>(i);
  }
  return -1;
}

// `opts` trained at `world` on device=cuda:0 gives device=cpu's params, bit for bit.
void expect_gpu_trains_like_cpu(const std::map<std::string, std::string>& opts, int world) {
  TrainedRun cpu, gpu;
  train(opts, false, world, false, &cpu);
  train(opts, true, world, false, &gpu);
  if (::testing::Test::HasFatalFailure()) return;
  for (int k = 0; k < kUnits; ++k) EXPECT_EQ(first_difference(cpu.params[k], gpu.params[k]), -1) << "unit " << k;
}

// Skips without a GPU; fails where nvidia-smi lists one that CUDA cannot use (gpu_presence.h).
#define SKIP_WITHOUT_GPU() FSDP_SKIP_WITHOUT_GPU("GPU test not run")

}  // namespace

TEST(CudaEngine, TrainsBitwiseLikeTheCpuDevice) {
  SKIP_WITHOUT_GPU();
  for (const char* sharding : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"}) {
    for (const char* dtype : {"fp32", "bf16"}) {
      SCOPED_TRACE(std::string(sharding) + " " + dtype);
      std::map<std::string, std::string> opts = {{"sharding", sharding}, {"param_dtype", dtype}};
      expect_gpu_trains_like_cpu(opts, 1);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

// optimizer=host on a GPU: fsdp_step_begin, fsdp_shard_tensors handing out
// the device's shards (here copied to the host and back with cudaMemcpy, on
// the legacy default stream the NULL stream means), fsdp_step_end making the
// bf16 copies follow and zeroing the grads: the same bits as on the CPU.
TEST(CudaEngine, AHostOptimizerTrainsBitwiseLikeOnTheCpu) {
  SKIP_WITHOUT_GPU();
  for (const char* dtype : {"fp32", "bf16"}) {
    for (int world : {1, 2}) {
      SCOPED_TRACE(std::string(dtype) + " world " + std::to_string(world));
      expect_gpu_trains_like_cpu({{"sharding", "FULL_SHARD"}, {"param_dtype", dtype}, {"test_host_sgd", "1"}}, world);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

// Ranks as threads sharing one GPU: the local communicator moves the GPU's
// memory with the device's copies and reduce kernel (kernels/reduce.h's
// order), so every world trains bit for bit like the same world on the CPU
// device (whose own equivalence with one unsharded rank tests/test_equivalence
// checks).
TEST(CudaEngine, RanksSharingOneGpuTrainBitwiseLikeTheSameWorldOnTheCpu) {
  SKIP_WITHOUT_GPU();
  for (int world : {2, 4}) {
    for (const char* sharding : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"}) {
      // fp16 runs with dynamic loss scaling (its default): the inf/nan check
      // and the scale's updates take the same path on both devices.
      for (const char* dtype : {"fp32", "bf16", "fp16"}) {
        SCOPED_TRACE("world " + std::to_string(world) + " " + sharding + " " + dtype);
        std::map<std::string, std::string> opts = {
            {"sharding", sharding}, {"param_dtype", dtype}, {"timeout_s", "60"}, {"shard_group_size", "2"}};
        if (std::string(sharding) != "HYBRID_SHARD") opts.erase("shard_group_size");
        expect_gpu_trains_like_cpu(opts, world);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

// Quantized gathers (gather_dtype) and reductions (reduce_dtype int8 /
// fp8_e4m3), with the node-local secondary shard, on ranks sharing one GPU:
// the GPU's quantize / dequantize / dequantize_sum kernels (blocks of 128:
// the warp-per-block kernels and, for the last partial block, the plain
// ones) give the same bits as the same world on the CPU device, whose
// equivalence with an unsharded reference that models the quantization
// tests/test_quant.cpp and tests/test_quant_reduce.cpp check.
TEST(CudaEngine, QuantizedGathersAndReductionsTrainBitwiseLikeTheCpu) {
  SKIP_WITHOUT_GPU();
  struct Case {
    const char *sharding, *gather, *reduce, *secondary;
  };
  const Case cases[] = {{"FULL_SHARD", "int8", "fp32", "off"},
                        {"FULL_SHARD", "fp8_e4m3", "int8", "2"},
                        {"SHARD_GRAD_OP", "int8", "fp8_e4m3", "off"},
                        {"HYBRID_SHARD", "fp8_e4m3", "int8", "off"}};
  for (int world : {2, 4}) {
    for (const Case& c : cases) {
      for (const char* dtype : {"fp32", "bf16"}) {
        SCOPED_TRACE("world " + std::to_string(world) + " " + c.sharding + " gather " + c.gather + " reduce " +
                     c.reduce + " secondary " + c.secondary + " " + dtype);
        std::map<std::string, std::string> opts = {{"sharding", c.sharding},         {"param_dtype", dtype},
                                                   {"gather_dtype", c.gather},       {"reduce_dtype", c.reduce},
                                                   {"secondary_shard", c.secondary}, {"gather_block", "128"},
                                                   {"reduce_block", "128"},          {"timeout_s", "60"}};
        if (std::string(c.sharding) == "HYBRID_SHARD") opts["shard_group_size"] = "2";
        expect_gpu_trains_like_cpu(opts, world);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

// comm=nccl at a world of one (a process with no launcher): the NCCL
// communicator forms, carries the context's host-memory collectives (config
// and registration checks, staged through the GPU) and the engine trains as
// on the CPU, bit for bit.
TEST(CudaEngine, NcclAtAWorldOfOneTrainsBitwiseLikeTheCpu) {
  SKIP_WITHOUT_GPU();
  if (std::string(fsdp_build_info()).find("nccl") == std::string::npos) {
    GTEST_SKIP() << "this build has no NCCL communicator";
  }
  TrainedRun cpu, gpu;
  train({{"sharding", "FULL_SHARD"}}, false, 1, false, &cpu);
  train({{"sharding", "FULL_SHARD"}, {"comm", "nccl"}, {"timeout_s", "60"}}, true, 1, false, &gpu);
  if (::testing::Test::HasFatalFailure()) return;
  for (int k = 0; k < kUnits; ++k) EXPECT_EQ(first_difference(cpu.params[k], gpu.params[k]), -1) << "unit " << k;
}

// offload=cpu on a GPU: state in pinned host memory, the optimizer on the
// host, copies on the copy streams; the same bits as offload on the CPU
// device, alone and with ranks sharing the GPU.
TEST(CudaEngine, OffloadTrainsBitwiseLikeOffloadOnTheCpu) {
  SKIP_WITHOUT_GPU();
  for (int world : {1, 2}) {
    for (const char* sharding : {"FULL_SHARD", "NO_SHARD"}) {
      for (const char* dtype : {"fp32", "bf16"}) {
        SCOPED_TRACE("world " + std::to_string(world) + " " + sharding + " " + dtype);
        std::map<std::string, std::string> opts = {
            {"sharding", sharding}, {"param_dtype", dtype}, {"offload", "cpu"}, {"timeout_s", "60"}};
        expect_gpu_trains_like_cpu(opts, world);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

TEST(CudaEngine, ClippingMatchesTheCpuDeviceClosely) {
  SKIP_WITHOUT_GPU();
  std::map<std::string, std::string> opts = {{"sharding", "FULL_SHARD"}, {"max_grad_norm", "0.05"}};
  TrainedRun cpu, gpu;
  train(opts, false, 1, false, &cpu);
  train(opts, true, 1, false, &gpu);
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

namespace {

// A model trained on one device (the GPU, or the CPU) and saved loads on the
// other bit for bit.
void expect_checkpoint_moves(bool from_gpu) {
  std::string dir = (std::filesystem::temp_directory_path() / ("fsdp_cuda_ckpt_" + std::to_string(getpid()))).string();
  std::filesystem::remove_all(dir);
  TrainedRun src;
  train({{"sharding", "FULL_SHARD"}}, from_gpu, 1, true, &src);
  if (::testing::Test::HasFatalFailure()) return;
  CHECK_OK(fsdp_save(src.ctx, dir.c_str(), "sharded"));
  CHECK_OK(fsdp_ctx_finalize(src.ctx));
  fsdp_ctx_destroy(src.ctx);
  // The same model on the other device, loaded from it.
  fsdp_config_t* cfg = nullptr;
  CHECK_OK(fsdp_config_create(&cfg));
  CHECK_OK(fsdp_config_set(cfg, "optimizer", "adamw"));
  CHECK_OK(fsdp_config_set(cfg, "device", from_gpu ? "cpu" : "cuda:0"));
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
    EXPECT_EQ(first_difference(src.params[k], w), -1) << "unit " << k;
  }
  CHECK_OK(fsdp_ctx_finalize(ctx));
  fsdp_ctx_destroy(ctx);
  std::filesystem::remove_all(dir);
}

}  // namespace

TEST(CudaEngine, ACheckpointSavedOnTheGpuLoadsOnTheCpuBitwise) {
  SKIP_WITHOUT_GPU();
  expect_checkpoint_moves(/*from_gpu=*/true);
}

TEST(CudaEngine, ACheckpointSavedOnTheCpuLoadsOnTheGpuBitwise) {
  SKIP_WITHOUT_GPU();
  expect_checkpoint_moves(/*from_gpu=*/false);
}

// comm=nccl across processes: the parent spawns kNcclRanks copies of this
// binary with torchrun's variables, one GPU each, each running
// NcclChild.TrainsLikeTheSameWorldOnTheCpu: every rank trains through NCCL and
// compares its params with the same world run as thread-ranks on the CPU
// device in the same process. Two ranks' sums are the same in any order, so
// fp32 matches bit for bit; bf16 to its rounding. Skipped with fewer GPUs.
namespace {

constexpr int kNcclRanks = 2;
constexpr const char* kChildFlag = "FSDP_TEST_NCCL_CHILD";

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

}  // namespace

TEST(CudaEngine, NcclProcessesTrainLikeTheSameWorldOnTheCpu_OnTwoGpus) {
  SKIP_WITHOUT_GPU();
  if (std::string(fsdp_build_info()).find("nccl") == std::string::npos) GTEST_SKIP() << "no NCCL in this build";
  if (fsdp::device::cuda::CudaDevice::count() < kNcclRanks) {
    GTEST_SKIP() << kNcclRanks << " NCCL processes need " << kNcclRanks << " GPUs";
  }
  const std::string port = std::to_string(free_port());
  std::vector<pid_t> pids;
  for (int r = 0; r < kNcclRanks; ++r) {
    std::vector<std::string> env_s = {std::string(kChildFlag) + "=1",
                                      "RANK=" + std::to_string(r),
                                      "WORLD_SIZE=" + std::to_string(kNcclRanks),
                                      "LOCAL_RANK=" + std::to_string(r),
                                      "LOCAL_WORLD_SIZE=" + std::to_string(kNcclRanks),
                                      "MASTER_ADDR=127.0.0.1",
                                      "MASTER_PORT=" + port};
    for (char** e = environ; *e != nullptr; ++e) env_s.emplace_back(*e);
    std::vector<char*> env;
    for (std::string& e : env_s) env.push_back(e.data());
    env.push_back(nullptr);
    std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
    std::string filter = "--gtest_filter=NcclChild.*";
    char* argv[] = {self.data(), filter.data(), nullptr};
    pid_t pid = 0;
    ASSERT_EQ(posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv, env.data()), 0);
    pids.push_back(pid);
  }
  for (size_t r = 0; r < pids.size(); ++r) {
    int status = 0;
    ASSERT_EQ(waitpid(pids[r], &status, 0), pids[r]);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "rank " << r << " failed (its output is above)";
  }
}

TEST(NcclChild, TrainsLikeTheSameWorldOnTheCpu) {
  if (std::getenv(kChildFlag) == nullptr) {
    GTEST_SKIP() << "runs only as a process of CudaEngine.NcclProcessesTrainLikeTheSameWorldOnTheCpu_OnTwoGpus";
  }
  const int rank = std::atoi(std::getenv("RANK"));
  const int world = std::atoi(std::getenv("WORLD_SIZE"));
  ASSERT_EQ(cudaSetDevice(rank), cudaSuccess);
  for (const char* sharding : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"}) {
    for (const char* dtype : {"fp32", "bf16"}) {
      SCOPED_TRACE(std::string("rank ") + std::to_string(rank) + " " + sharding + " " + dtype);
      std::map<std::string, std::string> opts = {{"sharding", sharding}, {"param_dtype", dtype}, {"timeout_s", "60"}};
      // HYBRID_SHARD: shard groups of one rank, replicated across the two.
      if (std::string(sharding) == "HYBRID_SHARD") opts["shard_group_size"] = "1";
      TrainedRun cpu, gpu;
      train(opts, false, world, false, &cpu);  // the same world as thread-ranks on the CPU
      opts["device"] = "cuda:" + std::to_string(rank);
      opts["comm"] = "nccl";
      train_rank(opts, true, nullptr, rank, world, false, &gpu);
      if (::testing::Test::HasFatalFailure()) return;
      const float tol = std::string(dtype) == "fp32" ? 0.0f : 1e-2f;
      for (int k = 0; k < kUnits; ++k) {
        for (size_t i = 0; i < cpu.params[k].size(); ++i) {
          ASSERT_NEAR(gpu.params[k][i], cpu.params[k][i], tol * (1.0f + std::fabs(cpu.params[k][i])))
              << "unit " << k << " element " << i;
        }
      }
    }
  }
}
