// src/core/checkpoint_async.cpp - checkpoints that do not stall the step:
// fsdp_save_async (a copy of the state in host memory at the call, the
// sharded save written from it by a thread) and fsdp_snapshot /
// fsdp_restore (the state copied into a per-rank, double-buffered snapshot
// in memory, e.g. /dev/shm, that a restarted process of the same job
// restores from). Both write the sharded checkpoint format of checkpoint.cpp
// and load through Context::load, so their guarantees (checksums, all or
// nothing) are that format's.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <random>
#include <set>
#include <sstream>
#include <utility>

#include "../base/log.h"
#include "../base/text.h"
#include "../ckpt/io.h"
#include "../ckpt/reader.h"
#include "../ckpt/snapshot.h"
#include "async_save.h"
#include "ckpt_stage.h"
#include "consensus.h"
#include "context.h"
#include "trace.h"

namespace fsdp::core {

void Context::settle_async(const char* call) {
  if (!async_) return;
  Outcome o = async_->take_outcome();
  if (!o.ok()) fail(o.status, std::string(call) + ": the earlier " + async_->what + " failed: " + o.message);
}

void Context::save_wait() {
  if (!async_) return;
  Outcome o = async_->take_outcome();
  if (!o.ok()) fail(o.status, o.message);
}

void Context::save_async(const std::string& dir) {
  const char* call = "fsdp_save_async";
  check_no_unit_in_use(call);
  if (dir.empty()) fail(FSDP_ERR_INVALID_ARGUMENT, "fsdp_save_async: dir is empty");
  settle_async(call);  // a second async save waits for the first
  TraceScope scope(rt_.trace, "save_async");
  const std::string what = "fsdp_save_async to " + base::quote_path(dir);
  if (!async_) {  // the first call: a communicator for the background (collective)
    auto a = std::make_unique<AsyncSave>(rt_.state_dev->host_memory(), &rt_.mem, rt_.rank);
    a->comm = rt_.comm->split(0, rt_.rank, "fsdp_save_async");
    async_ = std::move(a);
  }
  // Every step queued before the call is in the copy, none after it. The
  // stall ends with the copy: agreeing on `dir`, readying the staging
  // directory, writing and committing all happen in the background, and
  // what fails there (a rank's other `dir` too) reaches every rank at the wait.
  settle_units();
  ckpt::Meta meta = checkpoint_meta("sharded");
  std::vector<StateSegment> copy;  // this rank's shard file's contents, one after another
  if (rt_.rank < rt_.shard_world()) {
    const std::vector<StateSegment> segs = shard_segments();
    size_t total = 0;
    for (const StateSegment& s : segs) total += s.nbytes;
    char* buf = async_->copy_buffer(total);
    // Host memory: one memcpy per segment on this thread (the pool's
    // dispatch per segment cost more than the copy at the demo's sizes).
    const bool host = rt_.state_dev->host_visible();
    for (const StateSegment& s : segs) {
      if (host) {
        std::memcpy(buf, s.data, s.nbytes);
      } else {
        rt_.state_dev->copy_to_host(buf, s.data, s.nbytes);
      }
      copy.push_back({buf, s.nbytes});
      buf += s.nbytes;
    }
  }
  async_->what = what;
  async_->start([this, call, dir, what, meta = std::move(meta), copy = std::move(copy)]() mutable {
    comm::Communicator& comm = *async_->comm;
    std::string staged;
    Outcome started = capture([&] {
      agree(comm, call, "dir=" + dir);
      staged = prepare_save(comm, dir, what, call);
    });
    if (!started.ok()) {
      async_->outcome = started;
      return;
    }
    std::vector<ckpt::FileRecord> mine;
    Outcome wrote = capture([&] {
      if (!copy.empty()) mine = {write_shard_file(staged, meta, copy, nullptr)};
    });
    // Named on its own rank too: the wait may be far from the call.
    if (!wrote.ok()) wrote.message = "rank " + std::to_string(rt_.rank) + ": " + wrote.message;
    async_->outcome = capture([&] { finish_save(comm, what, dir, std::move(meta), wrote, mine); });
  });
}

namespace {

// The steps this rank's snapshot holds whole, by slot ("" when none, with
// the reason in `why`).
std::vector<ckpt::SnapshotSlot> whole_slots(const std::string& path, int rank, int world, std::string* why) {
  ckpt::SnapshotMarker m;
  if (!ckpt::read_snapshot_marker(path, rank, &m, why)) return {};
  if (m.rank != rank || m.world != world) {
    *why = "the snapshot at " + base::quote_path(ckpt::snapshot_rank_dir(path, rank)) + " is rank " +
           std::to_string(m.rank) + " of " + std::to_string(m.world) + ", not rank " + std::to_string(rank) + " of " +
           std::to_string(world);
    return {};
  }
  std::vector<ckpt::SnapshotSlot> whole;
  for (const ckpt::SnapshotSlot& s : m.slots) {
    if (ckpt::path_exists(ckpt::join(ckpt::snapshot_slot_dir(path, rank, s.slot), ckpt::kMetaFile))) {
      whole.push_back(s);
    }
  }
  if (whole.empty()) *why = "the snapshot of rank " + std::to_string(rank) + " names no slot that is there";
  return whole;
}

}  // namespace

void Context::snapshot(const std::string& path) {
  const char* call = "fsdp_snapshot";
  check_no_unit_in_use(call);
  agree(*rt_.comm, call, "path=" + path);
  if (path.empty()) fail(FSDP_ERR_INVALID_ARGUMENT, "fsdp_snapshot: path is empty");
  TraceScope scope(rt_.trace, "snapshot");
  const std::string what = "fsdp_snapshot to " + base::quote_path(path);
  settle_units();
  if (snapshot_run_.empty()) {
    // This context's first snapshot, not restored from one: a new run, whose
    // id (rank 0's) every rank learns; slots of other runs are not kept.
    std::random_device rd;
    char id[17];
    std::snprintf(id, sizeof id, "%08x%08x", rd(), rd());
    snapshot_run_ = gather_strings(*rt_.comm, id, what + " (run id)")[0];
  }
  ckpt::Meta meta = checkpoint_meta("sharded");
  const int64_t step = meta.optimizer.step;
  // Each rank writes its own shard (replicas too: every rank restores
  // itself) into the slot its marker does not hold as the newest; the
  // marker stops naming that slot before it is rewritten.
  ckpt::SnapshotMarker marker{rt_.rank, rt_.world, {}};
  int slot = 0;
  std::string slot_dir;
  std::vector<ckpt::FileRecord> mine;
  Outcome wrote = capture([&] {
    ckpt::make_dirs(ckpt::snapshot_rank_dir(path, rt_.rank));
    std::string why;
    std::vector<ckpt::SnapshotSlot> had = whole_slots(path, rt_.rank, rt_.world, &why);
    std::vector<ckpt::SnapshotSlot> ours;
    for (const ckpt::SnapshotSlot& s : had) {
      if (s.run == snapshot_run_) ours.push_back(s);
    }
    if (!ours.empty()) slot = 1 - ours.front().slot;
    for (const ckpt::SnapshotSlot& s : ours) {
      if (s.slot != slot) marker.slots.push_back(s);
    }
    if (had.size() != marker.slots.size()) ckpt::write_snapshot_marker(path, marker);
    slot_dir = ckpt::snapshot_slot_dir(path, rt_.rank, slot);
    ckpt::remove_tree(slot_dir);
    ckpt::make_dirs(slot_dir);
    ckpt::FileRecord rec = write_shard_file(slot_dir, meta, shard_segments(), rt_.state_dev);
    if (rt_.rank < rt_.shard_world()) mine.push_back(std::move(rec));
  });
  check_outcomes(*rt_.comm, what, wrote.status, wrote.message);
  std::vector<std::string> recs = gather_strings(*rt_.comm, ckpt::files_to_json(mine), what + " (file records)");
  Outcome commit = capture([&] {
    add_file_records(recs, &meta);
    ckpt::write_meta(slot_dir, meta);
    marker.slots.insert(marker.slots.begin(), ckpt::SnapshotSlot{slot, step, snapshot_run_});
    ckpt::write_snapshot_marker(path, marker);
  });
  check_outcomes(*rt_.comm, what + " (commit)", commit.status, commit.message);
}

int Context::restore(const std::string& path, const std::string& checkpoint_dir) {
  const char* call = "fsdp_restore";
  check_no_unit_in_use(call);
  settle_async(call);
  agree(*rt_.comm, call, "path=" + path + "\ncheckpoint_dir=" + checkpoint_dir);
  TraceScope scope(rt_.trace, "restore");
  const bool root = rt_.rank == 0;
  // The newest step that every rank's snapshot holds whole, of one run.
  std::string why;
  std::vector<ckpt::SnapshotSlot> mine;
  if (!path.empty()) mine = whole_slots(path, rt_.rank, rt_.world, &why);
  std::string text;
  for (const ckpt::SnapshotSlot& s : mine) text += s.run + ":" + std::to_string(s.step) + " ";
  if (mine.empty()) text = "-" + (path.empty() ? std::string("no snapshot path given") : why);
  std::vector<std::string> all = gather_strings(*rt_.comm, text, "fsdp_restore (snapshot steps)");
  using Key = std::pair<int64_t, std::string>;  // (step, run): the newest step last
  std::set<Key> common;
  std::string reason;
  for (size_t r = 0; r < all.size(); ++r) {
    std::set<Key> keys;
    if (all[r][0] == '-') {
      if (reason.empty()) reason = all[r].substr(1);
    } else {
      std::istringstream in(all[r]);
      for (std::string w; in >> w;) {
        const size_t colon = w.find(':');
        keys.insert({std::stoll(w.substr(colon + 1)), w.substr(0, colon)});
      }
    }
    if (r == 0) {
      common = keys;
    } else {
      std::set<Key> both;
      std::set_intersection(common.begin(), common.end(), keys.begin(), keys.end(), std::inserter(both, both.begin()));
      common = std::move(both);
    }
  }
  if (!common.empty()) {
    const auto [step, run] = *common.rbegin();
    int slot = 0;
    for (const ckpt::SnapshotSlot& s : mine) {
      if (s.step == step && s.run == run) slot = s.slot;
    }
    const std::string dir = ckpt::snapshot_slot_dir(path, rt_.rank, slot);
    Outcome loaded = capture([&] {
      load(dir, /*strict=*/true,
           "fsdp_restore of step " + std::to_string(step) + " from the snapshot at " + base::quote_path(path));
    });
    if (loaded.ok()) {
      snapshot_run_ = run;  // this context's snapshots continue that run
      if (root) {
        base::log(
            FSDP_LOG_INFO, rt_.rank,
            "fsdp_restore: restored step " + std::to_string(step) + " from the snapshot at " + base::quote_path(path));
      }
      return FSDP_RESTORED_SNAPSHOT;
    }
    // Every rank got the same outcome (the load is all or nothing).
    reason = "the snapshot of step " + std::to_string(step) + " did not load: " + loaded.message;
  } else if (reason.empty()) {
    reason = "the ranks' snapshots hold no step of one run in common";
  }
  // The disk checkpoint, as rank 0 sees it.
  const bool have = !checkpoint_dir.empty() && ckpt::path_exists(ckpt::join(checkpoint_dir, ckpt::kMetaFile));
  std::vector<std::string> seen = gather_strings(*rt_.comm, have ? "1" : "0", "fsdp_restore (checkpoint)");
  if (seen[0] != "1") {
    if (root) {
      base::log(FSDP_LOG_WARN, rt_.rank,
                "fsdp_restore: nothing restored (" + reason + "; no checkpoint at " +
                    (checkpoint_dir.empty() ? std::string("(none given)") : base::quote_path(checkpoint_dir)) + ")");
    }
    return FSDP_RESTORED_NOTHING;
  }
  load(checkpoint_dir);
  if (root) {
    base::log(path.empty() ? FSDP_LOG_INFO : FSDP_LOG_WARN, rt_.rank,
              "fsdp_restore: restored step " + std::to_string(optimizer_.step_count()) + " from the checkpoint at " +
                  base::quote_path(checkpoint_dir) + ", not from a snapshot: " + reason);
  }
  return FSDP_RESTORED_CHECKPOINT;
}

}  // namespace fsdp::core
