// benchmarks/bench_step_cli.h - bench_step's options and its clocks and
// statistics (what one step's time went to, per rank and summarised).
// Private to bench_step.cpp.
#pragma once

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
#include "bench_util.h"
#include "fsdp.h"

namespace bench_step {

// ---- options ----------------------------------------------------------------

struct Options {
  int width = 1024, layers = 8, batch = 64, steps = 20, warmup = 3, threads = 0;
  std::vector<int> ranks = {1, 2, 4};
  std::string sharding = "FULL_SHARD";
  bool json = false;
};

constexpr float kLr = 1e-3f, kBeta1 = 0.9f, kBeta2 = 0.999f, kEps = 1e-8f, kWeightDecay = 0.01f;
constexpr double kTolerance = 1e-4;

[[noreturn]] void usage(const char* prog) {
  std::fprintf(stderr,
               "usage: %s [--width N] [--layers N] [--batch N] [--steps N] [--warmup N] [--ranks 1,2,4]\n"
               "          [--threads N] [--sharding full_shard|no_shard|shard_grad_op|hybrid_shard] [--json]\n",
               prog);
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  auto positive = [&](const char* v) {
    char* end = nullptr;
    long n = std::strtol(v, &end, 10);
    if (*end != '\0' || n < 1 || n > (1 << 20)) usage(argv[0]);
    return static_cast<int>(n);
  };
  for (int a = 1; a < argc; ++a) {
    std::string k = argv[a];
    if (k == "--json") {
      o.json = true;
      continue;
    }
    if (a + 1 >= argc) usage(argv[0]);
    const char* v = argv[++a];
    if (k == "--width") {
      o.width = positive(v);
    } else if (k == "--layers") {
      o.layers = positive(v);
    } else if (k == "--batch") {
      o.batch = positive(v);
    } else if (k == "--steps") {
      o.steps = positive(v);
    } else if (k == "--warmup") {
      o.warmup = std::string(v) == "0" ? 0 : positive(v);
    } else if (k == "--threads") {
      o.threads = positive(v);
    } else if (k == "--sharding") {
      o.sharding = v;
      for (char& c : o.sharding) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    } else if (k == "--ranks") {
      o.ranks.clear();
      for (const char* p = v; *p;) {
        char* end = nullptr;
        long n = std::strtol(p, &end, 10);
        if (end == p || n < 1 || n > 64) usage(argv[0]);
        o.ranks.push_back(static_cast<int>(n));
        p = *end == ',' ? end + 1 : end;
        if (*end != ',' && *end != '\0') usage(argv[0]);
      }
    } else {
      usage(argv[0]);
    }
  }
  return o;
}

// ---- clocks and statistics --------------------------------------------------

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n == 0 ? 0.0 : (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

int cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  return sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
}

// What one step's time went to, in ms. The per-rank figure of each is its
// median over the timed steps.
enum Field {
  kForwardBegin,
  kForwardEnd,
  kBackwardBegin,
  kBackwardEnd,
  kStepCall,
  kZeroGrad,
  kCompute,
  kOther,
  kStep,
  kNumFields
};
const char* const kFieldNames[kNumFields] = {"forward_begin_ms", "forward_end_ms", "backward_begin_ms",
                                             "backward_end_ms",  "step_call_ms",   "zero_grad_ms",
                                             "compute_ms",       "other_ms",       "step_ms"};
using Times = std::array<double, kNumFields>;

// One rank's summary: the medians, then process CPU and wall ms per timed
// step, then the loss after training.
enum { kCpuMs = kNumFields, kWallMs, kLoss, kSummarySize };
using Summary = std::array<double, kSummarySize>;

Summary summarize(const std::vector<Times>& steps, double cpu_total, double wall_total, double loss) {
  Summary s{};
  for (int f = 0; f < kNumFields; ++f) {
    std::vector<double> v;
    for (const Times& t : steps) v.push_back(t[f]);
    s[f] = median(v);
  }
  s[kCpuMs] = cpu_total / static_cast<double>(steps.size());
  s[kWallMs] = wall_total / static_cast<double>(steps.size());
  s[kLoss] = loss;
  return s;
}

}  // namespace bench_step
