// src/comm/slurm.cpp - see slurm.h.
#include "slurm.h"

#include <cstdlib>

#include "../base/error.h"
#include "../base/text.h"
#include "launch.h"

namespace fsdp::comm {
namespace {

const char* env(const char* name) {
  return std::getenv(name);  // NOLINT(concurrency-mt-unsafe): read at context creation
}

[[noreturn]] void malformed(const std::string& what, const std::string& text, const std::string& why) {
  fail(FSDP_ERR_INVALID_ARGUMENT, what + "=" + base::quote(text) + " is not a Slurm list: " + why);
}

// The items of `text` split at the commas outside brackets.
std::vector<std::string> top_items(const std::string& text, const std::string& what) {
  std::vector<std::string> items;
  std::string cur;
  int depth = 0;
  for (char c : text) {
    if (c == '[') ++depth;
    if (c == ']' && --depth < 0) malformed(what, text, "a ']' without its '['");
    if (c == ',' && depth == 0) {
      items.push_back(cur);
      cur.clear();
      continue;
    }
    cur += c;
  }
  if (depth != 0) malformed(what, text, "a '[' without its ']'");
  items.push_back(cur);
  for (const std::string& i : items) {
    if (i.empty()) malformed(what, text, "an empty name");
  }
  return items;
}

bool all_digits(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

// One name with zero or more bracket groups, expanded into `out`.
void expand_name(const std::string& name, const std::string& what, const std::string& text,
                 std::vector<std::string>* out) {
  const size_t open = name.find('[');
  if (open == std::string::npos) {
    out->push_back(name);
    return;
  }
  const size_t close = name.find(']', open);
  const std::string prefix = name.substr(0, open), body = name.substr(open + 1, close - open - 1);
  const std::string rest = name.substr(close + 1);
  std::vector<std::string> values;
  size_t start = 0;
  while (start <= body.size()) {
    const size_t comma = body.find(',', start);
    const std::string part = body.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    const size_t dash = part.find('-');
    const std::string lo = part.substr(0, dash), hi = dash == std::string::npos ? lo : part.substr(dash + 1);
    if (!all_digits(lo) || !all_digits(hi)) malformed(what, text, "a range that is not numbers: " + base::quote(part));
    const long a = std::strtol(lo.c_str(), nullptr, 10), b = std::strtol(hi.c_str(), nullptr, 10);
    if (b < a || b - a > 100000) malformed(what, text, "a range that runs backwards or too far: " + base::quote(part));
    for (long v = a; v <= b; ++v) {
      std::string s = std::to_string(v);
      if (s.size() < lo.size()) s.insert(0, lo.size() - s.size(), '0');
      values.push_back(s);
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  for (const std::string& v : values) expand_name(prefix + v + rest, what, text, out);
}

int env_count(const char* name, int lo) {
  const char* v = env(name);
  if (v == nullptr) return -1;
  long n = 0;
  if (!base::parse_long(v, &n) || n < lo || n > (1L << 30)) {
    fail(FSDP_ERR_INVALID_ARGUMENT, std::string("environment variable ") + name + "=" + base::quote(v) +
                                        " is not an integer >= " + std::to_string(lo) + " (Slurm's srun sets it)");
  }
  return static_cast<int>(n);
}

}  // namespace

std::vector<std::string> expand_slurm_hostlist(const std::string& text, const std::string& what) {
  std::vector<std::string> hosts;
  for (const std::string& item : top_items(text, what)) expand_name(item, what, text, &hosts);
  return hosts;
}

std::vector<int> expand_slurm_tasks_per_node(const std::string& text, const std::string& what) {
  std::vector<int> out;
  for (const std::string& item : top_items(text, what)) {
    const size_t paren = item.find('(');
    const std::string count = item.substr(0, paren);
    long repeat = 1;
    if (paren != std::string::npos) {
      const std::string r = item.substr(paren);
      if (r.size() < 4 || r.substr(0, 2) != "(x" || r.back() != ')' || !all_digits(r.substr(2, r.size() - 3))) {
        malformed(what, text, "a repeat that is not (xN): " + base::quote(item));
      }
      repeat = std::strtol(r.c_str() + 2, nullptr, 10);
    }
    if (!all_digits(count) || repeat < 1 || repeat > 100000) malformed(what, text, "not a count: " + base::quote(item));
    for (long i = 0; i < repeat; ++i) out.push_back(static_cast<int>(std::strtol(count.c_str(), nullptr, 10)));
  }
  return out;
}

LaunchEnv read_slurm_env() {
  LaunchEnv e;
  if (env("SLURM_STEP_ID") == nullptr && env("SLURM_STEPID") == nullptr) return e;  // not an srun task
  const int rank = env_count("SLURM_PROCID", 0);
  int world = env_count("SLURM_STEP_NUM_TASKS", 1);
  if (world < 0) world = env_count("SLURM_NTASKS", 1);
  if (rank < 0 || world < 0) return e;
  if (rank >= world) {
    fail(FSDP_ERR_INVALID_ARGUMENT, "launcher variables disagree: SLURM_PROCID=" + std::to_string(rank) +
                                        " is not below the step's " + std::to_string(world) + " tasks");
  }
  e.source = "SLURM_*";
  e.rank = rank;
  e.world = world;
  e.local_rank = env_count("SLURM_LOCALID", 0);
  const char* per_node = env("SLURM_STEP_TASKS_PER_NODE");
  const char* per_node_name = "SLURM_STEP_TASKS_PER_NODE";
  if (per_node == nullptr) per_node = env(per_node_name = "SLURM_TASKS_PER_NODE");
  const int node = env_count("SLURM_NODEID", 0);
  if (per_node != nullptr && node >= 0) {
    std::vector<int> counts = expand_slurm_tasks_per_node(per_node, per_node_name);
    if (static_cast<size_t>(node) < counts.size()) e.local_world = counts[static_cast<size_t>(node)];
  }
  return e;
}

bool slurm_rendezvous(std::string* host, int* port) {
  if (!read_slurm_env().present()) return false;
  const char* names[] = {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"};
  const char* list = nullptr;
  const char* which = nullptr;
  for (const char* n : names) {
    if ((list = env(n)) != nullptr) {
      which = n;
      break;
    }
  }
  if (list == nullptr) {
    fail(FSDP_ERR_INVALID_ARGUMENT,
         "srun set SLURM_PROCID but no node list (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST): set MASTER_ADDR");
  }
  *host = expand_slurm_hostlist(list, which).front();
  if (const char* addr = env("MASTER_ADDR")) *host = addr;
  *port = env_count("MASTER_PORT", 1);
  if (*port < 0) {
    const long job = env_count("SLURM_JOB_ID", 0), step = std::max(0, env_count("SLURM_STEP_ID", 0));
    *port = static_cast<int>(20000 + (std::max(0L, job) * 16 + step) % 40000);
  }
  return true;
}

}  // namespace fsdp::comm
