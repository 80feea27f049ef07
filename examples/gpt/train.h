// train.h - what the files of train_gpt share: its options, what a phase of
// training reports, and the functions of train_phase.cpp (the ranks of one
// phase), train_report.cpp (tables, samples, traces) and train_cli.cpp (the
// command line). train_gpt.cpp holds the runs: the demo, the mpirun job, the
// timing run and LoRA.
#pragma once

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

namespace train {

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

[[noreturn]] inline void fail(const std::string& what) { throw std::runtime_error(what); }

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
  std::string base;                // the base's safetensors (fsdp_load_pretrained), loaded before training
  std::string snapshot, fallback;  // --snapshot-every's directory and the checkpoint a restore falls back to
  int snapshot_every = 0, save_every = 0;
  bool lora = false;                        // the adapters of --lora on the frozen base
  bool want_params = false, report = true;  // report: validation loss and progress lines
};

// train_phase.cpp: one phase of training on its ranks, and what it measures.
double peak_rss_bytes();
fsdp_config_t* make_config(const Options& o, bool unsharded);
// A key's value as the contexts get it: the demo's settings, then FSDP_*
// variables ("device": --device, or FSDP_DEVICE, else cpu).
std::string config_value(const Options& o, const char* key);
Memory memory_of(fsdp_ctx_t* ctx);
// Every rank's memory, on every rank.
std::vector<Memory> all_memory(fsdp_ctx_t* ctx, int rank, int world);
void run_phase(const Options& o, const gpt::Corpus& corpus, const Phase& phase, int64_t total_steps, PhaseResult& res);
// What an unsharded single rank holds (the memory table's last row).
void measure_unsharded(const Options& o, PhaseResult& res);
// The optimizer step a checkpoint was saved at (docs/checkpoints.md).
int64_t checkpoint_step(const std::string& dir);
int launcher_world();
int launcher_rank();

// train_report.cpp: what the runs print and write.
double median(std::vector<double> v);
void print_memory_table(const char* title, const PhaseResult& r);
std::string sample_text(const Options& o, const std::vector<std::vector<float>>& params, const std::string& prompt,
                        int n, bool lora = false);
// The validation loss of `params` (fp32, the phases' windows) by one
// unsharded forward without libfsdp.
double unsharded_val_loss(const Options& o, const gpt::Corpus& corpus, const std::vector<std::vector<float>>& params);
void merge_traces(const std::string& out, int world);
Json memory_json(const std::vector<Memory>& mem);
void print_stalls(const PhaseResult& r);

// train_cli.cpp: the command line.
void usage(const char* argv0);
Options parse(int argc, char** argv);

}  // namespace train
