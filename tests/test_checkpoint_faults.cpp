// Proves that a checkpoint survives what goes wrong around it: damage to any
// of its files is refused with an error naming the file and tensor while the
// context stays as it was; a model or optimizer it does not fit is refused
// before anything is read; a crash between two files, or between the two
// renames, leaves the previous checkpoint loadable; a read or write error on
// one rank fails every rank saying so; bad arguments write nothing. What loads
// and resumes is test_checkpoint.cpp's. The training around them computes
// through ckpt_util.h's Job::host: at once, or late on a host stream (the
// .late CTests).
#include <sys/wait.h>

#include <mutex>

#include "ckpt_util.h"

using namespace fsdp_test;

namespace {

const Net kNet = Net::make(3, 10);

// ---- damage --------------------------------------------------------------------------

// Byte offset of tensor `name`'s data in a safetensors file (independent parse).
struct Damage {
  std::string name;
  std::function<void(const std::string& dir)> apply;
  fsdp_status_t status;
  std::vector<std::string> says;  // substrings of the message
};

const std::string kShard1 = "shard-00001-of-00002.safetensors";

std::vector<Damage> damages() {
  // Metadata edited consistently (its CRC-32 file rewritten too): what the
  // field checks see.
  auto edit_meta = [](const std::function<void(nlohmann::json&)>& f) {
    return [f](const std::string& dir) {
      auto j = read_meta(dir);
      f(j);
      write_meta_consistently(dir, j.dump());
    };
  };
  return {
      {"FlippedDataByte",
       [](const std::string& d) {
         flip_byte(d + "/" + kShard1, data_offset(d + "/" + kShard1, "units.1.exp_avg") + 5);
       },
       FSDP_ERR_CORRUPT,
       {kShard1, "units.1.exp_avg", "checksum"}},
      {"FlippedHeaderByte",
       [](const std::string& d) { flip_byte(d + "/" + kShard1, 20); },
       FSDP_ERR_CORRUPT,
       {kShard1, "header"}},
      {"Truncated",
       [](const std::string& d) {
         std::string b = read_file(d + "/" + kShard1);
         write_file(d + "/" + kShard1, b.substr(0, b.size() - 100));
       },
       FSDP_ERR_CORRUPT,
       {kShard1, "truncated"}},
      {"MissingShard",
       [](const std::string& d) { std::filesystem::remove(d + "/" + kShard1); },
       FSDP_ERR_CORRUPT,
       {kShard1, "missing"}},
      {"MetadataDigitChanged",  // "step": 2 -> 3: still valid, caught only by the checksum
       [](const std::string& d) {
         std::string t = read_file(d + "/fsdp_checkpoint.json");
         size_t at = t.find("\"step\": 2");
         ASSERT_NE(at, std::string::npos);
         t[at + 8] = '3';
         write_file(d + "/fsdp_checkpoint.json", t);
       },
       FSDP_ERR_CORRUPT,
       {"fsdp_checkpoint.json", "fails its checksum"}},
      {"MissingMetadataChecksum",
       [](const std::string& d) { std::filesystem::remove(d + "/fsdp_checkpoint.json.crc32"); },
       FSDP_ERR_CORRUPT,
       {"fsdp_checkpoint.json.crc32", "missing"}},
      {"MissingMetadata",
       [](const std::string& d) { std::filesystem::remove(d + "/fsdp_checkpoint.json"); },
       FSDP_ERR_CORRUPT,
       {"fsdp_checkpoint.json", "missing"}},
      {"BadJson",
       [](const std::string& d) {
         std::string t = read_file(d + "/fsdp_checkpoint.json");
         write_meta_consistently(d, t.substr(0, t.size() / 2));
       },
       FSDP_ERR_CORRUPT,
       {"fsdp_checkpoint.json", "not valid JSON"}},
      {"HeaderLengthTooLarge",
       [](const std::string& d) {
         std::string b = read_file(d + "/" + kShard1);
         b[5] = char(0x7f);
         write_file(d + "/" + kShard1, b);
       },
       FSDP_ERR_CORRUPT,
       {kShard1, "header length"}},
      {"HeaderLengthOffByEight",
       [](const std::string& d) {
         std::string b = read_file(d + "/" + kShard1);
         b[0] = char(uint8_t(b[0]) - 8);
         write_file(d + "/" + kShard1, b);
       },
       FSDP_ERR_CORRUPT,
       {kShard1, "header"}},
      {"MetadataChecksumEdited",
       edit_meta([](nlohmann::json& j) {
         auto& crc = j["files"][1]["tensors"]["units.0.param"]["chunk_crc32"][0];
         crc = crc.get<uint64_t>() ^ 1u;
       }),
       FSDP_ERR_CORRUPT,
       {kShard1, "units.0.param", "checksum"}},
      {"ShapeDoesNotFitTheUnits",
       edit_meta([](nlohmann::json& j) {
         auto& p = j["units"][1]["params"][0];
         p["shape"] = {p["shape"][1], p["shape"][0]};
       }),
       FSDP_ERR_INVALID_ARGUMENT,
       {"fsdp_checkpoint.json", "blocks.1.weight", "shape"}},
      {"NumelDoesNotMatchShape",
       edit_meta([](nlohmann::json& j) { j["units"][0]["params"][1]["numel"] = 8; }),
       FSDP_ERR_CORRUPT,
       {"fsdp_checkpoint.json", "units[0].params[1].numel"}},
      {"FutureFormatVersion",
       edit_meta([](nlohmann::json& j) { j["format_version"] = 99; }),
       FSDP_ERR_CORRUPT,
       {"fsdp_checkpoint.json", "format_version"}},
      {"NotADirectory",
       [](const std::string& d) { std::filesystem::remove_all(d); },
       FSDP_ERR_INVALID_ARGUMENT,
       {"fsdp_load: ", "does not exist"}},
  };
}

// A sharded checkpoint of kNet saved at world 2 after 2 steps (in "ck"),
// made once and shared by the tests that damage or misfit it.
const std::string& good_checkpoint() {
  static TempDir* good = [] {
    auto* t = new TempDir;
    run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
      Job job;
      open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
      ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, 6)));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, 2, 2, rank));
      ASSERT_OK(fsdp_save(job.ctx.get(), (*t / "ck").c_str(), "sharded"));
    });
    return t;
  }();
  return good->path();
}

class Corruption : public ::testing::TestWithParam<Damage> {};

// State of a job trained 1 step from init 5, then (optionally) a load
// attempt, then 1 more step.
State damaged_run(const std::string* bad_dir, const Damage* d, State* before, State* after) {
  State end;
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
    ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, 5)));
    ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, 1, 2, rank));
    if (bad_dir != nullptr) {
      State b = gather(job, kNet);
      fsdp_status_t st = fsdp_load(job.ctx.get(), bad_dir->c_str());
      std::string msg = last_error_str();
      EXPECT_EQ(st, d->status) << status_str(st) << ": " << msg;
      for (const auto& s : d->says) EXPECT_NE(msg.find(s), std::string::npos) << "'" << s << "' not in: " << msg;
      State a = gather(job, kNet);
      if (rank == 0) {
        *before = b;
        *after = a;
      }
    }
    ASSERT_NO_FATAL_FAILURE(train(job, kNet, 1, 2, 2, rank));
    State p = gather(job, kNet);
    if (rank == 0) end = p;
  });
  return end;
}

TEST_P(Corruption, IsRefusedNamingTheFileAndTheContextIsUnchanged) {
  static const State control = damaged_run(nullptr, nullptr, nullptr, nullptr);
  TempDir tmp;
  std::string bad = tmp / "bad";
  copy_dir(good_checkpoint() + "/ck", bad);
  GetParam().apply(bad);
  State before, after;
  State end = damaged_run(&bad, &GetParam(), &before, &after);
  EXPECT_TRUE(bitwise_equal(before, after)) << "a failed load changed the params";
  // Still usable, and the optimizer state was untouched too: the next step
  // lands where a run that never tried the load does.
  EXPECT_TRUE(bitwise_equal(end, control));
}

INSTANTIATE_TEST_SUITE_P(Checkpoint, Corruption, ::testing::ValuesIn(damages()),
                         [](const auto& i) { return i.param.name; });

// A checkpoint of other units, or of an optimizer keeping other state, does
// not fit: refused before anything is read.
TEST(Checkpoint, LoadRefusesOtherUnitsOrOptimizer) {
  struct Misfit {
    Net net;
    std::map<std::string, std::string> opts;
    std::string says;
  };
  auto sgd = base_options("FULL_SHARD");
  sgd["optimizer"] = "sgd";
  // kNet's params without blocks.2, plus a head: every offender named at once.
  Net other = Net::make(2, 10);
  other.units.push_back({{"head.weight", {4, 4}}});
  const std::vector<Misfit> misfits = {
      {Net::make(4, 10), base_options("FULL_SHARD"),
       "registered but not in the checkpoint: 'blocks.3.weight' and 'blocks.3.bias'"},
      {other, base_options("FULL_SHARD"),
       "registered but not in the checkpoint: 'head.weight'; in the checkpoint but not registered: "
       "'blocks.2.bias' and 'blocks.2.weight'"},
      {Net::make(3, 12), base_options("FULL_SHARD"),
       "shapes differ: 'blocks.0.weight' ([10, 6] saved, [12, 7] registered)"},
      {kNet, sgd, "optimizer 'adamw' keeps state [exp_avg, exp_avg_sq]"},
  };
  for (const Misfit& m : misfits) {
    run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
      Job job;
      open_job(job, m.net, m.opts, rank, group);
      fsdp_status_t st = fsdp_load(job.ctx.get(), (good_checkpoint() + "/ck").c_str());
      std::string msg = last_error_str();
      EXPECT_EQ(st, FSDP_ERR_INVALID_ARGUMENT) << msg;
      EXPECT_NE(msg.find(m.says), std::string::npos) << msg;
      EXPECT_NE(msg.find("fsdp_checkpoint.json"), std::string::npos) << msg;
    });
  }
}

// ---- crash safety --------------------------------------------------------------------

State save_world4(const std::string& dir, uint64_t seed, int steps) {
  State saved;
  run_ranks(4, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
    ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, seed)));
    ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, steps, 4, rank));
    ASSERT_OK(fsdp_save(job.ctx.get(), dir.c_str(), "sharded"));
    State p = gather(job, kNet);
    if (rank == 0) saved = p;
  });
  return saved;
}

State load_world(const std::string& dir, int world) {
  std::vector<State> got(static_cast<size_t>(world));
  run_ranks(world, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
    ASSERT_OK(fsdp_load(job.ctx.get(), dir.c_str()));
    got[size_t(rank)] = gather(job, kNet);
  });
  return got[0];
}

// A forked process (a fresh one: no clean-up at its end) saves a new state at
// world 4 to `dir` with FSDP_CKPT_FAULT=`fault`; its exit status (86 when the
// fault crashed it where told).
int save_in_a_crashing_process(const std::string& dir, const std::string& fault, uint64_t seed) {
  pid_t pid = fork();
  if (pid == 0) {
    setenv("FSDP_CKPT_FAULT", fault.c_str(), 1);
    save_world4(dir, seed, 3);
    _exit(1);  // the save should not have returned
  }
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

struct CrashCase {
  std::string fault;
  std::string name;
};

class Crash : public ::testing::TestWithParam<CrashCase> {};

// A save at world 4 writes 4 shard files, then the metadata, then renames.
// The process dies after N files (FSDP_CKPT_FAULT, real _exit: no clean-up):
// the previous checkpoint still loads, bitwise.
TEST_P(Crash, BetweenFilesLeavesThePreviousCheckpointLoadable) {
  TempDir tmp;
  const std::string dir = tmp / "ck";
  const State previous = save_world4(dir, 7, 2);
  ASSERT_EQ(save_in_a_crashing_process(dir, GetParam().fault, 8), 86) << "the child did not crash where told to";
  EXPECT_TRUE(std::filesystem::exists(tmp / ".ck.fsdp-staging")) << "the crash left no partial checkpoint";
  EXPECT_TRUE(bitwise_equal(load_world(dir, 2), previous));
  // The next save clears the partial one and replaces the checkpoint.
  const State next = save_world4(dir, 9, 1);
  EXPECT_FALSE(std::filesystem::exists(tmp / ".ck.fsdp-staging"));
  EXPECT_TRUE(bitwise_equal(load_world(dir, 3), next));
}

INSTANTIATE_TEST_SUITE_P(Checkpoint, Crash,
                         ::testing::Values(CrashCase{"crash_after_files=1", "after_1_file"},
                                           CrashCase{"crash_after_files=2", "after_2_files"},
                                           CrashCase{"crash_after_files=4", "after_every_shard"},
                                           CrashCase{"crash_after_files=5", "after_the_metadata"},
                                           CrashCase{"no_exchange=1,crash_after_files=5",
                                                     "NoExchange_after_the_metadata"}),
                         [](const auto& i) { return i.param.name; });

// On a file system without RENAME_EXCHANGE the old checkpoint moves aside,
// then the new one into place. A crash between the two leaves the old one
// whole beside `dir`; the next save moves it back before anything else, so a
// save that then fails still leaves it at `dir`.
TEST(Checkpoint, CrashBetweenTheTwoRenamesIsRecoveredByTheNextSave) {
  TempDir tmp;
  const std::string dir = tmp / "ck";
  const State previous = save_world4(dir, 12, 2);
  ASSERT_EQ(save_in_a_crashing_process(dir, "no_exchange=1,crash_after_aside=1", 13), 86);
  ASSERT_FALSE(std::filesystem::exists(dir));
  EXPECT_TRUE(bitwise_equal(load_world(tmp / ".ck.fsdp-staging.old", 2), previous)) << "the aside copy is not whole";
  setenv("FSDP_CKPT_FAULT", "io_error_rank=1", 1);
  run_ranks(4, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
    EXPECT_STATUS(FSDP_ERR_IO, fsdp_save(job.ctx.get(), dir.c_str(), "sharded"));
  });
  unsetenv("FSDP_CKPT_FAULT");
  EXPECT_TRUE(bitwise_equal(load_world(dir, 4), previous));
  EXPECT_FALSE(std::filesystem::exists(tmp / ".ck.fsdp-staging.old"));
  // And the two-rename path, uninterrupted, replaces it.
  setenv("FSDP_CKPT_FAULT", "no_exchange=1", 1);
  const State next = save_world4(dir, 14, 1);
  unsetenv("FSDP_CKPT_FAULT");
  EXPECT_TRUE(bitwise_equal(load_world(dir, 1), next));
  EXPECT_FALSE(std::filesystem::exists(tmp / ".ck.fsdp-staging.old"));
}

// The second pass of a load fails on one rank (a disk error after every rank
// had checked its part, injected after rank 1's first unit): every rank
// returns FSDP_ERR_IO saying the state is partly loaded, and loading again
// mends it.
TEST(Checkpoint, AReadErrorInTheSecondPassFailsEveryRankSayingSoAndLoadingAgainMendsIt) {
  TempDir tmp;
  const std::string dir = tmp / "ck";
  const State saved = save_world4(dir, 15, 2);
  setenv("FSDP_CKPT_FAULT", "read_error_rank=1", 1);
  Meeting failed(2);
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
    fsdp_status_t st = fsdp_load(job.ctx.get(), dir.c_str());
    std::string msg = last_error_str();
    EXPECT_EQ(st, FSDP_ERR_IO) << msg;
    EXPECT_NE(msg.find("injected by FSDP_CKPT_FAULT"), std::string::npos) << msg;
    EXPECT_NE(msg.find("are now partly loaded; load again"), std::string::npos) << msg;
    failed.meet(rank, [] { unsetenv("FSDP_CKPT_FAULT"); });  // no rank reads it meanwhile
    ASSERT_OK(fsdp_load(job.ctx.get(), dir.c_str()));
    EXPECT_TRUE(bitwise_equal(gather(job, kNet), saved));
  });
  unsetenv("FSDP_CKPT_FAULT");
}

// One rank's write fails: every rank returns FSDP_ERR_IO naming that file,
// the previous checkpoint stays, the partial one is removed.
TEST(Checkpoint, WriteErrorOnOneRankFailsEveryRankAndKeepsThePrevious) {
  TempDir tmp;
  const std::string dir = tmp / "ck";
  const State previous = save_world4(dir, 10, 1);
  setenv("FSDP_CKPT_FAULT", "io_error_rank=2", 1);
  run_ranks(4, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
    fsdp_status_t st = fsdp_save(job.ctx.get(), dir.c_str(), "sharded");
    std::string msg = last_error_str();
    EXPECT_EQ(st, FSDP_ERR_IO) << msg;
    EXPECT_NE(msg.find("shard-00002-of-00004.safetensors"), std::string::npos) << msg;
  });
  unsetenv("FSDP_CKPT_FAULT");
  EXPECT_FALSE(std::filesystem::exists(tmp / ".ck.fsdp-staging"));
  EXPECT_TRUE(bitwise_equal(load_world(dir, 4), previous));
}

// A check that fails before fsdp_save's first collective (a unit in use)
// fails on that rank alone; the others wait in the call. The failing rank's
// next collective then decides: another call fails every rank at once with
// FSDP_ERR_MISMATCH naming both calls (not a timeout: timeout_s is 30 here),
// and fsdp_save again, in a valid state, joins the others' save.
TEST(Checkpoint, ACheckThatFailsOnOneRankBeforeTheFirstCollectiveIsSettledByItsNextCollective) {
  TempDir tmp;
  for (bool retry_save : {false, true}) {
    SCOPED_TRACE(retry_save ? "rank 0 then saves again" : "rank 0 then gathers a param");
    const std::string dir = tmp / (retry_save ? "retried" : "mismatched");
    run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
      Job job;
      open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
      ASSERT_OK(fsdp_forward_begin(job.units[0], job.host.stream()));
      if (rank == 1) {
        ASSERT_OK(fsdp_forward_end(job.units[0], job.host.stream()));
        EXPECT_STATUS(retry_save ? FSDP_OK : FSDP_ERR_MISMATCH, fsdp_save(job.ctx.get(), dir.c_str(), "sharded"));
        if (!retry_save) {
          EXPECT_NE(last_error_str().find("fsdp_save"), std::string::npos) << last_error_str();
        }
        return;
      }
      EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_save(job.ctx.get(), dir.c_str(), "sharded"));
      ASSERT_OK(fsdp_forward_end(job.units[0], job.host.stream()));
      if (retry_save) {
        EXPECT_OK(fsdp_save(job.ctx.get(), dir.c_str(), "sharded"));
      } else {
        std::vector<float> w(numel_of(kNet.units[0][0].shape));
        EXPECT_STATUS(FSDP_ERR_MISMATCH, fsdp_gather_param(job.units[0], 0, w.data(), w.size()));
      }
    });
  }
}

namespace {
std::mutex g_warn_mu;
std::vector<std::string> g_warnings;
void keep_warnings(fsdp_log_level_t level, int, const char* message, void*) {
  std::lock_guard<std::mutex> lock(g_warn_mu);
  if (level == FSDP_LOG_WARN) g_warnings.emplace_back(message);
}
}  // namespace

// A failed save whose staging directory cannot be removed (its parent became
// read-only, say: simulated, since root ignores permissions) leaves it behind
// with a warning naming it; the save still fails with the first error, and
// the next save clears the stale directory.
TEST(Checkpoint, AFailedSaveThatCannotRemoveItsStagingDirectoryWarnsNamingIt) {
  TempDir tmp;
  const std::string dir = tmp / "ck";
  const State previous = save_world4(dir, 10, 1);
  g_warnings.clear();
  ASSERT_OK(fsdp_log_set_callback(keep_warnings, nullptr));
  setenv("FSDP_CKPT_FAULT", "io_error_rank=2,cleanup_error=1", 1);
  run_ranks(4, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
    EXPECT_STATUS(FSDP_ERR_IO, fsdp_save(job.ctx.get(), dir.c_str(), "sharded"));
    EXPECT_NE(last_error_str().find("shard-00002-of-00004"), std::string::npos) << last_error_str();
  });
  unsetenv("FSDP_CKPT_FAULT");
  ASSERT_OK(fsdp_log_set_callback(nullptr, nullptr));
  const std::string staged = tmp / ".ck.fsdp-staging";
  EXPECT_TRUE(std::filesystem::exists(staged));
  ASSERT_EQ(g_warnings.size(), 1u) << "rank 0, which removes it, warns once";
  EXPECT_NE(g_warnings[0].find("'" + staged + "' was left behind"), std::string::npos) << g_warnings[0];
  EXPECT_NE(g_warnings[0].find("remove it by hand"), std::string::npos) << g_warnings[0];
  EXPECT_TRUE(bitwise_equal(load_world(dir, 4), previous));
  const State next = save_world4(dir, 11, 1);
  EXPECT_FALSE(std::filesystem::exists(staged));
  EXPECT_TRUE(bitwise_equal(load_world(dir, 4), next));
}

// ---- misuse --------------------------------------------------------------------------

TEST(Checkpoint, BadArgumentsFailOnEveryRankAndWriteNothing) {
  TempDir tmp;
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_save(job.ctx.get(), (tmp / "a").c_str(), "everything"));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_save(job.ctx.get(), nullptr, "full"));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_save(nullptr, "x", "full"));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_save(job.ctx.get(), (tmp / "a").c_str(), nullptr));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_load(job.ctx.get(), nullptr));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_load_partial(job.ctx.get(), nullptr));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_load_partial(nullptr, "x"));
    char small[1];
    size_t len = 7;
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_load_report(nullptr, small, 1, &len));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_load_report(job.ctx.get(), nullptr, 0, &len));
    EXPECT_EQ(len, 0u) << "the report's length comes back with the refusal";
    EXPECT_OK(fsdp_load_report(job.ctx.get(), small, 1, &len));
    EXPECT_EQ(small[0], '\0');
    EXPECT_STATUS(FSDP_ERR_MISMATCH, fsdp_save(job.ctx.get(), (tmp / ("r" + std::to_string(rank))).c_str(), "sharded"));
    ASSERT_OK(fsdp_forward_begin(job.units[0], job.host.stream()));
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_save(job.ctx.get(), (tmp / "a").c_str(), "sharded"));
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_load(job.ctx.get(), (tmp / "a").c_str()));
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_load_partial(job.ctx.get(), (tmp / "a").c_str()));
    ASSERT_OK(fsdp_forward_end(job.units[0], job.host.stream()));
  });
  EXPECT_TRUE(std::filesystem::is_empty(tmp.path()));
}

// fsdp_save replaces `dir` whole, so it must hold a checkpoint (or nothing).
TEST(Checkpoint, SaveRefusesToReplaceWhatIsNotACheckpoint) {
  FSDP_SKIP_WHEN_LATE("no host compute and no call that takes a stream: only what fsdp_save refuses");
  TempDir tmp;
  std::filesystem::create_directories(tmp / "notes");
  write_file(tmp / "notes/keep.txt", "mine");
  write_file(tmp / "file", "mine too");
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
    for (const char* d : {"notes", "file"}) {
      fsdp_status_t st = fsdp_save(job.ctx.get(), (tmp / d).c_str(), "sharded");
      std::string msg = last_error_str();
      EXPECT_EQ(st, FSDP_ERR_INVALID_ARGUMENT) << msg;
      EXPECT_NE(msg.find(tmp / d), std::string::npos) << msg;
    }
    // An empty directory is fine.
    std::filesystem::create_directories(tmp / "empty");
    EXPECT_OK(fsdp_save(job.ctx.get(), (tmp / "empty").c_str(), "sharded"));
  });
  EXPECT_EQ(read_file(tmp / "notes/keep.txt"), "mine");
  EXPECT_EQ(read_file(tmp / "file"), "mine too");
  EXPECT_TRUE(std::filesystem::exists(tmp / "empty/fsdp_checkpoint.json"));
}

// model.safetensors names tensors by param name: `units` (one param each)
// cannot be saved "full", only "sharded"; the refusal says `why`.
void expect_full_save_refused(const std::vector<std::pair<std::string, std::string>>& units, const std::string& why) {
  TempDir tmp;
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    ConfigPtr cfg = make_config(base_options("FULL_SHARD"));
    fsdp_ctx_t* raw = nullptr;
    ASSERT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
    CtxPtr ctx(raw);
    fsdp_unit_t* u = nullptr;
    for (const auto& [unit, param] : units) ASSERT_OK(register_unit(raw, unit, {{param, {4, 3}}}, &u));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_save(raw, (tmp / "full").c_str(), "full"));
    std::string msg = last_error_str();
    EXPECT_NE(msg.find(why), std::string::npos) << msg;
    EXPECT_OK(fsdp_save(raw, (tmp / "sharded").c_str(), "sharded"));
  });
  EXPECT_FALSE(std::filesystem::exists(tmp / "full"));
  EXPECT_TRUE(std::filesystem::exists(tmp / "sharded/fsdp_checkpoint.json"));
}

TEST(Checkpoint, FullSaveNeedsUniqueParamNames) {
  FSDP_SKIP_WHEN_LATE("no host compute and no call that takes a stream: only what fsdp_save refuses");
  expect_full_save_refused({{"a", "weight"}, {"b", "weight"}}, "'weight' is used twice (units 'a' and 'b')");
}

// "__metadata__" is the safetensors header's own key: no tensor may take it.
TEST(Checkpoint, FullSaveRefusesTheSafetensorsMetadataName) {
  FSDP_SKIP_WHEN_LATE("no host compute and no call that takes a stream: only what fsdp_save refuses");
  expect_full_save_refused({{"a", "__metadata__"}}, "'__metadata__' (unit 'a') is reserved by safetensors");
}

}  // namespace
