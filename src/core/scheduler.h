// src/core/scheduler.h - Scheduler: learns the execution order of units in the
// first iteration and uses it to prefetch: the next unit's all-gather is issued
// on the comm stream while the host computes the current one (forward_prefetch,
// backward_prefetch=pre|post), never more than limit_all_gathers units gathered
// at once. An iteration that departs from the recorded order is detected (one
// warning), and prefetch stays off for the rest of that iteration.
#pragma once

#include <memory>
#include <vector>

#include "runtime.h"

namespace fsdp::core {

class Unit;

class Scheduler {
 public:
  Scheduler(Runtime& rt, const std::vector<std::unique_ptr<Unit>>& units) : rt_(rt), units_(units) {}

  // Hooks called by Unit, after the unit's own gather has been issued.
  void before_forward(const Unit& u);
  void before_backward(const Unit& u);
  void after_backward(const Unit& u);
  // A unit's gathered params were freed: a deferred prefetch may go now.
  void on_freed();
  // End of an iteration (fsdp_step).
  void on_step();
  // A unit started (true) or stopped (false) holding gathered params.
  void count_gathered(bool more) {
    if (more) {
      ++gathered_;
    } else {
      --gathered_;
    }
  }
  // Units that hold (or are gathering) full params of their own.
  size_t gathered_units() const { return gathered_; }

 private:
  void note(std::vector<size_t>& order, std::vector<size_t>& seen, size_t index, const char* phase);
  bool can_prefetch() const { return recorded_ && !diverged_; }
  void prefetch(const std::vector<size_t>& order, size_t pos);
  void issue_or_defer(size_t index);

  Runtime& rt_;
  const std::vector<std::unique_ptr<Unit>>& units_;
  std::vector<size_t> fwd_order_, bwd_order_;  // recorded in the first iteration
  std::vector<size_t> fwd_seen_, bwd_seen_;    // this iteration so far
  bool recorded_ = false;
  bool diverged_ = false;
  bool warned_ = false;
  long deferred_ = -1;  // unit index whose prefetch waits for the limit
  size_t gathered_ = 0;
};

}  // namespace fsdp::core
