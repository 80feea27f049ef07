// src/core/scheduler.cpp - see scheduler.h.
#include "scheduler.h"

#include "../base/log.h"
#include "../base/text.h"
#include "unit.h"

namespace fsdp::core {

void Scheduler::note(std::vector<size_t>& order, std::vector<size_t>& seen, size_t index, const char* phase) {
  seen.push_back(index);
  bool prefetching = rt_.opts.forward_prefetch || rt_.opts.backward_prefetch != BackwardPrefetch::kNone;
  if (!recorded_ || diverged_ || !prefetching) return;
  size_t pos = seen.size() - 1;
  if (pos < order.size() && order[pos] == index) return;
  diverged_ = true;
  std::string msg =
      std::string("execution order changed: ") + phase + " call #" + std::to_string(pos + 1) +
      " of this iteration is unit " + base::quote(units_[index]->name()) + ", but the first iteration had " +
      (pos < order.size() ? "unit " + base::quote(units_[order[pos]]->name()) : std::string("no more units")) +
      "; prefetching is off for the rest of this iteration (results are unaffected)";
  base::log(warned_ ? FSDP_LOG_DEBUG : FSDP_LOG_WARN, rt_.rank, msg);
  warned_ = true;
}

void Scheduler::issue_or_defer(size_t index) {
  Unit& u = *units_[index];
  if (!u.can_gather()) return;
  if (gathered_units() >= static_cast<size_t>(rt_.opts.limit_all_gathers)) {
    deferred_ = static_cast<long>(index);
    return;
  }
  u.issue_gather(/*prefetch=*/true);
}

void Scheduler::prefetch(const std::vector<size_t>& order, size_t pos) {
  if (!can_prefetch() || pos >= order.size()) return;
  issue_or_defer(order[pos]);
}

void Scheduler::before_forward(const Unit& u) {
  note(fwd_order_, fwd_seen_, u.index(), "forward");
  if (rt_.opts.forward_prefetch) prefetch(fwd_order_, fwd_seen_.size());
}

void Scheduler::before_backward(const Unit& u) {
  note(bwd_order_, bwd_seen_, u.index(), "backward");
  if (rt_.opts.backward_prefetch == BackwardPrefetch::kPre) prefetch(bwd_order_, bwd_seen_.size());
}

void Scheduler::after_backward(const Unit&) {
  if (rt_.opts.backward_prefetch == BackwardPrefetch::kPost) prefetch(bwd_order_, bwd_seen_.size());
}

void Scheduler::on_freed() {
  if (deferred_ < 0) return;
  size_t index = static_cast<size_t>(deferred_);
  if (gathered_units() >= static_cast<size_t>(rt_.opts.limit_all_gathers)) return;
  deferred_ = -1;
  if (can_prefetch()) issue_or_defer(index);
}

void Scheduler::on_step() {
  if (!recorded_ && (!fwd_seen_.empty() || !bwd_seen_.empty())) {
    fwd_order_ = fwd_seen_;
    bwd_order_ = bwd_seen_;
    recorded_ = true;
  }
  fwd_seen_.clear();
  bwd_seen_.clear();
  diverged_ = false;
  deferred_ = -1;
}

}  // namespace fsdp::core
