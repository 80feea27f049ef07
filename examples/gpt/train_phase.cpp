// train_phase.cpp - one phase of train_gpt: its ranks (thread-ranks of this
// process, or this process as one rank of a launcher's job), each a context
// and a model, the training loop with its snapshots and async saves, and
// what the phase measures (loss, tokens/s, memory per rank, stalls).

#include <sys/resource.h>
#include <unistd.h>

#include "train.h"

namespace train {

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

// A key's value as the contexts get it: the demo's settings, then FSDP_*.
std::string config_value(const Options& o, const char* key) {
  fsdp_config_t* cfg = make_config(o, false);
  char v[64] = {};
  const fsdp_status_t st = fsdp_config_get(cfg, key, v, sizeof v, nullptr);
  fsdp_config_destroy(cfg);
  CHECK(st);
  return v;
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
    gpt::load_batch(data, seed, step, rank_ * local_, local_, o_.shape.context, inputs_.data(), targets_.data());
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
      load_batch(sh_.corpus->val, o_.seed + gpt::kValSeedOffset, k);
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
  std::vector<uint8_t> inputs_, targets_;
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

// mpirun's, MPICH's or srun's (fsdp_launcher), else torchrun's.
int launcher_world() {
  int world = -1;
  CHECK(fsdp_launcher(nullptr, &world, nullptr, nullptr));
  if (world > 0) return world;
  const char* v = std::getenv("WORLD_SIZE");
  return v != nullptr ? std::atoi(v) : 0;
}
int launcher_rank() {
  int rank = -1;
  CHECK(fsdp_launcher(&rank, nullptr, nullptr, nullptr));
  if (rank >= 0) return rank;
  const char* v = std::getenv("RANK");
  return v != nullptr ? std::atoi(v) : 0;
}

}  // namespace train
