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

#include "train.h"

namespace train {
namespace {

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
            {"device", config_value(o, "device")},
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
  std::printf("GPT: %d layers, width %d, %d heads, context %d: %zu params, frozen, loaded from %s\n", o.shape.layers,
              o.shape.width, o.shape.heads, o.shape.context, base_n, o.base.c_str());
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
  for (const auto& [name, r] :
       {std::pair<const char*, const PhaseResult*>{lora_name.c_str(), &lora}, {"full FT", &full}})
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
}  // namespace train

using namespace train;

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
    const std::string device = config_value(o, "device");
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
    pa.want_params = !two_phases;  // the sample and the unsharded validation loss
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
      pb.want_params = true;
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
    // The trained fp32 master (what a checkpoint or an export holds), without
    // the rounding of the gathers (to param_dtype, or gather_dtype's codes).
    const double master_val = unsharded_val_loss(o, corpus, last->final_params);
    std::printf("the same windows on the fp32 master params, one unsharded forward without libfsdp: %.4f nats/byte\n",
                master_val);
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
      // fp32 params gathered as they are: the sharded forward is the
      // unsharded one's up to the order of fp32 sums.
      if (o.dtype == "fp32" && config_value(o, "gather_dtype") == "param" &&
          !(std::fabs(final_val - master_val) <= 1e-4 * master_val))
        fail("check: the sharded validation loss " + std::to_string(final_val) +
             " is not the unsharded forward's on the gathered params, " + std::to_string(master_val));
      std::printf("\ncheck passed\n");
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_gpt: %s\n", e.what());
    return 1;
  }
}
