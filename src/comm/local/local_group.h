// src/comm/local/local_group.h - LocalGroup: the shared state of N ranks that
// live as threads of one process: a slot per rank through which buffers (and,
// for device memory, stream marks) are published, and a phase barrier with a
// timeout that names the missing rank.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../../base/function_ref.h"
#include "fsdp.h"

namespace fsdp::comm {

// What a rank is doing in its current collective; every rank must agree.
struct CollectiveDesc {
  const char* kind = "";
  size_t size = 0;  // elements or bytes, as the kind defines
  int dtype = -1;
  int op = -1;
  int root = -1;
  // The caller's label, read by this rank only (its call holds it).
  const std::string* label = nullptr;
  bool device = false;  // moves memory of the communicator's DataPlane (set by the rank's run)
  // What the other ranks read of the label (a rank may return, and its label
  // go, while a peer still builds a mismatch's message): its hash and length
  // to compare, and its start (truncated) for messages. Copied into the slot
  // without an allocation.
  uint64_t label_hash = 0;
  size_t label_size = 0;
  char label_text[96] = {};
  void copy_label();
};

struct Slot {
  CollectiveDesc desc;
  uint64_t seq = 0;  // this rank's collective sequence number
  const void* send = nullptr;
  void* recv = nullptr;
  // Collectives over DataPlane memory: the point in this rank's stream that
  // each phase of the collective starts after (its buffers are written, or
  // its reads of the peers' buffers are queued). Two, by the parity of the
  // rank's phase count: a rank is at most one phase ahead of any other, so a
  // peer still reading the previous phase's mark never sees it overwritten.
  std::shared_ptr<void> marks[2];
};

class LocalGroup {
 public:
  explicit LocalGroup(int world_size);
  // A group of the ranks `world_ranks` of a parent (names used in messages).
  explicit LocalGroup(std::vector<int> world_ranks);
  int world_size() const { return world_size_; }
  // The rank of the outermost group that group rank `rank` is, for messages.
  int world_rank(int rank) const { return world_ranks_[static_cast<size_t>(rank)]; }

  // The sub-group made by split number `split_id` for `color`: the first rank
  // to ask creates it with `members` (world ranks, in group order), the others
  // get the same object.
  std::shared_ptr<LocalGroup> child(uint64_t split_id, int color, const std::vector<int>& members);

  // A rank is taken by at most one live context at a time.
  void claim(int rank);
  void release(int rank) noexcept;

  Slot& slot(int rank) { return slots_[static_cast<size_t>(rank)]; }
  const Slot& slot(int rank) const { return slots_[static_cast<size_t>(rank)]; }

  // Marks `rank` as having reached its next phase and waits until every rank
  // has. Throws Error(TIMEOUT) naming the ranks that did not arrive, or the
  // status the group was aborted with. Publishing a slot before this call makes
  // it visible to every rank after it.
  void arrive_and_wait(int rank, double timeout_s, base::FunctionRef<std::string()> what);
  // Fails every current and future collective of the group; with
  // `with_children`, also of every sub-group split from it, including those
  // split after this call.
  void abort(fsdp_status_t status, const std::string& reason, bool with_children = false);
  bool aborted() const { return aborted_flag_.load(std::memory_order_acquire); }

 private:
  int world_size_;
  std::vector<int> world_ranks_;
  // By (split number, color, members): a later context on this group (its
  // split numbers start again) gets its own sub-group wherever its split
  // differs from an earlier context's of the same number (hit by a
  // secondary_shard split where the earlier context split off its gathers).
  std::map<std::tuple<uint64_t, int, std::vector<int>>, std::shared_ptr<LocalGroup>> children_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint64_t> phase_;  // phases each rank has reached
  std::vector<Slot> slots_;
  std::vector<bool> claimed_;
  bool aborted_ = false;
  std::atomic<bool> aborted_flag_{false};  // aborted_, readable without the lock
  bool abort_children_ = false;
  fsdp_status_t abort_status_ = FSDP_OK;
  std::string abort_reason_;
};

}  // namespace fsdp::comm
