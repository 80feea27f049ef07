// Proves fsdp_save / fsdp_load: checkpoints load bitwise at any world size and
// sharding, resume training exactly, are readable without libfsdp, refuse
// damage with an error naming the file and tensor while leaving the context
// as it was, survive a crash between two files, and a full save holds about
// one unit in memory at a time. The training around them computes through
// ckpt_util.h's Job::host: at once, or late on a host stream (the .late
// CTests), so saves and loads also follow steps whose compute ran late.
#include <sys/wait.h>

#include <algorithm>

#include "ckpt_util.h"

using namespace fsdp_test;

namespace {

const Net kNet = Net::make(3, 10);

// ---- a checkpoint written at world 4 under FULL_SHARD, shared by the tests ----

struct Source {
  TempDir tmp;
  State params;                           // gathered after training
  std::map<std::string, StTensor> optim;  // optimizer.safetensors of the full save
};

const int kSourceSteps = 3;

Source& source() {
  static Source* s = [] {
    auto* src = new Source;
    run_ranks(4, [&](int rank, fsdp_local_group_t* group) {
      Job job;
      open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
      ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, 1)));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, kSourceSteps, 4, rank));
      ASSERT_OK(fsdp_save(job.ctx.get(), (src->tmp / "sharded").c_str(), "sharded"));
      ASSERT_OK(fsdp_save(job.ctx.get(), (src->tmp / "full").c_str(), "full"));
      State p = gather(job, kNet);
      if (rank == 0) src->params = p;
    });
    src->optim = read_safetensors(src->tmp / "full/optimizer.safetensors");
    return src;
  }();
  return *s;
}

nlohmann::json read_meta(const std::string& dir) {
  return nlohmann::json::parse(read_file(dir + "/fsdp_checkpoint.json"));
}

// ---- resharding on load ------------------------------------------------------------

struct LoadCase {
  std::string kind;  // of the source checkpoint
  int world;
  std::string sharding;
  std::map<std::string, std::string> extra = {};
};

std::string case_name(const ::testing::TestParamInfo<LoadCase>& i) {
  std::string n = i.param.kind + "_to_world" + std::to_string(i.param.world) + "_" + i.param.sharding;
  for (const auto& kv : i.param.extra) n += "_" + kv.first + kv.second;
  return n;
}

class ReshardOnLoad : public ::testing::TestWithParam<LoadCase> {};

// Params (gathered) and optimizer state (through a full save, read by the
// test's own reader) are bitwise those saved at world 4.
TEST_P(ReshardOnLoad, ParamsAndOptimizerStateAreBitwiseTheSaved) {
  const LoadCase& c = GetParam();
  Source& src = source();
  ASSERT_FALSE(src.params.empty());
  TempDir out;
  std::vector<State> got(static_cast<size_t>(c.world));
  run_ranks(c.world, [&](int rank, fsdp_local_group_t* group) {
    auto opts = base_options(c.sharding);
    for (const auto& kv : c.extra) opts[kv.first] = kv.second;
    Job job;
    open_job(job, kNet, opts, rank, group);
    ASSERT_OK(fsdp_load(job.ctx.get(), (src.tmp / c.kind).c_str()));
    got[size_t(rank)] = gather(job, kNet);
    ASSERT_OK(fsdp_save(job.ctx.get(), (out / "again").c_str(), "full"));
  });
  for (int r = 0; r < c.world; ++r) EXPECT_TRUE(bitwise_equal(got[size_t(r)], src.params)) << "rank " << r;
  auto model = read_safetensors(out / "again/model.safetensors");
  for (size_t k = 0; k < kNet.units.size(); ++k)
    for (size_t i = 0; i < kNet.units[k].size(); ++i)
      EXPECT_TRUE(bitwise_equal(model[kNet.units[k][i].name].values, src.params[k][i])) << kNet.units[k][i].name;
  auto optim = read_safetensors(out / "again/optimizer.safetensors");
  ASSERT_EQ(optim.size(), src.optim.size());
  ASSERT_EQ(optim.size(), 2 * 2 * kNet.units.size());  // exp_avg and exp_avg_sq of every param
  for (const auto& [name, t] : src.optim) {
    EXPECT_TRUE(bitwise_equal(optim[name].values, t.values)) << name;
    EXPECT_EQ(optim[name].shape, t.shape) << name;
  }
  auto meta = read_meta(out / "again");
  EXPECT_EQ(meta["optimizer"]["step"].get<int>(), kSourceSteps);
  EXPECT_EQ(meta["world_size"].get<int>(), c.world);
}

std::vector<LoadCase> load_cases() {
  std::vector<LoadCase> cases;
  for (const char* kind : {"sharded", "full"})
    for (int w : {1, 2, 3, 4})
      for (const char* s : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"}) cases.push_back({kind, w, s});
  cases.push_back({"sharded", 4, "HYBRID_SHARD", {{"shard_group_size", "2"}}});
  cases.push_back({"sharded", 2, "FULL_SHARD", {{"offload", "cpu"}}});
  cases.push_back({"full", 3, "SHARD_GRAD_OP", {{"param_dtype", "bf16"}}});
  cases.push_back({"sharded", 3, "FULL_SHARD", {{"align_bytes", "4"}}});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Checkpoint, ReshardOnLoad, ::testing::ValuesIn(load_cases()), case_name);

// Strategies whose shard group is not the world write one file per shard of
// the group; what they write loads anywhere.
TEST(Checkpoint, HybridAndNoShardSavesLoadUnderFullShard) {
  for (const auto& [sharding, files] : std::vector<std::pair<std::string, int>>{{"HYBRID_SHARD", 2}, {"NO_SHARD", 1}}) {
    SCOPED_TRACE(sharding);
    TempDir tmp;
    State saved;
    run_ranks(4, [&](int rank, fsdp_local_group_t* group) {
      auto opts = base_options(sharding);
      if (sharding == "HYBRID_SHARD") opts["shard_group_size"] = "2";
      Job job;
      open_job(job, kNet, opts, rank, group);
      ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, 2)));
      ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, 2, 4, rank));
      ASSERT_OK(fsdp_save(job.ctx.get(), (tmp / "ck").c_str(), "sharded"));
      State p = gather(job, kNet);
      if (rank == 0) saved = p;
    });
    auto meta = read_meta(tmp / "ck");
    EXPECT_EQ(meta["shard_world"].get<int>(), files);
    EXPECT_EQ(meta["files"].size(), size_t(files));
    std::vector<State> got(4);
    run_ranks(4, [&](int rank, fsdp_local_group_t* group) {
      Job job;
      open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
      ASSERT_OK(fsdp_load(job.ctx.get(), (tmp / "ck").c_str()));
      got[size_t(rank)] = gather(job, kNet);
    });
    for (int r = 0; r < 4; ++r) EXPECT_TRUE(bitwise_equal(got[size_t(r)], saved)) << "rank " << r;
  }
}

// ---- resume ------------------------------------------------------------------------

// Trains steps [0, 10) at world 4, saves, trains [10, 20): the reference end.
struct ResumeRef {
  TempDir tmp;
  State end;
  State at_save;
};

// "sharded" or "full", optionally with "/bf16" (param_dtype).
std::map<std::string, std::string> resume_options(const std::string& sharding, const std::string& variant) {
  auto o = base_options(sharding);
  if (variant.find("/bf16") != std::string::npos) o["param_dtype"] = "bf16";
  return o;
}
std::string kind_of(const std::string& variant) { return variant.substr(0, variant.find('/')); }

ResumeRef& resume_ref(const std::string& variant) {
  static std::map<std::string, std::unique_ptr<ResumeRef>> refs;
  auto& r = refs[variant];
  if (r) return *r;
  r = std::make_unique<ResumeRef>();
  const std::string kind = kind_of(variant);
  run_ranks(4, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, kNet, resume_options("FULL_SHARD", variant), rank, group);
    ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(kNet, 3)));
    ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, 10, 4, rank));
    ASSERT_OK(fsdp_save(job.ctx.get(), (r->tmp / "ck").c_str(), kind.c_str()));
    State mid = gather(job, kNet);
    ASSERT_NO_FATAL_FAILURE(train(job, kNet, 10, 20, 4, rank));
    State end = gather(job, kNet);
    if (rank == 0) {
      r->at_save = mid;
      r->end = end;
    }
  });
  return *r;
}

State resume(const std::string& dir, int world, const std::string& sharding, const std::string& variant) {
  std::vector<State> got(static_cast<size_t>(world));
  run_ranks(world, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, kNet, resume_options(sharding, variant), rank, group);
    ASSERT_OK(fsdp_load(job.ctx.get(), dir.c_str()));
    ASSERT_NO_FATAL_FAILURE(train(job, kNet, 10, 20, world, rank));
    got[size_t(rank)] = gather(job, kNet);
  });
  for (int r = 1; r < world; ++r) EXPECT_TRUE(bitwise_equal(got[size_t(r)], got[0])) << "rank " << r;
  return got[0];
}

// The largest rel_max_diff over every tensor; infinite when the structure
// differs (a rank that failed returns an empty State).
double max_rel_error(const State& a, const State& ref) {
  if (a.size() != ref.size()) return INFINITY;
  double worst = 0;
  for (size_t k = 0; k < ref.size(); ++k) {
    if (a[k].size() != ref[k].size()) return INFINITY;
    for (size_t i = 0; i < ref[k].size(); ++i) worst = std::max(worst, rel_max_diff(a[k][i], ref[k][i]));
  }
  return worst;
}

class Resume : public ::testing::TestWithParam<std::string> {};

TEST_P(Resume, AtTheSameWorldSizeIsBitwise) {
  ResumeRef& ref = resume_ref(GetParam());
  State got = resume(ref.tmp / "ck", 4, "FULL_SHARD", GetParam());
  EXPECT_TRUE(bitwise_equal(got, ref.end));
}

// The same world size under another strategy reduces in the same order.
TEST_P(Resume, UnderShardGradOpIsBitwise) {
  ResumeRef& ref = resume_ref(GetParam());
  EXPECT_TRUE(bitwise_equal(resume(ref.tmp / "ck", 4, "SHARD_GRAD_OP", GetParam()), ref.end));
}

// Another world size sums the grads in another order: rounding only. The
// engine's own equivalence tests hold 20-step runs to 1e-5 of the unsharded
// reference in fp32, and to 3e-2 in bf16 (8-bit mantissas, grads reduced in
// bf16); 10 steps of this quadratic stay inside both. (A lost moment or step
// count is O(1): ParamsWithoutOptimizerStateDoNotResumeTheSame.)
TEST_P(Resume, AtOtherWorldSizesMatchesWithinTheDtypesTolerance) {
  ResumeRef& ref = resume_ref(GetParam());
  const double tol = GetParam().find("bf16") != std::string::npos ? 3e-2 : 1e-5;
  for (int w : {1, 2, 3}) {
    State got = resume(ref.tmp / "ck", w, "FULL_SHARD", GetParam());
    EXPECT_LT(max_rel_error(got, ref.end), tol) << "world " << w;
  }
}

// The power of the tests above: params alone (no optimizer state, step 0)
// do not resume to the same end.
TEST_P(Resume, ParamsWithoutOptimizerStateDoNotResumeTheSame) {
  ResumeRef& ref = resume_ref(GetParam());
  State got;
  run_ranks(4, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, kNet, resume_options("FULL_SHARD", GetParam()), rank, group);
    ASSERT_NO_FATAL_FAILURE(set_state(job, ref.at_save));
    ASSERT_NO_FATAL_FAILURE(train(job, kNet, 10, 20, 4, rank));
    State p = gather(job, kNet);
    if (rank == 0) got = p;
  });
  EXPECT_GT(max_rel_error(got, ref.end), 1e-3);
}

// bf16: the load recomputes the bf16 params the next forward uses from the
// loaded fp32 master.
INSTANTIATE_TEST_SUITE_P(Checkpoint, Resume, ::testing::Values("sharded", "full", "sharded/bf16", "full/bf16"),
                         [](const auto& i) {
                           std::string n = i.param;
                           std::replace(n.begin(), n.end(), '/', '_');
                           return n;
                         });

// ---- model.safetensors without libfsdp -----------------------------------------------

TEST(Checkpoint, FullModelReadsBackWithAnIndependentReader) {
  TempDir tmp;
  const State init = make_init(kNet, 4);
  State trained;
  run_ranks(4, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, kNet, base_options("FULL_SHARD"), rank, group);
    ASSERT_NO_FATAL_FAILURE(set_state(job, init));
    ASSERT_OK(fsdp_save(job.ctx.get(), (tmp / "at_init").c_str(), "full"));
    ASSERT_NO_FATAL_FAILURE(train(job, kNet, 0, 2, 4, rank));
    ASSERT_OK(fsdp_save(job.ctx.get(), (tmp / "trained").c_str(), "full"));
    State p = gather(job, kNet);
    if (rank == 0) trained = p;
  });
  for (const auto& [dir, want] :
       std::vector<std::pair<std::string, const State*>>{{"at_init", &init}, {"trained", &trained}}) {
    SCOPED_TRACE(dir);
    auto model = read_safetensors(tmp / (dir + "/model.safetensors"));
    size_t n = 0;
    for (size_t k = 0; k < kNet.units.size(); ++k)
      for (size_t i = 0; i < kNet.units[k].size(); ++i, ++n) {
        const ParamSpec& p = kNet.units[k][i];
        ASSERT_EQ(model.count(p.name), 1u) << p.name;
        EXPECT_EQ(model[p.name].shape, p.shape) << p.name;
        EXPECT_TRUE(bitwise_equal(model[p.name].values, (*want)[k][i])) << p.name;
      }
    EXPECT_EQ(model.size(), n);
  }
}

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
  static const State control = damaged_run(nullptr, nullptr, nullptr, nullptr);
  TempDir tmp;
  std::string bad = tmp / "bad";
  copy_dir(*good / "ck", bad);
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
  Source& src = source();
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
      {Net::make(3, 12), base_options("FULL_SHARD"), "shapes differ: 'blocks.0.weight' ([10, 6] saved, [12, 7] registered)"},
      {kNet, sgd, "optimizer 'adamw' keeps state [exp_avg, exp_avg_sq]"},
  };
  for (const Misfit& m : misfits) {
    run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
      Job job;
      open_job(job, m.net, m.opts, rank, group);
      fsdp_status_t st = fsdp_load(job.ctx.get(), (src.tmp / "sharded").c_str());
      std::string msg = last_error_str();
      EXPECT_EQ(st, FSDP_ERR_INVALID_ARGUMENT) << msg;
      EXPECT_NE(msg.find(m.says), std::string::npos) << msg;
      EXPECT_NE(msg.find("fsdp_checkpoint.json"), std::string::npos) << msg;
    });
  }
}

// ---- load by name into another grouping ----------------------------------------------

// kNet's six params in other units: split (blocks.0), merged (blocks.1 with
// blocks.2's bias), reordered (blocks.2's weight first), under other unit names.
Net regrouped() {
  const auto& b = kNet.units;
  Net n;
  n.units = {{b[2][0], b[0][1]}, {b[1][0], b[1][1], b[2][1]}, {b[0][0]}};
  return n;
}

std::map<std::string, Tensor> by_name(const Net& net, const State& s) {
  std::map<std::string, Tensor> out;
  for (size_t k = 0; k < net.units.size(); ++k)
    for (size_t i = 0; i < net.units[k].size(); ++i) out[net.units[k][i].name] = s[k][i];
  return out;
}

struct RegroupCase {
  std::string kind;
  int world;
  std::string sharding;
};

class LoadByName : public ::testing::TestWithParam<RegroupCase> {};

// Saved at world 4 with kNet's units, loaded into other units at another
// world size and strategy: params and optimizer state bitwise by name, the
// step and the learning rate restored.
TEST_P(LoadByName, AnotherGroupingGetsEveryParamAndMomentBitwise) {
  const RegroupCase& c = GetParam();
  Source& src = source();
  ASSERT_FALSE(src.params.empty());
  const Net net = regrouped();
  TempDir out;
  std::vector<std::map<std::string, Tensor>> got(static_cast<size_t>(c.world));
  run_ranks(c.world, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, net, base_options(c.sharding), rank, group);
    ASSERT_OK(fsdp_load(job.ctx.get(), (src.tmp / c.kind).c_str()));
    uint64_t step = 0;
    EXPECT_OK(fsdp_ctx_step(job.ctx.get(), &step));
    EXPECT_EQ(step, uint64_t(kSourceSteps));
    got[size_t(rank)] = by_name(net, gather(job, net));
    ASSERT_OK(fsdp_save(job.ctx.get(), (out / "again").c_str(), "full"));
  });
  const auto want = by_name(kNet, src.params);
  for (int r = 0; r < c.world; ++r) {
    ASSERT_EQ(got[size_t(r)].size(), want.size());
    for (const auto& [name, values] : want) EXPECT_TRUE(bitwise_equal(got[size_t(r)][name], values)) << name;
  }
  auto optim = read_safetensors(out / "again/optimizer.safetensors");
  ASSERT_EQ(optim.size(), src.optim.size());
  for (const auto& [name, t] : src.optim) EXPECT_TRUE(bitwise_equal(optim[name].values, t.values)) << name;
  auto meta = read_meta(out / "again");
  EXPECT_EQ(meta["optimizer"]["step"].get<int>(), kSourceSteps);
}

INSTANTIATE_TEST_SUITE_P(Checkpoint, LoadByName,
                         ::testing::Values(RegroupCase{"sharded", 1, "FULL_SHARD"}, RegroupCase{"sharded", 3, "FULL_SHARD"},
                                           RegroupCase{"full", 2, "SHARD_GRAD_OP"}, RegroupCase{"sharded", 2, "NO_SHARD"},
                                           RegroupCase{"full", 3, "FULL_SHARD"}),
                         [](const auto& i) {
                           return i.param.kind + "_to_world" + std::to_string(i.param.world) + "_" + i.param.sharding;
                         });

std::string load_report(fsdp_ctx_t* ctx) {
  size_t n = 0;
  fsdp_load_report(ctx, nullptr, 0, &n);  // refused, with the length
  std::string text(n + 1, '\0');
  EXPECT_OK(fsdp_load_report(ctx, text.data(), text.size(), &n));
  text.resize(n);
  return text;
}

// Not strict: the params the checkpoint has are loaded with their optimizer
// state, the one it lacks keeps its values and (fresh) state, its params that
// are not registered are ignored, and the report lists both kinds. A shape
// that differs is refused all the same; a strict load that matched reports "".
TEST(Checkpoint, APartialLoadLoadsWhatMatchesAndReportsTheRest) {
  Source& src = source();
  ASSERT_FALSE(src.params.empty());
  Net net = Net::make(2, 10);
  net.units.insert(net.units.begin(), {{"head.weight", {4, 4}}});
  TempDir out;
  std::vector<std::string> reports(2);
  std::vector<State> got(2);
  State init;
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, net, base_options("FULL_SHARD"), rank, group);
    const State mine = make_init(net, 5);
    ASSERT_NO_FATAL_FAILURE(set_state(job, mine));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_load(job.ctx.get(), (src.tmp / "sharded").c_str()));
    ASSERT_OK(fsdp_load_partial(job.ctx.get(), (src.tmp / "sharded").c_str()));
    reports[size_t(rank)] = load_report(job.ctx.get());
    got[size_t(rank)] = gather(job, net);
    if (rank == 0) init = mine;
    ASSERT_OK(fsdp_save(job.ctx.get(), (out / "again").c_str(), "full"));
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(reports[size_t(r)], "missing: head.weight\nunexpected: blocks.2.bias\nunexpected: blocks.2.weight\n");
    EXPECT_TRUE(bitwise_equal(got[size_t(r)][0][0], init[0][0])) << "the param the checkpoint lacks changed";
    for (size_t k = 1; k < net.units.size(); ++k)
      for (size_t i = 0; i < net.units[k].size(); ++i)
        EXPECT_TRUE(bitwise_equal(got[size_t(r)][k][i], src.params[k - 1][i])) << net.units[k][i].name;
  }
  auto optim = read_safetensors(out / "again/optimizer.safetensors");
  for (const auto& [name, t] : optim) {
    if (name.rfind("head.weight", 0) == 0) {
      EXPECT_TRUE(std::all_of(t.values.begin(), t.values.end(), [](float v) { return v == 0.f; })) << name;
    } else {
      ASSERT_TRUE(src.optim.count(name)) << name;
      EXPECT_TRUE(bitwise_equal(t.values, src.optim[name].values)) << name;
    }
  }
  // A shape that differs is refused without strictness too; a strict load
  // that matched everything reports nothing.
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, Net::make(3, 12), base_options("FULL_SHARD"), rank, group);
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_load_partial(job.ctx.get(), (src.tmp / "sharded").c_str()));
    EXPECT_NE(last_error_str().find("fsdp_load_partial: checkpoint"), std::string::npos) << last_error_str();
    EXPECT_NE(last_error_str().find("shapes differ"), std::string::npos) << last_error_str();
  });
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    Job same;
    open_job(same, kNet, base_options("FULL_SHARD"), rank, group);
    ASSERT_OK(fsdp_load(same.ctx.get(), (src.tmp / "sharded").c_str()));
    EXPECT_EQ(load_report(same.ctx.get()), "");
  });
}

// A load reads each rank's part twice (checked first, then into place), so
// that it holds one unit's fp32 shard more than the steady state instead of
// a second copy of every param and moment; with offload=cpu that buffer is
// host memory. Measured with fsdp_memory_stats around the load.
TEST(Checkpoint, ALoadHoldsAtMostOneUnitShardAboveTheSteadyState) {
  Source& src = source();
  ASSERT_FALSE(src.params.empty());
  for (const char* offload : {"none", "cpu"}) {
    SCOPED_TRACE(std::string("offload=") + offload);
    run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
      auto opts = base_options("FULL_SHARD");
      opts["offload"] = offload;
      Job job;
      open_job(job, kNet, opts, rank, group);
      size_t largest = 0;
      for (fsdp_unit_t* u : job.units) {
        float* p = nullptr;
        size_t off = 0, n = 0;
        ASSERT_OK(fsdp_shard_info(u, &p, &off, &n));
        largest = std::max(largest, n * sizeof(float));
      }
      fsdp_memory_stats_t before{}, after{};
      before.struct_size = after.struct_size = sizeof(fsdp_memory_stats_t);
      ASSERT_OK(fsdp_memory_stats(job.ctx.get(), &before));
      ASSERT_OK(fsdp_memory_stats_reset_peak(job.ctx.get()));
      ASSERT_OK(fsdp_load(job.ctx.get(), (src.tmp / "sharded").c_str()));
      ASSERT_OK(fsdp_memory_stats(job.ctx.get(), &after));
      EXPECT_EQ(after.total_nbytes, before.total_nbytes);
      EXPECT_LE(after.total_peak_nbytes, before.total_nbytes + largest)
          << "the load's peak is " << after.total_peak_nbytes - before.total_nbytes
          << " bytes above the steady state; the largest unit's shard is " << largest;
      // The state it loaded is the checkpoint's (the two passes read the same).
      EXPECT_TRUE(bitwise_equal(gather(job, kNet), src.params));
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

// ---- memory ------------------------------------------------------------------------

// Rank 0 writes model.safetensors gathering one unit at a time: its peak
// grows by the largest unit (fp32, padded), never by the model.
TEST(Checkpoint, FullSavePeakStaysWithinTheLargestUnitPlusAConstant) {
  FSDP_SKIP_WHEN_LATE("no host compute and no call that takes a stream: it measures fsdp_save alone");
  const Net net = Net::make(8, 48);
  for (bool offload : {false, true}) {
    SCOPED_TRACE(offload ? "offload=cpu" : "no offload");
    TempDir tmp;
    size_t growth = 0, largest = 0, model = 0, shard_of_largest = 0;
    run_ranks(4, [&](int rank, fsdp_local_group_t* group) {
      auto opts = base_options("FULL_SHARD");
      if (offload) opts["offload"] = "cpu";
      Job job;
      open_job(job, net, opts, rank, group);
      ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(net, 11)));
      ASSERT_OK(fsdp_memory_stats_reset_peak(job.ctx.get()));
      fsdp_memory_stats_t before{};
      before.struct_size = sizeof before;
      ASSERT_OK(fsdp_memory_stats(job.ctx.get(), &before));
      ASSERT_OK(fsdp_save(job.ctx.get(), (tmp / "full").c_str(), "full"));
      fsdp_memory_stats_t after{};
      after.struct_size = sizeof after;
      ASSERT_OK(fsdp_memory_stats(job.ctx.get(), &after));
      if (rank != 0) return;
      growth = after.total_peak_nbytes - before.total_nbytes;
      for (auto* u : job.units) {
        float* p = nullptr;
        size_t off = 0, n = 0;
        ASSERT_OK(fsdp_shard_info(u, &p, &off, &n));
        if (4 * n * 4 > largest) shard_of_largest = n * 4;
        largest = std::max(largest, 4 * n * 4);  // world 4, fp32
        model += 4 * n * 4;
      }
    });
    const size_t constant = 4096;
    const size_t bound = largest + (offload ? shard_of_largest : 0) + constant;
    EXPECT_LE(growth, bound) << "largest unit " << largest << " B, model " << model << " B";
    EXPECT_GT(growth, 0u) << "the gather was not counted at all";
    EXPECT_LT(bound, model / 2) << "the test cannot tell one unit from the model";
  }
}

// ---- ranks as processes -------------------------------------------------------------

// Runs as 4 threads, and as the 4 processes of an mpirun job (CTest
// mpi_np4_checkpoint, which names a directory every process sees in
// FSDP_TEST_CKPT_DIR): each rank writes its own shard file, rank 0 the rest;
// fresh contexts load both kinds bitwise and train on exactly as the saver.
// Every rank checks its own results, so nothing needs exchanging.
TEST(CheckpointWorld4, SaveAndLoadWithRanksAsThreadsOrProcesses) {
  TempDir tmp;
  const char* env = std::getenv("FSDP_TEST_CKPT_DIR");
  const std::string base = env != nullptr ? std::string(env) + "/np4" : tmp.path();
  if (launcher_rank() == 0 && env != nullptr) {
    std::filesystem::remove_all(base);
    std::filesystem::create_directories(base);
  }
  run_ranks(4, [&](int rank, fsdp_local_group_t* group) {
    State saved, end;
    {  // a rank has one live context at a time
      Job saver;
      open_job(saver, kNet, base_options("FULL_SHARD"), rank, group);
      ASSERT_NO_FATAL_FAILURE(set_state(saver, make_init(kNet, 15)));
      ASSERT_NO_FATAL_FAILURE(train(saver, kNet, 0, 3, 4, rank));
      // The first collective of the saver waited for rank 0's clean-up above.
      ASSERT_OK(fsdp_save(saver.ctx.get(), (base + "/sharded").c_str(), "sharded"));
      ASSERT_OK(fsdp_save(saver.ctx.get(), (base + "/full").c_str(), "full"));
      saved = gather(saver, kNet);
      if (rank == 0) {
        auto model = read_safetensors(base + "/full/model.safetensors");
        for (size_t k = 0; k < kNet.units.size(); ++k)
          for (size_t i = 0; i < kNet.units[k].size(); ++i)
            EXPECT_TRUE(bitwise_equal(model[kNet.units[k][i].name].values, saved[k][i])) << kNet.units[k][i].name;
      }
      ASSERT_NO_FATAL_FAILURE(train(saver, kNet, 3, 5, 4, rank));
      end = gather(saver, kNet);
    }
    for (const char* kind : {"sharded", "full"}) {
      SCOPED_TRACE(kind);
      Job loader;
      open_job(loader, kNet, base_options("SHARD_GRAD_OP"), rank, group);
      ASSERT_OK(fsdp_load(loader.ctx.get(), (base + "/" + kind).c_str()));
      EXPECT_TRUE(bitwise_equal(gather(loader, kNet), saved));
      ASSERT_NO_FATAL_FAILURE(train(loader, kNet, 3, 5, 4, rank));
      EXPECT_TRUE(bitwise_equal(gather(loader, kNet), end));
    }
    // Damage one rank's file: every rank fails, naming it.
    const std::string victim_file = base + "/sharded/shard-00003-of-00004.safetensors";
    // Shard 3 is mostly padding, which no load reads: flip a byte of the
    // one param that reaches into it (unit 1's bias).
    if (rank == 0) flip_byte(victim_file, data_offset(victim_file, "units.1.param") + 4);
    Job victim;
    open_job(victim, kNet, base_options("FULL_SHARD"), rank, group);  // collective: after the flip
    fsdp_status_t st = fsdp_load(victim.ctx.get(), (base + "/sharded").c_str());
    std::string msg = last_error_str();
    EXPECT_EQ(st, FSDP_ERR_CORRUPT) << msg;
    EXPECT_NE(msg.find("shard-00003-of-00004.safetensors"), std::string::npos) << msg;
  });
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
