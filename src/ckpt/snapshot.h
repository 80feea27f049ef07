// src/ckpt/snapshot.h - the files of an in-memory snapshot (fsdp_snapshot /
// fsdp_restore): under the snapshot path, each rank keeps a directory
// "rank<R>" with two slots ("slot0", "slot1"), each a sharded checkpoint of
// that rank's own shard, and a marker file naming the slots that hold a
// whole snapshot and of which step. A snapshot is written into the slot the
// marker does not name as current; the marker is replaced (write, rename)
// only after the slot is whole, so a process that dies mid-copy leaves the
// previous snapshot as it was. No core types here: the core decides what to
// write and which step to restore.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::ckpt {

struct SnapshotSlot {
  int slot = 0;      // 0 or 1
  int64_t step = 0;  // the optimizer step the slot's checkpoint holds
  // The training run that wrote it (random, the same on every rank, kept by
  // a run restored from it): a step restores only from slots of one run,
  // never step 7 of one run on some ranks and of another on the others.
  std::string run;
};

struct SnapshotMarker {
  int rank = 0;
  int world = 0;
  std::vector<SnapshotSlot> slots;  // whole slots, the newest first (at most 2)
};

std::string snapshot_rank_dir(const std::string& path, int rank);
std::string snapshot_slot_dir(const std::string& path, int rank, int slot);

// The rank's marker; false with `why` set when it has none or it is not a
// marker of this format (a damaged marker is reported, not thrown).
bool read_snapshot_marker(const std::string& path, int rank, SnapshotMarker* out, std::string* why);
// Replaces the rank's marker (written beside it, fsync'ed, renamed over it).
void write_snapshot_marker(const std::string& path, const SnapshotMarker& m);

}  // namespace fsdp::ckpt
