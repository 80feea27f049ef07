// src/ckpt/reader.h - CheckpointReader: a checkpoint directory opened for
// reading, sharded or full, behind one question: "what are elements [a, b) of
// this param (or of its optimizer state)?". Resharding is answered by it: a
// rank fills its new shard by asking for the param ranges the shard covers,
// and only the byte ranges of the source files that hold them are read.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "../base/layout.h"
#include "meta.h"

namespace fsdp::ckpt {

// A param of the checkpoint: unit `unit`'s param `param` in its metadata.
struct ParamRef {
  // A param the checkpoint does not have (a non-strict load): read_shard
  // leaves its range of `out` as the caller filled it.
  static constexpr size_t kNone = static_cast<size_t>(-1);
  size_t unit = 0;
  size_t param = 0;
  bool none() const { return unit == kNone; }
};

class CheckpointReader {
 public:
  // Reads and checks the metadata. FSDP_ERR_CORRUPT if it is missing or bad.
  explicit CheckpointReader(std::string dir);
  const Meta& meta() const { return meta_; }
  const std::string& dir() const { return dir_; }

  // Elements [a, b) of param `p` of unit `u`: `kind` is "param" or one of the
  // optimizer's state names. Verifies the checksums of every chunk it reads.
  void read_param(size_t u, size_t p, const std::string& kind, uint64_t a, uint64_t b, float* out);
  // Shard `shard` of unit `u` as `layout` lays it out (which may differ from
  // the checkpoint's: another world size, alignment or choice of frozen
  // params); padding is zero. `out` holds layout.shard_numel() elements for
  // "param", layout.trainable_shard_numel() for a state (the trainable
  // block's slice; a param frozen in the checkpoint reads as zero state).
  // `layout` must have the unit's params (checked by the caller).
  void read_shard(size_t u, const std::string& kind, const FlatLayout& layout, int shard, float* out);
  // The same for a layout whose param i is the checkpoint's `sources[i]`,
  // from any unit: a checkpoint loaded into another grouping of its params.
  void read_shard(const std::vector<ParamRef>& sources, const std::string& kind, const FlatLayout& layout, int shard,
                  float* out);
  // Every file read whole, every checksum checked; the damage found, one
  // line each ("" if none). Throws what is not damage (FSDP_ERR_IO).
  std::string verify_all();

 private:
  const Reader& file(const std::string& name);

  static constexpr size_t kMaxOpenFiles = 32;
  std::string dir_;
  Meta meta_;
  std::map<std::string, std::unique_ptr<Reader>> open_;
};

// Writes `m` as the directory's metadata file and its CRC-32 file, fsync'ed.
void write_meta(const std::string& dir, const Meta& m);

}  // namespace fsdp::ckpt
