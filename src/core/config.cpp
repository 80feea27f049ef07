// src/core/config.cpp - the option table: keys, aliases, parsing, canonical
// values. Adding an option is one entry here; no struct crosses the ABI.
#include "config.h"

#include <fnmatch.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <sstream>

#include "../base/error.h"
#include "../base/text.h"
#include "config_parse.h"

namespace fsdp::core {
namespace {

using namespace config_parse;  // the option table's own helpers

// A group option (secondary_shard, reduce_hierarchy): 0 off, -1 node (the
// ranks on this host), else a group size.
int parse_group(const char* key, const std::string& v, const char* expected) {
  const std::string w = lower(trim(v));
  if (w == "off" || w == "0" || w == "none") return 0;
  if (w == "node") return -1;
  return static_cast<int>(parse_int(key, v, 1, 1 << 20, expected));
}

std::string group_name(int g) { return g == 0 ? std::string("off") : g < 0 ? std::string("node") : std::to_string(g); }

// A list option of fnmatch patterns (no_weight_decay, gather_dtype_exclude):
// comma-separated, blanks around each trimmed, empty items dropped.
std::vector<std::string> parse_patterns(const std::string& v) {
  std::vector<std::string> pats;
  std::stringstream ss(v);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item = trim(item);
    if (!item.empty()) pats.push_back(item);
  }
  return pats;
}

struct Entry {
  const char* key;
  std::vector<const char*> aliases;
  std::function<void(Options&, const std::string&)> set;
  std::function<std::string(const Options&)> get;
};

const std::vector<Entry>& table() {
  static const std::vector<Entry> entries = {
      {"sharding",
       {"sharding_strategy", "shard_strat"},
       [](Options& o, const std::string& v) { o.sharding = parse_choice("sharding", v, kShardings); },
       [](const Options& o) { return std::string(sharding_name(o.sharding)); }},
      {"param_dtype",
       {"mp"},
       [](Options& o, const std::string& v) { o.param_dtype = parse_dtype("param_dtype", v); },
       [](const Options& o) { return std::string(dtype_name(o.param_dtype)); }},
      {"reduce_dtype",
       {},
       [](Options& o, const std::string& v) {
         const std::string w = lower(trim(v));
         if (w == "int8" || w == "fp8_e4m3" || w == "fp8") {
           o.reduce_quantized = true;
           o.reduce_qtype = w == "int8" ? kernels::QType::kInt8 : kernels::QType::kFp8E4m3;
           o.reduce_dtype_set = DType::kFp32;  // what the quantized reduction leaves
           o.reduce_dtype_auto = false;
           return;
         }
         if (w == "auto") {
           o.reduce_dtype_auto = true;
         } else {
           static const char* const kNames[] = {"fp32", "float32", "f32",  "bf16", "bfloat16",
                                                "fp16", "float16", "half", "f16"};
           if (std::find(std::begin(kNames), std::end(kNames), w) == std::end(kNames)) {
             bad_value("reduce_dtype", v, "auto, fp32, bf16, fp16, int8, fp8_e4m3");
           }
           o.reduce_dtype_set = parse_dtype("reduce_dtype", v);
           o.reduce_dtype_auto = false;
         }
         o.reduce_quantized = false;
       },
       [](const Options& o) {
         if (o.reduce_quantized) return std::string(o.reduce_qtype == kernels::QType::kInt8 ? "int8" : "fp8_e4m3");
         return o.reduce_dtype_auto ? std::string("auto") : std::string(dtype_name(o.reduce_dtype_set));
       }},
      {"secondary_shard",
       {},
       [](Options& o, const std::string& v) {
         o.secondary_shard = parse_group("secondary_shard", v, "off, node, or a group size: an integer");
       },
       [](const Options& o) { return group_name(o.secondary_shard); }},
      {"reduce_hierarchy",
       {},
       [](Options& o, const std::string& v) {
         o.reduce_hierarchy = parse_group("reduce_hierarchy", v, "node, off, or a group size: an integer");
       },
       [](const Options& o) { return group_name(o.reduce_hierarchy); }},
      {"reduce_block",
       {},
       [](Options& o, const std::string& v) {
         o.reduce_block = static_cast<size_t>(parse_int("reduce_block", v, 16, 65536));
       },
       [](const Options& o) { return std::to_string(o.reduce_block); }},
      {"reduce_op",
       {},
       [](Options& o, const std::string& v) { o.reduce_op = parse_choice("reduce_op", v, kReduceOps); },
       [](const Options& o) { return choice_name(o.reduce_op, kReduceOps); }},
      {"optimizer",
       {},
       [](Options& o, const std::string& v) { o.optimizer = parse_choice("optimizer", v, kOptimizers); },
       [](const Options& o) { return optimizer_name(o.optimizer); }},
      {"host_state",
       {},
       [](Options& o, const std::string& v) { o.host_state = static_cast<int>(parse_int("host_state", v, 0, 8)); },
       [](const Options& o) { return std::to_string(o.host_state); }},
      {"lr",
       {"learning_rate"},
       [](Options& o, const std::string& v) { o.lr = parse_double("lr", v, kLrRange); },
       [](const Options& o) { return fmt(o.lr); }},
      {"beta1",
       {},
       [](Options& o, const std::string& v) {
         o.beta1 = parse_double("beta1", v, {0, 1, true});
       },
       [](const Options& o) { return fmt(o.beta1); }},
      {"beta2",
       {},
       [](Options& o, const std::string& v) {
         o.beta2 = parse_double("beta2", v, {0, 1, true});
       },
       [](const Options& o) { return fmt(o.beta2); }},
      {"eps",
       {},
       [](Options& o, const std::string& v) {
         o.eps = parse_double("eps", v, {0, 1});
       },
       [](const Options& o) { return fmt(o.eps); }},
      {"weight_decay",
       {},
       [](Options& o, const std::string& v) { o.weight_decay = parse_double("weight_decay", v, kWeightDecayRange); },
       [](const Options& o) { return fmt(o.weight_decay); }},
      {"momentum",
       {},
       [](Options& o, const std::string& v) {
         o.momentum = parse_double("momentum", v, {0, 1});
       },
       [](const Options& o) { return fmt(o.momentum); }},
      {"nesterov",
       {},
       [](Options& o, const std::string& v) { o.nesterov = parse_bool("nesterov", v); },
       [](const Options& o) { return std::string(o.nesterov ? "1" : "0"); }},
      {"max_grad_norm",
       {"clip_grad_norm"},
       [](Options& o, const std::string& v) {
         o.max_grad_norm = parse_double("max_grad_norm", v, {0, 1e30}, "a number", " (0 = no clipping)");
       },
       [](const Options& o) { return fmt(o.max_grad_norm); }},
      {"no_weight_decay",
       {},
       [](Options& o, const std::string& v) { o.no_weight_decay = parse_patterns(v); },
       [](const Options& o) { return join_patterns(o.no_weight_decay); }},
      {"align_bytes",
       {},
       [](Options& o, const std::string& v) {
         long n = parse_int("align_bytes", v, 4, 4096, "a power of two");
         if ((n & (n - 1)) != 0) bad_value("align_bytes", v, "a power of two in [4, 4096]");
         o.align_bytes = static_cast<size_t>(n);
       },
       [](const Options& o) { return std::to_string(o.align_bytes); }},
      {"timeout_s",
       {"timeout"},
       [](Options& o, const std::string& v) {
         o.timeout_s = parse_double("timeout_s", v, {0.001, 1e7}, "seconds");
       },
       [](const Options& o) { return fmt(o.timeout_s); }},
      {"threads",
       {"num_threads"},
       [](Options& o, const std::string& v) { o.threads = static_cast<int>(parse_int("threads", v, 1, 1024)); },
       [](const Options& o) { return std::to_string(o.threads); }},
      {"device",
       {},
       [](Options& o, const std::string& v) {
         std::string l = lower(trim(v));
         if (l == "cpu") {
           o.cuda_ordinal = -1;
           return;
         }
         if (l == "cuda" || l == "gpu" || l.rfind("cuda:", 0) == 0) {
           if (!kHaveCuda) {
             fail(FSDP_ERR_UNSUPPORTED, "config: device " + base::quote(v) +
                                            " needs the CUDA device, which this build does not have (see "
                                            "fsdp_build_info()); use cpu");
           }
           if (l.rfind("cuda:", 0) == 0) {
             o.cuda_ordinal = static_cast<int>(parse_int("device", l.substr(5), 0, 1023));
           } else {
             // The launcher's local rank picks the GPU, as torchrun's users expect.
             const char* local = std::getenv("LOCAL_RANK");
             if (local == nullptr) local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
             if (local == nullptr && std::getenv("SLURM_STEP_ID") != nullptr) {
               // srun: its task's place on the node, unless Slurm bound the
               // task to one GPU (--gpus-per-task=1: it then sees only that one).
               const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
               const bool one = visible != nullptr && *visible != '\0' && std::strchr(visible, ',') == nullptr;
               local = one ? "0" : std::getenv("SLURM_LOCALID");
             }
             o.cuda_ordinal = local != nullptr ? static_cast<int>(parse_int("LOCAL_RANK", local, 0, 1023)) : 0;
           }
           return;
         }
         bad_value("device", v, kHaveCuda ? "cpu, cuda, cuda:N" : "cpu");
       },
       [](const Options& o) { return o.on_cuda() ? "cuda:" + std::to_string(o.cuda_ordinal) : std::string("cpu"); }},
      {"comm",
       {"communicator", "backend"},
       [](Options& o, const std::string& v) {
         std::string l = lower(trim(v));
         if (l == "mpi" && !kHaveMpi) {
           fail(FSDP_ERR_UNSUPPORTED,
                "config: comm 'mpi' is not built into this library (it was configured "
                "without MPI; rebuild with MPI installed, see fsdp_build_info()); use local");
         }
         if (l == "nccl" && !kHaveNccl) {
           fail(FSDP_ERR_UNSUPPORTED,
                std::string("config: comm 'nccl' is not in this build: ") +
                    (kHaveCuda ? "CMake did not find NCCL (nccl.h and libnccl; FSDP_WITH_NCCL)"
                               : "it needs the CUDA device, which this build does not have (see fsdp_build_info())") +
                    "; use " + (kHaveMpi ? "mpi or local" : "local"));
         }
         o.comm = parse_choice("comm", v, kComms);
       },
       [](const Options& o) { return choice_name(o.comm, kComms); }},
      {"mpi_algorithm",
       {},
       [](Options& o, const std::string& v) { o.mpi_algorithm = parse_choice("mpi_algorithm", v, kMpiAlgorithms); },
       [](const Options& o) { return choice_name(o.mpi_algorithm, kMpiAlgorithms); }},
      {"comm_id",
       {"nccl_id"},
       [](Options& o, const std::string& v) {
         std::string t = lower(trim(v));
         if (!t.empty() && !kHaveNccl) {
           fail(FSDP_ERR_UNSUPPORTED, "config: comm_id is the id of comm=nccl, which this build does not have");
         }
         bool hex = t.size() == 256 && t.find_first_not_of("0123456789abcdef") == std::string::npos;
         if (!t.empty() && !hex) bad_value("comm_id", v, "the 256 hex digits fsdp_comm_id_create() wrote, or empty");
         o.comm_id = t;
       },
       [](const Options& o) { return o.comm_id; }},
      {"world_size",
       {},
       [](Options& o, const std::string& v) {
         o.world_size = static_cast<int>(parse_int("world_size", v, 0, 1 << 24));
       },
       [](const Options& o) { return std::to_string(o.world_size); }},
      {"shard_group_size",
       {"hybrid_shard_group_size"},
       [](Options& o, const std::string& v) {
         o.shard_group_size = static_cast<int>(parse_int("shard_group_size", v, 0, 1 << 20));
       },
       [](const Options& o) { return std::to_string(o.shard_group_size); }},
      {"offload",
       {"cpu_offload"},
       [](Options& o, const std::string& v) {
         std::string l = lower(trim(v));
         if (l == "cpu" || l == "1" || l == "true" || l == "on") {
           o.offload_cpu = true;
         } else if (l == "none" || l == "0" || l == "false" || l == "off") {
           o.offload_cpu = false;
         } else {
           bad_value("offload", v, "none, cpu");
         }
       },
       [](const Options& o) { return std::string(o.offload_cpu ? "cpu" : "none"); }},
      {"keep_param_dtype_shard",
       {},
       [](Options& o, const std::string& v) {
         o.keep_param_dtype_shard = parse_auto_bool("keep_param_dtype_shard", v);
       },
       [](const Options& o) { return auto_bool_name(o.keep_param_dtype_shard); }},
      {"gather_stream",
       {},
       [](Options& o, const std::string& v) { o.gather_stream = parse_auto_bool("gather_stream", v); },
       [](const Options& o) { return auto_bool_name(o.gather_stream); }},
      {"gather_dtype",
       {},
       [](Options& o, const std::string& v) {
         const std::string w = lower(trim(v));
         if (w == "param" || w == "param_dtype") {
           o.gather_quantized = false;
         } else if (w == "int8") {
           o.gather_quantized = true;
           o.gather_qtype = kernels::QType::kInt8;
         } else if (w == "fp8_e4m3" || w == "fp8") {
           o.gather_quantized = true;
           o.gather_qtype = kernels::QType::kFp8E4m3;
         } else {
           bad_value("gather_dtype", v, "param, int8, fp8_e4m3");
         }
       },
       [](const Options& o) {
         if (!o.gather_quantized) return std::string("param");
         return std::string(o.gather_qtype == kernels::QType::kInt8 ? "int8" : "fp8_e4m3");
       }},
      {"gather_dtype_exclude",
       {},
       [](Options& o, const std::string& v) { o.gather_dtype_exclude = parse_patterns(v); },
       [](const Options& o) { return join_patterns(o.gather_dtype_exclude); }},
      {"gather_block",
       {},
       [](Options& o, const std::string& v) {
         o.gather_block = static_cast<size_t>(parse_int("gather_block", v, 16, 65536));
       },
       [](const Options& o) { return std::to_string(o.gather_block); }},
      {"forward_prefetch",
       {},
       [](Options& o, const std::string& v) { o.forward_prefetch = parse_bool("forward_prefetch", v); },
       [](const Options& o) { return std::string(o.forward_prefetch ? "1" : "0"); }},
      {"backward_prefetch",
       {},
       [](Options& o, const std::string& v) {
         o.backward_prefetch = parse_choice("backward_prefetch", v, kBackwardPrefetch);
       },
       [](const Options& o) { return choice_name(o.backward_prefetch, kBackwardPrefetch); }},
      {"limit_all_gathers",
       {},
       [](Options& o, const std::string& v) {
         o.limit_all_gathers = static_cast<int>(parse_int("limit_all_gathers", v, 1, 1024));
       },
       [](const Options& o) { return std::to_string(o.limit_all_gathers); }},
      {"loss_scale",
       {},
       [](Options& o, const std::string& v) {
         std::string l = lower(trim(v));
         if (l == "auto") {
           o.loss_scale_mode = LossScaleMode::kAuto;
         } else if (l == "dynamic") {
           o.loss_scale_mode = LossScaleMode::kDynamic;
         } else if (l == "off" || l == "none") {
           o.loss_scale_mode = LossScaleMode::kOff;
         } else {
           o.loss_scale_static = parse_double("loss_scale", v, {1e-30, 1e30}, "auto, dynamic, off, or a static scale");
           o.loss_scale_mode = LossScaleMode::kStatic;
         }
       },
       [](const Options& o) {
         switch (o.loss_scale_mode) {
           case LossScaleMode::kAuto:
             return std::string("auto");
           case LossScaleMode::kDynamic:
             return std::string("dynamic");
           case LossScaleMode::kOff:
             return std::string("off");
           case LossScaleMode::kStatic:
             return fmt(o.loss_scale_static);
         }
         return std::string();
       }},
      {"loss_scale_init",
       {"init_scale"},
       [](Options& o, const std::string& v) {
         o.loss_scale_init = parse_double("loss_scale_init", v, {1e-30, 1e30});
       },
       [](const Options& o) { return fmt(o.loss_scale_init); }},
      {"loss_scale_growth",
       {"growth_factor"},
       [](Options& o, const std::string& v) {
         o.loss_scale_growth = parse_double("loss_scale_growth", v, {1, 1e6});
       },
       [](const Options& o) { return fmt(o.loss_scale_growth); }},
      {"loss_scale_backoff",
       {"backoff_factor"},
       [](Options& o, const std::string& v) {
         o.loss_scale_backoff = parse_double("loss_scale_backoff", v, {1e-6, 1});
       },
       [](const Options& o) { return fmt(o.loss_scale_backoff); }},
      {"loss_scale_growth_interval",
       {"growth_interval"},
       [](Options& o, const std::string& v) {
         o.loss_scale_growth_interval = parse_int("loss_scale_growth_interval", v, 1, 1000000000L);
       },
       [](const Options& o) { return std::to_string(o.loss_scale_growth_interval); }},
      {"sync_module_states",
       {},
       [](Options& o, const std::string& v) { o.sync_module_states = parse_bool("sync_module_states", v); },
       [](const Options& o) { return std::string(o.sync_module_states ? "1" : "0"); }},
      {"debug_poison",
       {},
       [](Options& o, const std::string& v) { o.debug_poison = parse_bool("debug_poison", v); },
       [](const Options& o) { return std::string(o.debug_poison ? "1" : "0"); }},
  };
  return entries;
}

const Entry* find(const std::string& key) {
  std::string k = lower(trim(key));
  for (const Entry& e : table()) {
    if (k == e.key) return &e;
    for (const char* a : e.aliases) {
      if (k == a) return &e;
    }
  }
  return nullptr;
}

const Entry& find_or_fail(const std::string& key) {
  const Entry* e = find(key);
  if (e == nullptr) {
    std::string keys;
    for (const Entry& x : table()) keys += (keys.empty() ? "" : ", ") + std::string(x.key);
    fail(FSDP_ERR_INVALID_ARGUMENT, "config: unknown key " + base::quote(key) + "; valid keys: " + keys);
  }
  return *e;
}

}  // namespace

std::string join_patterns(const std::vector<std::string>& patterns) {
  std::string s;
  for (const auto& p : patterns) s += (s.empty() ? "" : ",") + p;
  return s;
}

bool Options::quantizes_gathers_of(const std::string& unit_name) const {
  if (!gather_quantized) return false;
  for (const std::string& pat : gather_dtype_exclude) {
    if (fnmatch(pat.c_str(), unit_name.c_str(), 0) == 0) return false;
  }
  return true;
}

bool debug_poison_from_env() {
  const char* v = std::getenv("FSDP_DEBUG_POISON");
  return v != nullptr && std::string(v) == "1";
}

const char* auto_bool_name(AutoBool b) {
  switch (b) {
    case AutoBool::kYes:
      return "1";
    case AutoBool::kNo:
      return "0";
    default:
      return "auto";
  }
}

const char* sharding_name(Sharding s) {
  switch (s) {
    case Sharding::kFullShard:
      return "FULL_SHARD";
    case Sharding::kShardGradOp:
      return "SHARD_GRAD_OP";
    case Sharding::kNoShard:
      return "NO_SHARD";
    case Sharding::kHybridShard:
      return "HYBRID_SHARD";
    case Sharding::kHybridShardZero2:
      return "HYBRID_SHARD_ZERO2";
  }
  return "?";
}

std::string optimizer_name(OptimizerKind k) { return choice_name(k, kOptimizers); }

void check_lr(double lr, const char* call) { check_range(lr, kLrRange, std::string(call) + ": the learning rate"); }

void check_weight_decay(double weight_decay, const char* call) {
  check_range(weight_decay, kWeightDecayRange, std::string(call) + ": the weight decay");
}

ParamGroupOptions parse_param_group(const char* text, bool adam, const char* call) {
  ParamGroupOptions g;
  std::string all = text == nullptr ? "" : text;
  size_t items = 0;
  for (size_t pos = 0; pos <= all.size();) {
    size_t end = all.find_first_of(";,", pos);
    if (end == std::string::npos) end = all.size();
    std::string item = trim(all.substr(pos, end - pos));
    pos = end + 1;
    if (item.empty()) continue;
    ++items;
    size_t eq = item.find('=');
    auto bad = [&](const std::string& why) {
      fail(FSDP_ERR_INVALID_ARGUMENT, std::string(call) + ": " + base::quote(item) + " " + why +
                                          " (keys: lr_scale, weight_decay, beta1, beta2)");
    };
    if (eq == std::string::npos) bad("is not key=value");
    std::string key = trim(item.substr(0, eq)), value = item.substr(eq + 1);
    double v = 0.0;
    auto number = [&](Range r) {
      if (!base::parse_double(trim(value), &v) || !std::isfinite(v) || !r.holds(v)) bad("is not a number in " + range_text(r));
      return v;
    };
    if (key == "lr_scale") {
      g.lr_scale = number({0, 1e9});
    } else if (key == "weight_decay") {
      g.weight_decay = number(kWeightDecayRange);
    } else if (key == "beta1" || key == "beta2") {
      if (!adam) bad("is Adam's: optimizer=sgd has no betas");
      (key == "beta1" ? g.beta1 : g.beta2) = number({0, 1, true});
    } else {
      bad("has an unknown key");
    }
  }
  if (items == 0) fail(FSDP_ERR_INVALID_ARGUMENT, std::string(call) + ": no options (lr_scale, weight_decay, beta1, beta2)");
  return g;
}

void Config::set(const std::string& key, const std::string& value) {
  const Entry& e = find_or_fail(key);
  Options next = options_;  // all-or-nothing: a failed parse leaves options_ alone
  e.set(next, value);
  options_ = next;
}

std::string Config::get(const std::string& key) const { return find_or_fail(key).get(options_); }

void Config::apply_env() {
  Options next = options_;
  for (const Entry& e : table()) {
    std::string var = "FSDP_" + upper(e.key);
    // getenv races only with setenv; contexts are configured before ranks start.
    if (const char* v = std::getenv(var.c_str())) {  // NOLINT(concurrency-mt-unsafe)
      try {
        e.set(next, v);
      } catch (const Error& err) {
        fail(err.status(), std::string("environment variable ") + var + ": " + err.what());
      }
    }
  }
  options_ = next;
}

}  // namespace fsdp::core
