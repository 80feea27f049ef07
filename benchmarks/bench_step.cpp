// benchmarks/bench_step.cpp - the engine overhead: one training step of an MLP
// (L layers of Linear [W, W] + ReLU, fp32, OpenBLAS sgemm), timed in one run
//   1. as a plain host loop: plain buffers, memset grads, a hand-written AdamW
//      of the same math as kernels/optim.h (torch.optim.AdamW), no libfsdp;
//   2. through libfsdp at world 1 (NO_SHARD and the --sharding strategy);
//   3. through libfsdp at world 2, 4, ... as thread ranks of this process
//      (comm=local), or, under mpirun, as one rank per process (comm=mpi; only
//      that world runs, rank 0 prints).
// Prints one JSON object per result (other lines start with '#'; --json drops
// them; benchmarks/bench_table.py makes a Markdown table of the JSON lines):
//   step_ms              median over the timed steps of the step's wall time
//                        (rank mean of the per-rank medians; step_ms_max: the
//                        slowest rank's)
//   *_begin_ms, *_end_ms host time inside fsdp_forward_begin, ... summed over
//                        the units; step_call_ms inside fsdp_step (baseline:
//                        the AdamW loop); zero_grad_ms the baseline's memset
//   compute_ms           sgemm + bias + ReLU + loss; other_ms the rest
//   cpu_ms               process CPU time per step (CLOCK_PROCESS_CPUTIME_ID)
//                        over the timed steps; cpu_scope says whose: thread
//                        ranks share one process, so it is the whole group's
//   cpu_per_wall         cpu_ms / wall ms per step: cores kept busy
//   cpu_over_compute     cpu_ms / compute_ms (compute_ms of one rank; with t
//                        BLAS threads and r ranks per process, compute alone
//                        at full use is about t * r)
//   ratio                libfsdp world 1: step_ms / the baseline's; world > 1:
//                        step_ms / world 1's of the same sharding and threads
// The batch is per rank, so world N does N times the work of world 1 on N
// times the data (weak scaling): ratio 1 is perfect. On a shared machine the
// same sgemm calls can take 1.7x longer in one run than in the next (seen on
// a 2-core VM), so compare step_ms - compute_ms too (bench_table.py prints it). Threads per rank
// (OpenBLAS and libfsdp's `threads`) default to cores / ranks sharing them.
//
// Check (exit status 1 on failure): from the same init and data, the loss of a
// forward pass after the last step through libfsdp at world 1 matches the
// baseline's within relative 1e-4. Both run the same sgemm calls on the same
// data, so they can differ only in how AdamW rounds (a SIMD loop that fused
// multiply-adds would differ by an ulp per element and step; on x86-64 with
// GCC they agree to the bit). A wrong step (unzeroed or unaveraged grads, a
// missed bias correction) moves the loss by far more than 1e-4; a missing
// weight decay (lr * wd = 1e-5 per step) only after about 20 steps.
//
//   bench_step [--width N] [--layers N] [--batch N] [--steps N] [--warmup N]
//              [--ranks 1,2,4] [--threads N] [--sharding full_shard|...] [--json]
//   mpirun -np 2 bench_step [...]
#include <cblas.h>
#include <sched.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bench_step_model.h"
#include "bench_util.h"
#include "fsdp.h"

using fsdp::bench::JsonLine;
using namespace bench_step;

namespace {

// ---- through libfsdp -----------------------------------------------------------

void check(fsdp_status_t s, const char* call) {
  if (s != FSDP_OK) throw std::runtime_error(std::string(call) + ": " + fsdp_status_name(s) + ": " + fsdp_last_error());
}
#define CHECK(call) check((call), #call)

struct ConfigDeleter {
  void operator()(fsdp_config_t* c) const { fsdp_config_destroy(c); }
};
struct CtxDeleter {
  void operator()(fsdp_ctx_t* c) const { fsdp_ctx_destroy(c); }
};
struct GroupDeleter {
  void operator()(fsdp_local_group_t* g) const { fsdp_local_group_destroy(g); }
};

// One rank's training through the public API. rank -1: this process is one
// rank of an mpirun job. Returns the rank's summary; *world_rank gets its rank.
// With `all` given, every rank's summary lands in it (row per rank, through
// fsdp_metrics_reduce: each rank fills its own row and the sum fills all).
Summary run_rank(const Options& o, const Init& init, const std::string& sharding, const char* comm, int threads,
                 fsdp_local_group_t* group, int rank, int* world_rank, std::vector<double>* all = nullptr) {
  const int W = o.width, L = o.layers, B = o.batch;
  const size_t wn = static_cast<size_t>(W) * W;
  std::unique_ptr<fsdp_ctx_t, CtxDeleter> owner;
  {
    fsdp_config_t* raw = nullptr;
    CHECK(fsdp_config_create(&raw));
    std::unique_ptr<fsdp_config_t, ConfigDeleter> cfg(raw);
    const std::pair<const char*, std::string> options[] = {
        {"sharding", sharding},  {"comm", comm},           {"threads", std::to_string(threads)},
        {"param_dtype", "fp32"}, {"reduce_dtype", "fp32"}, {"optimizer", "adamw"},
        {"lr", "1e-3"},          {"beta1", "0.9"},         {"beta2", "0.999"},
        {"eps", "1e-8"},         {"weight_decay", "0.01"}};
    for (const auto& [k, v] : options) CHECK(fsdp_config_set(cfg.get(), k, v.c_str()));
    // FSDP_* variables override (e.g. FSDP_FORWARD_PREFETCH=1), for trying settings.
    CHECK(fsdp_config_from_env(cfg.get()));
    fsdp_ctx_t* ctx = nullptr;
    CHECK(fsdp_ctx_create(cfg.get(), group, rank, &ctx));
    owner.reset(ctx);
  }
  fsdp_ctx_t* ctx = owner.get();
  CHECK(fsdp_ctx_rank(ctx, world_rank));
  std::vector<fsdp_unit_t*> units(L);
  const char* names[2] = {"weight", "bias"};
  const int32_t ndims[2] = {2, 1};
  const int64_t dims[3] = {W, W, W};
  for (int l = 0; l < L; ++l) {
    std::string name = "layer" + std::to_string(l);
    CHECK(fsdp_unit_register(ctx, name.c_str(), 2, names, ndims, dims, &units[l]));
    CHECK(fsdp_param_set_values(units[l], 0, init.weight[l].data(), wn));
    CHECK(fsdp_param_set_values(units[l], 1, init.bias[l].data(), static_cast<size_t>(W)));
  }
  Batch data(W, B, *world_rank);
  Activations act(W, B, L);
  auto ptr = [](fsdp_status_t (*get)(fsdp_unit_t*, size_t, void**), fsdp_unit_t* u, size_t i) {
    void* p = nullptr;
    check(get(u, i, &p), "fsdp_param_ptr / fsdp_grad_ptr");
    return static_cast<float*>(p);
  };
  // Host time inside one libfsdp call, added to t[field].
  auto timed_call = [](Times& t, int field, fsdp_status_t st, double since, const char* what) {
    t[field] += now_ms() - since;
    check(st, what);
  };
  auto forward = [&](Times& t) {
    std::copy(data.x.begin(), data.x.end(), act.a[0].begin());
    for (int l = 0; l < L; ++l) {
      double c = now_ms();
      timed_call(t, kForwardBegin, fsdp_forward_begin(units[l], nullptr), c, "fsdp_forward_begin");
      c = now_ms();
      const float* w = ptr(fsdp_param_ptr, units[l], 0);
      forward_layer(w, ptr(fsdp_param_ptr, units[l], 1), act.a[l].data(), act.a[l + 1].data(), B, W);
      t[kCompute] += now_ms() - c;
      c = now_ms();
      timed_call(t, kForwardEnd, fsdp_forward_end(units[l], nullptr), c, "fsdp_forward_end");
    }
    double c = now_ms();
    double loss = loss_grad(act.a[L].data(), data.y.data(), act.da[L].data(), B, W);
    t[kCompute] += now_ms() - c;
    return loss;
  };
  double barrier = 0;  // fsdp_metrics_reduce as a barrier around the timed steps
  std::vector<Times> timed;
  double cpu0 = 0, wall0 = 0;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    if (s == o.warmup) {
      CHECK(fsdp_metrics_reduce(ctx, &barrier, 1, FSDP_REDUCE_SUM));
      cpu0 = cpu_ms();
      wall0 = now_ms();
    }
    Times t{};
    double t0 = now_ms();
    forward(t);
    for (int l = L - 1; l >= 0; --l) {
      double c = now_ms();
      timed_call(t, kBackwardBegin, fsdp_backward_begin(units[l], nullptr), c, "fsdp_backward_begin");
      c = now_ms();
      backward_layer(ptr(fsdp_param_ptr, units[l], 0), ptr(fsdp_grad_ptr, units[l], 0), ptr(fsdp_grad_ptr, units[l], 1),
                     act.a[l].data(), act.a[l + 1].data(), act.da[l + 1].data(), l > 0 ? act.da[l].data() : nullptr, B,
                     W);
      t[kCompute] += now_ms() - c;
      c = now_ms();
      timed_call(t, kBackwardEnd, fsdp_backward_end(units[l], nullptr), c, "fsdp_backward_end");
    }
    double c = now_ms();
    timed_call(t, kStepCall, fsdp_step(ctx, nullptr), c, "fsdp_step");
    t[kStep] = now_ms() - t0;
    t[kOther] = t[kStep] - t[kCompute] - t[kStepCall];
    for (int f : {kForwardBegin, kForwardEnd, kBackwardBegin, kBackwardEnd}) t[kOther] -= t[f];
    if (s >= o.warmup) timed.push_back(t);
  }
  CHECK(fsdp_metrics_reduce(ctx, &barrier, 1, FSDP_REDUCE_SUM));
  double cpu_total = cpu_ms() - cpu0, wall_total = now_ms() - wall0;
  Times unused{};
  double loss = forward(unused);  // after the last update
  CHECK(fsdp_metrics_reduce(ctx, &loss, 1, FSDP_REDUCE_AVG));
  Summary mine = summarize(timed, cpu_total, wall_total, loss);
  if (all) {
    int world = 0;
    CHECK(fsdp_ctx_world_size(ctx, &world));
    all->assign(static_cast<size_t>(world) * kSummarySize, 0.0);
    std::copy(mine.begin(), mine.end(), all->begin() + static_cast<size_t>(*world_rank) * kSummarySize);
    CHECK(fsdp_metrics_reduce(ctx, all->data(), all->size(), FSDP_REDUCE_SUM));
  }
  CHECK(fsdp_ctx_finalize(ctx));
  return mine;
}

// What one configuration measured: the ranks' summaries combined.
struct Result {
  std::string way, launcher, comm, sharding, cpu_scope;
  int world = 1, threads = 1;
  Summary mean{};  // over ranks; cpu and wall from rank 0 when the ranks share a process
  double step_max = 0;
};

Result combine(const std::vector<Summary>& ranks) {
  Result r;
  for (const Summary& s : ranks) {
    for (int f = 0; f < kSummarySize; ++f) r.mean[f] += s[f] / static_cast<double>(ranks.size());
    r.step_max = std::max(r.step_max, s[kStep]);
  }
  return r;
}

// `world` thread ranks of this process on one local group (world 1: no group).
Result run_local(const Options& o, const Init& init, int world, const std::string& sharding, int threads) {
  std::unique_ptr<fsdp_local_group_t, GroupDeleter> group;
  if (world > 1) {
    fsdp_local_group_t* g = nullptr;
    CHECK(fsdp_local_group_create(world, &g));
    group.reset(g);
  }
  std::vector<Summary> out(world);
  std::vector<std::string> errors(world);
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      try {
        int rank = 0;
        out[r] = run_rank(o, init, sharding, "local", threads, group.get(), r, &rank);
      } catch (const std::exception& e) {
        errors[r] = e.what();
        if (group) fsdp_local_group_abort(group.get(), e.what());  // the others stop waiting for this rank
      }
    });
  }
  for (std::thread& t : ranks) t.join();
  for (int r = 0; r < world; ++r)
    if (!errors[r].empty()) throw std::runtime_error("rank " + std::to_string(r) + ": " + errors[r]);
  Result res = combine(out);
  res.mean[kCpuMs] = out[0][kCpuMs];  // the process's, measured by rank 0 for the whole group
  res.mean[kWallMs] = out[0][kWallMs];
  res.cpu_scope = world > 1 ? "process (all " + std::to_string(world) + " thread ranks)" : "process";
  res.launcher = world > 1 ? "threads" : "none";
  res.comm = "local";
  return res;
}

// This process as one rank of an mpirun job; rank 0 gets every rank's
// summary and returns true, the others false.
bool run_mpi(const Options& o, const Init& init, int world, const std::string& sharding, int threads, Result* res) {
  int rank = -1;
  std::vector<double> all;
  run_rank(o, init, sharding, "mpi", threads, nullptr, -1, &rank, &all);
  if (rank != 0) return false;
  std::vector<Summary> ranks(world);
  for (int r = 0; r < world; ++r)
    std::copy(all.begin() + static_cast<size_t>(r) * kSummarySize,
              all.begin() + static_cast<size_t>(r + 1) * kSummarySize, ranks[r].begin());
  *res = combine(ranks);
  res->cpu_scope = "per process (mean over ranks)";
  res->launcher = "mpirun";
  res->comm = "mpi";
  return true;
}

// ---- output ---------------------------------------------------------------------

JsonLine describe(const Options& o, const Result& r) {
  JsonLine j;
  j.add("benchmark", "engine_step")
      .add("way", r.way)
      .add("world", r.world)
      .add("launcher", r.launcher)
      .add("comm", r.comm)
      .add("sharding", r.sharding)
      .add("width", o.width)
      .add("layers", o.layers)
      .add("batch", o.batch)
      .add("threads", r.threads)
      .add("steps", o.steps);
  for (int f = 0; f < kNumFields; ++f) j.add(kFieldNames[f], r.mean[f]);
  double fsdp_ms = 0;
  for (int f : {kForwardBegin, kForwardEnd, kBackwardBegin, kBackwardEnd, kStepCall}) fsdp_ms += r.mean[f];
  if (r.way == "libfsdp") j.add("fsdp_ms", fsdp_ms);
  j.add("step_ms_max", r.step_max)
      .add("cpu_ms", r.mean[kCpuMs])
      .add("cpu_scope", r.cpu_scope)
      .add("cpu_per_wall", r.mean[kCpuMs] / r.mean[kWallMs])
      .add("cpu_over_compute", r.mean[kCpuMs] / r.mean[kCompute])
      .add("loss", r.mean[kLoss]);
  return j;
}

int threads_for(const Options& o, int ranks_sharing_cores) {
  return o.threads > 0 ? o.threads : std::max(1, cores() / ranks_sharing_cores);
}

int launcher_size(const char* var) {
  const char* v = std::getenv(var);
  return v ? std::atoi(v) : 0;
}

int main_mpi(const Options& o, const Init& init) {
  int world = launcher_size("OMPI_COMM_WORLD_SIZE");
  int local = launcher_size("OMPI_COMM_WORLD_LOCAL_SIZE");
  int threads = threads_for(o, local > 0 ? local : world);
  openblas_set_num_threads(threads);
  Result r;
  if (!run_mpi(o, init, world, o.sharding, threads, &r)) return 0;
  r.way = "libfsdp";
  r.world = world;
  r.threads = threads;
  r.sharding = o.sharding;
  std::printf("%s\n", describe(o, r).str().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  try {
    Init init(o.width, o.layers);
    if (launcher_size("OMPI_COMM_WORLD_SIZE") > 0) return main_mpi(o, init);
    if (!o.json)
      std::printf("# %s; %d cores; MLP %d x Linear(%d, %d)+ReLU, batch %d per rank, fp32, AdamW; medians of %d steps\n",
                  fsdp_build_info(), cores(), o.layers, o.width, o.width, o.batch, o.steps);
    // Each thread count in use gets its own baseline and world-1 runs, the
    // references of the ratios.
    std::vector<int> thread_counts;
    for (int world : o.ranks) {
      int t = threads_for(o, world);
      if (std::find(thread_counts.begin(), thread_counts.end(), t) == thread_counts.end()) thread_counts.push_back(t);
    }
    std::vector<std::string> world1_shardings = {"NO_SHARD"};
    if (o.sharding != "NO_SHARD") world1_shardings.push_back(o.sharding);
    std::vector<Result> world1;
    bool ok = true;
    double worst = 0;
    for (int t : thread_counts) {
      openblas_set_num_threads(t);
      Result base = combine({run_baseline(o, init, t)});
      base.way = "baseline";
      base.launcher = base.comm = base.sharding = "none";
      base.cpu_scope = "process";
      base.threads = t;
      std::printf("%s\n", describe(o, base).add("ratio", 1.0).add("ratio_to", "self").str().c_str());
      std::fflush(stdout);
      for (const std::string& s : world1_shardings) {
        Result r = run_local(o, init, 1, s, t);
        r.way = "libfsdp";
        r.sharding = s;
        r.threads = t;
        double rel = std::fabs(r.mean[kLoss] - base.mean[kLoss]) / std::fabs(base.mean[kLoss]);
        bool same = rel <= kTolerance;  // false for nan too
        ok = ok && same;
        worst = std::max(worst, rel);
        std::printf("%s\n", describe(o, r)
                                .add("ratio", r.mean[kStep] / base.mean[kStep])
                                .add("ratio_to", "baseline")
                                .add("loss_rel_diff", rel)
                                .add_bool("ok", same)
                                .str()
                                .c_str());
        std::fflush(stdout);
        world1.push_back(r);
      }
    }
    for (int world : o.ranks) {
      if (world == 1) continue;
      int t = threads_for(o, world);
      openblas_set_num_threads(t);
      // The physical reference of a world-N step on this machine: N plain
      // loops running at once, as the ranks do, each with its own batch and
      // no communication. Ranks that share cores (or memory bandwidth) slow
      // each other's compute; that is the machine, not libfsdp.
      std::vector<Summary> alone(world);
      {
        std::vector<std::thread> loops;
        for (int r = 0; r < world; ++r) loops.emplace_back([&, r] { alone[r] = run_baseline(o, init, t); });
        for (std::thread& th : loops) th.join();
      }
      Result base = combine(alone);
      base.way = "baseline";
      base.world = world;
      base.launcher = "threads";
      base.comm = base.sharding = "none";
      base.cpu_scope = "process (all " + std::to_string(world) + " plain loops)";
      base.threads = t;
      std::printf("%s\n", describe(o, base).add("ratio", 1.0).add("ratio_to", "self").str().c_str());
      std::fflush(stdout);
      Result r = run_local(o, init, world, o.sharding, t);
      r.way = "libfsdp";
      r.world = world;
      r.sharding = o.sharding;
      r.threads = t;
      JsonLine j = describe(o, r);
      j.add("ratio", r.mean[kStep] / base.mean[kStep])
          .add("ratio_to", "baseline x" + std::to_string(world) + " concurrent");
      for (const Result& ref : world1)
        if (ref.threads == t && ref.sharding == o.sharding) j.add("ratio_world1", r.mean[kStep] / ref.mean[kStep]);
      std::printf("%s\n", j.str().c_str());
      std::fflush(stdout);
    }
    std::printf("%s\n", JsonLine()
                            .add("benchmark", "engine_step_check")
                            .add("what", "loss after training, libfsdp world 1 vs baseline")
                            .add("max_rel_diff", worst)
                            .add("tolerance", kTolerance)
                            .add_bool("ok", ok)
                            .str()
                            .c_str());
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_step: %s\n", e.what());
    return 1;
  }
}
