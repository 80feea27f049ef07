// src/base/log.cpp - see log.h.
#include "log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace fsdp::base {
namespace {

struct LogState {
  std::mutex mu;
  fsdp_log_level_t level = FSDP_LOG_WARN;
  fsdp_log_fn fn = nullptr;
  void* user = nullptr;
  LogState() {
    // Read once, at first use; NOLINT: no other thread sets the environment here.
    if (const char* v = std::getenv("FSDP_LOG_LEVEL")) {  // NOLINT(concurrency-mt-unsafe)
      if (!std::strcmp(v, "error")) level = FSDP_LOG_ERROR;
      if (!std::strcmp(v, "warn")) level = FSDP_LOG_WARN;
      if (!std::strcmp(v, "info")) level = FSDP_LOG_INFO;
      if (!std::strcmp(v, "debug")) level = FSDP_LOG_DEBUG;
    }
  }
};

LogState& state() {
  static LogState s;
  return s;
}

const char* level_name(fsdp_log_level_t l) {
  switch (l) {
    case FSDP_LOG_ERROR:
      return "error";
    case FSDP_LOG_WARN:
      return "warn";
    case FSDP_LOG_INFO:
      return "info";
    case FSDP_LOG_DEBUG:
      return "debug";
  }
  return "?";
}

}  // namespace

void log(fsdp_log_level_t level, int rank, const std::string& message) {
  LogState& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (level > s.level) return;
  if (s.fn != nullptr) {
    s.fn(level, rank, message.c_str(), s.user);
    return;
  }
  if (rank >= 0) {
    std::fprintf(stderr, "[fsdp rank %d %s] %s\n", rank, level_name(level), message.c_str());
  } else {
    std::fprintf(stderr, "[fsdp %s] %s\n", level_name(level), message.c_str());
  }
}

void set_log_level(fsdp_log_level_t level) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().level = level;
}

void set_log_callback(fsdp_log_fn fn, void* user) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().fn = fn;
  state().user = user;
}

}  // namespace fsdp::base
