// Proves fsdp_metrics_reduce: the sum, mean, maximum and minimum of the
// host's doubles over every rank (also across HYBRID_SHARD's groups), the same
// bits on every rank, equal to the test's own rank-order reduction; and that a
// bad op, a count over the limit or counts that differ between ranks fail
// without hanging. Also runs as an mpirun job of 3 processes.
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "rank_runner.h"

using namespace fsdp_test;

namespace {

constexpr size_t kCount = 1000;

// Rank r's value i: different on every rank, with roundings that depend on
// the order of a sum.
double value(int rank, size_t i) {
  return (0.1 * (rank + 1) + 1e-3 * static_cast<double>(i)) * (i % 3 == 0 ? -1.0 : 1.0) / 3.0;
}

std::vector<double> reference(fsdp_reduce_op_t op, int world) {
  std::vector<double> out(kCount);
  for (size_t i = 0; i < kCount; ++i) {
    double acc = value(0, i);
    for (int r = 1; r < world; ++r) {
      double x = value(r, i);
      if (op == FSDP_REDUCE_MAX) {
        acc = std::max(acc, x);
      } else if (op == FSDP_REDUCE_MIN) {
        acc = std::min(acc, x);
      } else {
        acc += x;
      }
    }
    out[i] = op == FSDP_REDUCE_AVG ? acc / world : acc;
  }
  return out;
}

void check_reductions(int world, const std::map<std::string, std::string>& opts) {
  run_ranks(world, [&](int rank, fsdp_local_group_t* group) {
    std::map<std::string, std::string> o = opts;
    o["timeout_s"] = "30";
    ConfigPtr cfg = make_config(o);
    ASSERT_TRUE(cfg);
    fsdp_ctx_t* raw = nullptr;
    ASSERT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
    CtxPtr ctx(raw);
    for (fsdp_reduce_op_t op : {FSDP_REDUCE_SUM, FSDP_REDUCE_AVG, FSDP_REDUCE_MAX, FSDP_REDUCE_MIN}) {
      SCOPED_TRACE("op " + std::to_string(int(op)));
      std::vector<double> v(kCount);
      for (size_t i = 0; i < kCount; ++i) v[i] = value(rank, i);
      ASSERT_OK(fsdp_metrics_reduce(raw, v.data(), v.size(), op));
      const std::vector<double> want = reference(op, world);
      size_t differ = 0;
      for (size_t i = 0; i < kCount; ++i) differ += v[i] != want[i];  // bitwise: same order, same bits
      EXPECT_EQ(differ, 0u) << "e.g. element 1: " << v[1] << " vs " << want[1];
    }
    // Count 0 (values may be NULL) is still a collective: the ranks stay in step.
    EXPECT_OK(fsdp_metrics_reduce(raw, nullptr, 0, FSDP_REDUCE_SUM));
    double loss = 1.5 * (rank + 1);
    ASSERT_OK(fsdp_metrics_reduce(raw, &loss, 1, FSDP_REDUCE_AVG));
    EXPECT_EQ(loss, 1.5 * (world + 1) / 2);
    EXPECT_OK(fsdp_ctx_finalize(raw));
  });
}

}  // namespace

TEST(Metrics, ReductionsOverThreeRanksEqualTheRankOrderReferenceBitwise) { check_reductions(3, {}); }

TEST(Metrics, HybridShardReducesOverTheWholeWorldNotTheShardGroup) {
  if (launcher_world() > 0) GTEST_SKIP() << "runs with thread ranks";
  check_reductions(4, {{"sharding", "HYBRID_SHARD"}, {"shard_group_size", "2"}});
}

TEST(Metrics, BadArgumentsFailLocallyAndDifferentCountsFailOnEveryRank) {
  if (launcher_world() > 0) GTEST_SKIP() << "runs with thread ranks";
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    ConfigPtr cfg = make_config({{"timeout_s", "30"}});
    ASSERT_TRUE(cfg);
    fsdp_ctx_t* raw = nullptr;
    ASSERT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
    CtxPtr ctx(raw);
    double v[2] = {1.0, 2.0};
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_metrics_reduce(raw, v, 2, static_cast<fsdp_reduce_op_t>(7)));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_metrics_reduce(raw, nullptr, 2, FSDP_REDUCE_SUM));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_metrics_reduce(raw, v, (size_t(1) << 20) + 1, FSDP_REDUCE_SUM));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_metrics_reduce(nullptr, v, 2, FSDP_REDUCE_SUM));
    EXPECT_EQ(v[0], 1.0);
    EXPECT_EQ(v[1], 2.0);
    // Those failed before any rank communicated: the next reduce is in step.
    ASSERT_OK(fsdp_metrics_reduce(raw, v, 2, FSDP_REDUCE_SUM));
    EXPECT_EQ(v[0], 2.0);
    EXPECT_STATUS(FSDP_ERR_MISMATCH, fsdp_metrics_reduce(raw, v, rank == 0 ? 1 : 2, FSDP_REDUCE_SUM));
  });
}
