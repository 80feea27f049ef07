// src/base/spin.h - spin_until(): the bounded spin that waits do before they
// block or sleep; deadline_after(): when a wait of timeout_s seconds ends. A wait that ends within a few microseconds
// then costs no sleep and wake-up; a longer one costs at most `limit` of CPU, so that ranks sharing cores do not take
// cycles from each other's compute.
#pragma once

#include <chrono>
#include <thread>

namespace fsdp::base {

// Calls pred() until it is true (returns true) or `limit` has passed (returns
// false). Yields between calls: on a core shared with the thread it waits for,
// that thread runs.
template <typename Pred>
bool spin_until(Pred&& pred, std::chrono::nanoseconds limit) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    if (pred()) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::yield();
  }
}

// The steady-clock time `seconds` from now (timeout_s as a deadline).
inline std::chrono::steady_clock::time_point deadline_after(double seconds) {
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
}

}  // namespace fsdp::base
