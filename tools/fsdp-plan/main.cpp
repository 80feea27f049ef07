// tools/fsdp-plan/main.cpp - the planner on the command line: builds
// fsdp_plan's JSON request from flags, prints its answer as a table (the
// best row marked) or, with --json, as it came.
//
//   fsdp-plan (--model FILE|DIR [--unit-rule 'h.{i}.'] | --size LAYERS,PARAMS_PER_LAYER[,OTHER])
//             --gpus N --gpus-per-node G --intra GBPS --inter GBPS --tflops T --mfu F
//             --memory-gib M --tokens TOKENS_PER_GPU [--option KEY=VALUE]... [--json]
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fsdp.h"

namespace {

using nlohmann::json;

int usage(const char* why) {
  std::fprintf(stderr,
               "fsdp-plan: %s\n"
               "usage: fsdp-plan (--model FILE|DIR [--unit-rule 'h.{i}.'] | --size LAYERS,PARAMS_PER_LAYER[,OTHER])\n"
               "                 --gpus N --gpus-per-node G --intra GBPS --inter GBPS --tflops T --mfu F\n"
               "                 --memory-gib M --tokens TOKENS_PER_GPU [--option KEY=VALUE]... [--json]\n",
               why);
  return 2;
}

double number(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const double d = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0') {
    std::fprintf(stderr, "fsdp-plan: %s wants a number, not '%s'\n", flag.c_str(), v.c_str());
    std::exit(2);
  }
  return d;
}

std::string gib(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f", bytes / 1073741824.0);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  json req = {{"model", json::object()}, {"cluster", json::object()}, {"options", json::object()}};
  bool as_json = false;
  const std::vector<std::pair<std::string, std::string>> cluster_flags = {{"--gpus", "gpus"},
                                                                          {"--gpus-per-node", "gpus_per_node"},
                                                                          {"--intra", "intra_node_GBps"},
                                                                          {"--inter", "inter_node_GBps"},
                                                                          {"--tflops", "peak_tflops"},
                                                                          {"--mfu", "mfu"},
                                                                          {"--memory-gib", "memory_GiB"}};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json") {
      as_json = true;
      continue;
    }
    if (a == "-h" || a == "--help") return usage("plans a model on a cluster");
    if (i + 1 >= argc) return usage(("missing the value of " + a).c_str());
    const std::string v = argv[++i];
    bool done = false;
    for (const auto& [flag, key] : cluster_flags) {
      if (a == flag) {
        req["cluster"][key] = number(a, v);
        done = true;
      }
    }
    if (done) continue;
    if (a == "--model") {
      req["model"]["safetensors"] = v;
    } else if (a == "--unit-rule") {
      req["model"]["unit_rule"] = v;
    } else if (a == "--size") {
      std::vector<double> parts;
      for (size_t p = 0; p <= v.size();) {
        size_t e = v.find(',', p);
        if (e == std::string::npos) e = v.size();
        parts.push_back(number("--size", v.substr(p, e - p)));
        p = e + 1;
      }
      if (parts.size() < 2 || parts.size() > 3) return usage("--size wants LAYERS,PARAMS_PER_LAYER[,OTHER]");
      req["model"]["size"] = {{"layers", parts[0]}, {"params_per_layer", parts[1]}};
      if (parts.size() == 3) req["model"]["size"]["other_params"] = parts[2];
    } else if (a == "--tokens") {
      req["tokens_per_gpu"] = number(a, v);
    } else if (a == "--option") {
      const size_t eq = v.find('=');
      if (eq == std::string::npos) return usage("--option wants KEY=VALUE");
      req["options"][v.substr(0, eq)] = v.substr(eq + 1);
    } else {
      return usage(("unknown flag " + a).c_str());
    }
  }
  const std::string text = req.dump();
  size_t len = 0;
  fsdp_plan(text.c_str(), nullptr, 0, &len);  // the length (or the request's error, reported below)
  std::string out(len + 1, '\0');
  if (fsdp_plan(text.c_str(), out.data(), out.size(), &len) != FSDP_OK) {
    std::fprintf(stderr, "fsdp-plan: %s\n", fsdp_last_error());
    return 1;
  }
  out.resize(len);
  if (as_json) {
    std::printf("%s\n", out.c_str());
    return 0;
  }
  const json plan = json::parse(out);
  std::printf("%.0f params in %zu units on %d GPUs (%d per node); compute %.3f s per step\n",
              plan["params"].get<double>(), plan["units"].get<size_t>(), plan["gpus"].get<int>(),
              plan["gpus_per_node"].get<int>(), plan["compute_s"].get<double>());
  std::printf("  %-3s %-14s %5s %-6s %-6s %-9s %-7s %10s %10s %4s %9s %9s %8s %6s\n", "#", "sharding", "group",
              "gather", "reduce", "secondary", "offload", "state GiB", "device GiB", "fits", "inter GB", "intra GB",
              "comm s", "hidden");
  const int best = plan["best"].get<int>();
  int i = 0;
  for (const json& r : plan["rows"]) {
    std::printf("%s %-3d %-14s %5s %-6s %-6s %-9s %-7s %10s %10s %4s %9.2f %9.2f %8.3f %6s\n", i == best ? "*" : " ", i,
                r["sharding"].get<std::string>().c_str(),
                r.contains("shard_group_size") ? r["shard_group_size"].get<std::string>().c_str() : "-",
                r["gather_dtype"].get<std::string>().c_str(), r["reduce_dtype"].get<std::string>().c_str(),
                r["secondary_shard"].get<std::string>().c_str(), r["offload"].get<std::string>().c_str(),
                gib(r["persistent_bytes"].get<double>()).c_str(), gib(r["device_bytes"].get<double>()).c_str(),
                r["fits"].get<bool>() ? "yes" : "no", r["wire_bytes_inter_node"].get<double>() / 1e9,
                r["wire_bytes_intra_node"].get<double>() / 1e9, r["comm_s"].get<double>(),
                r["comm_hidden"].get<bool>() ? "yes" : "no");
    ++i;
  }
  if (best < 0) std::printf("no candidate fits in memory\n");
  return 0;
}
