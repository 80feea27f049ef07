// train_gpt_cuda.cpp - the GPT of examples/gpt trained on GPUs: the model on
// the GPU (gpt_cuda: cuBLAS bf16 GEMMs, cuDNN's fused attention, this
// example's kernels), libfsdp on device=cuda for everything else (FULL_SHARD,
// bf16 params, fp32 grad reduction, AdamW, clipping, prefetch). One process
// per GPU: alone, or started by torchrun or mpirun (comm=auto takes nccl; the
// GPU is LOCAL_RANK's). Same text, same init and the same batches as the CPU
// demo train_gpt, so the two runs can be compared step by step.
//
//   train_gpt_cuda [--steps 300] [--layers 4 --width 128 --heads 4 --context 128] [--batch 16] [--check]
//   examples/cuda/launch_local.sh 2 train_gpt_cuda --check          (2 GPUs of this host)
//   torchrun --nproc-per-node 8 --no-python train_gpt_cuda --width 768 --heads 12 --layers 12 --context 1024
//
// Prints, every --print-every steps: the mean train loss since the last line,
// the validation loss, tokens per second (the slowest rank's) and the largest
// rank's memory. --check: a small shape and 40 steps; exits 1 unless the loss
// fell to below 0.8 of the first step's.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "fsdp.h"
#include "gpt_cuda.h"
#include "gpt_fsdp.h"
#include "gpt_model.h"

#ifndef FSDP_GPT_SOURCE_DIR
#define FSDP_GPT_SOURCE_DIR "."
#endif

namespace {

using Clock = std::chrono::steady_clock;

#define CHECK(call) gpt::check_fsdp((call), #call)

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what); }

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(std::string(what) + ": " + cudaGetErrorString(e));
}

struct Options {
  gpt::Shape shape;
  int steps = 300, batch = 16, print_every = 20, eval_batches = 4;
  double lr = 3e-3, weight_decay = 0.1, max_grad_norm = 1.0;
  std::string text;
  bool check = false;
  uint64_t seed = 1234;
};

void usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [options]\n"
               "  --steps S          optimizer steps (300)\n"
               "  --layers L --width C --heads H --context T   the GPT's shape (4, 128, 4, 128);\n"
               "                     width / heads must be a multiple of 8, at most 128 (cuDNN's attention)\n"
               "  --batch B          sequences per step over all ranks (16)\n"
               "  --lr X             peak learning rate (3e-3)\n"
               "  --print-every N (20) --eval-batches N (4)\n"
               "  --text FILE        the corpus (examples/gpt/data/alice29.txt)\n"
               "  --check            a small, short run that fails unless the loss falls\n"
               "FSDP_* variables override libfsdp's options (docs/configuration.md).\n",
               argv0);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int a = 1; a < argc; ++a)
    if (!std::strcmp(argv[a], "--check")) {  // the CTest size: small and quick, still a GPT
      o.shape = {2, 64, 4, 64};
      o.steps = 40;
      o.batch = 8;
      o.print_every = 10;
      o.eval_batches = 2;
      o.check = true;
    }
  for (int a = 1; a < argc; ++a) {
    const std::string k = argv[a];
    if (k == "--check") continue;
    if (k == "--help" || k == "-h") {
      usage(argv[0]);
      std::exit(0);
    }
    if (a + 1 >= argc) fail("option " + k + " needs a value (--help)");
    const std::string v = argv[++a];
    auto num = [&]() {
      char* end = nullptr;
      const long x = std::strtol(v.c_str(), &end, 10);
      if (*end || v.empty()) fail("option " + k + " takes an integer, not '" + v + "'");
      return static_cast<int>(x);
    };
    if (k == "--steps")
      o.steps = num();
    else if (k == "--layers")
      o.shape.layers = num();
    else if (k == "--width")
      o.shape.width = num();
    else if (k == "--heads")
      o.shape.heads = num();
    else if (k == "--context")
      o.shape.context = num();
    else if (k == "--batch")
      o.batch = num();
    else if (k == "--print-every")
      o.print_every = num();
    else if (k == "--eval-batches")
      o.eval_batches = num();
    else if (k == "--lr")
      o.lr = std::atof(v.c_str());
    else if (k == "--text")
      o.text = v;
    else
      fail("unknown option " + k + " (--help)");
  }
  const std::string why = gpt::cuda::cuda_shape_error(o.shape);
  if (!why.empty()) fail(why);
  if (o.steps < 1 || o.batch < 1 || o.print_every < 1 || o.eval_batches < 1)
    fail("--steps, --batch, --print-every and --eval-batches must be >= 1");
  return o;
}

fsdp_config_t* make_config(const Options& o) {
  fsdp_config_t* cfg;
  CHECK(fsdp_config_create(&cfg));
  std::unique_ptr<fsdp_config_t, void (*)(fsdp_config_t*)> guard(cfg, fsdp_config_destroy);
  auto set = [&](const char* k, const std::string& v) { CHECK(fsdp_config_set(cfg, k, v.c_str())); };
  set("device", "cuda");  // LOCAL_RANK's GPU
  set("sharding", "FULL_SHARD");
  set("param_dtype", "bf16");
  set("reduce_dtype", "fp32");
  set("optimizer", "adamw");
  set("lr", std::to_string(o.lr));
  set("beta2", "0.95");
  set("weight_decay", std::to_string(o.weight_decay));
  set("no_weight_decay", gpt::kNoWeightDecay);
  set("max_grad_norm", std::to_string(o.max_grad_norm));
  set("forward_prefetch", "1");
  set("backward_prefetch", "pre");
  CHECK(fsdp_config_from_env(cfg));  // FSDP_* variables override the above
  return guard.release();
}

// One rank's memory, in the order of kMemoryNames.
constexpr int kMemoryFields = 6;
const char* const kMemoryNames[kMemoryFields] = {"params",        "grads",        "optim",
                                                 "gathered-peak", "libfsdp-peak", "activations"};
std::vector<double> memory_of(fsdp_ctx_t* ctx, const gpt::cuda::FsdpGptCuda& model) {
  fsdp_memory_stats_t m{};
  m.struct_size = sizeof m;
  CHECK(fsdp_memory_stats(ctx, &m));
  return {static_cast<double>(m.sharded_params_nbytes),  static_cast<double>(m.sharded_grads_nbytes),
          static_cast<double>(m.optimizer_state_nbytes), static_cast<double>(m.gathered_params_peak_nbytes),
          static_cast<double>(m.device_peak_nbytes),     static_cast<double>(model.activation_bytes())};
}
// Every rank's memory, on every rank (row r: rank r's).
std::vector<std::vector<double>> all_memory(fsdp_ctx_t* ctx, const gpt::cuda::FsdpGptCuda& model, int rank, int world) {
  std::vector<double> rows(static_cast<size_t>(world) * kMemoryFields, 0.0);
  const std::vector<double> mine = memory_of(ctx, model);
  std::copy(mine.begin(), mine.end(), rows.begin() + static_cast<ptrdiff_t>(rank) * kMemoryFields);
  CHECK(fsdp_metrics_reduce(ctx, rows.data(), rows.size(), FSDP_REDUCE_SUM));
  std::vector<std::vector<double>> out;
  for (int r = 0; r < world; ++r)
    out.emplace_back(rows.begin() + static_cast<ptrdiff_t>(r) * kMemoryFields,
                     rows.begin() + static_cast<ptrdiff_t>(r + 1) * kMemoryFields);
  return out;
}

class Trainer {
 public:
  Trainer(const Options& o, const gpt::Corpus& corpus, fsdp_ctx_t* ctx, cudaStream_t stream)
      : o_(o), corpus_(corpus), ctx_(ctx) {
    CHECK(fsdp_ctx_rank(ctx_, &rank_));
    CHECK(fsdp_ctx_world_size(ctx_, &world_));
    if (o_.batch % world_)
      fail("the batch of " + std::to_string(o_.batch) + " sequences must divide over " + std::to_string(world_) +
           " ranks");
    local_ = o_.batch / world_;
    model_ = std::make_unique<gpt::cuda::FsdpGptCuda>(ctx_, o_.shape, local_, o_.seed, stream);
    const int t = o_.shape.context;
    window_.resize(static_cast<size_t>(local_) * (t + 1));
    inputs_.resize(static_cast<size_t>(local_) * t);
    targets_.resize(inputs_.size());
  }

  // Trains; returns the mean loss of each step (every rank's average).
  std::vector<double> run() {
    const bool root = rank_ == 0;
    const double tokens_per_step = static_cast<double>(o_.batch) * o_.shape.context, mib = 1024.0 * 1024.0;
    const double v0 = val_loss();
    if (root) std::printf("step %5d  val %.4f  (initial params)\n", 0, v0);
    std::vector<double> losses;
    double interval_s = 0, interval_loss = 0;
    int interval_steps = 0;
    for (int step = 1; step <= o_.steps; ++step) {
      const auto t0 = Clock::now();
      CHECK(fsdp_set_lr(ctx_, gpt::lr_schedule(o_.lr, step, o_.steps)));
      load_batch(corpus_.train, o_.seed, step);
      double loss = model_->train_step(inputs_.data(), targets_.data());  // returns after the step's update
      const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
      CHECK(fsdp_metrics_reduce(ctx_, &loss, 1, FSDP_REDUCE_AVG));
      losses.push_back(loss);
      interval_s += dt;
      interval_loss += loss;
      ++interval_steps;
      if (step % o_.print_every && step != o_.steps) continue;
      double norm = 0;
      CHECK(fsdp_last_grad_norm(ctx_, &norm));
      double tps = tokens_per_step * interval_steps / interval_s;
      CHECK(fsdp_metrics_reduce(ctx_, &tps, 1, FSDP_REDUCE_MIN));  // the slowest rank sets the pace
      const double v = val_loss();
      const std::vector<std::vector<double>> mem = all_memory(ctx_, *model_, rank_, world_);
      if (root) {
        std::vector<double> worst(kMemoryFields, 0.0);
        for (const auto& r : mem)
          for (int f = 0; f < kMemoryFields; ++f) worst[f] = std::max(worst[f], r[f]);
        std::printf(
            "step %5d  train %.4f  val %.4f  grad norm %.3f  tokens/s %8.0f  per-rank MiB params %.2f grads %.2f"
            " optim %.2f libfsdp-peak %.2f activations %.2f\n",
            step, interval_loss / interval_steps, v, norm, tps, worst[0] / mib, worst[1] / mib, worst[2] / mib,
            worst[4] / mib, worst[5] / mib);
        std::fflush(stdout);
      }
      interval_s = interval_loss = 0;
      interval_steps = 0;
    }
    const std::vector<std::vector<double>> mem = all_memory(ctx_, *model_, rank_, world_);
    if (root) {
      std::printf(
          "\nper-rank GPU memory, MiB (params = fp32 master + bf16 shard; grads = fp32 grad shard; optim = AdamW m,"
          " v;\ngathered-peak = most held in gathered full params; libfsdp-peak = most device memory libfsdp held at"
          " once;\nactivations = the model's own buffers and cuDNN's workspace)\n  %-8s",
          "");
      for (const char* name : kMemoryNames) std::printf(" %13s", name);
      std::printf("\n");
      for (int r = 0; r < world_; ++r) {
        std::printf("  rank %-3d", r);
        for (double b : mem[static_cast<size_t>(r)]) std::printf(" %13.2f", b / mib);
        std::printf("\n");
      }
    }
    return losses;
  }

 private:
  // This rank's sequences of the global batch of `step` (the CPU demo's windows).
  void load_batch(const std::vector<uint8_t>& data, uint64_t seed, int64_t step) {
    const int t = o_.shape.context;
    for (int i = 0; i < local_; ++i) {
      uint8_t* w = window_.data() + static_cast<size_t>(i) * (t + 1);
      gpt::sample_window(data, seed, step, rank_ * local_ + i, t, w);
      std::memcpy(inputs_.data() + static_cast<size_t>(i) * t, w, static_cast<size_t>(t));
      std::memcpy(targets_.data() + static_cast<size_t>(i) * t, w + 1, static_cast<size_t>(t));
    }
  }
  // The mean loss over eval_batches x batch fixed windows of the validation text.
  double val_loss() {
    double sum = 0;
    for (int k = 0; k < o_.eval_batches; ++k) {
      load_batch(corpus_.val, o_.seed + 77, k);
      sum += model_->eval(inputs_.data(), targets_.data());
    }
    sum /= o_.eval_batches;
    CHECK(fsdp_metrics_reduce(ctx_, &sum, 1, FSDP_REDUCE_AVG));
    return sum;
  }

  const Options& o_;
  const gpt::Corpus& corpus_;
  fsdp_ctx_t* ctx_;
  int rank_ = 0, world_ = 1, local_ = 1;
  std::unique_ptr<gpt::cuda::FsdpGptCuda> model_;
  std::vector<uint8_t> window_, inputs_, targets_;
};

int run(const Options& o) {
  int gpus = 0;
  const cudaError_t e = cudaGetDeviceCount(&gpus);
  if (e != cudaSuccess || gpus == 0) {
    std::fprintf(stderr, "train_gpt_cuda: no CUDA device can be used here (%s): nothing to train on\n",
                 e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found none");
    return 1;
  }
  const gpt::Corpus corpus = gpt::load_corpus(o.text);
  fsdp_config_t* cfg = make_config(o);
  char device[32] = {};
  const fsdp_status_t got = fsdp_config_get(cfg, "device", device, sizeof device, nullptr);
  fsdp_ctx_t* ctx = nullptr;
  const fsdp_status_t st = got == FSDP_OK ? fsdp_ctx_create(cfg, nullptr, -1, &ctx) : got;
  fsdp_config_destroy(cfg);
  gpt::check_fsdp(st, "fsdp_ctx_create");
  std::unique_ptr<fsdp_ctx_t, void (*)(fsdp_ctx_t*)> ctx_guard(ctx, fsdp_ctx_destroy);
  // The model's buffers and stream on the context's GPU ("cuda:N").
  const char* colon = std::strchr(device, ':');
  if (!colon) fail(std::string("the context's device is '") + device + "', not cuda:N");
  const int ordinal = std::atoi(colon + 1);
  cuda_check(cudaSetDevice(ordinal), "cudaSetDevice");
  cudaStream_t stream;
  cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  std::unique_ptr<CUstream_st, cudaError_t (*)(cudaStream_t)> stream_guard(stream, cudaStreamDestroy);

  int rank = 0, world = 1;
  CHECK(fsdp_ctx_rank(ctx, &rank));
  CHECK(fsdp_ctx_world_size(ctx, &world));
  Trainer trainer(o, corpus, ctx, stream);
  if (rank == 0) {
    cudaDeviceProp prop{};
    cuda_check(cudaGetDeviceProperties(&prop, ordinal), "cudaGetDeviceProperties");
    std::printf("%s\n", fsdp_build_info());
    std::printf("GPT: %d layers, width %d, %d heads, context %d, byte vocab, tied embeddings: %zu params\n",
                o.shape.layers, o.shape.width, o.shape.heads, o.shape.context, gpt::param_count(o.shape));
    std::printf(
        "on %d process(es) with a GPU each (rank 0: %s, %s); FULL_SHARD, param_dtype bf16, reduce fp32,"
        " AdamW, lr %.2g; %d sequences x %d tokens per step\n",
        world, device, prop.name, o.lr, o.batch, o.shape.context);
    std::printf("text: %s (%zu train / %zu validation bytes)\n\n", o.text.c_str(), corpus.train.size(),
                corpus.val.size());
    std::fflush(stdout);
  }
  const std::vector<double> losses = trainer.run();
  CHECK(fsdp_ctx_finalize(ctx));
  if (o.check) {  // every rank has the same (averaged) losses
    if (!(losses.back() < 0.8 * losses.front()))
      fail("check: the loss did not fall (" + std::to_string(losses.front()) + " -> " + std::to_string(losses.back()) +
           ")");
    if (rank == 0) std::printf("\ncheck passed: loss %.4f -> %.4f\n", losses.front(), losses.back());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Options o = parse(argc, argv);
    if (o.text.empty()) o.text = std::string(FSDP_GPT_SOURCE_DIR) + "/data/alice29.txt";
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_gpt_cuda: %s\n", e.what());
    return 1;
  }
}
