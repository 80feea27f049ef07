// benchmarks/bench_util.h - timing and JSON output shared by the benchmark
// drivers. Each figure is reported beside a physical limit measured in the
// same run, never against a constant.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace fsdp::bench {

// Best of `reps` timings of fn() in seconds, after one warm-up call. The best
// (not the mean) estimates the machine's capability, robust to other load.
inline double best_seconds(int reps, const std::function<void()>& fn) {
  fn();
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  return best;
}

// Minimal JSON object writer: one flat object per result line.
class JsonLine {
 public:
  JsonLine& add(const std::string& k, const std::string& v) {
    items_.push_back("\"" + k + "\": \"" + v + "\"");
    return *this;
  }
  JsonLine& add(const std::string& k, double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.6g", v);
    items_.push_back("\"" + k + "\": " + buf);
    return *this;
  }
  JsonLine& add_bool(const std::string& k, bool v) {  // not add(): a string literal would pick a bool overload
    items_.push_back("\"" + k + "\": " + (v ? "true" : "false"));
    return *this;
  }
  std::string str() const {
    std::string s = "{";
    for (size_t i = 0; i < items_.size(); ++i) s += (i ? ", " : "") + items_[i];
    return s + "}";
  }

 private:
  std::vector<std::string> items_;
};

}  // namespace fsdp::bench
