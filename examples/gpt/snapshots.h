// examples/gpt/snapshots.h - what train_gpt needs for checkpoints that do not
// stall the step (--snapshot-every, --save-every): how long each call held
// the step, how old the process is when it resumes, and a memcpy of the same
// bytes to compare the stall with.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

namespace gpt {

// Seconds since this process started (the kernel's start time, so the
// loader, static initialisation and the corpus count too).
inline double process_age_seconds() {
  std::ifstream stat("/proc/self/stat"), up("/proc/uptime");
  std::string text;
  std::getline(stat, text);
  double uptime = 0;
  up >> uptime;
  // Field 22 (starttime, clock ticks since boot) counts from after the
  // command name's closing parenthesis (field 2 may hold spaces).
  std::istringstream rest(text.substr(text.rfind(')') + 2));
  std::string field;
  for (int i = 3; i <= 22 && rest >> field; ++i) {
  }
  return uptime - std::stod(field) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// The calls of one kind (fsdp_snapshot, fsdp_save_async): how long each
// held the training loop: the first call apart (it sets up what the later
// ones reuse), then the median and the most of the others (on a loaded
// machine one call in several takes a scheduling delay).
struct Stalls {
  int calls = 0;
  double first_s = 0;
  std::vector<double> rest_s;
  template <typename F>
  void time(F&& call) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (calls++ == 0) {
      first_s = s;
    } else {
      rest_s.push_back(s);
    }
  }
  double median_s() const {
    std::vector<double> v = rest_s;
    std::sort(v.begin(), v.end());
    return v.empty() ? 0 : (v[(v.size() - 1) / 2] + v[v.size() / 2]) / 2;
  }
  double max_s() const { return rest_s.empty() ? 0 : *std::max_element(rest_s.begin(), rest_s.end()); }
};

// The bytes of the shard files under `dir` (a snapshot's rank directory).
inline double shard_bytes(const std::string& dir) {
  double n = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("shard-", 0) == 0) n = std::max(n, static_cast<double>(e.file_size()));
  }
  return n;
}

// The best of 3 memcpys of `bytes` into memory already touched.
inline double memcpy_seconds(size_t bytes) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  double best = 1e30;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(dst.data(), src.data(), bytes);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace gpt
