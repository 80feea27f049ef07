// src/core/trace.h - Trace: a timeline of one rank, written as Chrome trace
// JSON (Perfetto, chrome://tracing). Track 0 is the caller's calls, track 1
// the comm stream (reductions, the step, synchronous collectives), track 2
// the copy streams of offload=cpu, track 3 the gather stream; memory
// counters ride along. Off until fsdp_trace_begin.
#pragma once

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <vector>

namespace fsdp::core {

enum class Track { kCaller = 0, kComm = 1, kCopy = 2, kGather = 3 };

class Trace {
 public:
  struct Record {
    std::string name;
    char phase;  // 'B' begin, 'E' end, 'i' instant, 'C' counter
    Track track;
    double ts_us;
    std::string args;  // a JSON object body, may be empty
    unsigned long seq;
  };

  void begin();  // clears and starts recording
  // One atomic load: every call checks it, on the caller and the comm stream.
  bool enabled() const { return enabled_.load(std::memory_order_acquire); }
  void add(const std::string& name, char phase, Track track, std::string args = "");
  // Writes {"traceEvents": [...]} with pid = rank; throws Error(IO).
  void write(const std::string& path, int rank) const;
  std::vector<Record> records() const;

 private:
  mutable std::mutex mu_;
  std::atomic<bool> enabled_{false};
  std::chrono::steady_clock::time_point t0_;
  std::vector<Record> records_;
  unsigned long seq_ = 0;
};

// Records a begin/end pair on the caller's track around a scope, named
// prefix + suffix. The name is built only while a trace is being recorded, so
// the per-call cost without a trace is one check.
class TraceScope {
 public:
  TraceScope(Trace& trace, const char* prefix, const std::string& suffix = std::string()) : trace_(trace) {
    if (!trace_.enabled()) return;
    name_ = prefix + suffix;
    trace_.add(name_, 'B', Track::kCaller);
  }
  ~TraceScope() {
    if (!name_.empty()) trace_.add(name_, 'E', Track::kCaller);
  }
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  Trace& trace_;
  std::string name_;  // empty: not recording
};

}  // namespace fsdp::core
