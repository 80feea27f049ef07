// src/base/layout.h - FlatLayout: where each param of a unit lies in the unit's
// flat buffer, and which elements each rank owns. Pure arithmetic: it drives
// allocation, the collectives, per-param optimizer options inside flat
// shards, and checkpoint resharding (src/ckpt/reader.h).
//
// The flat buffer is one block, or two when some params are frozen (not
// trainable, fsdp_param_set_trainable): the trainable params first, each
// block padded to shard_world * align_elems and sharded on its own. A rank's
// shard is its slice of the trainable block, then its slice of the frozen
// block: the grads and the optimizer state cover the first slice only, and
// a reduce-scatter of the trainable block alone (the front of the grads'
// flat buffer) lands in it with no copy.
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
  size_t param_begin = 0;  // element offset inside the param
};

// One block's slice in a rank's shard: flat elements [flat_begin, flat_begin
// + numel) are shard elements [shard_begin, shard_begin + numel).
struct ShardRange {
  size_t flat_begin;
  size_t shard_begin;
  size_t numel;
};

class FlatLayout {
 public:
  // align_elems: every param starts at a multiple of it; each block is padded
  // to a multiple of shard_world * align_elems so every shard is aligned too.
  // `frozen` (empty: none) marks the params laid out in the frozen block.
  FlatLayout(std::vector<ParamSpec> params, size_t align_elems, int shard_world, std::vector<bool> frozen = {});

  size_t n_params() const { return params_.size(); }
  const ParamSpec& param(size_t i) const { return params_[i]; }
  const std::vector<ParamSpec>& params() const { return params_; }
  bool frozen(size_t i) const { return !frozen_.empty() && frozen_[i]; }
  bool has_frozen() const { return frozen_padded_ > 0; }
  const std::vector<bool>& frozen_flags() const { return frozen_; }
  size_t param_offset(size_t i) const { return offsets_[i]; }
  size_t padded_numel() const { return trainable_padded_ + frozen_padded_; }
  // The trainable block: flat elements [0, trainable_padded_numel()).
  size_t trainable_padded_numel() const { return trainable_padded_; }
  size_t shard_numel() const { return padded_numel() / world(); }
  // The front of every shard: its slice of the trainable block (the grads'
  // and the optimizer state's length).
  size_t trainable_shard_numel() const { return trainable_padded_ / world(); }
  int shard_world() const { return shard_world_; }
  // The blocks' slices of shard `shard_rank` (one, or two with frozen params).
  std::vector<ShardRange> shard_ranges(int shard_rank) const;
  // Which shard holds flat element `pos`, and where in it.
  struct Place {
    int shard;
    size_t shard_pos;
  };
  Place locate(size_t pos) const;
  // Params (pieces of them) inside shard `shard_rank`, in shard order; padding
  // is not covered by any segment.
  std::vector<ShardSegment> shard_segments(int shard_rank) const;

 private:
  size_t world() const { return static_cast<size_t>(shard_world_); }
  std::vector<ParamSpec> params_;
  std::vector<bool> frozen_;
  std::vector<size_t> offsets_;
  size_t trainable_padded_ = 0, frozen_padded_ = 0;
  int shard_world_ = 1;
};

}  // namespace fsdp
