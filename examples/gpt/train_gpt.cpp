// train_gpt.cpp - the libfsdp main job: a small GPT learning English prose on
// several ranks, sharded (FULL_SHARD, bf16 params, fp32 grad reduction, AdamW,
// clipping, prefetch), with a sharded checkpoint resumed at another world size.
//
//   train_gpt                      the demo: 4 thread-ranks of this process, then
//                                  the checkpoint resumed on 2 (usage: --help)
//   mpirun -np N train_gpt ...     one rank per process (comm=auto picks mpi)
//   train_gpt --bench-json F ...   the timing run of benchmarks/vs_pytorch
//   train_gpt --lora R --base DIR  LoRA: the base (a --export of the demo's
//                                  model) frozen, rank-R adapters trained,
//                                  memory beside full fine-tuning
//
// The model's math is gpt_model.{h,cpp}; this file is what a host framework
// writes around it: one libfsdp unit per block, one for the embeddings (used
// at the input and again at the tied head), one for the final norm, and the
// begin/end brackets around each use.
#include <cblas.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fsdp.h"
#include "gpt_fsdp.h"
#include "gpt_model.h"
#include "snapshots.h"

namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

#ifndef FSDP_GPT_SOURCE_DIR
#define FSDP_GPT_SOURCE_DIR "."
#endif

struct Options {
  gpt::Shape shape;
  int ranks = 4, resume_ranks = 2, steps = 600, switch_step = 480, batch = 16, print_every = 40, eval_batches = 4;
  int sample_chars = 300;
  double lr = 3e-3, weight_decay = 0.1, max_grad_norm = 1.0;
  std::string dtype = "bf16", sharding = "FULL_SHARD", device, text, ckpt, trace, plot, bench_json, save, resume;
  std::string export_dir;  // --export: the trained params as safetensors (fsdp_export)
  int lora = 0;            // --lora R: adapters of rank R on a frozen base
  double lora_alpha = -1;  // --lora-alpha (default: R, a scale of 1)
  std::string base;        // --base: the safetensors of the base model (a --export)
  bool recompute = false, check = false;
  bool graph = false;  // --graph: the GPU GPT's step captured in a CUDA graph
  // --snapshot-every N: fsdp_snapshot into snapshot_dir every N steps, and a
  // run started again resumes from it (fsdp_restore; else from --ckpt);
  // --save-every N: fsdp_save_async into --ckpt every N steps.
  int snapshot_every = 0, save_every = 0;
  std::string snapshot_dir;
  bool ranks_given = false;
  int bf16_shard = -1;  // keep_param_dtype_shard: -1 libfsdp's default, 0, 1
  uint64_t seed = 1234;
};

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what); }

#define CHECK(call) gpt::check_fsdp((call), #call)

// What one phase of training reports (filled by rank 0).
struct Memory {
  double params = 0, grads = 0, optim = 0, gathered_peak = 0, total_peak = 0;
};
struct Progress {
  int64_t step;
  double train_loss, val_loss, tokens_per_s, grad_norm;
  std::vector<Memory> ranks;  // per rank, at this point
};
struct PhaseResult {
  std::vector<Progress> lines;
  std::vector<double> step_losses, step_seconds, step_library_seconds;
  double val_at_start = NAN;  // before the first step (after --resume: the loaded params)
  double unsharded_params = 0, unsharded_grads = 0, unsharded_optim = 0;
  std::vector<std::vector<float>> final_params;  // full fp32 params (when asked), rank 0
  std::vector<double> peak_rss;
  std::vector<Memory> memory;  // per rank, at the end
  size_t activation_bytes = 0;
  gpt::Stalls snapshots, async_saves;  // rank 0's
  int64_t resumed_step = -1;           // restored from a snapshot (or --ckpt) at this step
  double resumed_at_s = 0;             // ... this long after the process started
  std::string resumed_from;
  double state_bytes = 0;  // a rank's shard file (what a snapshot copies)
  double copy_s = 0;       // a memcpy of those bytes on every rank at once
};

struct Phase {
  int world = 1;                          // thread-ranks; 0: this process is one rank of an mpirun job
  int64_t first_step = 0, last_step = 0;  // trains steps first_step+1 .. last_step
  std::string resume, save, trace, export_dir;
  std::string base;  // the base's safetensors (fsdp_load_pretrained), loaded before training
  std::string snapshot, fallback;  // --snapshot-every's directory and the checkpoint a restore falls back to
  int snapshot_every = 0, save_every = 0;
  bool lora = false;  // the adapters of --lora on the frozen base
  bool want_params = false, report = true;  // report: validation loss and progress lines
};

double peak_rss_bytes() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) * 1024.0;
}

struct Shared {  // what the ranks of one phase share
  const Options* opt;
  const gpt::Corpus* corpus;
  Phase phase;
  int64_t total_steps;
  fsdp_local_group_t* group = nullptr;
  PhaseResult* result;
  std::mutex mu;
  std::string error;
};

fsdp_config_t* make_config(const Options& o, bool unsharded) {
  fsdp_config_t* cfg;
  CHECK(fsdp_config_create(&cfg));
  std::unique_ptr<fsdp_config_t, void (*)(fsdp_config_t*)> guard(cfg, fsdp_config_destroy);
  auto set = [&](const char* k, const std::string& v) { CHECK(fsdp_config_set(cfg, k, v.c_str())); };
  if (!o.device.empty()) set("device", o.device);
  set("sharding", unsharded ? "NO_SHARD" : o.sharding);
  if (unsharded) set("comm", "local");  // a world of one, also inside an mpirun job
  set("param_dtype", o.dtype);
  set("reduce_dtype", "fp32");
  set("optimizer", "adamw");
  set("lr", std::to_string(o.lr));
  set("beta2", "0.95");
  set("weight_decay", std::to_string(o.weight_decay));
  set("no_weight_decay", gpt::kNoWeightDecay);
  set("max_grad_norm", std::to_string(o.max_grad_norm));
  set("forward_prefetch", "1");
  if (o.bf16_shard >= 0) set("keep_param_dtype_shard", o.bf16_shard ? "1" : "0");
  set("backward_prefetch", "pre");
  CHECK(fsdp_config_from_env(cfg));  // FSDP_* variables override the above
  return guard.release();
}

// The device the contexts run on: --device, or FSDP_DEVICE, else cpu.
std::string effective_device(const Options& o) {
  fsdp_config_t* cfg = make_config(o, false);
  char device[32] = {};
  const fsdp_status_t st = fsdp_config_get(cfg, "device", device, sizeof device, nullptr);
  fsdp_config_destroy(cfg);
  CHECK(st);
  return device;
}

Memory memory_of(fsdp_ctx_t* ctx) {
  fsdp_memory_stats_t m{};
  m.struct_size = sizeof m;
  CHECK(fsdp_memory_stats(ctx, &m));
  return {static_cast<double>(m.sharded_params_nbytes), static_cast<double>(m.sharded_grads_nbytes),
          static_cast<double>(m.optimizer_state_nbytes), static_cast<double>(m.gathered_params_peak_nbytes),
          static_cast<double>(m.total_peak_nbytes)};
}

// Every rank's memory, on every rank (rank r fills row r, the sum fills all).
std::vector<Memory> all_memory(fsdp_ctx_t* ctx, int rank, int world) {
  std::vector<double> rows(static_cast<size_t>(world) * 5, 0.0);
  const Memory m = memory_of(ctx);
  const double mine[5] = {m.params, m.grads, m.optim, m.gathered_peak, m.total_peak};
  std::copy(mine, mine + 5, rows.begin() + static_cast<ptrdiff_t>(rank) * 5);
  CHECK(fsdp_metrics_reduce(ctx, rows.data(), rows.size(), FSDP_REDUCE_SUM));
  std::vector<Memory> out(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    const double* v = rows.data() + static_cast<size_t>(r) * 5;
    out[static_cast<size_t>(r)] = {v[0], v[1], v[2], v[3], v[4]};
  }
  return out;
}

// One rank of a phase.
class Rank {
 public:
  Rank(Shared& sh, int thread_rank) : sh_(sh), o_(*sh.opt) {
    fsdp_config_t* cfg = make_config(o_, false);
    char device[32] = {};  // what the context runs on: the model follows it
    fsdp_status_t st = fsdp_config_get(cfg, "device", device, sizeof device, nullptr);
    if (st == FSDP_OK) st = fsdp_ctx_create(cfg, sh.group, thread_rank, &ctx_);
    fsdp_config_destroy(cfg);
    gpt::check_fsdp(st, "fsdp_ctx_create");
    CHECK(fsdp_ctx_rank(ctx_, &rank_));
    CHECK(fsdp_ctx_world_size(ctx_, &world_));
    if (o_.batch % world_)
      fail("the batch of " + std::to_string(o_.batch) + " sequences must divide over " + std::to_string(world_) +
           " ranks");
    local_ = o_.batch / world_;
    const gpt::Lora lora = sh.phase.lora ? gpt::Lora{o_.lora, o_.lora_alpha} : gpt::Lora{};
    model_ = gpt::make_trainer(ctx_, device, o_.shape, local_, o_.recompute, o_.seed, lora, o_.graph);
    if (!sh.phase.resume.empty()) CHECK(fsdp_load(ctx_, sh.phase.resume.c_str()));
    if (!sh.phase.base.empty()) load_base(sh.phase.base, lora.on());
    first_step_ = sh.phase.first_step;
    if (!sh.phase.snapshot.empty()) restore();
    const int t = o_.shape.context;
    window_.resize(static_cast<size_t>(local_) * (t + 1));
    inputs_.resize(static_cast<size_t>(local_) * t);
    targets_.resize(inputs_.size());
  }
  ~Rank() {
    if (ctx_) fsdp_ctx_destroy(ctx_);
  }

  // A run started again: the newest snapshot every rank holds, else the
  // checkpoint in --ckpt, else the start.
  void restore() {
    const Phase& ph = sh_.phase;
    int source = FSDP_RESTORED_NOTHING;
    CHECK(fsdp_restore(ctx_, ph.snapshot.c_str(), ph.fallback.c_str(), &source));
    if (source == FSDP_RESTORED_NOTHING) return;
    uint64_t step = 0;
    CHECK(fsdp_ctx_step(ctx_, &step));
    first_step_ = static_cast<int64_t>(step);
    if (first_step_ >= ph.last_step) {
      fail("the run resumed at step " + std::to_string(first_step_) + " from " +
           (source == FSDP_RESTORED_SNAPSHOT ? ph.snapshot : ph.fallback) + ", which is not before its last step (" +
           std::to_string(ph.last_step) + "): nothing left to train (remove it, or raise --steps)");
    }
    if (rank_ == 0) {
      sh_.result->resumed_step = first_step_;
      sh_.result->resumed_at_s = gpt::process_age_seconds();
      sh_.result->resumed_from =
          source == FSDP_RESTORED_SNAPSHOT ? "the snapshot in " + ph.snapshot : "the checkpoint in " + ph.fallback;
    }
  }

  void run() {
    const Phase& ph = sh_.phase;
    PhaseResult& res = *sh_.result;
    const bool root = rank_ == 0;
    const double tokens_per_step = static_cast<double>(o_.batch) * o_.shape.context;
    if (ph.report) {
      const double v = val_loss();
      if (root) {
        res.val_at_start = v;
        if (res.resumed_step >= 0) {
          std::printf("resumed at step %lld from %s, %.2f s after the process started\n",
                      static_cast<long long>(res.resumed_step), res.resumed_from.c_str(), res.resumed_at_s);
        }
        std::printf("step %5lld  val %.4f  (%s)\n", static_cast<long long>(first_step_), v,
                    ph.resume.empty() && res.resumed_step < 0 ? "initial params" : "the loaded params");
        std::fflush(stdout);
      }
    }
    double interval_s = 0, interval_loss = 0;
    int interval_steps = 0;
    for (int64_t step = first_step_ + 1; step <= ph.last_step; ++step) {
      if (!ph.trace.empty() && step == ph.last_step - 1) CHECK(fsdp_trace_begin(ctx_));
      const auto t0 = Clock::now();
      const double lib0 = model_->library_seconds();
      CHECK(fsdp_set_lr(ctx_, gpt::lr_schedule(o_.lr, step, sh_.total_steps)));
      double loss = train_step(step);
      const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
      const double lib = model_->library_seconds() - lib0;
      CHECK(fsdp_metrics_reduce(ctx_, &loss, 1, FSDP_REDUCE_AVG));
      if (root) {
        res.step_losses.push_back(loss);
        res.step_seconds.push_back(dt);
        res.step_library_seconds.push_back(lib);
      }
      interval_s += dt;
      interval_loss += loss;
      ++interval_steps;
      if (ph.snapshot_every > 0 && step % ph.snapshot_every == 0) {
        gpt::Stalls& log = res.snapshots;
        auto call = [&] { CHECK(fsdp_snapshot(ctx_, ph.snapshot.c_str())); };
        root ? log.time(call) : call();
      }
      if (ph.save_every > 0 && step % ph.save_every == 0) {
        auto call = [&] { CHECK(fsdp_save_async(ctx_, ph.fallback.c_str())); };
        root ? res.async_saves.time(call) : call();
      }
      const bool line = ph.report && ((step - ph.first_step) % o_.print_every == 0 || step == ph.last_step);
      if (line) {
        double norm = 0;
        CHECK(fsdp_last_grad_norm(ctx_, &norm));
        double tps = tokens_per_step * interval_steps / interval_s;
        CHECK(fsdp_metrics_reduce(ctx_, &tps, 1, FSDP_REDUCE_MIN));  // the slowest rank sets the pace
        const double v = val_loss();
        std::vector<Memory> mem = all_memory(ctx_, rank_, world_);
        if (root) {
          res.lines.push_back({step, interval_loss / interval_steps, v, tps, norm, mem});
          print_line(res.lines.back(), res);
        }
        interval_s = interval_loss = 0;
        interval_steps = 0;
      }
    }
    if (!ph.trace.empty()) CHECK(fsdp_trace_write(ctx_, (ph.trace + ".rank" + std::to_string(rank_)).c_str()));
    CHECK(fsdp_save_wait(ctx_));
    if (!ph.save.empty()) CHECK(fsdp_save(ctx_, ph.save.c_str(), "sharded"));
    if (ph.save_every > 0 || !ph.snapshot.empty()) {
      // The limit of a copy of the state: a memcpy of its bytes by every
      // rank at once (the slowest rank's).
      double bytes = root ? gpt::shard_bytes(ph.snapshot.empty() ? ph.fallback : ph.snapshot + "/rank0") : 0;
      CHECK(fsdp_metrics_reduce(ctx_, &bytes, 1, FSDP_REDUCE_SUM));
      double copy_s = gpt::memcpy_seconds(static_cast<size_t>(bytes));
      CHECK(fsdp_metrics_reduce(ctx_, &copy_s, 1, FSDP_REDUCE_MAX));
      if (root) res.state_bytes = bytes, res.copy_s = copy_s;
    }
    if (!ph.snapshot.empty()) {  // done: a run started again starts afresh
      std::filesystem::remove_all(ph.snapshot + "/rank" + std::to_string(rank_));
    }
    if (!ph.export_dir.empty()) CHECK(fsdp_export(ctx_, ph.export_dir.c_str(), nullptr));
    std::vector<Memory> mem = all_memory(ctx_, rank_, world_);
    std::vector<double> rss(static_cast<size_t>(world_), 0.0);
    rss[static_cast<size_t>(rank_)] = peak_rss_bytes();
    CHECK(fsdp_metrics_reduce(ctx_, rss.data(), rss.size(), FSDP_REDUCE_SUM));
    if (ph.want_params) {  // every rank joins the gathers; rank 0 keeps them
      std::vector<std::vector<float>> full = model_->gather_params();
      if (root) res.final_params = std::move(full);
    }
    if (root) {
      res.memory = mem;
      res.peak_rss = rss;
      res.activation_bytes = model_->activation_bytes();
    }
    CHECK(fsdp_ctx_finalize(ctx_));
  }

 private:
  // The base model's weights from `path` (what --export wrote, or any
  // safetensors with this GPT's names). With LoRA the adapters are not in
  // it and keep their init (B = 0: the model starts as the base exactly);
  // any other param missing, or a tensor this GPT lacks, is an error.
  void load_base(const std::string& path, bool lora) {
    CHECK(fsdp_load_pretrained(ctx_, path.c_str(), lora ? "strict=0" : nullptr));
    if (!lora) return;
    std::string report(1, '\0');
    size_t n = 0;
    while (fsdp_load_report(ctx_, report.data(), report.size(), &n) != FSDP_OK && n >= report.size())
      report.resize(n + 1);  // too small: n is the length
    report.resize(n);
    std::string wrong;
    size_t start = 0;
    while (start < report.size()) {
      size_t end = report.find('\n', start);
      if (end == std::string::npos) end = report.size();
      const std::string line = report.substr(start, end - start);
      if (!line.empty() && (line.rfind("missing: ", 0) != 0 || line.find(".lora_") == std::string::npos))
        wrong += (wrong.empty() ? "" : ", ") + line;
      start = end + 1;
    }
    if (!wrong.empty())
      fail("--base " + path + " is not this GPT's base model (check --layers/--width/--heads/--context): " + wrong);
  }

  // Fills inputs/targets with this rank's sequences of the global batch of `step`.
  void load_batch(const std::vector<uint8_t>& data, uint64_t seed, int64_t step) {
    const int t = o_.shape.context;
    for (int i = 0; i < local_; ++i) {
      uint8_t* w = window_.data() + static_cast<size_t>(i) * (t + 1);
      gpt::sample_window(data, seed, step, rank_ * local_ + i, t, w);
      std::memcpy(inputs_.data() + static_cast<size_t>(i) * t, w, static_cast<size_t>(t));
      std::memcpy(targets_.data() + static_cast<size_t>(i) * t, w + 1, static_cast<size_t>(t));
    }
  }

  double train_step(int64_t step) {
    load_batch(sh_.corpus->train, o_.seed, step);
    return model_->train_step(inputs_.data(), targets_.data());
  }

  // The mean loss over eval_batches x batch fixed windows of the validation
  // text, split over the ranks (forward only).
  double val_loss() {
    double sum = 0;
    for (int k = 0; k < o_.eval_batches; ++k) {
      load_batch(sh_.corpus->val, o_.seed + 77, k);
      sum += model_->eval(inputs_.data(), targets_.data());
    }
    sum /= o_.eval_batches;
    CHECK(fsdp_metrics_reduce(ctx_, &sum, 1, FSDP_REDUCE_AVG));
    return sum;
  }

  void print_line(const Progress& p, const PhaseResult& res) const {
    Memory worst;
    for (const Memory& m : p.ranks) {
      worst.params = std::max(worst.params, m.params);
      worst.grads = std::max(worst.grads, m.grads);
      worst.optim = std::max(worst.optim, m.optim);
    }
    const double mib = 1024.0 * 1024.0;
    std::printf(
        "step %5lld  train %.4f  val %.4f  tokens/s %7.0f  per-rank MiB params %.2f grads %.2f optim %.2f"
        "  (unsharded %.2f %.2f %.2f)\n",
        static_cast<long long>(p.step), p.train_loss, p.val_loss, p.tokens_per_s, worst.params / mib, worst.grads / mib,
        worst.optim / mib, res.unsharded_params / mib, res.unsharded_grads / mib, res.unsharded_optim / mib);
    std::fflush(stdout);
  }

  Shared& sh_;
  const Options& o_;
  fsdp_ctx_t* ctx_ = nullptr;
  int rank_ = 0, world_ = 1, local_ = 1;
  int64_t first_step_ = 0;  // the phase's, or the step a restore resumed at
  std::unique_ptr<gpt::Trainer> model_;
  std::vector<uint8_t> window_, inputs_, targets_;
};

// Runs a phase on `phase.world` thread-ranks (0: as this process's one rank).
void run_phase(const Options& o, const gpt::Corpus& corpus, const Phase& phase, int64_t total_steps, PhaseResult& res) {
  Shared sh;
  sh.opt = &o;
  sh.corpus = &corpus;
  sh.phase = phase;
  sh.total_steps = total_steps;
  sh.result = &res;
  const int n = phase.world == 0 ? 1 : phase.world;
  if (phase.world > 0) CHECK(fsdp_local_group_create(phase.world, &sh.group));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        Rank rank(sh, phase.world == 0 ? -1 : r);  // -1: the launcher's rank
        rank.run();
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(sh.mu);
        if (sh.error.empty()) sh.error = e.what();
        if (sh.group) fsdp_local_group_abort(sh.group, e.what());  // the peers fail instead of waiting
      }
    });
  for (std::thread& t : threads) t.join();
  if (sh.group) fsdp_local_group_destroy(sh.group);
  if (!sh.error.empty()) fail(sh.error);
}

// What an unsharded single rank holds: the same model on one NO_SHARD rank
// after one (zero-grad) step, so its optimizer state exists.
void measure_unsharded(const Options& o, PhaseResult& res) {
  fsdp_config_t* cfg = make_config(o, true);
  fsdp_ctx_t* ctx;
  const fsdp_status_t st = fsdp_ctx_create(cfg, nullptr, 0, &ctx);
  fsdp_config_destroy(cfg);
  gpt::check_fsdp(st, "fsdp_ctx_create (unsharded)");
  gpt::FsdpGpt model(ctx, o.shape, 1, false, o.seed);
  CHECK(fsdp_step(ctx, nullptr));
  const Memory m = memory_of(ctx);
  res.unsharded_params = m.params;
  res.unsharded_grads = m.grads;
  res.unsharded_optim = m.optim;
  fsdp_ctx_destroy(ctx);
}

// The optimizer step a checkpoint was saved at (docs/checkpoints.md).
int64_t checkpoint_step(const std::string& dir) {
  std::ifstream in(dir + "/fsdp_checkpoint.json");
  if (!in) fail("cannot read " + dir + "/fsdp_checkpoint.json");
  return Json::parse(in).at("optimizer").at("step").get<int64_t>();
}

int launcher_world() {
  for (const char* k : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "WORLD_SIZE"})
    if (const char* v = std::getenv(k)) return std::atoi(v);
  return 0;
}
int launcher_rank() {
  for (const char* k : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK"})
    if (const char* v = std::getenv(k)) return std::atoi(v);
  return 0;
}

double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

void print_memory_table(const char* title, const PhaseResult& r) {
  const double mib = 1024.0 * 1024.0;
  std::printf(
      "\n%s: per-rank MiB (params = fp32 master shard, and a bf16 copy where kept; grads = fp32 grad shard;\n"
      "optim = AdamW m, v; "
      "gathered-peak = most held in gathered full params; total-peak = most held by libfsdp at once)\n",
      title);
  std::printf("  %-14s %8s %8s %8s %14s %11s\n", "", "params", "grads", "optim", "gathered-peak", "total-peak");
  for (size_t k = 0; k < r.memory.size(); ++k)
    std::printf("  rank %-9zu %8.2f %8.2f %8.2f %14.2f %11.2f\n", k, r.memory[k].params / mib, r.memory[k].grads / mib,
                r.memory[k].optim / mib, r.memory[k].gathered_peak / mib, r.memory[k].total_peak / mib);
  std::printf("  %-14s %8.2f %8.2f %8.2f\n", "unsharded", r.unsharded_params / mib, r.unsharded_grads / mib,
              r.unsharded_optim / mib);
  std::printf("  activations per rank: %.2f MiB (the model's own buffers, outside libfsdp)\n",
              static_cast<double>(r.activation_bytes) / mib);
}

// Samples `n` bytes after `prompt` from the full params (rank 0, no libfsdp);
// with `lora`, the adapters' params follow the base's.
std::string sample_text(const Options& o, const std::vector<std::vector<float>>& params, const std::string& prompt,
                        int n, bool lora = false) {
  std::vector<gpt::UnitSpec> specs = gpt::model_units(o.shape);
  const size_t n_base = specs.size();
  if (lora) {
    const auto adapters = gpt::lora_units(o.shape, o.lora);
    specs.insert(specs.end(), adapters.begin(), adapters.end());
  }
  std::vector<gpt::UnitView<float>> views(specs.size());
  size_t k = 0;
  for (size_t u = 0; u < specs.size(); ++u)
    for (size_t i = 0; i < specs[u].params.size(); ++i) views[u].p.push_back(params[k++].data());
  gpt::Model<float> model(o.shape, 1, false, lora ? gpt::Lora{o.lora, o.lora_alpha} : gpt::Lora{});
  std::string text = prompt;
  std::mt19937_64 rng(o.seed);
  const size_t L = static_cast<size_t>(o.shape.layers);
  for (int c = 0; c < n; ++c) {
    const size_t t = std::min(text.size(), static_cast<size_t>(o.shape.context));
    const auto* tokens = reinterpret_cast<const uint8_t*>(text.data() + text.size() - t);
    model.embed_forward(views[0], tokens, static_cast<int>(t));
    for (size_t l = 0; l < L; ++l) model.block_forward(static_cast<int>(l), views[1 + l], lora ? &views[n_base + l] : nullptr);
    model.final_forward(views[1 + L]);
    model.head_forward(views[0], nullptr);
    const float* logits = model.last_logits();
    std::vector<double> p(gpt::kVocab);
    const double temperature = 0.8;
    const float mx = *std::max_element(logits, logits + gpt::kVocab);
    for (int v = 0; v < gpt::kVocab; ++v) p[static_cast<size_t>(v)] = std::exp((logits[v] - mx) / temperature);
    std::discrete_distribution<int> pick(p.begin(), p.end());
    text.push_back(static_cast<char>(pick(rng)));
  }
  for (char& ch : text)  // what a terminal shows: bytes outside printable ASCII as '?'
    if (ch != '\n' && (static_cast<unsigned char>(ch) < 32 || static_cast<unsigned char>(ch) > 126)) ch = '?';
  return text;
}

void merge_traces(const std::string& out, int world) {
  Json merged = {{"traceEvents", Json::array()}};
  for (int r = 0; r < world; ++r) {
    const std::string part = out + ".rank" + std::to_string(r);
    std::ifstream in(part);
    Json j = Json::parse(in);
    for (auto& e : j["traceEvents"]) merged["traceEvents"].push_back(e);
    std::filesystem::remove(part);
  }
  std::ofstream(out) << merged.dump() << "\n";
}

Json memory_json(const std::vector<Memory>& mem) {
  Json a = Json::array();
  for (const Memory& m : mem)
    a.push_back({{"params", m.params},
                 {"grads", m.grads},
                 {"optim", m.optim},
                 {"gathered_peak", m.gathered_peak},
                 {"total_peak", m.total_peak}});
  return a;
}

void usage(const char* argv0) {
  std::fprintf(
      stderr,
      "usage: %s [options]\n"
      "  --ranks N          thread-ranks of the first phase (4)\n"
      "  --resume-ranks M   thread-ranks that load its checkpoint and train on (2; 0: no second phase)\n"
      "  --steps S          optimizer steps in all (600); --switch-step K: the first phase ends at K (480)\n"
      "  --layers L --width C --heads H --context T   the GPT's shape (4, 128, 4, 128)\n"
      "  --batch B          sequences per step over all ranks (16)\n"
      "  --dtype bf16|fp32  param_dtype (bf16); --sharding S (FULL_SHARD); --lr X (3e-3)\n"
      "  --device cpu|cuda[:N]  where the ranks compute (cpu; cuda: the GPU GPT, bf16, one GPU shared by\n"
      "                     the thread-ranks, or one GPU per process under torchrun/mpirun)\n"
      "  --recompute        drop each block's activations after forward, recompute them in backward\n"
      "  --graph            (--device cuda, --ranks 1 --resume-ranks 1) capture the step once in a CUDA\n"
      "                     graph and replay it (libfsdp's step stays on the device)\n"
      "  --no-bf16-shard    keep_param_dtype_shard=0: no persistent bf16 shard, cast at each gather\n"
      "  --bf16-shard       keep_param_dtype_shard=1\n"
      "  --text FILE        the corpus (examples/gpt/data/alice29.txt)\n"
      "  --ckpt DIR         where the checkpoint goes (a temporary directory, removed at the end)\n"
      "  --snapshot-every N fsdp_snapshot every N steps into --snapshot-dir DIR (/dev/shm/libfsdp-gpt-UID);\n"
      "                     run again after a kill, it resumes from the snapshot (else from --ckpt DIR);\n"
      "                     a run that ends removes it\n"
      "  --save-every N     fsdp_save_async into --ckpt DIR every N steps (the step goes on meanwhile)\n"
      "  --trace FILE       the timeline of the first phase's last 2 steps (Chrome trace JSON)\n"
      "  --plot DIR         metrics.json and trace.json into DIR, then PNGs via examples/gpt/plot.py\n"
      "                     (matplotlib; $PYTHON, else python3, runs it)\n"
      "  --print-every N (40) --eval-batches N (4) --sample N (300 bytes of text at the end)\n"
      "  --check            a small, short run that fails unless it learns and resumes exactly\n"
      "  --save DIR / --resume DIR   (under mpirun: one phase) write / load a sharded checkpoint\n"
      "  --export DIR       at the end, the params as safetensors into DIR (new or empty): the base of --lora\n"
      "  --lora R --base DIR   LoRA fine-tuning: DIR's model (an --export) frozen, rank-R adapters on every\n"
      "                     block's qkv, proj, fc and fc2 trained for --steps (--lora-alpha X: scale X/R,\n"
      "                     default 1); then one step of full fine-tuning for its memory, printed beside\n"
      "  --bench-json FILE  timing run on random bytes: 2 warm-up steps, then --steps timed; writes JSON\n",
      argv0);
}

Options parse(int argc, char** argv) {
  Options o;
  bool check_mode = false, switch_given = false;
  for (int a = 1; a < argc; ++a)
    if (!std::strcmp(argv[a], "--check")) check_mode = true;
  if (check_mode) {  // the CTest size: small and quick, still a GPT
    o.shape = {2, 64, 4, 64};
    o.steps = 40;
    o.switch_step = 30;
    o.batch = 8;
    o.print_every = 10;
    o.eval_batches = 2;
    o.sample_chars = 80;
    o.check = true;
  }
  for (int a = 1; a < argc; ++a) {
    const std::string k = argv[a];
    if (k == "--check") continue;
    if (k == "--graph") {
      o.graph = true;
      continue;
    }
    if (k == "--recompute") {
      o.recompute = true;
      continue;
    }
    if (k == "--no-bf16-shard" || k == "--bf16-shard") {  // keep_param_dtype_shard=0 / 1
      o.bf16_shard = k == "--bf16-shard" ? 1 : 0;
      continue;
    }
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
    if (k == "--ranks")
      o.ranks = num(), o.ranks_given = true;
    else if (k == "--resume-ranks")
      o.resume_ranks = num();
    else if (k == "--steps")
      o.steps = num();
    else if (k == "--switch-step")
      o.switch_step = num(), switch_given = true;
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
    else if (k == "--sample")
      o.sample_chars = num();
    else if (k == "--dtype")
      o.dtype = v;
    else if (k == "--device")
      o.device = v;
    else if (k == "--sharding")
      o.sharding = v;
    else if (k == "--lr")
      o.lr = std::atof(v.c_str());
    else if (k == "--text")
      o.text = v;
    else if (k == "--ckpt")
      o.ckpt = v;
    else if (k == "--trace")
      o.trace = v;
    else if (k == "--plot")
      o.plot = v;
    else if (k == "--save")
      o.save = v;
    else if (k == "--snapshot-every")
      o.snapshot_every = num();
    else if (k == "--snapshot-dir")
      o.snapshot_dir = v;
    else if (k == "--save-every")
      o.save_every = num();
    else if (k == "--resume")
      o.resume = v;
    else if (k == "--bench-json")
      o.bench_json = v;
    else if (k == "--export")
      o.export_dir = v;
    else if (k == "--lora")
      o.lora = num();
    else if (k == "--lora-alpha")
      o.lora_alpha = std::atof(v.c_str());
    else if (k == "--base")
      o.base = v;
    else
      fail("unknown option " + k + " (--help)");
  }
  if (!switch_given && o.switch_step >= o.steps) o.switch_step = o.steps * 4 / 5;
  const std::string why = gpt::shape_error(o.shape);
  if (!why.empty()) fail(why);
  if (o.ranks < 1 || o.ranks > 64 || o.resume_ranks < 0 || o.resume_ranks > 64) fail("--ranks must be in [1, 64]");
  if (o.steps < 1 || o.batch < 1 || o.print_every < 1 || o.eval_batches < 1)
    fail("--steps, --batch, --print-every and --eval-batches must be >= 1");
  if (o.resume_ranks > 0 && (o.switch_step < 1 || o.switch_step >= o.steps))
    fail("--switch-step must be in [1, --steps)");
  if (o.dtype != "bf16" && o.dtype != "fp32") fail("--dtype must be bf16 or fp32");
  if (o.snapshot_every < 0 || o.save_every < 0) fail("--snapshot-every and --save-every take a number of steps");
  if (o.save_every > 0 && o.ckpt.empty()) fail("--save-every N saves into --ckpt DIR: give --ckpt too");
  if (o.snapshot_dir.empty()) o.snapshot_dir = "/dev/shm/libfsdp-gpt-" + std::to_string(getuid());
  if (o.lora < 0 || o.lora > 4096) fail("--lora takes a rank in [1, 4096]");
  if (o.lora > 0) {
    if (o.lora_alpha < 0) o.lora_alpha = o.lora;
    if (o.base.empty())
      fail("--lora needs --base DIR: the base model's weights, as `train_gpt --export DIR` writes them "
           "(README, 'Fine-tuning')");
  } else if (!o.base.empty()) {
    fail("--base is the frozen model of --lora R; give --lora too");
  }
  return o;
}

int main_bench(const Options& o) {
  const gpt::Corpus corpus = gpt::random_corpus(1 << 20, o.seed);
  const int launched = launcher_world();
  Phase ph;
  // Under a launcher one rank per process; alone, one rank (the unsharded
  // baseline) unless --ranks asks for thread-ranks.
  const int ranks = o.ranks_given ? o.ranks : 1;
  ph.world = launched > 1 ? 0 : ranks;
  ph.first_step = 0;
  ph.last_step = o.steps + 2;
  ph.report = false;
  PhaseResult res;
  run_phase(o, corpus, ph, ph.last_step, res);
  if (launcher_rank() != 0) return 0;
  std::vector<double> timed(res.step_seconds.begin() + 2, res.step_seconds.end());
  std::vector<double> lib(res.step_library_seconds.begin() + 2, res.step_library_seconds.end());
  const int world = launched > 1 ? launched : ranks;
  Json j = {{"framework", "libfsdp"},
            {"variant", o.bf16_shard < 0 ? "default" : (o.bf16_shard ? "bf16-shard" : "no-bf16-shard")},
            {"world", world},
            {"device", effective_device(o)},
            {"layers", o.shape.layers},
            {"width", o.shape.width},
            {"heads", o.shape.heads},
            {"context", o.shape.context},
            {"global_batch", o.batch},
            {"dtype", o.dtype},
            {"steps", o.steps},
            {"median_step_s", median(timed)},
            {"tokens_per_s", o.batch * o.shape.context / median(timed)},
            {"step_times_s", timed},
            // rank 0's seconds inside libfsdp's begin/end/step calls per step
            // (waits for gathers and reductions included); the rest is the model
            {"library_s_per_step", lib},
            {"median_library_s", median(lib)},
            {"peak_rss_bytes", res.peak_rss},
            {"threads_per_rank", openblas_get_num_threads()}};
  Json p = Json::array(), g = Json::array(), op = Json::array(), dev = Json::array(), tot = Json::array();
  for (const Memory& m : res.memory) {
    p.push_back(m.params), g.push_back(m.grads), op.push_back(m.optim), tot.push_back(m.total_peak);
    dev.push_back(nullptr);
  }
  j["params_bytes"] = p, j["grads_bytes"] = g, j["optim_bytes"] = op, j["device_peak_bytes"] = dev;
  j["libfsdp_total_peak_bytes"] = tot;
  j["build"] = fsdp_build_info();
  std::ofstream(o.bench_json) << j.dump(1) << "\n";
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

// Adapter params of --lora over all blocks.
size_t adapter_count(const Options& o) {
  size_t n = 0;
  for (const gpt::UnitSpec& u : gpt::lora_units(o.shape, o.lora))
    for (const gpt::ParamSpec& p : u.params) n += p.numel();
  return n;
}

// --lora R --base DIR: the base frozen, the adapters trained for --steps on
// --ranks thread-ranks; then one step of full fine-tuning of the same model
// at the same world, for the memory it takes, printed beside.
int main_lora(const Options& o, const gpt::Corpus& corpus, double unigram) {
  const size_t base_n = gpt::param_count(o.shape), adapters_n = adapter_count(o);
  std::printf("%s\n", fsdp_build_info());
  std::printf("GPT: %d layers, width %d, %d heads, context %d: %zu params, frozen, loaded from %s\n",
              o.shape.layers, o.shape.width, o.shape.heads, o.shape.context, base_n, o.base.c_str());
  std::printf(
      "LoRA: rank %d, alpha %g (scale %g) on attn.qkv, attn.proj, mlp.fc and mlp.fc2 of every block: %zu adapter "
      "params (%.2f%% of the base), one unit per block\n",
      o.lora, o.lora_alpha, o.lora_alpha / o.lora, adapters_n, 100.0 * static_cast<double>(adapters_n) / base_n);
  std::printf("text: %s (%zu train / %zu validation bytes); unigram baseline (validation): %.4f nats/byte\n",
              o.text.c_str(), corpus.train.size(), corpus.val.size(), unigram);
  std::printf("training: %d ranks, %s, param_dtype %s, AdamW on the adapters alone, lr %.2g, clip %.1f\n\n", o.ranks,
              o.sharding.c_str(), o.dtype.c_str(), o.lr, o.max_grad_norm);
  PhaseResult lora, full;
  measure_unsharded(o, lora);
  Phase pl;
  pl.world = o.ranks;
  pl.last_step = o.steps;
  pl.base = o.base;
  pl.lora = true;
  pl.export_dir = o.export_dir;
  pl.want_params = o.sample_chars > 0;
  run_phase(o, corpus, pl, o.steps, lora);
  Phase pf;  // full fine-tuning, one step: its memory
  pf.world = o.ranks;
  pf.last_step = 1;
  pf.base = o.base;
  pf.report = false;
  run_phase(o, corpus, pf, 1, full);
  const double mib = 1024.0 * 1024.0;
  std::printf(
      "\nper-rank MiB held by libfsdp, LoRA beside full fine-tuning of the same model on %d ranks (params = fp32\n"
      "master shard and its %s copy; grads = fp32 grad shards; optim = AdamW m, v; total-peak = the most at once)\n",
      o.ranks, o.dtype.c_str());
  std::printf("  %-16s %8s %8s %8s %11s\n", "", "params", "grads", "optim", "total-peak");
  const std::string lora_name = "LoRA r=" + std::to_string(o.lora);
  for (const auto& [name, r] : {std::pair<const char*, const PhaseResult*>{lora_name.c_str(), &lora}, {"full FT", &full}})
    for (size_t k = 0; k < r->memory.size(); ++k)
      std::printf("  %-9s rank %-2zu %8.3f %8.3f %8.3f %11.3f\n", k == 0 ? name : "", k, r->memory[k].params / mib,
                  r->memory[k].grads / mib, r->memory[k].optim / mib, r->memory[k].total_peak / mib);
  auto all_grads = [](const PhaseResult& r) {
    double s = 0;
    for (const Memory& m : r.memory) s += m.grads;
    return s;
  };
  std::printf(
      "  the frozen base keeps no grads and no optimizer state: LoRA's grads and optim are the %zu adapter params'\n"
      "  shards (%.3f MiB of fp32 grads over all ranks, against %.3f MiB for full fine-tuning)\n",
      adapters_n, all_grads(lora) / mib, all_grads(full) / mib);
  const double start = lora.val_at_start, end = lora.lines.back().val_loss;
  std::printf("\nvalidation loss %.4f nats/byte, from the base's %.4f (unigram baseline %.4f)\n", end, start, unigram);
  if (!o.export_dir.empty())
    std::printf("exported the base and its adapters (safetensors) to %s\n", o.export_dir.c_str());
  if (o.sample_chars > 0)
    std::printf("\nsample (temperature 0.8):\n%s\n",
                sample_text(o, lora.final_params, "Alice ", o.sample_chars, true).c_str());
  if (o.check) {
    if (!(end < start))
      fail("check: LoRA did not lower the validation loss (" + std::to_string(start) + " -> " + std::to_string(end) +
           ")");
    for (size_t k = 0; k < lora.memory.size(); ++k) {
      const Memory& m = lora.memory[k];
      // AdamW keeps two moments per trainable element, and the grads one:
      // the base (frozen) must add to neither.
      if (m.optim != 2 * m.grads || m.grads > full.memory[k].grads * (2.0 * adapters_n / base_n) + 4096)
        fail("check: rank " + std::to_string(k) + " holds grads or optimizer state beyond the adapters' (grads " +
             std::to_string(m.grads) + " B, optim " + std::to_string(m.optim) + " B; full fine-tuning " +
             std::to_string(full.memory[k].grads) + " B)");
    }
    std::printf("\ncheck passed\n");
  }
  return 0;
}

// --snapshot-every / --save-every for a phase: its snapshots, its async
// saves, and what a run started again resumes from.
void set_snapshots(const Options& o, Phase& ph) {
  if (o.snapshot_every > 0) ph.snapshot = o.snapshot_dir;
  ph.snapshot_every = o.snapshot_every;
  ph.save_every = o.save_every;
  ph.fallback = o.ckpt;
}

// How long the snapshots and async saves held the loop, beside a memcpy of
// the bytes they copy.
void print_stalls(const PhaseResult& r) {
  if (r.snapshots.calls == 0 && r.async_saves.calls == 0) return;
  const double copy_s = r.copy_s;
  for (const auto& [name, log] :
       {std::pair<const char*, const gpt::Stalls&>{"fsdp_snapshot", r.snapshots}, {"fsdp_save_async", r.async_saves}}) {
    if (log.calls == 0) continue;
    std::printf("%s: %d calls for %.1f MiB per rank; the step held %.2f ms at the first", name, log.calls,
                r.state_bytes / 1048576.0, 1e3 * log.first_s);
    if (log.calls > 1) {
      const double median = log.median_s();
      std::printf(", then %.2f ms (median; max %.2f ms)", 1e3 * median, 1e3 * log.max_s());
      if (copy_s > 0) {
        std::printf("; a memcpy of those bytes on every rank at once: %.2f ms (%.1fx)", 1e3 * copy_s, median / copy_s);
      }
    }
    std::printf("\n");
  }
}

int main_launched(const Options& o, const gpt::Corpus& corpus) {  // one rank of an mpirun job
  Phase ph;
  ph.world = 0;
  ph.first_step = o.resume.empty() ? 0 : checkpoint_step(o.resume);
  ph.last_step = ph.first_step + o.steps;
  ph.resume = o.resume;
  ph.save = o.save;
  set_snapshots(o, ph);
  ph.export_dir = o.export_dir;
  ph.base = o.base;
  ph.lora = o.lora > 0;
  ph.want_params = o.sample_chars > 0;
  PhaseResult res;
  if (launcher_rank() == 0) {
    measure_unsharded(o, res);
    std::printf("%s\nGPT %d layers, width %d, %d heads, context %d (%zu params) on %d processes, %s, param_dtype %s\n",
                fsdp_build_info(), o.shape.layers, o.shape.width, o.shape.heads, o.shape.context,
                gpt::param_count(o.shape), launcher_world(), o.sharding.c_str(), o.dtype.c_str());
  }
  run_phase(o, corpus, ph, ph.last_step, res);
  if (launcher_rank() != 0) return 0;
  print_memory_table("memory", res);
  print_stalls(res);
  if (o.check && !(res.step_losses.back() < 0.8 * res.step_losses.front()))
    fail("check: the loss did not fall (" + std::to_string(res.step_losses.front()) + " -> " +
         std::to_string(res.step_losses.back()) + ")");
  if (o.sample_chars > 0)
    std::printf("\nsample:\n%s\n", sample_text(o, res.final_params, "Alice ", o.sample_chars, o.lora > 0).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Options o = parse(argc, argv);
    const int launched = launcher_world();
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    // OpenBLAS threads per rank: the cores shared out over the ranks of this machine.
    // (a timing run alone is one rank unless --ranks says otherwise)
    const int ranks_here = launched > 1 ? launched : (!o.bench_json.empty() && !o.ranks_given ? 1 : o.ranks);
    openblas_set_num_threads(static_cast<int>(std::max(1u, cores / static_cast<unsigned>(ranks_here))));
    if (!o.bench_json.empty()) return main_bench(o);
    if (o.text.empty()) o.text = std::string(FSDP_GPT_SOURCE_DIR) + "/data/alice29.txt";
    const gpt::Corpus corpus = gpt::load_corpus(o.text);
    if (launched > 1) return main_launched(o, corpus);

    const double unigram = gpt::unigram_loss(corpus.train, corpus.val);
    if (o.lora > 0) return main_lora(o, corpus, unigram);
    bool temp_ckpt = false;
    std::string ckpt = o.ckpt;
    if (ckpt.empty()) {
      ckpt = (std::filesystem::temp_directory_path() / ("libfsdp-gpt-" + std::to_string(getpid()))).string();
      temp_ckpt = true;
    }
    const bool two_phases = o.resume_ranks > 0;
    const int64_t first_end = two_phases ? o.switch_step : o.steps;
    std::printf("%s\n", fsdp_build_info());
    std::printf("GPT: %d layers, width %d, %d heads, context %d, byte vocab, tied embeddings: %zu params, %d units\n",
                o.shape.layers, o.shape.width, o.shape.heads, o.shape.context, gpt::param_count(o.shape),
                o.shape.layers + 2);
    std::printf("text: %s (%zu train / %zu validation bytes); unigram baseline (validation): %.4f nats/byte\n",
                o.text.c_str(), corpus.train.size(), corpus.val.size(), unigram);
    const std::string device = effective_device(o);
    if (device != "cpu") std::printf("device: %s (the thread-ranks share it)\n", device.c_str());
    std::printf(
        "training: %s, param_dtype %s, reduce fp32, AdamW (wd %.2g, 0 on biases, norms, embeddings), lr %.2g,"
        " clip %.1f, prefetch on%s; %d sequences x %d tokens per step\n",
        o.sharding.c_str(), o.dtype.c_str(), o.weight_decay, o.lr, o.max_grad_norm,
        o.recompute ? ", activations recomputed" : "", o.batch, o.shape.context);
    std::printf(
        "train/val: mean cross-entropy in nats/byte (train: over the steps since the last line); tokens/s:"
        " the slowest rank's;\nper-rank MiB: the largest rank's sharded params/grads/optimizer state, beside"
        " one unsharded rank's\n\n");

    PhaseResult a, b;
    measure_unsharded(o, a);
    b.unsharded_params = a.unsharded_params, b.unsharded_grads = a.unsharded_grads,
    b.unsharded_optim = a.unsharded_optim;
    Phase pa;
    pa.world = o.ranks;
    pa.last_step = first_end;
    pa.save = ckpt;
    set_snapshots(o, pa);
    pa.trace = o.trace.empty() && o.plot.empty() ? "" : (o.trace.empty() ? o.plot + "/trace.json" : o.trace);
    pa.want_params = !two_phases && o.sample_chars > 0;
    if (!two_phases) pa.export_dir = o.export_dir;
    if (!o.plot.empty()) std::filesystem::create_directories(o.plot);
    std::printf("== %d ranks, steps 1-%lld\n", o.ranks, static_cast<long long>(first_end));
    run_phase(o, corpus, pa, o.steps, a);
    if (!pa.trace.empty()) merge_traces(pa.trace, o.ranks);
    if (!o.trace.empty() && !o.plot.empty())
      std::filesystem::copy_file(o.trace, o.plot + "/trace.json", std::filesystem::copy_options::overwrite_existing);
    print_memory_table("first phase", a);
    print_stalls(a);
    std::printf("\nsaved a sharded checkpoint of step %lld to %s\n", static_cast<long long>(first_end), ckpt.c_str());
    const PhaseResult* last = &a;
    if (two_phases) {
      Phase pb;
      pb.world = o.resume_ranks;
      pb.first_step = first_end;
      pb.last_step = o.steps;
      pb.resume = ckpt;
      pb.export_dir = o.export_dir;
      pb.want_params = o.sample_chars > 0;
      std::printf("\n== %d ranks, resumed from the checkpoint, steps %lld-%d\n", o.resume_ranks,
                  static_cast<long long>(first_end + 1), o.steps);
      run_phase(o, corpus, pb, o.steps, b);
      print_memory_table("second phase", b);
      last = &b;
    }
    if (temp_ckpt) std::filesystem::remove_all(ckpt);
    if (!o.export_dir.empty())
      std::printf("\nexported the trained params (safetensors, the base of --lora) to %s\n", o.export_dir.c_str());
    const double final_val = last->lines.back().val_loss;
    std::printf("\nvalidation loss %.4f nats/byte against the unigram baseline's %.4f (%.0f%% of it)\n", final_val,
                unigram, 100.0 * final_val / unigram);
    if (o.sample_chars > 0)
      std::printf("\nsample (temperature 0.8):\n%s\n",
                  sample_text(o, last->final_params, "Alice ", o.sample_chars).c_str());
    if (!o.plot.empty()) {
      Json m = {{"unigram", unigram}, {"phases", Json::array()}};
      for (const PhaseResult* r : {&a, &b}) {
        if (r->lines.empty()) continue;
        Json lines = Json::array();
        for (const Progress& p : r->lines)
          lines.push_back({{"step", p.step},
                           {"train", p.train_loss},
                           {"val", p.val_loss},
                           {"tokens_per_s", p.tokens_per_s},
                           {"memory", memory_json(p.ranks)}});
        m["phases"].push_back(
            {{"world", r == &a ? o.ranks : o.resume_ranks},
             {"lines", lines},
             {"memory", memory_json(r->memory)},
             {"unsharded",
              {{"params", r->unsharded_params}, {"grads", r->unsharded_grads}, {"optim", r->unsharded_optim}}}});
      }
      std::ofstream(o.plot + "/metrics.json") << m.dump(1) << "\n";
      const char* python = std::getenv("PYTHON");  // a venv's interpreter, say; python3 when unset
      const std::string cmd = std::string(python ? python : "python3") + " " FSDP_GPT_SOURCE_DIR "/plot.py " + o.plot;
      std::printf("\n%s\n", cmd.c_str());
      std::fflush(stdout);
      if (std::system(cmd.c_str()) != 0)
        fail(
            "--plot: the PNGs were not written (plot.py needs matplotlib: pip install matplotlib); "
            "the data is in " +
            o.plot);
    }
    if (o.check) {
      const double first = a.step_losses.front(), last_a = a.step_losses.back();
      if (!(last_a < 0.8 * first))
        fail("check: the loss did not fall (" + std::to_string(first) + " -> " + std::to_string(last_a) + ")");
      if (two_phases) {
        const double saved = a.lines.back().val_loss, loaded = b.val_at_start;
        if (!(std::fabs(saved - loaded) <= 1e-3 * saved))
          fail("check: the resumed run does not continue where the saved one was (validation loss " +
               std::to_string(saved) + " saved, " + std::to_string(loaded) + " loaded)");
        if (!(b.step_losses.back() < first)) fail("check: the resumed run's loss is not below the start's");
      }
      std::printf("\ncheck passed\n");
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_gpt: %s\n", e.what());
    return 1;
  }
}
