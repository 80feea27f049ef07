// SIGKILLs at random points of fsdp_snapshot's copy and of fsdp_save_async's
// background write never leave a state that restores (loads) as anything
// other than the uninterrupted run's state at the step it claims, nor mix
// two runs' snapshots. The reference is that run, trained in this process
// (tests/ckpt_util.h) and gathered after each step.
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <random>
#include <set>
#include <thread>

#include "ckpt_util.h"

using namespace fsdp_test;

namespace {

// A bigger net, so that the copies and writes take most of the child's time.
const Net kKillNet = Net::make(3, 160);
constexpr int kKillWorld = 4;
// Each child trains this many steps from where it starts (a fresh run from 0,
// a resumed one from what the last child left), so that every child's run is
// as long as the calibrated one and a kill lands at any point of any step;
// runs stop at kKillMaxSteps, the reference's length.
constexpr int kKillRunSteps = 10;
constexpr int kKillMaxSteps = 40;

// In a forked process: trains step after step, after each one a snapshot
// (or an async save) of it, until killed. `resume`: first restores what an
// earlier child left and trains on from there (as a restarted job does);
// else starts afresh over it (a new run, whose snapshots must never mix with
// the old run's).
[[noreturn]] void train_and_checkpoint(const std::string& where, bool snapshot, bool resume, uint64_t seed) {
  run_ranks(kKillWorld, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, kKillNet, base_options("FULL_SHARD"), rank, group);
    ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kKillNet, seed)));
    int first = 0;
    if (resume) {
      int source = 0;
      ASSERT_OK(snapshot ? fsdp_restore(job.ctx.get(), where.c_str(), nullptr, &source)
                         : fsdp_restore(job.ctx.get(), nullptr, where.c_str(), &source));
      first = static_cast<int>(step_of(job));
    }
    for (int s = first; s < std::min(first + kKillRunSteps, kKillMaxSteps); ++s) {
      ASSERT_NO_FATAL_FAILURE(train(job, kKillNet, s, s + 1, kKillWorld, rank));
      ASSERT_OK(snapshot ? fsdp_snapshot(job.ctx.get(), where.c_str()) : fsdp_save_async(job.ctx.get(), where.c_str()));
    }
    ASSERT_OK(fsdp_save_wait(job.ctx.get()));
  });
  _exit(0);
}

// The (run, step) pairs whose slot every rank's marker names, read here from
// the markers' JSON (the test's own reading of the format).
std::set<std::pair<std::string, int64_t>> common_snapshot_steps(const std::string& where) {
  std::set<std::pair<std::string, int64_t>> common;
  for (int r = 0; r < kKillWorld; ++r) {
    const std::string f = where + "/rank" + std::to_string(r) + "/snapshot.json";
    std::set<std::pair<std::string, int64_t>> mine;
    if (std::filesystem::exists(f)) {
      const nlohmann::json marker = nlohmann::json::parse(read_file(f));
      for (const auto& slot : marker.at("slots"))
        mine.insert({slot.at("run").get<std::string>(), slot.at("step").get<int64_t>()});
    }
    if (r == 0) {
      common = mine;
    } else {
      std::set<std::pair<std::string, int64_t>> both;
      for (const auto& k : mine)
        if (common.count(k) != 0) both.insert(k);
      common = both;
    }
  }
  return common;
}

// `kills` times: a child trains and checkpoints and gets SIGKILL after a
// random delay; whatever it left is then restored (or loaded) by a fresh
// world here and must be, bitwise, the reference state of the step it says.
void kill_and_check(bool snapshot, int kills) {
  // Fresh runs start from one of two inits, so that a state mixed from two
  // runs' snapshots of the same step matches neither run's reference.
  const uint64_t seeds[2] = {9, 10};
  const std::vector<State> refs[2] = {reference_states(kKillNet, kKillWorld, "FULL_SHARD", seeds[0], kKillMaxSteps),
                                      reference_states(kKillNet, kKillWorld, "FULL_SHARD", seeds[1], kKillMaxSteps)};
  TempDir tmp;
  const std::string where = tmp / (snapshot ? "shm" : "ck");
  std::mt19937 rng(snapshot ? 1 : 2);
  int restored = 0, completed = 0, mid_copy = 0;
  // The kills land at random points of a child's whole run, timed once here
  // (so that a sanitizer's slower run is killed as evenly).
  long run_us = 0;
  {
    const auto t0 = std::chrono::steady_clock::now();
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) train_and_checkpoint(tmp / "calibration", snapshot, /*resume=*/false, seeds[0]);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the uninterrupted child failed";
    run_us = static_cast<long>(
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count());
  }
  // Until `kills` children were killed (a child may finish its run first:
  // one that resumes near kKillMaxSteps has fewer steps left; a fresh one on
  // a machine whose load fell since the calibration, and each such finish
  // shortens the delays).
  int killed = 0;
  for (int i = 0; killed < kills && i < 5 * kills; ++i) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    // Two of three children resume what the last one left; the third starts
    // a new run over it, from the other init than the one before.
    if (pid == 0) train_and_checkpoint(where, snapshot, /*resume=*/i % 3 != 0, seeds[(i / 3) % 2]);
    std::this_thread::sleep_for(
        std::chrono::microseconds(std::uniform_int_distribution<long>(run_us / 20, run_us * 9 / 10)(rng)));
    kill(pid, SIGKILL);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    if (WIFEXITED(status)) {
      ++completed;
      // A fresh run that beat its kill: runs are faster now than timed.
      if (i % 3 == 0) run_us = std::max(run_us * 3 / 4, 1000L);
    }
    if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) ++killed;
    // Evidence of where the kill landed: a background write's staging
    // directory left behind; a snapshot slot that no marker names (being
    // rewritten). And what must then restore: every rank has a marker.
    bool in_copy = false;
    const auto common = common_snapshot_steps(where);
    for (int r = 0; r < kKillWorld; ++r) {
      const std::string rank_dir = where + "/rank" + std::to_string(r);
      if (!std::filesystem::exists(rank_dir + "/snapshot.json")) continue;
      const std::string marker = read_file(rank_dir + "/snapshot.json");
      for (int slot = 0; slot < 2; ++slot) {
        const bool named = marker.find("\"slot\":" + std::to_string(slot)) != std::string::npos;
        if (!named && std::filesystem::exists(rank_dir + "/slot" + std::to_string(slot))) in_copy = true;
      }
    }
    if (std::filesystem::exists(tmp / ".ck.fsdp-staging")) in_copy = true;
    mid_copy += in_copy ? 1 : 0;
    run_ranks(kKillWorld, [&](int rank, fsdp_local_group_t* group) {
      Job job;
      open_job(job, kKillNet, base_options("FULL_SHARD"), rank, group);
      int source = FSDP_RESTORED_NOTHING;
      if (snapshot) {
        ASSERT_OK(fsdp_restore(job.ctx.get(), where.c_str(), nullptr, &source));
      } else if (std::filesystem::exists(where)) {
        ASSERT_OK(fsdp_load(job.ctx.get(), where.c_str()));
        source = FSDP_RESTORED_CHECKPOINT;
      }
      if (snapshot) {  // a step of one run that every rank holds, and only then
        EXPECT_EQ(source, common.empty() ? FSDP_RESTORED_NOTHING : FSDP_RESTORED_SNAPSHOT)
            << "kill " << i << "; rank 0's marker: " << read_file(where + "/rank0/snapshot.json");
      }
      if (source == FSDP_RESTORED_NOTHING) return;
      const uint64_t step = step_of(job);
      if (snapshot) {
        int64_t newest = -1;
        for (const auto& k : common) newest = std::max(newest, k.second);
        EXPECT_EQ(int64_t(step), newest) << "kill " << i << ": not the newest common step";
      }
      ASSERT_LE(step, uint64_t(kKillMaxSteps));
      ASSERT_GE(step, 1u);
      const State got = gather(job, kKillNet);
      EXPECT_TRUE(bitwise_equal(got, refs[0][step]) || bitwise_equal(got, refs[1][step]))
          << "kill " << i << ": step " << step << " is neither run's state at that step";
      if (rank == 0) ++restored;
    });
    if (::testing::Test::HasFailure()) return;
  }
  std::printf(
      "a whole run %.1f ms; %d kills and %d runs that ended before their kill: %d left a state that restored "
      "bitwise, %d of them in the middle of a copy\n",
      1e-3 * double(run_us), killed, completed, restored, mid_copy);
  EXPECT_EQ(killed, kills) << "too few children were still running at their kill";
  EXPECT_GT(restored, kills / 2) << "most kills should land after a first checkpoint (a run: " << run_us << " us)";
  EXPECT_GT(mid_copy, 0) << "no kill landed in the middle of a copy: the test proved nothing";
}

// 60 each (120 in all) in the default preset; the late host stream's
// variant 20 and the sanitizer presets 10 (FSDP_TEST_KILLS in
// CMakePresets.json): they check the same paths for the stream's timing,
// memory errors and races rather than for more kills.
int kill_count() {
  const char* env = std::getenv("FSDP_TEST_KILLS");
  if (env != nullptr) return std::atoi(env);
  return std::getenv("FSDP_TEST_LATE_HOST_US") != nullptr ? 20 : 60;
}

TEST(Kills, DuringSnapshotCopiesNeverLeaveAWrongOrMixedState) { kill_and_check(/*snapshot=*/true, kill_count()); }

TEST(Kills, DuringBackgroundWritesNeverLeaveAWrongOrMixedState) { kill_and_check(/*snapshot=*/false, kill_count()); }

}  // namespace
