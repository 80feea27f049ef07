// Frozen units (fsdp_unit_set_trainable, issue 27): a frozen unit keeps no
// grad shard, no optimizer state and no grad slot, counted exactly in
// fsdp_memory_stats; checkpoints record which units are frozen and how old
// each unit's optimizer state is, and resume bitwise with the same choice or
// with a unit unfrozen at the load; misuse is refused on every rank and
// changes nothing. Training itself is checked against the single-process
// reference in test_equivalence.cpp (the Frozen* and UnfrozenAtStep8 cases).
#include <cmath>
#include <string>
#include <vector>

#include "ckpt_util.h"

using namespace fsdp_test;

namespace {

const Net kNet = Net::make(3, 10);

fsdp_memory_stats_t stats(fsdp_ctx_t* ctx) {
  fsdp_memory_stats_t m{};
  m.struct_size = sizeof m;
  EXPECT_OK(fsdp_memory_stats(ctx, &m));
  return m;
}

size_t shard_bytes(fsdp_unit_t* u) {
  float* p = nullptr;
  size_t off = 0, n = 0;
  EXPECT_OK(fsdp_shard_info(u, &p, &off, &n));
  return n * sizeof(float);
}

void set_trainable(Job& job, size_t k, int trainable) {
  ASSERT_OK(fsdp_unit_set_trainable(job.ctx.get(), job.units[k], trainable));
}

}  // namespace

// Freezing unit 1 frees exactly its grad shard and its two AdamW moments;
// with every unit frozen a training step takes no grad slot at all, and
// unfreezing brings back exactly what there was.
TEST(FrozenMemory, AFrozenUnitKeepsNoGradShardNoOptimizerStateAndNoGradSlot) {
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
    if (HasFatalFailure()) return;
    ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, 5)));
    const fsdp_memory_stats_t all = stats(job.ctx.get());
    const size_t s1 = shard_bytes(job.units[1]);
    set_trainable(job, 1, 0);
    int trainable = 1;
    ASSERT_OK(fsdp_unit_trainable(job.units[1], &trainable));
    EXPECT_EQ(trainable, 0);
    fsdp_memory_stats_t m = stats(job.ctx.get());
    EXPECT_EQ(m.sharded_grads_nbytes, all.sharded_grads_nbytes - s1);
    EXPECT_EQ(m.optimizer_state_nbytes, all.optimizer_state_nbytes - 2 * s1);
    EXPECT_EQ(m.sharded_params_nbytes, all.sharded_params_nbytes);
    set_trainable(job, 0, 0);
    set_trainable(job, 2, 0);
    m = stats(job.ctx.get());
    EXPECT_EQ(m.sharded_grads_nbytes, 0u);
    EXPECT_EQ(m.optimizer_state_nbytes, 0u);
    ASSERT_OK(fsdp_memory_stats_reset_peak(job.ctx.get()));
    const State before = gather(job, kNet);
    ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, 2, 2, rank));
    m = stats(job.ctx.get());
    EXPECT_EQ(m.unsharded_grads_peak_nbytes, 0u) << "a frozen unit's backward took a grad slot";
    EXPECT_TRUE(bitwise_equal(gather(job, kNet), before)) << "a step changed frozen params";
    for (size_t k = 0; k < 3; ++k) set_trainable(job, k, 1);
    m = stats(job.ctx.get());
    EXPECT_EQ(m.sharded_grads_nbytes, all.sharded_grads_nbytes);
    EXPECT_EQ(m.optimizer_state_nbytes, all.optimizer_state_nbytes);
  });
}

// Misuse: nothing changes, every rank fails.
TEST(FrozenMisuse, IsRefusedOnEveryRankAndChangesNothing) {
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
    if (HasFatalFailure()) return;
    fsdp_ctx_t* ctx = job.ctx.get();
    auto trainable = [&](size_t k) {
      int t = -1;
      EXPECT_OK(fsdp_unit_trainable(job.units[k], &t));
      return t;
    };
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_unit_set_trainable(nullptr, job.units[0], 0));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_unit_set_trainable(ctx, nullptr, 0));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_unit_set_trainable(ctx, job.units[0], 2));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_unit_trainable(job.units[0], nullptr));
    // Ranks that disagree (rank 0 freezes unit 0, rank 1 unit 1).
    EXPECT_STATUS(FSDP_ERR_MISMATCH, fsdp_unit_set_trainable(ctx, job.units[size_t(rank)], 0));
    EXPECT_NE(last_error_str().find("fsdp_unit_set_trainable"), std::string::npos) << last_error_str();
    // In the middle of a step: a unit in use, then grads not yet stepped.
    ASSERT_OK(fsdp_forward_begin(job.units[0], nullptr));
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_unit_set_trainable(ctx, job.units[1], 0));
    EXPECT_NE(last_error_str().find("is in forward"), std::string::npos) << last_error_str();
    ASSERT_OK(fsdp_forward_end(job.units[0], nullptr));
    ASSERT_OK(fsdp_backward_begin(job.units[0], nullptr));
    ASSERT_OK(fsdp_backward_end(job.units[0], nullptr));
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_unit_set_trainable(ctx, job.units[0], 0));
    EXPECT_NE(last_error_str().find("after fsdp_step"), std::string::npos) << last_error_str();
    for (size_t k = 0; k < 3; ++k) EXPECT_EQ(trainable(k), 1) << "unit " << k;
    ASSERT_OK(fsdp_step(ctx, nullptr));
    // A frozen unit's grads are asked for.
    set_trainable(job, 2, 0);
    ASSERT_OK(fsdp_backward_begin(job.units[2], nullptr));
    void* g = nullptr;
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_grad_ptr(job.units[2], 0, &g));
    EXPECT_NE(last_error_str().find("is frozen"), std::string::npos) << last_error_str();
    ASSERT_OK(fsdp_backward_end(job.units[2], nullptr));
    std::vector<float> out(numel_of(kNet.units[2][0].shape));
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_gather_grad(job.units[2], 0, out.data(), out.size()));
    // A unit of another context (a world of one of its own).
    Job other;
    open_job(other, kNet, base_options("FULL_SHARD"), -1, nullptr);
    if (HasFatalFailure()) return;
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_unit_set_trainable(ctx, other.units[0], 0));
    EXPECT_NE(last_error_str().find("belongs to another context"), std::string::npos) << last_error_str();
  });
}

// Steps [0, 3) with units 0 and 2 frozen, unit 2 unfrozen, steps [3, 6),
// a save, steps [6, 12): resumed from the save with the same choice the
// end is bitwise the same (unit 2's moments are 3 steps younger than the
// optimizer's count: a lost age would change its bias correction). Loaded
// with unit 0 unfrozen too, the end is bitwise that of a run that unfroze
// unit 0 at step 6: its state starts fresh.
class FrozenCheckpoint : public ::testing::TestWithParam<const char*> {};

TEST_P(FrozenCheckpoint, RecordsTheChoiceAndResumesBitwise) {
  const std::string kind = GetParam();
  TempDir tmp;
  const std::string dir = tmp / "ck";
  State end_frozen, end_unfrozen;
  for (bool unfreeze_0 : {false, true}) {
    run_ranks(4, [&](int rank, fsdp_local_group_t* group) {
      Job job;
      open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
      if (HasFatalFailure()) return;
      ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, 7)));
      set_trainable(job, 0, 0);
      set_trainable(job, 2, 0);
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, 3, 4, rank));
      set_trainable(job, 2, 1);
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 3, 6, 4, rank));
      if (!unfreeze_0) ASSERT_OK(fsdp_save(job.ctx.get(), dir.c_str(), kind.c_str()));
      if (unfreeze_0) set_trainable(job, 0, 1);
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 6, 12, 4, rank));
      State end = gather(job, kNet);
      if (rank == 0) (unfreeze_0 ? end_unfrozen : end_frozen) = end;
    });
  }
  // What the files hold: unit 0 frozen and without state, unit 2's state 3 steps old.
  nlohmann::json meta = nlohmann::json::parse(read_file(dir + "/fsdp_checkpoint.json"));
  EXPECT_EQ(meta["units"][0].value("trainable", true), false);
  EXPECT_FALSE(meta["units"][1].contains("trainable"));
  EXPECT_EQ(meta["units"][2].value("state_fresh_at", -1), 3);
  EXPECT_EQ(meta["optimizer"]["step"], 6);
  if (kind == "sharded") {
    auto t = read_safetensors(dir + "/shard-00000-of-00004.safetensors");
    EXPECT_EQ(t.count("units.0.param"), 1u);
    EXPECT_EQ(t.count("units.0.exp_avg"), 0u);
    EXPECT_EQ(t.count("units.2.exp_avg_sq"), 1u);
  } else {
    auto t = read_safetensors(dir + "/optimizer.safetensors");
    EXPECT_EQ(t.count("blocks.0.weight.exp_avg"), 0u);
    EXPECT_EQ(t.count("blocks.1.weight.exp_avg"), 1u);
  }
  for (bool unfreeze_0 : {false, true}) {
    SCOPED_TRACE(unfreeze_0 ? "loaded with unit 0 unfrozen" : "loaded with the same choice");
    std::vector<State> got(4);
    run_ranks(4, [&](int rank, fsdp_local_group_t* group) {
      Job job;
      open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
      if (HasFatalFailure()) return;
      if (!unfreeze_0) set_trainable(job, 0, 0);
      ASSERT_OK(fsdp_load(job.ctx.get(), dir.c_str()));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 6, 12, 4, rank));
      got[size_t(rank)] = gather(job, kNet);
    });
    EXPECT_TRUE(bitwise_equal(got[0], unfreeze_0 ? end_unfrozen : end_frozen));
  }
  EXPECT_FALSE(bitwise_equal(end_frozen, end_unfrozen)) << "unfreezing unit 0 made no difference";
}

INSTANTIATE_TEST_SUITE_P(Kinds, FrozenCheckpoint, ::testing::Values("sharded", "full"));
