// src/comm/local/local_group.cpp - see local_group.h.
#include "local_group.h"

#include <chrono>
#include <string>

#include "../../base/error.h"
#include "../../base/text.h"

namespace fsdp::comm {

LocalGroup::LocalGroup(int world_size) : LocalGroup(std::vector<int>(static_cast<size_t>(world_size))) {
  for (int r = 0; r < world_size; ++r) world_ranks_[static_cast<size_t>(r)] = r;
}

LocalGroup::LocalGroup(std::vector<int> world_ranks)
    : world_size_(static_cast<int>(world_ranks.size())),
      world_ranks_(std::move(world_ranks)),
      phase_(world_ranks_.size(), 0),
      slots_(world_ranks_.size()),
      claimed_(world_ranks_.size(), false) {}

std::shared_ptr<LocalGroup> LocalGroup::child(uint64_t split_id, int color, const std::vector<int>& members) {
  std::shared_ptr<LocalGroup> g;
  fsdp_status_t status = FSDP_OK;
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& slot = children_[{split_id, color, members}];
    if (!slot) slot = std::make_shared<LocalGroup>(members);
    g = slot;
    if (abort_children_) {
      status = abort_status_;
      reason = abort_reason_;
    }
  }
  if (status != FSDP_OK) g->abort(status, reason, true);
  return g;
}

void LocalGroup::claim(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  if (claimed_[static_cast<size_t>(rank)]) {
    fail(FSDP_ERR_INVALID_ARGUMENT, "rank " + std::to_string(world_rank(rank)) +
                                        " of this local group already has a live context; each "
                                        "rank creates exactly one");
  }
  if (aborted_) {
    fail(FSDP_ERR_COMM, "this local group was aborted and cannot take new contexts: " + abort_reason_);
  }
  claimed_[static_cast<size_t>(rank)] = true;
}

void LocalGroup::release(int rank) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  claimed_[static_cast<size_t>(rank)] = false;
}

void LocalGroup::abort(fsdp_status_t status, const std::string& reason, bool with_children) {
  std::vector<std::shared_ptr<LocalGroup>> children;
  fsdp_status_t first_status;
  std::string first_reason;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_) {
      aborted_ = true;
      aborted_flag_.store(true, std::memory_order_release);
      abort_status_ = status;
      abort_reason_ = reason;
    }
    if (with_children && !abort_children_) {
      abort_children_ = true;
      for (auto& kv : children_) children.push_back(kv.second);
    }
    first_status = abort_status_;
    first_reason = abort_reason_;
  }
  cv_.notify_all();
  // Children share this group's first reason, as those split later do (child()).
  for (auto& c : children) c->abort(first_status, first_reason, true);
}

void LocalGroup::arrive_and_wait(int rank, double timeout_s, base::FunctionRef<std::string()> what) {
  std::unique_lock<std::mutex> lock(mu_);
  if (aborted_) {
    std::string reason = abort_reason_;
    lock.unlock();
    fail(FSDP_ERR_COMM,
         what() + " on rank " + std::to_string(world_rank(rank)) + ": the communicator was aborted earlier: " + reason);
  }
  uint64_t target = ++phase_[static_cast<size_t>(rank)];
  auto all_here = [&] {
    for (uint64_t p : phase_) {
      if (p < target) return false;
    }
    return true;
  };
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                         std::chrono::duration<double>(timeout_s));
  while (!aborted_ && !all_here()) {
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && !aborted_ && !all_here()) {
      std::string missing;
      int n_missing = 0;
      for (int r = 0; r < world_size_; ++r) {
        if (phase_[static_cast<size_t>(r)] < target) {
          missing += (n_missing++ ? ", " : "") + std::to_string(world_rank(r));
        }
      }
      std::string msg = what() + ": timed out after " + base::format_double(timeout_s) + " s waiting for rank" +
                        (n_missing > 1 ? "s " : " ") + missing + " (seen from rank " +
                        std::to_string(world_rank(rank)) +
                        "; the missing rank may have failed, hung, or called a different collective)";
      aborted_ = true;
      aborted_flag_.store(true, std::memory_order_release);
      abort_status_ = FSDP_ERR_TIMEOUT;
      abort_reason_ = msg;
      lock.unlock();
      cv_.notify_all();
      fail(FSDP_ERR_TIMEOUT, msg);
    }
  }
  if (aborted_) {
    // Ranks that were waiting in the phase that failed share its status.
    fsdp_status_t st = abort_status_;
    std::string reason = abort_reason_;
    lock.unlock();
    fail(st, reason);
  }
  lock.unlock();
  cv_.notify_all();
}

}  // namespace fsdp::comm
