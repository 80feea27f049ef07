// src/base/layout.cpp - flat layout arithmetic (see layout.h).
#include "layout.h"

#include <algorithm>

namespace fsdp {

static size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

FlatLayout::FlatLayout(std::vector<ParamSpec> params, size_t align_elems, int shard_world)
    : params_(std::move(params)), shard_world_(shard_world) {
  size_t end = 0;
  offsets_.reserve(params_.size());
  for (const ParamSpec& p : params_) {
    size_t start = round_up(end, align_elems);
    offsets_.push_back(start);
    end = start + p.numel;
  }
  // Never empty: even a unit of empty params owns one aligned block per rank.
  padded_numel_ = round_up(std::max<size_t>(end, 1), align_elems * static_cast<size_t>(shard_world));
}

std::vector<ShardSegment> FlatLayout::shard_segments(int shard_rank) const {
  std::vector<ShardSegment> segs;
  size_t lo = shard_offset(shard_rank);
  size_t hi = lo + shard_numel();
  for (size_t i = 0; i < params_.size(); ++i) {
    size_t b = std::max(lo, offsets_[i]);
    size_t e = std::min(hi, offsets_[i] + params_[i].numel);
    if (b < e) segs.push_back({i, b - lo, e - b});
  }
  return segs;
}

}  // namespace fsdp
