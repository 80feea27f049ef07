// train_report.cpp - what train_gpt prints and writes: the memory tables,
// text sampled from the trained params, merged traces, JSON of memory, and
// the stalls of --snapshot-every / --save-every beside a memcpy.

#include "train.h"

namespace train {

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

namespace {

// The specs of the model's units (and with `lora`, the adapters' after
// them), with views on `params` in that order.
std::vector<gpt::UnitView<float>> views_of(const Options& o, const std::vector<std::vector<float>>& params, bool lora) {
  std::vector<gpt::UnitSpec> specs = gpt::model_units(o.shape);
  if (lora) {
    const auto adapters = gpt::lora_units(o.shape, o.lora);
    specs.insert(specs.end(), adapters.begin(), adapters.end());
  }
  std::vector<gpt::UnitView<float>> views(specs.size());
  size_t k = 0;
  for (size_t u = 0; u < specs.size(); ++u)
    for (size_t i = 0; i < specs[u].params.size(); ++i) views[u].p.push_back(params.at(k++).data());
  return views;
}

// One forward of the whole model on `views` (views_of's order; `n_base`
// base units, then with `lora` the adapters): the head's loss on `targets`
// (null: only the logits).
double forward(gpt::Model<float>& model, const Options& o, const std::vector<gpt::UnitView<float>>& views,
               size_t n_base, bool lora, const uint8_t* tokens, int t, const uint8_t* targets) {
  const size_t L = static_cast<size_t>(o.shape.layers);
  model.embed_forward(views[0], tokens, t);
  for (size_t l = 0; l < L; ++l)
    model.block_forward(static_cast<int>(l), views[1 + l], lora ? &views[n_base + l] : nullptr);
  model.final_forward(views[1 + L]);
  return model.head_forward(views[0], targets);
}

}  // namespace

// Samples `n` bytes after `prompt` from the full params (rank 0, no libfsdp);
// with `lora`, the adapters' params follow the base's.
std::string sample_text(const Options& o, const std::vector<std::vector<float>>& params, const std::string& prompt,
                        int n, bool lora) {
  const std::vector<gpt::UnitView<float>> views = views_of(o, params, lora);
  const size_t n_base = gpt::model_units(o.shape).size();
  gpt::Model<float> model(o.shape, 1, false, lora ? gpt::Lora{o.lora, o.lora_alpha} : gpt::Lora{});
  std::string text = prompt;
  std::mt19937_64 rng(o.seed);
  for (int c = 0; c < n; ++c) {
    const size_t t = std::min(text.size(), static_cast<size_t>(o.shape.context));
    const auto* tokens = reinterpret_cast<const uint8_t*>(text.data() + text.size() - t);
    forward(model, o, views, n_base, lora, tokens, static_cast<int>(t), nullptr);
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

// The validation loss of the phases' val_loss() (the same eval_batches x
// batch windows: rank r's window i is window r * local + i of the batch), on
// `params` in fp32 by one unsharded forward, without libfsdp.
double unsharded_val_loss(const Options& o, const gpt::Corpus& corpus, const std::vector<std::vector<float>>& params) {
  const std::vector<gpt::UnitView<float>> views = views_of(o, params, false);
  gpt::Model<float> model(o.shape, o.batch, false);
  const int t = o.shape.context;
  std::vector<uint8_t> inputs(static_cast<size_t>(o.batch) * t), targets(inputs.size());
  double sum = 0;
  for (int k = 0; k < o.eval_batches; ++k) {
    gpt::load_batch(corpus.val, o.seed + gpt::kValSeedOffset, k, 0, o.batch, t, inputs.data(), targets.data());
    sum += forward(model, o, views, views.size(), false, inputs.data(), t, targets.data());
  }
  return sum / o.eval_batches;
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

}  // namespace train
