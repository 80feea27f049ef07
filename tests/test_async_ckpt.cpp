// Proves fsdp_save_async / fsdp_save_wait and fsdp_snapshot / fsdp_restore:
// the async save writes the same shard files as fsdp_save of the state at
// its call while training goes on; its errors reach every rank at the wait
// or at the next checkpoint call; a snapshot restores bitwise and resumes
// training exactly as the uninterrupted run; a restore falls back to the disk
// checkpoint when a rank's snapshot is gone or of another step (the SIGKILLs
// at random points of both: tests/test_ckpt_kills.cpp).
// The reference of every claim is the same training run uninterrupted, in
// this process (tests/ckpt_util.h), gathered after each step.
#include <cstdlib>

#include "ckpt_util.h"

using namespace fsdp_test;

namespace {

const Net kNet = Net::make(3, 10);

struct Case {
  int world;
  std::string sharding;
};

std::string case_name(const ::testing::TestParamInfo<Case>& i) {
  return "world" + std::to_string(i.param.world) + "_" + i.param.sharding;
}

std::vector<Case> cases() {
  return {{1, "FULL_SHARD"}, {2, "FULL_SHARD"}, {3, "SHARD_GRAD_OP"}, {4, "FULL_SHARD"}, {4, "HYBRID_SHARD"}};
}

class AsyncSave : public ::testing::TestWithParam<Case> {};

// The background save holds the state at the call, though training goes on
// at once; its shard files are byte for byte fsdp_save's of that state, and
// a fresh context loads it bitwise and trains on exactly as the saver did.
TEST_P(AsyncSave, WritesTheStateAtTheCallWhileTrainingGoesOn) {
  const Case c = GetParam();
  const auto ref = reference_states(kNet, c.world, c.sharding, 3, 6);
  TempDir tmp;
  const std::string async_dir = tmp / "async", sync_dir = tmp / "sync";
  run_ranks(c.world, [&](int rank, fsdp_local_group_t* group) {
    {
      Job job;
      open_job(job, kNet, options_for(c.sharding, c.world), rank, group);
      ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, 3)));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, 3, c.world, rank));
      ASSERT_OK(fsdp_save_async(job.ctx.get(), async_dir.c_str()));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 3, 5, c.world, rank));  // while it writes
      ASSERT_OK(fsdp_save_wait(job.ctx.get()));
      ASSERT_OK(fsdp_save_wait(job.ctx.get()));  // nothing pending: OK at once
      EXPECT_TRUE(bitwise_equal(gather(job, kNet), ref[5]));
    }
    {  // the same state saved synchronously, for the files' bytes
      Job job;
      open_job(job, kNet, options_for(c.sharding, c.world), rank, group);
      ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, 3)));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, 3, c.world, rank));
      ASSERT_OK(fsdp_save(job.ctx.get(), sync_dir.c_str(), "sharded"));
    }
    Job loader;
    open_job(loader, kNet, options_for(c.sharding, c.world), rank, group);
    ASSERT_OK(fsdp_load(loader.ctx.get(), async_dir.c_str()));
    EXPECT_EQ(step_of(loader), 3u);
    EXPECT_TRUE(bitwise_equal(gather(loader, kNet), ref[3]));
    ASSERT_NO_FATAL_FAILURE(train(loader, kNet, 3, 6, c.world, rank));
    EXPECT_TRUE(bitwise_equal(gather(loader, kNet), ref[6]));
  });
  size_t shard_files = 0;
  for (const auto& e : std::filesystem::directory_iterator(sync_dir)) {
    const std::string name = e.path().filename();
    if (name.rfind("shard-", 0) != 0) continue;
    ++shard_files;
    EXPECT_EQ(read_file(async_dir + "/" + name), read_file(e.path())) << name;
  }
  EXPECT_GT(shard_files, 0u);
  EXPECT_EQ(nlohmann::json::parse(read_file(async_dir + "/fsdp_checkpoint.json")),
            nlohmann::json::parse(read_file(sync_dir + "/fsdp_checkpoint.json")));
}

// A second async save waits for the first; each commits whole, the last wins.
TEST_P(AsyncSave, ASecondSaveWaitsForTheFirst) {
  const Case c = GetParam();
  const auto ref = reference_states(kNet, c.world, c.sharding, 4, 4);
  TempDir tmp;
  const std::string a = tmp / "a", b = tmp / "b";
  run_ranks(c.world, [&](int rank, fsdp_local_group_t* group) {
    {
      Job job;
      open_job(job, kNet, options_for(c.sharding, c.world), rank, group);
      ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, 4)));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, 1, c.world, rank));
      ASSERT_OK(fsdp_save_async(job.ctx.get(), a.c_str()));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 1, 2, c.world, rank));
      ASSERT_OK(fsdp_save_async(job.ctx.get(), a.c_str()));  // the same directory: replaced whole
      ASSERT_OK(fsdp_save_async(job.ctx.get(), b.c_str()));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 2, 4, c.world, rank));
      // No wait: destroying the context finishes the save.
    }
    for (const auto& [dir, step] : {std::pair<std::string, int>{a, 2}, {b, 2}}) {
      Job loader;
      open_job(loader, kNet, options_for(c.sharding, c.world), rank, group);
      ASSERT_OK(fsdp_load(loader.ctx.get(), dir.c_str()));
      EXPECT_EQ(step_of(loader), uint64_t(step));
      EXPECT_TRUE(bitwise_equal(gather(loader, kNet), ref[size_t(step)]));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Checkpoint, AsyncSave, ::testing::ValuesIn(cases()), case_name);

// A write that fails on one rank fails every rank's wait with that rank's
// error (naming the file); the wait reports it once; the previous checkpoint
// stays. Unwaited, the next checkpoint call reports it instead and does
// nothing else; the one after works.
TEST(AsyncSaveErrors, ReachEveryRankAtTheWaitOrTheNextCall) {
  TempDir tmp;
  const std::string dir = tmp / "ck";
  const auto ref = reference_states(kNet, 3, "FULL_SHARD", 5, 2);
  Meeting env(3), env2(3);
  run_ranks(3, [&](int rank, fsdp_local_group_t* group) {
    {
      Job job;
      open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
      ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, 5)));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, 1, 3, rank));
      ASSERT_OK(fsdp_save(job.ctx.get(), dir.c_str(), "sharded"));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 1, 2, 3, rank));
      env.meet(rank, [] { setenv("FSDP_CKPT_FAULT", "io_error_rank=2", 1); });
      ASSERT_OK(fsdp_save_async(job.ctx.get(), dir.c_str()));  // the copy is taken; the write fails later
      EXPECT_EQ(fsdp_save_wait(job.ctx.get()), FSDP_ERR_IO);
      std::string msg = last_error_str();
      EXPECT_NE(msg.find("rank 2"), std::string::npos) << msg;
      EXPECT_NE(msg.find("shard-00002-of-00003.safetensors"), std::string::npos) << msg;
      EXPECT_OK(fsdp_save_wait(job.ctx.get()));  // reported once
      ASSERT_OK(fsdp_save_async(job.ctx.get(), dir.c_str()));
      fsdp_status_t st = fsdp_save(job.ctx.get(), (tmp / "other").c_str(), "sharded");
      msg = last_error_str();
      EXPECT_EQ(st, FSDP_ERR_IO) << msg;
      EXPECT_NE(msg.find("fsdp_save: the earlier fsdp_save_async"), std::string::npos) << msg;
      EXPECT_FALSE(std::filesystem::exists(tmp / "other")) << "the call that reported the error wrote anyway";
      env2.meet(rank, [] { unsetenv("FSDP_CKPT_FAULT"); });
      ASSERT_OK(fsdp_save(job.ctx.get(), (tmp / "other").c_str(), "sharded"));  // the one after works
    }
    Job loader;
    open_job(loader, kNet, base_options("FULL_SHARD"), rank, group);
    ASSERT_OK(fsdp_load(loader.ctx.get(), dir.c_str()));
    EXPECT_EQ(step_of(loader), 1u) << "the failed saves replaced the previous checkpoint";
    EXPECT_TRUE(bitwise_equal(gather(loader, kNet), ref[1]));
    ASSERT_OK(fsdp_load(loader.ctx.get(), (tmp / "other").c_str()));
    EXPECT_EQ(step_of(loader), 2u);
    EXPECT_TRUE(bitwise_equal(gather(loader, kNet), ref[2]));
  });
}

TEST(AsyncSaveErrors, BadArgumentsAreRefused) {
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
    EXPECT_EQ(fsdp_save_async(job.ctx.get(), nullptr), FSDP_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(fsdp_save_async(nullptr, "x"), FSDP_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(fsdp_save_wait(nullptr), FSDP_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(fsdp_snapshot(job.ctx.get(), nullptr), FSDP_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(fsdp_save_async(job.ctx.get(), ""), FSDP_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(fsdp_snapshot(job.ctx.get(), ""), FSDP_ERR_INVALID_ARGUMENT);
    EXPECT_OK(fsdp_save_wait(job.ctx.get()));
    ASSERT_OK(fsdp_forward_begin(job.units[0], job.host.stream()));
    fsdp_status_t st = fsdp_save_async(job.ctx.get(), "/nonexistent/never");
    EXPECT_EQ(st, FSDP_ERR_INVALID_STATE) << last_error_str();
    st = fsdp_snapshot(job.ctx.get(), "/nonexistent/never");
    EXPECT_EQ(st, FSDP_ERR_INVALID_STATE) << last_error_str();
    ASSERT_OK(fsdp_forward_end(job.units[0], job.host.stream()));
    // Ranks that disagree on the directory fail together, at the wait (the
    // call returns after its copy), and write nothing.
    TempDir tmp;
    const std::string mine = tmp / ("r" + std::to_string(rank));
    ASSERT_OK(fsdp_save_async(job.ctx.get(), mine.c_str()));
    st = fsdp_save_wait(job.ctx.get());
    EXPECT_EQ(st, FSDP_ERR_MISMATCH) << last_error_str();
    EXPECT_NE(last_error_str().find("fsdp_save_async"), std::string::npos) << last_error_str();
    EXPECT_FALSE(std::filesystem::exists(mine));
  });
}

// ---- snapshots ------------------------------------------------------------------------

class Snapshot : public ::testing::TestWithParam<Case> {};

// Two snapshots (steps 3 and 5, one per slot), then a step more; fresh
// contexts restore step 5 bitwise and train on exactly as the run did. With
// one rank's snapshot deleted they fall back to the disk checkpoint (step 3),
// and with neither they keep their state.
TEST_P(Snapshot, RestoresTheNewestCommonStepOrFallsBack) {
  const Case c = GetParam();
  const auto ref = reference_states(kNet, c.world, c.sharding, 6, 7);
  TempDir tmp;
  const std::string shm = tmp / "shm", ck = tmp / "ck";
  Meeting lose(c.world);
  run_ranks(c.world, [&](int rank, fsdp_local_group_t* group) {
    {
      Job job;
      open_job(job, kNet, options_for(c.sharding, c.world), rank, group);
      ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, 6)));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, 3, c.world, rank));
      ASSERT_OK(fsdp_snapshot(job.ctx.get(), shm.c_str()));
      ASSERT_OK(fsdp_save(job.ctx.get(), ck.c_str(), "sharded"));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 3, 5, c.world, rank));
      ASSERT_OK(fsdp_snapshot(job.ctx.get(), shm.c_str()));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 5, 6, c.world, rank));
    }
    {
      Job job;
      open_job(job, kNet, options_for(c.sharding, c.world), rank, group);
      int source = -1;
      ASSERT_OK(fsdp_restore(job.ctx.get(), shm.c_str(), ck.c_str(), &source));
      EXPECT_EQ(source, FSDP_RESTORED_SNAPSHOT);
      EXPECT_EQ(step_of(job), 5u);
      EXPECT_TRUE(bitwise_equal(gather(job, kNet), ref[5]));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 5, 7, c.world, rank));
      EXPECT_TRUE(bitwise_equal(gather(job, kNet), ref[7]));
    }
    lose.meet(rank, [&] { std::filesystem::remove_all(shm + "/rank" + std::to_string(c.world - 1)); });
    {
      Job job;
      open_job(job, kNet, options_for(c.sharding, c.world), rank, group);
      int source = -1;
      ASSERT_OK(fsdp_restore(job.ctx.get(), shm.c_str(), ck.c_str(), &source));
      EXPECT_EQ(source, FSDP_RESTORED_CHECKPOINT);
      EXPECT_EQ(step_of(job), 3u);
      EXPECT_TRUE(bitwise_equal(gather(job, kNet), ref[3]));
    }
    {
      Job job;
      open_job(job, kNet, options_for(c.sharding, c.world), rank, group);
      ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, 6)));
      int source = -1;
      ASSERT_OK(fsdp_restore(job.ctx.get(), shm.c_str(), (tmp / "none").c_str(), &source));
      EXPECT_EQ(source, FSDP_RESTORED_NOTHING);
      EXPECT_EQ(step_of(job), 0u);
      EXPECT_TRUE(bitwise_equal(gather(job, kNet), ref[0]));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Checkpoint, Snapshot, ::testing::ValuesIn(cases()), case_name);

// A rank whose newest snapshot is of another step (its process died during
// that copy): the ranks restore the newest step they all hold, from the
// other slot. A damaged slot fails its checksums: the restore falls back.
TEST(SnapshotEdges, RanksRestoreTheNewestStepTheyAllHoldAndRefuseDamage) {
  const auto ref = reference_states(kNet, 2, "FULL_SHARD", 7, 4);
  TempDir tmp;
  const std::string shm = tmp / "shm";
  Meeting m(2), m2(2), m3(2), m4(2);
  std::string saved_marker;
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    {
      Job job;
      open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
      ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, 7)));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, 2, 2, rank));
      ASSERT_OK(fsdp_snapshot(job.ctx.get(), shm.c_str()));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 2, 4, 2, rank));
      ASSERT_OK(fsdp_snapshot(job.ctx.get(), shm.c_str()));
    }
    // Rank 1's marker as a process that died copying step 4 leaves it: the
    // slot of step 2 alone.
    m.meet(rank, [&] {
      const std::string f = shm + "/rank1/snapshot.json";
      nlohmann::json j = nlohmann::json::parse(read_file(f));
      nlohmann::json keep = nlohmann::json::array();
      for (const auto& s : j["slots"])
        if (s["step"] == 2) keep.push_back(s);
      j["slots"] = keep;
      write_file(f, j.dump());
    });
    {
      Job job;
      open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
      int source = -1;
      ASSERT_OK(fsdp_restore(job.ctx.get(), shm.c_str(), nullptr, &source));
      EXPECT_EQ(source, FSDP_RESTORED_SNAPSHOT);
      EXPECT_EQ(step_of(job), 2u);
      EXPECT_TRUE(bitwise_equal(gather(job, kNet), ref[2]));
    }
    // The same steps, but rank 1's of another run (as a new run over an old
    // one's snapshots leaves them): no step of one run in common.
    m3.meet(rank, [&] {
      const std::string f = shm + "/rank1/snapshot.json";
      const std::string kept = read_file(f);
      nlohmann::json j = nlohmann::json::parse(kept);
      for (auto& s : j["slots"]) s["run"] = "0123456789abcdef";
      write_file(f, j.dump());
      saved_marker = kept;
    });
    {
      Job job;
      open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
      ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, 7)));
      int source = -1;
      ASSERT_OK(fsdp_restore(job.ctx.get(), shm.c_str(), nullptr, &source));
      EXPECT_EQ(source, FSDP_RESTORED_NOTHING) << "steps of two runs restored as one";
      EXPECT_TRUE(bitwise_equal(gather(job, kNet), ref[0]));
    }
    m4.meet(rank, [&] { write_file(shm + "/rank1/snapshot.json", saved_marker); });
    m2.meet(rank, [&] {
      for (const auto& e : std::filesystem::recursive_directory_iterator(shm + "/rank0")) {
        const std::string p = e.path();
        if (p.find(".safetensors") != std::string::npos) flip_byte(p, data_offset(p, "units.0.param") + 4);
      }
    });
    {
      Job job;
      open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
      ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, 7)));
      int source = -1;
      ASSERT_OK(fsdp_restore(job.ctx.get(), shm.c_str(), "", &source));
      EXPECT_EQ(source, FSDP_RESTORED_NOTHING);
      EXPECT_TRUE(bitwise_equal(gather(job, kNet), ref[0])) << "a damaged snapshot changed the state";
    }
  });
}

// ---- ranks as processes ---------------------------------------------------------------

// Runs as 4 threads, and as the 4 processes of an mpirun job (CTest
// mpi_np4_async_ckpt, which names a directory every process sees in
// FSDP_TEST_CKPT_DIR). Each rank checks its own results against the same run
// uninterrupted, which every rank gathers itself: nothing is exchanged.
TEST(AsyncCkptWorld4, SaveAsyncSnapshotAndRestoreWithRanksAsThreadsOrProcesses) {
  TempDir tmp;
  const char* env = std::getenv("FSDP_TEST_CKPT_DIR");
  const std::string base = env != nullptr ? std::string(env) + "/async_np4" : tmp.path();
  if (launcher_rank() == 0 && env != nullptr) {
    std::filesystem::remove_all(base);
    std::filesystem::create_directories(base);
  }
  const std::string async_dir = base + "/async", shm = base + "/shm";
  run_ranks(4, [&](int rank, fsdp_local_group_t* group) {
    State s3, s5, s6;
    {  // the reference (a rank has one live context at a time)
      Job job;
      open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
      ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, 21)));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, 3, 4, rank));
      s3 = gather(job, kNet);
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 3, 5, 4, rank));
      s5 = gather(job, kNet);
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 5, 6, 4, rank));
      s6 = gather(job, kNet);
    }
    {
      Job job;
      open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
      ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, 21)));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, 3, 4, rank));
      ASSERT_OK(fsdp_save_async(job.ctx.get(), async_dir.c_str()));
      ASSERT_OK(fsdp_snapshot(job.ctx.get(), shm.c_str()));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 3, 5, 4, rank));
      ASSERT_OK(fsdp_snapshot(job.ctx.get(), shm.c_str()));
      ASSERT_OK(fsdp_save_wait(job.ctx.get()));
    }
    {
      Job job;
      open_job(job, kNet, base_options("SHARD_GRAD_OP"), rank, group);
      ASSERT_OK(fsdp_load(job.ctx.get(), async_dir.c_str()));
      EXPECT_TRUE(bitwise_equal(gather(job, kNet), s3));
    }
    {
      Job job;
      open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
      int source = -1;
      ASSERT_OK(fsdp_restore(job.ctx.get(), shm.c_str(), async_dir.c_str(), &source));
      EXPECT_EQ(source, FSDP_RESTORED_SNAPSHOT);
      EXPECT_TRUE(bitwise_equal(gather(job, kNet), s5));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 5, 6, 4, rank));
      EXPECT_TRUE(bitwise_equal(gather(job, kNet), s6));
    }
    // Rank 3's snapshot lost (its node's memory): every rank falls back to
    // the disk checkpoint. Deleted before rank 0's next context, whose
    // creation the others wait for.
    if (rank == 0) std::filesystem::remove_all(shm + "/rank3");
    Job job;
    open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
    int source = -1;
    ASSERT_OK(fsdp_restore(job.ctx.get(), shm.c_str(), async_dir.c_str(), &source));
    EXPECT_EQ(source, FSDP_RESTORED_CHECKPOINT);
    EXPECT_TRUE(bitwise_equal(gather(job, kNet), s3));
  });
}

// ---- one rank of an mpirun job killed (tests/run_mpi_snapshot_kill.py) -----------------

// Phase 1, as the 2 processes of an mpirun job only: both snapshot after
// every step; rank 1's process dies (FSDP_CKPT_FAULT=crash_after_files=5,
// _Exit: no clean-up) after writing its shard of the third snapshot, before
// that slot's metadata and its marker; rank 0 times out waiting for it.
TEST(AsyncCkptProcesses, SnapshotsUntilRankOneDies) {
  const char* env = std::getenv("FSDP_TEST_CKPT_DIR");
  if (launcher_world() != 2 || env == nullptr) GTEST_SKIP() << "run by tests/run_mpi_snapshot_kill.py";
  const std::string shm = std::string(env) + "/shm";
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    auto o = base_options("FULL_SHARD");
    o["timeout_s"] = "5";
    open_job(job, kNet, o, rank, group);
    ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, 31)));
    if (rank == 1) setenv("FSDP_CKPT_FAULT", "crash_after_files=5", 1);
    for (int s = 0; s < 3; ++s) {
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, s, s + 1, 2, rank));
      fsdp_status_t st = fsdp_snapshot(job.ctx.get(), shm.c_str());
      if (s < 2) ASSERT_OK(st);
      if (s == 2) {
        EXPECT_NE(st, FSDP_OK) << "rank 0's third snapshot succeeded without rank 1";
        std::printf("rank %d: the third snapshot failed: %s\n", rank, last_error_str().c_str());
      }
    }
  });
}

// Phase 2, a new mpirun job of 2 processes: both restore the newest step
// they both hold whole (2: rank 1 died writing 3), bitwise the uninterrupted
// run's, and train on exactly as it does.
TEST(AsyncCkptProcesses, RestoresAfterRankOneDied) {
  const char* env = std::getenv("FSDP_TEST_CKPT_DIR");
  if (launcher_world() != 2 || env == nullptr) GTEST_SKIP() << "run by tests/run_mpi_snapshot_kill.py";
  const std::string shm = std::string(env) + "/shm";
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    State s2, s4;
    {
      Job job;
      open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
      ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, 31)));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, 2, 2, rank));
      s2 = gather(job, kNet);
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 2, 4, 2, rank));
      s4 = gather(job, kNet);
    }
    Job job;
    open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
    int source = -1;
    ASSERT_OK(fsdp_restore(job.ctx.get(), shm.c_str(), nullptr, &source));
    EXPECT_EQ(source, FSDP_RESTORED_SNAPSHOT);
    EXPECT_EQ(step_of(job), 2u);
    EXPECT_TRUE(bitwise_equal(gather(job, kNet), s2));
    ASSERT_NO_FATAL_FAILURE(train(job, kNet, 2, 4, 2, rank));
    EXPECT_TRUE(bitwise_equal(gather(job, kNet), s4));
  });
}

}  // namespace
