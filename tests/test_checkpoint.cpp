// Proves fsdp_save / fsdp_load: checkpoints load bitwise at any world size,
// sharding and grouping of units (by name), resume training exactly, are
// readable without libfsdp, load partly when told to, and a save or load holds about one unit in memory at a
// time. What goes wrong around them (damage, crashes, I/O errors, misuse) is
// test_checkpoint_faults.cpp's. The training around them computes through
// ckpt_util.h's Job::host: at once, or late on a host stream (the .late
// CTests), so saves and loads also follow steps whose compute ran late.
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

}  // namespace
