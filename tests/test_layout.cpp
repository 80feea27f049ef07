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
      size_t flat = l.shard_offset(r) + seg.shard_begin;
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
