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

void set_param_trainable(Job& job, size_t k, size_t i, int trainable) {
  ASSERT_OK(fsdp_param_set_trainable(job.ctx.get(), job.units[k], i, trainable));
}

size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

// What the rank's collectives moved, once the last fsdp_step (and the
// reductions before it) ran: the step returns when queued, and a read of its
// results (fsdp_ctx_step) waits for it.
fsdp_comm_stats_t comm_stats(fsdp_ctx_t* ctx) {
  uint64_t step = 0;
  EXPECT_OK(fsdp_ctx_step(ctx, &step));
  fsdp_comm_stats_t c{};
  c.struct_size = sizeof c;
  EXPECT_OK(fsdp_comm_stats(ctx, &c));
  return c;
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

// The bytes collectives move, as the communicator counts them: freezing a
// unit takes its share, and only its share, out of the grad reductions
// (reduce-scatter and, across replicas or with NO_SHARD, all-reduce), under
// every strategy; the gathers move the same bytes, since a frozen unit's
// params are still gathered for forward and backward. With every unit
// frozen no grad is reduced at all. The counter itself is checked against
// the layout: FULL_SHARD reduce-scatters every unit's padded fp32 grads once
// per step.
TEST(FrozenComm, ReductionsMoveNoBytesForAFrozenUnit) {
  struct Case {
    const char* sharding;
    int world;
    const char* extra;  // one option besides
  };
  for (const Case& c : {Case{"FULL_SHARD", 2, ""}, Case{"FULL_SHARD", 4, "param_dtype=bf16"},
                        Case{"SHARD_GRAD_OP", 3, ""}, Case{"NO_SHARD", 2, ""},
                        Case{"HYBRID_SHARD", 4, "shard_group_size=2"}}) {
    SCOPED_TRACE(std::string(c.sharding) + " world " + std::to_string(c.world) + " " + c.extra);
    constexpr int kSteps = 2;
    // [which units are frozen] -> rank 0's counts over kSteps steps.
    std::vector<fsdp_comm_stats_t> got(3);
    std::vector<size_t> shard(3);
    const std::vector<std::vector<int>> frozen = {{}, {1}, {0, 1, 2}};
    for (size_t f = 0; f < frozen.size(); ++f) {
      run_ranks(c.world, [&](int rank, fsdp_local_group_t* group) {
        auto opts = base_options(c.sharding);
        const std::string extra = c.extra;
        if (!extra.empty()) opts[extra.substr(0, extra.find('='))] = extra.substr(extra.find('=') + 1);
        Job job;
        open_job(job, kNet, opts, rank, group);
        if (HasFatalFailure()) return;
        ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, 5)));
        for (int k : frozen[f]) set_trainable(job, size_t(k), 0);
        ASSERT_OK(fsdp_comm_stats_reset(job.ctx.get()));
        ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, kSteps, c.world, rank));
        if (rank != 0) return;
        got[f] = comm_stats(job.ctx.get());
        for (size_t k = 0; k < 3; ++k) shard[k] = shard_bytes(job.units[k]) / sizeof(float);
      });
    }
    auto reduced = [](const fsdp_comm_stats_t& s) { return s.reduce_scatter_nbytes + s.all_reduce_nbytes; };
    const uint64_t all = reduced(got[0]);
    ASSERT_GT(all, 0u);
    // Every reduction scales with the shard (the unit's padded numel over
    // the shard group): unit 1's share of the bytes is its share of the shards.
    EXPECT_EQ(reduced(got[1]) * (shard[0] + shard[1] + shard[2]), all * (shard[0] + shard[2]))
        << "frozen: " << reduced(got[1]) << " bytes, all trainable: " << all;
    EXPECT_EQ(reduced(got[2]), 0u) << "a step with every unit frozen reduced grads";
    EXPECT_EQ(got[2].reduce_scatter_calls + got[2].all_reduce_calls, 0u);
    for (size_t f = 1; f < frozen.size(); ++f) {
      EXPECT_EQ(got[f].all_gather_nbytes, got[0].all_gather_nbytes) << frozen[f].size() << " frozen";
      EXPECT_EQ(got[f].all_gather_calls, got[0].all_gather_calls) << frozen[f].size() << " frozen";
    }
    if (std::string(c.sharding) == "FULL_SHARD" && std::string(c.extra).empty()) {
      EXPECT_EQ(got[0].reduce_scatter_nbytes, uint64_t(kSteps) * (shard[0] + shard[1] + shard[2]) * c.world * 4);
      EXPECT_EQ(got[0].reduce_scatter_calls, uint64_t(kSteps) * 3);
      EXPECT_GT(got[0].all_gather_nbytes, 0u);
    }
  }
}

// A world of one runs no collective; the stats' misuse.
TEST(FrozenComm, AWorldOfOneCountsNothingAndMisuseIsRefused) {
  Job job;
  open_job(job, kNet, base_options("FULL_SHARD"), -1, nullptr);
  if (HasFatalFailure()) return;
  ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, 5)));
  ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, 2, 1, 0));
  const fsdp_comm_stats_t c = comm_stats(job.ctx.get());
  EXPECT_EQ(c.all_gather_nbytes + c.reduce_scatter_nbytes + c.all_reduce_nbytes + c.broadcast_nbytes, 0u);
  fsdp_comm_stats_t s{};
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_comm_stats(job.ctx.get(), &s));  // struct_size not set
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_comm_stats(nullptr, &s));
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_comm_stats(job.ctx.get(), nullptr));
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_comm_stats_reset(nullptr));
}

// A param frozen inside a unit (fsdp_param_set_trainable): the unit keeps a
// grad shard and optimizer state for its trainable block alone, whose size
// is the trainable params' numel padded to world x align (align 16 bytes: 4
// elements), split over the ranks; the reduce-scatter moves that block and
// nothing of the frozen one; a step leaves the frozen param bitwise as it
// was and trains the other; unfreezing brings back exactly what there was.
TEST(FrozenParams, AFrozenParamHasNoGradsNoStateAndNoReductionBytes) {
  for (int world : {1, 2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    run_ranks(world, [&](int rank, fsdp_local_group_t* group) {
      auto opts = base_options("FULL_SHARD");
      opts["align_bytes"] = "16";
      Job job;
      open_job(job, kNet, opts, rank, group);
      if (HasFatalFailure()) return;
      const State init = make_init(kNet, 5);
      ASSERT_NO_FATAL_FAILURE(set_state(job, init));
      const fsdp_memory_stats_t all = stats(job.ctx.get());
      const size_t w = static_cast<size_t>(world), bias1 = numel_of(kNet.units[1][1].shape);
      const size_t shard1 = shard_bytes(job.units[1]) / sizeof(float);
      set_param_trainable(job, 1, 0, 0);  // unit 1's weight
      int t = 1;
      ASSERT_OK(fsdp_param_trainable(job.units[1], 0, &t));
      EXPECT_EQ(t, 0);
      ASSERT_OK(fsdp_param_trainable(job.units[1], 1, &t));
      EXPECT_EQ(t, 1);
      // Unit 1's grads and moments: its bias's block alone.
      const size_t trainable1 = round_up(bias1, 4 * w) / w;
      const fsdp_memory_stats_t m = stats(job.ctx.get());
      EXPECT_EQ(m.sharded_grads_nbytes, all.sharded_grads_nbytes - (shard1 - trainable1) * sizeof(float));
      EXPECT_EQ(m.optimizer_state_nbytes, all.optimizer_state_nbytes - 2 * (shard1 - trainable1) * sizeof(float));
      // The values moved to the new layout unchanged.
      EXPECT_TRUE(bitwise_equal(gather(job, kNet), init));
      ASSERT_OK(fsdp_comm_stats_reset(job.ctx.get()));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, 2, world, rank));
      const fsdp_comm_stats_t c = comm_stats(job.ctx.get());
      if (world > 1) {
        size_t padded = trainable1 * w;
        for (size_t k : {size_t(0), size_t(2)}) padded += shard_bytes(job.units[k]) / sizeof(float) * w;
        EXPECT_EQ(c.reduce_scatter_nbytes, 2 * padded * sizeof(float)) << "2 steps of the trainable blocks' fp32 grads";
        EXPECT_EQ(c.reduce_scatter_calls, 2u * 3u);
      } else {
        EXPECT_EQ(c.reduce_scatter_nbytes, 0u);
      }
      const State after = gather(job, kNet);
      EXPECT_TRUE(bitwise_equal(after[1][0], init[1][0])) << "a step changed the frozen weight";
      EXPECT_FALSE(bitwise_equal(after[1][1], init[1][1])) << "the bias beside it did not train";
      // Its grads are refused, its unit's other grads are not.
      ASSERT_OK(fsdp_backward_begin(job.units[1], nullptr));
      void* g = nullptr;
      EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_grad_ptr(job.units[1], 0, &g));
      EXPECT_NE(last_error_str().find("is frozen (fsdp_param_set_trainable)"), std::string::npos) << last_error_str();
      EXPECT_OK(fsdp_grad_ptr(job.units[1], 1, &g));
      ASSERT_OK(fsdp_backward_end(job.units[1], nullptr));
      std::vector<float> out(numel_of(kNet.units[1][0].shape));
      EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_gather_grad(job.units[1], 0, out.data(), out.size()));
      ASSERT_OK(fsdp_step(job.ctx.get(), nullptr));
      set_param_trainable(job, 1, 0, 1);
      const fsdp_memory_stats_t back = stats(job.ctx.get());
      EXPECT_EQ(back.sharded_grads_nbytes, all.sharded_grads_nbytes);
      EXPECT_EQ(back.optimizer_state_nbytes, all.optimizer_state_nbytes);
      EXPECT_EQ(back.sharded_params_nbytes, all.sharded_params_nbytes);
    });
  }
}

// Params registered frozen (fsdp_unit_register_trainable, what fsdp.torch
// does for a PEFT base): the grads and AdamW moments of the frozen ones are
// never allocated, not even for a moment (the peak is what stays), where
// freezing after registering peaks at the full sizes first; both train to
// the same bits.
TEST(FrozenAtRegistration, AllocatesNothingForFrozenParamsAndTrainsLikeFreezingAfter) {
  const State init = make_init(kNet, 6);
  const std::vector<std::vector<int32_t>> flags = {{1, 1}, {0, 1}, {0, 0}};
  for (int world : {1, 2}) {
    SCOPED_TRACE("world " + std::to_string(world));
    std::vector<State> trained(2 * world);
    std::vector<fsdp_memory_stats_t> mem(2 * world);
    for (int from_start : {0, 1}) {
      run_ranks(world, [&](int rank, fsdp_local_group_t* group) {
        Job job;
        ConfigPtr cfg = make_config(base_options("FULL_SHARD"));
        fsdp_ctx_t* raw = nullptr;
        ASSERT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
        job.ctx.reset(raw);
        job.host.attach(raw);
        job.units.assign(kNet.units.size(), nullptr);
        for (size_t k = 0; k < kNet.units.size(); ++k) {
          ASSERT_OK(register_unit(raw, kNet.unit_name(k), kNet.units[k], &job.units[k],
                                  from_start ? &flags[k] : nullptr));
        }
        if (!from_start) {  // unit 1's weight and unit 2 frozen after registering
          set_param_trainable(job, 1, 0, 0);
          set_trainable(job, 2, 0);
        }
        ASSERT_NO_FATAL_FAILURE(set_state(job, init));
        int t = 1;
        ASSERT_OK(fsdp_unit_trainable(job.units[2], &t));
        EXPECT_EQ(t, 0) << "a unit registered with every param frozen is frozen";
        ASSERT_OK(fsdp_param_trainable(job.units[1], 0, &t));
        EXPECT_EQ(t, 0);
        mem[from_start * world + rank] = stats(raw);
        ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, 3, world, rank));
        trained[from_start * world + rank] = gather(job, kNet);
        if (from_start) {
          const std::vector<int32_t> bad = {1, 2};
          fsdp_unit_t* u = nullptr;
          EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, register_unit(raw, "bad", kNet.units[0], &u, &bad));
          EXPECT_NE(last_error_str().find("not 0 or 1"), std::string::npos) << last_error_str();
        }
      });
    }
    for (int rank = 0; rank < world; ++rank) {
      const fsdp_memory_stats_t &a = mem[rank], &b = mem[world + rank];
      EXPECT_EQ(b.sharded_grads_nbytes, a.sharded_grads_nbytes);
      EXPECT_EQ(b.optimizer_state_nbytes, a.optimizer_state_nbytes);
      EXPECT_EQ(b.total_peak_nbytes, b.total_nbytes) << "frozen grads or moments were allocated, then freed";
      EXPECT_GT(a.total_peak_nbytes, a.total_nbytes) << "freezing after registering peaks higher (the control)";
      EXPECT_TRUE(bitwise_equal(trained[world + rank], trained[rank])) << "rank " << rank;
    }
  }
}

// Every param of a trainable unit frozen one by one: the unit keeps no grad
// and no state bytes (its trainable block is empty), takes no grad slot,
// trains nothing, and both kinds of checkpoint save and load it whole.
TEST(FrozenParams, EveryParamOfAUnitFrozenOneByOne) {
  TempDir tmp;
  for (const char* kind : {"sharded", "full"}) {
    SCOPED_TRACE(kind);
    const std::string dir = tmp / kind;
    const State init = make_init(kNet, 9);
    State saved;
    run_ranks(3, [&](int rank, fsdp_local_group_t* group) {
      Job job;
      open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
      if (HasFatalFailure()) return;
      ASSERT_NO_FATAL_FAILURE(set_state(job, init));
      const fsdp_memory_stats_t all = stats(job.ctx.get());
      const size_t s2 = shard_bytes(job.units[2]);
      set_param_trainable(job, 2, 0, 0);
      set_param_trainable(job, 2, 1, 0);
      const fsdp_memory_stats_t m = stats(job.ctx.get());
      EXPECT_EQ(m.sharded_grads_nbytes, all.sharded_grads_nbytes - s2);
      EXPECT_EQ(m.optimizer_state_nbytes, all.optimizer_state_nbytes - 2 * s2);
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, 2, 3, rank));
      ASSERT_OK(fsdp_save(job.ctx.get(), dir.c_str(), kind));
      State end = gather(job, kNet);
      EXPECT_TRUE(bitwise_equal(end[2][0], init[2][0]) && bitwise_equal(end[2][1], init[2][1])) << "unit 2 trained";
      if (rank == 0) saved = end;
    });
    std::vector<State> got(2);
    run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
      Job job;
      open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
      if (HasFatalFailure()) return;
      set_param_trainable(job, 2, 1, 0);  // another choice: the weight trains now (fresh state)
      ASSERT_OK(fsdp_load(job.ctx.get(), dir.c_str()));
      got[size_t(rank)] = gather(job, kNet);
    });
    EXPECT_TRUE(bitwise_equal(got[0], saved));
  }
}

// Misuse of fsdp_param_set_trainable: refused on every rank, nothing changes.
TEST(FrozenParams, MisuseIsRefusedOnEveryRankAndChangesNothing) {
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
    if (HasFatalFailure()) return;
    fsdp_ctx_t* ctx = job.ctx.get();
    auto trainable = [&](size_t k, size_t i) {
      int t = -1;
      EXPECT_OK(fsdp_param_trainable(job.units[k], i, &t));
      return t;
    };
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_param_set_trainable(nullptr, job.units[0], 0, 0));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_param_set_trainable(ctx, nullptr, 0, 0));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_param_set_trainable(ctx, job.units[0], 2, 0));
    EXPECT_NE(last_error_str().find("out of range"), std::string::npos) << last_error_str();
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_param_set_trainable(ctx, job.units[0], 0, 7));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_param_trainable(job.units[0], 0, nullptr));
    int t = 0;
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_param_trainable(job.units[0], 5, &t));
    // Ranks that disagree (rank 0 freezes param 0, rank 1 param 1).
    EXPECT_STATUS(FSDP_ERR_MISMATCH, fsdp_param_set_trainable(ctx, job.units[0], size_t(rank), 0));
    EXPECT_NE(last_error_str().find("fsdp_param_set_trainable"), std::string::npos) << last_error_str();
    // Mid-step: a unit in use, then grads not yet stepped.
    ASSERT_OK(fsdp_forward_begin(job.units[0], nullptr));
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_param_set_trainable(ctx, job.units[1], 0, 0));
    ASSERT_OK(fsdp_forward_end(job.units[0], nullptr));
    ASSERT_OK(fsdp_backward_begin(job.units[0], nullptr));
    ASSERT_OK(fsdp_backward_end(job.units[0], nullptr));
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_param_set_trainable(ctx, job.units[0], 0, 0));
    EXPECT_NE(last_error_str().find("after fsdp_step"), std::string::npos) << last_error_str();
    for (size_t k = 0; k < 3; ++k)
      for (size_t i = 0; i < 2; ++i) EXPECT_EQ(trainable(k, i), 1) << "unit " << k << " param " << i;
    ASSERT_OK(fsdp_step(ctx, nullptr));
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

// Params frozen inside units: unit 0's weight frozen throughout, unit 2's
// bias frozen for steps [0, 3) and unfrozen then (its moments are 3 steps
// younger than the rest of its unit's); a save at step 6. Loaded with the
// same choice, the end is bitwise that of training on; loaded with unit 0's
// weight unfrozen, bitwise that of a run that unfroze it at step 6 (fresh
// state). The checkpoint records the frozen param, the two-block layout and
// the younger param's age, and a world of 3 loads the world of 4's params
// and moments exactly (a full save from each holds the same bytes).
class FrozenParamCheckpoint : public ::testing::TestWithParam<const char*> {};

TEST_P(FrozenParamCheckpoint, RecordsTheChoiceAndResumesBitwise) {
  const std::string kind = GetParam();
  TempDir tmp;
  const std::string dir = tmp / "ck", full4 = tmp / "full4", full3 = tmp / "full3";
  State end_frozen, end_unfrozen;
  for (bool unfreeze : {false, true}) {
    run_ranks(4, [&](int rank, fsdp_local_group_t* group) {
      Job job;
      open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
      if (HasFatalFailure()) return;
      ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, 7)));
      set_param_trainable(job, 0, 0, 0);
      set_param_trainable(job, 2, 1, 0);
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, 3, 4, rank));
      set_param_trainable(job, 2, 1, 1);
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 3, 6, 4, rank));
      if (!unfreeze) {
        ASSERT_OK(fsdp_save(job.ctx.get(), dir.c_str(), kind.c_str()));
        ASSERT_OK(fsdp_save(job.ctx.get(), full4.c_str(), "full"));
      }
      if (unfreeze) set_param_trainable(job, 0, 0, 1);
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 6, 12, 4, rank));
      State end = gather(job, kNet);
      if (rank == 0) (unfreeze ? end_unfrozen : end_frozen) = end;
    });
  }
  nlohmann::json meta = nlohmann::json::parse(read_file(dir + "/fsdp_checkpoint.json"));
  EXPECT_EQ(meta["units"][0]["params"][0].value("trainable", true), false);
  EXPECT_FALSE(meta["units"][0]["params"][1].contains("trainable"));
  EXPECT_EQ(meta["units"][2]["params"][1].value("state_fresh_at", -1), 3);
  EXPECT_FALSE(meta["units"][2]["params"][0].contains("state_fresh_at"));
  if (kind == "sharded") {
    EXPECT_TRUE(meta["units"][0].contains("trainable_numel"));
    EXPECT_FALSE(meta["units"][1].contains("trainable_numel"));
  } else {
    auto t = read_safetensors(dir + "/optimizer.safetensors");
    EXPECT_EQ(t.count("blocks.0.weight.exp_avg"), 0u);
    EXPECT_EQ(t.count("blocks.0.bias.exp_avg"), 1u);
  }
  for (bool unfreeze : {false, true}) {
    SCOPED_TRACE(unfreeze ? "loaded with the weight unfrozen" : "loaded with the same choice");
    std::vector<State> got(4);
    run_ranks(4, [&](int rank, fsdp_local_group_t* group) {
      Job job;
      open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
      if (HasFatalFailure()) return;
      if (!unfreeze) set_param_trainable(job, 0, 0, 0);
      ASSERT_OK(fsdp_load(job.ctx.get(), dir.c_str()));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 6, 12, 4, rank));
      got[size_t(rank)] = gather(job, kNet);
    });
    EXPECT_TRUE(bitwise_equal(got[0], unfreeze ? end_unfrozen : end_frozen));
  }
  EXPECT_FALSE(bitwise_equal(end_frozen, end_unfrozen)) << "unfreezing the weight made no difference";
  // Another world: the same params and moments, through the other layout.
  run_ranks(3, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
    if (HasFatalFailure()) return;
    set_param_trainable(job, 0, 0, 0);
    ASSERT_OK(fsdp_load(job.ctx.get(), dir.c_str()));
    ASSERT_OK(fsdp_save(job.ctx.get(), full3.c_str(), "full"));
  });
  for (const char* f : {"/model.safetensors", "/optimizer.safetensors"}) {
    auto a = read_safetensors(full4 + f), b = read_safetensors(full3 + f);
    ASSERT_EQ(a.size(), b.size()) << f;
    for (const auto& [name, t] : a) {
      ASSERT_EQ(b.count(name), 1u) << name;
      EXPECT_TRUE(bitwise_equal(t.values, b.at(name).values)) << name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, FrozenParamCheckpoint, ::testing::Values("sharded", "full"));
