// src/core/plan_request.cpp - the planner behind fsdp_plan and fsdp-plan
// (docs/scaling.md, "The planner"): a JSON request naming a model, a cluster
// and a step's tokens; the answer, one row per candidate configuration, each
// row's bytes from plan_rank (core/plan.h, the engine's own layout) and its
// times from the cluster's links and compute.
#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../base/error.h"
#include "../base/text.h"
#include "../ckpt/pretrained.h"
#include "../ckpt/safetensors.h"
#include "config.h"
#include "plan.h"

namespace fsdp::core {
namespace {

using nlohmann::json;

[[noreturn]] void bad(const std::string& what) { fail(FSDP_ERR_INVALID_ARGUMENT, "fsdp_plan: " + what); }

const json& need(const json& j, const char* key, const char* where) {
  auto it = j.find(key);
  if (it == j.end()) bad(std::string(where) + " needs \"" + key + "\"");
  return *it;
}

double positive(const json& j, const char* key, const char* where) {
  const json& v = need(j, key, where);
  if (!v.is_number() || !(v.get<double>() > 0)) bad(std::string(where) + "." + key + " must be a positive number");
  return v.get<double>();
}

void only_keys(const json& j, const std::vector<std::string>& keys, const char* where) {
  if (!j.is_object()) bad(std::string(where) + " must be a JSON object");
  for (const auto& [k, v] : j.items()) {
    if (std::find(keys.begin(), keys.end(), k) == keys.end()) {
      std::string known;
      for (const std::string& key : keys) known += (known.empty() ? "" : ", ") + key;
      bad(std::string(where) + " has an unknown key \"" + k + "\" (known: " + known + ")");
    }
  }
}

// The unit of a tensor by a rule such as "h.{i}.": the tensors whose names
// hold the rule's text with a number in place of {i} form unit <rule with
// the number>; all others one unit "rest".
std::string unit_of(const std::string& name, const std::string& rule) {
  const size_t at = rule.find("{i}");
  const std::string pre = rule.substr(0, at), post = at == std::string::npos ? "" : rule.substr(at + 3);
  for (size_t p = name.find(pre); p != std::string::npos; p = name.find(pre, p + 1)) {
    size_t d = p + pre.size(), e = d;
    while (e < name.size() && std::isdigit(static_cast<unsigned char>(name[e]))) ++e;
    if (e > d && name.compare(e, post.size(), post) == 0) return pre + name.substr(d, e - d) + post;
  }
  return "rest";
}

std::vector<PlanUnit> model_units(const json& m) {
  only_keys(m, {"safetensors", "unit_rule", "size", "units"}, "model");
  std::vector<PlanUnit> units;
  if (m.contains("safetensors")) {
    const std::string rule = m.value("unit_rule", std::string("layers.{i}."));
    if (rule.find("{i}") == std::string::npos) bad("model.unit_rule must hold \"{i}\" (e.g. \"h.{i}.\")");
    std::map<std::string, size_t> index;  // unit name -> position, in first-seen order
    for (const std::string& file : ckpt::pretrained_files(need(m, "safetensors", "model").get<std::string>())) {
      ckpt::Reader r(file, nullptr, 1 << 20, "pretrained weights file");
      for (const ckpt::TensorInfo& t : r.header().tensors) {
        const std::string u = unit_of(t.name, rule);
        auto [it, fresh] = index.emplace(u, units.size());
        if (fresh) {
          units.emplace_back();
          units.back().name = u;
        }
        units[it->second].params.push_back({t.name, t.shape, 0});
      }
    }
    if (units.empty()) bad("model.safetensors holds no tensors");
    return units;
  }
  if (m.contains("size")) {
    const json& s = m["size"];
    only_keys(s, {"layers", "params_per_layer", "other_params"}, "model.size");
    const auto layers = static_cast<size_t>(positive(s, "layers", "model.size"));
    const auto per = static_cast<int64_t>(positive(s, "params_per_layer", "model.size"));
    for (size_t i = 0; i < layers; ++i) {
      const std::string name = "layer" + std::to_string(i);
      units.push_back({{{name, {per}, 0}}, {}, name});
    }
    if (s.contains("other_params")) {
      units.push_back({{{"other", {static_cast<int64_t>(positive(s, "other_params", "model.size"))}, 0}}, {}, "other"});
    }
    return units;
  }
  const json& list = need(m, "units", "model (one of \"safetensors\", \"size\", \"units\")");
  if (!list.is_array() || list.empty()) bad("model.units must be a non-empty array");
  for (const json& u : list) {
    PlanUnit pu;
    pu.name = u.value("name", "unit" + std::to_string(units.size()));
    for (const json& p : need(u, "params", "model.units[]")) {
      pu.params.push_back(
          {p.value("name", std::string()), need(p, "shape", "model.units[].params[]").get<std::vector<int64_t>>(), 0});
      pu.frozen.push_back(p.value("frozen", false));
    }
    units.push_back(pu);
  }
  return units;
}

struct Cluster {
  int gpus = 1, per_node = 1;
  double intra = 0, inter = 0, flops = 0, mfu = 0, memory = 0;  // bytes/s, bytes/s, FLOP/s, fraction, bytes
};

// A candidate: the options that differ from the request's base options.
std::vector<std::map<std::string, std::string>> candidates(const Cluster& c) {
  std::vector<std::map<std::string, std::string>> out;
  std::vector<std::map<std::string, std::string>> strategies = {{{"sharding", "FULL_SHARD"}},
                                                                {{"sharding", "SHARD_GRAD_OP"}}};
  for (int g = c.per_node; g < c.gpus; g *= 2) {
    if (c.gpus % g == 0) strategies.push_back({{"sharding", "HYBRID_SHARD"}, {"shard_group_size", std::to_string(g)}});
  }
  for (const auto& s : strategies) {
    const bool reshards = s.at("sharding") != "SHARD_GRAD_OP";
    const int shard = s.count("shard_group_size") != 0 ? std::stoi(s.at("shard_group_size")) : c.gpus;
    for (const char* gather : {"param", "int8"}) {
      for (const char* reduce : {"auto", "int8"}) {
        for (bool secondary : {false, true}) {
          if (secondary && (!reshards || shard <= c.per_node)) continue;  // nothing crosses nodes in backward
          for (bool offload : {false, true}) {
            auto o = s;
            o["gather_dtype"] = gather;
            o["reduce_dtype"] = reduce;
            o["secondary_shard"] = secondary ? std::to_string(c.per_node) : "off";
            o["offload"] = offload ? "cpu" : "none";
            out.push_back(o);
          }
        }
      }
    }
  }
  return out;
}

}  // namespace

std::string plan_request(const std::string& request) {
  json req;
  try {
    req = json::parse(request);
  } catch (const json::exception& e) {
    bad(std::string("the request is not JSON: ") + e.what());
  }
  try {
    only_keys(req, {"model", "cluster", "tokens_per_gpu", "options"}, "the request");
    const std::vector<PlanUnit> units = model_units(need(req, "model", "the request"));
    const json& cj = need(req, "cluster", "the request");
    only_keys(cj, {"gpus", "gpus_per_node", "intra_node_GBps", "inter_node_GBps", "peak_tflops", "mfu", "memory_GiB"},
              "cluster");
    Cluster c;
    c.gpus = static_cast<int>(positive(cj, "gpus", "cluster"));
    c.per_node = static_cast<int>(positive(cj, "gpus_per_node", "cluster"));
    if (c.gpus % c.per_node != 0) bad("cluster.gpus must be a multiple of cluster.gpus_per_node");
    c.intra = positive(cj, "intra_node_GBps", "cluster") * 1e9;
    c.inter = positive(cj, "inter_node_GBps", "cluster") * 1e9;
    c.flops = positive(cj, "peak_tflops", "cluster") * 1e12;
    c.mfu = positive(cj, "mfu", "cluster");
    c.memory = positive(cj, "memory_GiB", "cluster") * 1073741824.0;
    const double tokens = positive(req, "tokens_per_gpu", "the request");
    std::map<std::string, std::string> base = {{"param_dtype", "bf16"}};
    if (req.contains("options")) {
      for (const auto& [k, v] : req["options"].items()) base[k] = v.is_string() ? v.get<std::string>() : v.dump();
    }
    double params = 0;
    for (const PlanUnit& u : units)
      for (const ParamSpec& p : u.params) {
        double n = 1;
        for (int64_t d : p.shape) n *= static_cast<double>(d);
        params += n;
      }
    // Forward and backward: 6 FLOPs per param per token.
    const double compute_s = 6.0 * params * tokens / (c.flops * c.mfu);
    json rows = json::array();
    int best = -1;
    std::array<double, 5> best_key{};
    for (const auto& cand : candidates(c)) {
      Config conf;
      for (const auto& [k, v] : base) conf.set(k, v);
      for (const auto& [k, v] : cand) conf.set(k, v);
      // The options' gather_dtype_exclude applies to the quantized gathers'
      // rows (with gather_dtype=param a context refuses it).
      if (cand.at("gather_dtype") == "param") conf.set("gather_dtype_exclude", "");
      const Options& o = conf.options();
      const RankPlan p = plan_rank(o, c.gpus, c.per_node, units);
      // On the device: the persistent state (on the host with offload), the
      // gathered units in flight (the one in use and those prefetched, up to
      // limit_all_gathers; every unit where forward keeps them for backward),
      // a unit's grads, and what secondary_shard keeps.
      const uint64_t persistent = p.sharded_params + p.sharded_grads + p.optimizer_state;
      const double gathered = o.reshard_after_forward() ? double(p.largest_gathered) * std::max(1, o.limit_all_gathers)
                                                        : double(p.all_gathered);
      const double device =
          (o.offload_cpu ? 0.0 : double(persistent)) + gathered + double(p.largest_gathered) + double(p.secondary_peak);
      // Each group's bytes on the wire per GPU (a ring's (n-1)/n of the data,
      // twice for an all-reduce: the replicas' unless the reduction is
      // quantized, whose all-to-all and all-gather are counted whole), on the
      // link it crosses.
      const double n_world = c.gpus, n_shard = p.shard_size, n_rep = double(c.gpus) / p.shard_size;
      auto ring = [](double n) { return n > 1 ? (n - 1) / n : 0.0; };
      const bool no_shard = o.sharding == Sharding::kNoShard;
      // The hierarchical quantized reduction's stages come out of their
      // group's bytes: the first inside its groups, the second across them.
      const double staged = double(p.reduce_local + p.reduce_cross);
      const double world_wire = (double(p.group[0]) - (o.hybrid() ? 0.0 : staged)) * ring(n_world) * (no_shard ? 2 : 1);
      const double shard_wire = (double(p.group[1]) - (o.hybrid() ? staged : 0.0)) * ring(n_shard);
      const double replica_wire = double(p.group[2]) * ring(n_rep) * (o.reduce_quantized ? 1 : 2);
      const double secondary_wire = double(p.group[3]) * ring(p.secondary_size);
      double intra = secondary_wire, inter = replica_wire;
      (c.gpus > c.per_node ? inter : intra) += world_wire;
      (p.shard_size > c.per_node ? inter : intra) += shard_wire;
      (p.reduce_group > c.per_node ? inter : intra) += double(p.reduce_local) * ring(p.reduce_group);
      (p.shard_size > c.per_node ? inter : intra) += double(p.reduce_cross) * ring(n_shard / p.reduce_group);
      const double comm_s = intra / c.intra + inter / c.inter;
      const double step_s = std::max(compute_s, comm_s);
      const bool fits = device <= c.memory;
      json row = cand;
      row["persistent_bytes"] = persistent;
      row["device_bytes"] = device;
      row["host_bytes"] = o.offload_cpu ? persistent : 0;
      row["largest_gathered_bytes"] = p.largest_gathered;
      row["peak_gathered_bytes"] = gathered;  // an estimate: the units in flight (above)
      row["secondary_bytes"] = p.secondary_peak;
      row["step_bytes"] = {{"all_gather", p.all_gather},  {"reduce_scatter", p.reduce_scatter},
                           {"all_reduce", p.all_reduce},  {"all_to_all", p.all_to_all},
                           {"world", p.group[0]},         {"shard_group", p.group[1]},
                           {"replica_group", p.group[2]}, {"secondary_group", p.group[3]}};
      row["wire_bytes_intra_node"] = intra;
      row["wire_bytes_inter_node"] = inter;
      row["comm_s"] = comm_s;
      row["compute_s"] = compute_s;
      row["fits"] = fits;
      row["comm_hidden"] = comm_s <= compute_s;
      const int i = static_cast<int>(rows.size());
      rows.push_back(row);
      // Best: fits, then the shortest step (compute and comm overlapped),
      // then no offload (its host copies and host optimizer are not in these
      // times), then the fewest lossy options (quantized gathers or
      // reductions buy nothing where the comm hides anyway), then the least
      // communication, then the least device memory.
      const double lossy = (o.gather_quantized ? 1.0 : 0.0) + (o.reduce_quantized ? 1.0 : 0.0);
      const std::array<double, 5> key = {step_s, o.offload_cpu ? 1.0 : 0.0, lossy, comm_s, device};
      if (fits && (best < 0 || key < best_key)) {
        best = i;
        best_key = key;
      }
    }
    json out = {{"gpus", c.gpus},           {"gpus_per_node", c.per_node}, {"params", params}, {"units", units.size()},
                {"tokens_per_gpu", tokens}, {"compute_s", compute_s},      {"rows", rows},     {"best", best}};
    return out.dump(1);
  } catch (const json::exception& e) {
    bad(std::string("the request does not have the expected types: ") + e.what());
  }
}

}  // namespace fsdp::core
