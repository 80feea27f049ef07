// src/base/layout.h - FlatLayout: where each param of a unit lies in the unit's
// flat buffer, and which contiguous range each rank owns. Pure arithmetic: it
// drives allocation, the collectives, per-param optimizer options inside flat
// shards, and checkpoint resharding (src/ckpt/reader.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  size_t numel = 0;
};

// The part of one param that falls inside one rank's shard.
struct ShardSegment {
  size_t param_index;
  size_t shard_begin;  // element offset inside the shard
  size_t numel;
};

class FlatLayout {
 public:
  // align_elems: every param starts at a multiple of it; the total is padded to a
  // multiple of shard_world * align_elems so every shard is aligned too.
  FlatLayout(std::vector<ParamSpec> params, size_t align_elems, int shard_world);

  size_t n_params() const { return params_.size(); }
  const ParamSpec& param(size_t i) const { return params_[i]; }
  size_t param_offset(size_t i) const { return offsets_[i]; }
  size_t padded_numel() const { return padded_numel_; }
  size_t shard_numel() const { return padded_numel_ / static_cast<size_t>(shard_world_); }
  size_t shard_offset(int shard_rank) const { return static_cast<size_t>(shard_rank) * shard_numel(); }
  int shard_world() const { return shard_world_; }
  // Params (pieces of them) inside shard `shard_rank`, in flat order; padding is
  // not covered by any segment.
  std::vector<ShardSegment> shard_segments(int shard_rank) const;

 private:
  std::vector<ParamSpec> params_;
  std::vector<size_t> offsets_;
  size_t padded_numel_ = 0;
  int shard_world_ = 1;
};

}  // namespace fsdp
