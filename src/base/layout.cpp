// src/base/layout.cpp - flat layout arithmetic (see layout.h).
#include "layout.h"

#include <algorithm>

namespace fsdp {

static size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

FlatLayout::FlatLayout(std::vector<ParamSpec> params, size_t align_elems, int shard_world, std::vector<bool> frozen)
    : params_(std::move(params)), frozen_(std::move(frozen)), shard_world_(shard_world) {
  if (std::find(frozen_.begin(), frozen_.end(), true) == frozen_.end()) frozen_.clear();
  frozen_.resize(frozen_.empty() ? 0 : params_.size(), false);
  const size_t block = align_elems * static_cast<size_t>(shard_world);
  offsets_.assign(params_.size(), 0);
  // The trainable block, then the frozen one, each in registration order.
  size_t end = 0;
  for (bool in_frozen : {false, true}) {
    size_t begin = end;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (this->frozen(i) != in_frozen) continue;
      size_t start = round_up(end, align_elems);
      offsets_[i] = start;
      end = start + params_[i].numel;
    }
    size_t padded = end > begin ? round_up(end - begin, block) : 0;
    (in_frozen ? frozen_padded_ : trainable_padded_) = padded;
    end = begin + padded;
  }
  // Never empty: even a unit of empty params owns one aligned block per rank.
  if (padded_numel() == 0) trainable_padded_ = block;
}

std::vector<ShardRange> FlatLayout::shard_ranges(int shard_rank) const {
  std::vector<ShardRange> out;
  const size_t r = static_cast<size_t>(shard_rank);
  const size_t t = trainable_shard_numel(), f = frozen_padded_ / world();
  if (t > 0) out.push_back({r * t, 0, t});
  if (f > 0) out.push_back({trainable_padded_ + r * f, t, f});
  return out;
}

FlatLayout::Place FlatLayout::locate(size_t pos) const {
  const size_t t = trainable_shard_numel();
  if (pos < trainable_padded_) return {static_cast<int>(pos / t), pos % t};
  const size_t f = frozen_padded_ / world(), q = pos - trainable_padded_;
  return {static_cast<int>(q / f), t + q % f};
}

std::vector<ShardSegment> FlatLayout::shard_segments(int shard_rank) const {
  std::vector<ShardSegment> segs;
  for (const ShardRange& range : shard_ranges(shard_rank)) {
    const size_t lo = range.flat_begin, hi = lo + range.numel;
    for (size_t i = 0; i < params_.size(); ++i) {
      size_t b = std::max(lo, offsets_[i]);
      size_t e = std::min(hi, offsets_[i] + params_[i].numel);
      if (b < e) segs.push_back({i, range.shard_begin + (b - lo), e - b, b - offsets_[i]});
    }
  }
  std::sort(segs.begin(), segs.end(),
            [](const ShardSegment& a, const ShardSegment& b) { return a.shard_begin < b.shard_begin; });
  return segs;
}

}  // namespace fsdp
