// Proves the flat layout arithmetic: alignment, padding, and that the shards of
// all ranks cover every param element exactly once, for awkward sizes.
#include <gtest/gtest.h>

#include <vector>

#include "base/layout.h"

using fsdp::FlatLayout;
using fsdp::ParamSpec;

namespace {

std::vector<ParamSpec> specs(const std::vector<size_t>& numels) {
  std::vector<ParamSpec> out;
  for (size_t i = 0; i < numels.size(); ++i) out.push_back({"p" + std::to_string(i), {int64_t(numels[i])}, numels[i]});
  return out;
}

// Counts, for every flat element, how many shard segments cover it.
void expect_exact_cover(const FlatLayout& l, const std::vector<size_t>& numels) {
  std::vector<int> covered(l.padded_numel(), 0);
  for (int r = 0; r < l.shard_world(); ++r) {
    for (const auto& seg : l.shard_segments(r)) {
      size_t flat = l.param_offset(seg.param_index) + seg.param_begin;
      // The shard position agrees with where locate() puts the flat element.
      const FlatLayout::Place at = l.locate(flat);
      ASSERT_EQ(at.shard, r);
      ASSERT_EQ(at.shard_pos, seg.shard_begin);
      ASSERT_LE(seg.shard_begin + seg.numel, l.shard_numel());
      ASSERT_GE(flat, l.param_offset(seg.param_index));
      ASSERT_LE(flat + seg.numel, l.param_offset(seg.param_index) + numels[seg.param_index]);
      for (size_t i = 0; i < seg.numel; ++i) covered[flat + i]++;
    }
  }
  size_t n_covered = 0;
  for (size_t p = 0; p < numels.size(); ++p) {
    for (size_t i = 0; i < numels[p]; ++i)
      EXPECT_EQ(covered[l.param_offset(p) + i], 1) << "param " << p << " elem " << i;
    n_covered += numels[p];
  }
  size_t total = 0;
  for (int c : covered) total += static_cast<size_t>(c);
  EXPECT_EQ(total, n_covered) << "padding must not belong to any param";
}

}  // namespace

TEST(FlatLayout, ParamsStartAlignedAndTotalDividesIntoAlignedShards) {
  std::vector<size_t> numels = {7, 1, 33, 16};
  for (int world : {1, 2, 3, 4, 5}) {
    FlatLayout l(specs(numels), 16, world);
    size_t end = 0;
    for (size_t p = 0; p < numels.size(); ++p) {
      EXPECT_EQ(l.param_offset(p) % 16, 0u);
      EXPECT_GE(l.param_offset(p), end);
      EXPECT_LT(l.param_offset(p) - end, 16u) << "no more padding than the alignment needs";
      end = l.param_offset(p) + numels[p];
    }
    EXPECT_EQ(l.padded_numel() % (16u * static_cast<size_t>(world)), 0u);
    EXPECT_GE(l.padded_numel(), end);
    EXPECT_LT(l.padded_numel() - end, 16u * static_cast<size_t>(world));
    EXPECT_EQ(l.shard_numel() * static_cast<size_t>(world), l.padded_numel());
    expect_exact_cover(l, numels);
  }
}

TEST(FlatLayout, ParamsSmallerThanTheWorldAndASingleElementUnit) {
  for (int world : {1, 2, 3, 4, 7}) {
    expect_exact_cover(FlatLayout(specs({1}), 1, world), {1});
    expect_exact_cover(FlatLayout(specs({1, 2, 1}), 1, world), {1, 2, 1});
    FlatLayout one(specs({1}), 16, world);
    EXPECT_EQ(one.padded_numel(), 16u * static_cast<size_t>(world));
    EXPECT_EQ(one.shard_segments(0).size(), 1u);
    for (int r = 1; r < world; ++r) EXPECT_TRUE(one.shard_segments(r).empty()) << "rank " << r << " holds only padding";
  }
}

TEST(FlatLayout, ParamSplitAcrossShardsKeepsOrder) {
  FlatLayout l(specs({10, 10}), 1, 4);  // 20 elements, 5 per rank
  auto s1 = l.shard_segments(1);        // elements 5..9 of p0
  ASSERT_EQ(s1.size(), 1u);
  EXPECT_EQ(s1[0].param_index, 0u);
  EXPECT_EQ(s1[0].numel, 5u);
  auto s2 = l.shard_segments(2);  // elements 0..4 of p1
  ASSERT_EQ(s2.size(), 1u);
  EXPECT_EQ(s2[0].param_index, 1u);
  EXPECT_EQ(s2[0].shard_begin, 0u);
}

TEST(FlatLayout, EmptyParamsStillGiveEveryRankAnAlignedShard) {
  FlatLayout l(specs({0}), 16, 3);
  EXPECT_EQ(l.padded_numel(), 48u);
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(l.shard_segments(r).empty());
}

// Frozen params (fsdp_param_set_trainable) go to a second block after the
// trainable ones, each block padded and sharded on its own: every shard
// starts with its slice of the trainable block, the only part grads and
// optimizer state cover, and the trainable params all fall inside it.
TEST(FlatLayout, FrozenParamsFollowInABlockOfTheirOwn) {
  std::vector<size_t> numels = {7, 1, 33, 16, 5};
  const std::vector<bool> frozen = {false, true, false, true, false};
  for (int world : {1, 2, 3, 4}) {
    FlatLayout l(specs(numels), 4, world, frozen);
    ASSERT_TRUE(l.has_frozen());
    const size_t block = 4u * static_cast<size_t>(world);
    EXPECT_EQ(l.trainable_padded_numel() % block, 0u);
    EXPECT_EQ((l.padded_numel() - l.trainable_padded_numel()) % block, 0u);
    EXPECT_EQ(l.trainable_shard_numel() * static_cast<size_t>(world), l.trainable_padded_numel());
    // Trainable params (0, 2, 4, in order) fill the first block tightly, the frozen ones (1, 3) the second.
    EXPECT_EQ(l.param_offset(0), 0u);
    EXPECT_LT(l.param_offset(0), l.param_offset(2));
    EXPECT_LT(l.param_offset(2), l.param_offset(4));
    EXPECT_LE(l.param_offset(4) + 5, l.trainable_padded_numel());
    EXPECT_LT(l.trainable_padded_numel() - (l.param_offset(4) + 5), block);
    EXPECT_EQ(l.param_offset(1), l.trainable_padded_numel());
    EXPECT_LT(l.param_offset(1), l.param_offset(3));
    for (int r = 0; r < world; ++r) {
      for (const auto& seg : l.shard_segments(r)) {
        EXPECT_EQ(seg.shard_begin < l.trainable_shard_numel(), !frozen[seg.param_index])
            << "param " << seg.param_index << " on rank " << r;
      }
      const auto ranges = l.shard_ranges(r);
      ASSERT_EQ(ranges.size(), 2u);
      EXPECT_EQ(ranges[0].shard_begin, 0u);
      EXPECT_EQ(ranges[1].shard_begin, l.trainable_shard_numel());
      EXPECT_EQ(ranges[0].numel + ranges[1].numel, l.shard_numel());
    }
    expect_exact_cover(l, numels);
  }
  // Every param frozen: no trainable block at all; none frozen: the one-block layout.
  FlatLayout all(specs(numels), 4, 2, std::vector<bool>(numels.size(), true));
  EXPECT_EQ(all.trainable_shard_numel(), 0u);
  expect_exact_cover(all, numels);
  FlatLayout none(specs(numels), 4, 2, std::vector<bool>(numels.size(), false));
  FlatLayout plain(specs(numels), 4, 2);
  EXPECT_FALSE(none.has_frozen());
  EXPECT_EQ(none.padded_numel(), plain.padded_numel());
  EXPECT_EQ(none.trainable_shard_numel(), plain.shard_numel());
}
