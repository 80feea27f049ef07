// Proves that prefetching on the comm stream changes when gathers happen, never
// what is computed: every prefetch setting gives parameters bitwise identical to
// no prefetch; gathers are issued ahead of the calls that need them (read from
// the trace's recorded order, not from timing); limit_all_gathers bounds the
// gathered units; a changed execution order gives one warning and correct results.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "host_stream.h"
#include "rank_runner.h"

using namespace fsdp_test;

namespace {

constexpr int kUnits = 5;
constexpr int kSteps = 4;

size_t unit_numel(int u, bool equal_sizes) { return equal_sizes ? 64 : 40 + 7 * static_cast<size_t>(u); }

struct Model {
  CtxPtr ctx;
  std::vector<fsdp_unit_t*> units;
};

void build(Model& m, const std::map<std::string, std::string>& opts, fsdp_local_group_t* group, int rank,
           bool equal_sizes = false) {
  std::map<std::string, std::string> all = {{"timeout_s", "20"}, {"lr", "0.01"}, {"weight_decay", "0.1"}};
  for (const auto& kv : opts) all[kv.first] = kv.second;
  ConfigPtr cfg = make_config(all);
  ASSERT_TRUE(cfg);
  fsdp_ctx_t* raw = nullptr;
  ASSERT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
  m.ctx.reset(raw);
  for (int u = 0; u < kUnits; ++u) {
    fsdp_unit_t* unit = nullptr;
    const size_t n = unit_numel(u, equal_sizes);
    ASSERT_OK(register_unit(raw, "u" + std::to_string(u), {{"w", {int64_t(n)}}}, &unit));
    const auto init = Rng(100 + static_cast<uint64_t>(u)).uniform_vec(n, -1.f, 1.f);
    ASSERT_OK(fsdp_param_set_values(unit, 0, init.data(), n));
    m.units.push_back(unit);
  }
}

// One iteration in which every value depends on the gathered params, so a
// prefetch that handed out stale or wrong params would change the result.
// `order` is the forward order; backward runs it in reverse.
void iterate(Model& m, int rank, int step, const std::vector<int>& order) {
  std::vector<float> act(kUnits, 0.f);
  float carry = 0.1f * static_cast<float>(rank + 1);
  for (int u : order) {
    void* p = nullptr;
    ASSERT_OK(fsdp_forward_begin(m.units[u], nullptr));
    ASSERT_OK(fsdp_param_ptr(m.units[u], 0, &p));
    const float* w = static_cast<const float*>(p);
    float s = carry;
    for (size_t k = 0; k < unit_numel(u, false) && k < 40; ++k) s += w[k] * static_cast<float>(k % 5 - 2 + step);
    act[u] = std::tanh(s);
    carry = act[u];
    ASSERT_OK(fsdp_forward_end(m.units[u], nullptr));
  }
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    const int u = *it;
    void *p = nullptr, *g = nullptr;
    ASSERT_OK(fsdp_backward_begin(m.units[u], nullptr));
    ASSERT_OK(fsdp_param_ptr(m.units[u], 0, &p));
    ASSERT_OK(fsdp_grad_ptr(m.units[u], 0, &g));
    const float* w = static_cast<const float*>(p);
    float* gw = static_cast<float*>(g);
    size_t n = 0;
    size_t off = 0;
    ASSERT_OK(fsdp_param_flat_range(m.units[u], 0, &off, &n));
    for (size_t k = 0; k < n; ++k) gw[k] += w[k] * act[u] + 0.01f * static_cast<float>((k + rank) % 7);
    ASSERT_OK(fsdp_backward_end(m.units[u], nullptr));
  }
  ASSERT_OK(fsdp_step(m.ctx.get(), nullptr));
}

std::vector<int> natural_order() {
  std::vector<int> o;
  for (int u = 0; u < kUnits; ++u) o.push_back(u);
  return o;
}

// Trains kSteps iterations (iteration `changed_at`, if >= 0, runs units 1 and 2
// swapped) and returns every param, gathered on every rank.
std::vector<std::vector<float>> train(int world, const std::map<std::string, std::string>& opts, int changed_at = -1) {
  std::vector<std::vector<std::vector<float>>> per_rank(static_cast<size_t>(world));
  run_ranks(world, [&](int rank, fsdp_local_group_t* group) {
    Model m;
    build(m, opts, group, rank);
    if (::testing::Test::HasFatalFailure()) return;
    for (int step = 0; step < kSteps; ++step) {
      std::vector<int> order = natural_order();
      if (step == changed_at) std::swap(order[1], order[2]);
      iterate(m, rank, step, order);
      if (::testing::Test::HasFatalFailure()) return;
    }
    auto& out = per_rank[static_cast<size_t>(rank)];
    for (int u = 0; u < kUnits; ++u) {
      std::vector<float> w(unit_numel(u, false));
      ASSERT_OK(fsdp_gather_param(m.units[u], 0, w.data(), w.size()));
      out.push_back(w);
    }
    EXPECT_OK(fsdp_ctx_finalize(m.ctx.get()));
  });
  for (int r = 1; r < world; ++r) EXPECT_EQ(per_rank[static_cast<size_t>(r)], per_rank[0]) << "rank " << r;
  return per_rank[0];
}

bool bitwise_equal(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t u = 0; u < a.size(); ++u) {
    if (a[u].size() != b[u].size()) return false;
    if (std::memcmp(a[u].data(), b[u].data(), a[u].size() * sizeof(float)) != 0) return false;
  }
  return true;
}

const std::map<std::string, std::string> kNoPrefetch = {{"forward_prefetch", "0"}, {"backward_prefetch", "none"}};

}  // namespace

// ---- every prefetch setting computes the same bits --------------------------

class PrefetchSetting : public ::testing::TestWithParam<std::tuple<int, std::string, int, std::string, int>> {};

TEST_P(PrefetchSetting, GivesParamsBitwiseIdenticalToNoPrefetch) {
  const auto [world, sharding, fwd, bwd, limit] = GetParam();
  std::map<std::string, std::string> base = kNoPrefetch;
  base["sharding"] = sharding;
  const auto reference = train(world, base);
  // The reference itself must have trained: params moved away from their init.
  EXPECT_NE(reference[0][0], Rng(100).uniform_vec(1, -1.f, 1.f)[0]);
  std::map<std::string, std::string> opts = {{"sharding", sharding},
                                             {"forward_prefetch", std::to_string(fwd)},
                                             {"backward_prefetch", bwd},
                                             {"limit_all_gathers", std::to_string(limit)}};
  EXPECT_TRUE(bitwise_equal(train(world, opts), reference));
}

INSTANTIATE_TEST_SUITE_P(All, PrefetchSetting,
                         ::testing::Combine(::testing::Values(2, 4), ::testing::Values("FULL_SHARD", "SHARD_GRAD_OP"),
                                            ::testing::Values(0, 1), ::testing::Values("pre", "post", "none"),
                                            ::testing::Values(1, 2, 3)),
                         [](const auto& pi) {
                           return "world" + std::to_string(std::get<0>(pi.param)) + "_" + std::get<1>(pi.param) +
                                  "_fwd" + std::to_string(std::get<2>(pi.param)) + "_" + std::get<3>(pi.param) +
                                  "_limit" + std::to_string(std::get<4>(pi.param));
                         });

// ---- gathers are issued ahead, read from the trace ---------------------------

namespace {

struct TraceEvent {
  std::string name;
  char phase;
  long seq;
};

// Reads the events fsdp_trace_write wrote (one per line) back.
std::vector<TraceEvent> read_trace(const std::string& path) {
  std::vector<TraceEvent> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    size_t n = line.find("\"name\": \"");
    size_t ph = line.find("\"ph\": \"");
    size_t sq = line.find("\"seq\": ");
    if (n == std::string::npos || ph == std::string::npos || sq == std::string::npos) continue;
    size_t n_end = line.find('"', n + 9);
    out.push_back({line.substr(n + 9, n_end - n - 9), line[ph + 7], std::stol(line.substr(sq + 7))});
  }
  return out;
}

long seq_of(const std::vector<TraceEvent>& ev, const std::string& name, char phase) {
  for (const auto& e : ev) {
    if (e.name == name && e.phase == phase) return e.seq;
  }
  return -1;
}

}  // namespace

TEST(PrefetchOrder, ForwardPrefetchIssuesTheNextGatherBeforeItIsNeeded) {
  run_ranks(2, [](int rank, fsdp_local_group_t* group) {
    Model m;
    build(m, {{"forward_prefetch", "1"}, {"backward_prefetch", "pre"}, {"limit_all_gathers", "2"}}, group, rank);
    if (::testing::Test::HasFatalFailure()) return;
    iterate(m, rank, 0, natural_order());  // the first iteration records the order
    ASSERT_OK(fsdp_trace_begin(m.ctx.get()));
    iterate(m, rank, 1, natural_order());
    const std::string path = ::testing::TempDir() + "overlap_trace_" + std::to_string(::getpid()) + "_" + std::to_string(rank) + ".json";
    ASSERT_OK(fsdp_trace_write(m.ctx.get(), path.c_str()));
    const auto ev = read_trace(path);
    for (int i = 0; i + 1 < kUnits; ++i) {
      const std::string next = "u" + std::to_string(i + 1);
      const long issued =
          seq_of(ev, "prefetch all_gather of unit '" + next + "' (#" + std::to_string(i + 1) + ")", 'i');
      ASSERT_GE(issued, 0) << "no forward prefetch of " << next;
      EXPECT_LT(issued, seq_of(ev, "forward_begin " + next, 'B')) << next << " was gathered on demand";
      EXPECT_LT(issued, seq_of(ev, "forward_end u" + std::to_string(i), 'E'))
          << next << " was not issued while u" << i << " computed";
    }
    // Backward pre-prefetch: unit i-1's gather is issued inside backward_begin(i).
    for (int i = kUnits - 1; i > 0; --i) {
      const std::string prev =
          "prefetch all_gather of unit 'u" + std::to_string(i - 1) + "' (#" + std::to_string(i - 1) + ")";
      const long begin = seq_of(ev, "backward_begin u" + std::to_string(i), 'B');
      const long end = seq_of(ev, "backward_begin u" + std::to_string(i), 'E');
      bool inside = false;
      for (const auto& e : ev) inside |= e.name == prev && e.phase == 'i' && e.seq > begin && e.seq < end;
      EXPECT_TRUE(inside) << "u" << i - 1 << " was not prefetched by backward_begin(u" << i << ")";
    }
    // The comm track shows each collective with its unit and bytes.
    bool saw_comm = false;
    for (const auto& e : ev) saw_comm |= e.name.rfind("reduce_scatter of unit 'u0' (#0)", 0) == 0 && e.phase == 'B';
    EXPECT_TRUE(saw_comm) << "no reduce_scatter of u0 on the comm track";
    EXPECT_OK(fsdp_ctx_finalize(m.ctx.get()));
  });
}

// ---- gathers never queue behind reductions ------------------------------------

namespace {

// The events of one track (tid) of a trace fsdp_trace_write wrote.
struct TrackEvent {
  std::string name;
  char phase;
  int tid;
  long seq;
};

std::vector<TrackEvent> read_tracks(const std::string& path) {
  std::vector<TrackEvent> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    size_t n = line.find("\"name\": \"");
    size_t ph = line.find("\"ph\": \"");
    size_t tid = line.find("\"tid\": ");
    size_t sq = line.find("\"seq\": ");
    if (n == std::string::npos || ph == std::string::npos || tid == std::string::npos || sq == std::string::npos) {
      continue;
    }
    size_t n_end = line.find('"', n + 9);
    out.push_back({line.substr(n + 9, n_end - n - 9), line[ph + 7], std::stoi(line.substr(tid + 7)),
                   std::stol(line.substr(sq + 7))});
  }
  return out;
}

// The seq of the first event of `tid` after seq `after` whose name starts
// with `prefix`, in `phase`.
long first_seq(const std::vector<TrackEvent>& ev, int tid, const std::string& prefix, char phase, long after = -1) {
  for (const auto& e : ev) {
    if (e.tid == tid && e.phase == phase && e.seq > after && e.name.rfind(prefix, 0) == 0) return e.seq;
  }
  return -1;
}

constexpr int kCallerTrack = 0, kCommTrack = 1, kGatherTrack = 3;

}  // namespace

// All-gathers run on a stream (and over a communicator) of their own and
// reductions on the comm stream, as FSDP2's do: a prefetched gather never
// waits behind a reduction. Rank 1 computes on a host stream whose tasks
// start 60 ms late, so the reduction of the last unit (u4, the first in
// backward) waits for rank 1's backward of u4 on both ranks; the gather of
// u2, which backward_begin(u3) prefetches after that reduction is queued,
// needs nothing of that compute (only u2's forward, long done) and completes
// while the reduction still waits. On rank 0's trace the gather's end comes
// before the reduction's. With gather_stream=0 (auto on a CPU host without a
// core per rank for each stream) both share the comm stream and the gather
// comes after the reduction: the test tells the two apart. auto splits them
// on a CPU host with three cores for each of the two ranks.
TEST(StreamSplit, AGatherQueuedAfterAReductionCompletesWhileTheReductionWaits) {
  for (const std::string mode : {"1", "0", "auto"}) {
  const bool apart = mode == "1" || (mode == "auto" && std::thread::hardware_concurrency() >= 6);
  SCOPED_TRACE("gather_stream=" + mode + (apart ? " (apart)" : " (together)"));
  run_ranks(2, [apart, mode](int rank, fsdp_local_group_t* group) {
    Model m;
    build(m,
          {{"forward_prefetch", "0"},
           {"backward_prefetch", "pre"},
           {"limit_all_gathers", "5"},
           {"gather_stream", mode}},
          group, rank);
    if (::testing::Test::HasFatalFailure()) return;
    Host host(m.ctx.get(), rank == 1 ? 60000 : 0);
    auto iteration = [&](int step) {
      for (int u = 0; u < kUnits; ++u) {
        ASSERT_OK(fsdp_forward_begin(m.units[u], host.stream()));
        host.run([] {});  // the unit's forward compute
        ASSERT_OK(fsdp_forward_end(m.units[u], host.stream()));
      }
      for (int u = kUnits; u-- > 0;) {
        ASSERT_OK(fsdp_backward_begin(m.units[u], host.stream()));
        void* g = nullptr;
        ASSERT_OK(fsdp_grad_ptr(m.units[u], 0, &g));
        host.run([g, step] { static_cast<float*>(g)[0] += 0.5f + static_cast<float>(step); });
        ASSERT_OK(fsdp_backward_end(m.units[u], host.stream()));
      }
      ASSERT_OK(fsdp_step(m.ctx.get(), host.stream()));
    };
    iteration(0);  // records the order that prefetch follows
    ASSERT_OK(fsdp_trace_begin(m.ctx.get()));
    iteration(1);
    double norm = 0.0;
    ASSERT_OK(fsdp_last_grad_norm(m.ctx.get(), &norm));  // the step, and so every reduction, is done
    EXPECT_GT(norm, 0.0);
    host.sync();
    if (rank == 0) {
      const std::string path = ::testing::TempDir() + "split_trace_" + std::to_string(::getpid()) + ".json";
      ASSERT_OK(fsdp_trace_write(m.ctx.get(), path.c_str()));
      const auto ev = read_tracks(path);
      std::remove(path.c_str());
      const long reduce_queued = first_seq(ev, kCallerTrack, "backward_end u4", 'E');
      const long gather_issued = first_seq(ev, kCallerTrack, "prefetch all_gather of unit 'u2'", 'i');
      // The end of the gather that prefetch issued (u2's forward gather ends
      // under the same name, before).
      const long gather_end =
          first_seq(ev, apart ? kGatherTrack : kCommTrack, "all_gather of unit 'u2' (#2)", 'E', gather_issued);
      const long reduce_end = first_seq(ev, kCommTrack, "reduce_scatter of unit 'u4' (#4)", 'E');
      ASSERT_GE(reduce_queued, 0);
      ASSERT_GE(gather_issued, 0) << "no backward prefetch of u2";
      ASSERT_GE(gather_end, 0) << "no all_gather of u2 on the " << (apart ? "gather" : "comm") << " track";
      ASSERT_GE(reduce_end, 0) << "no reduce_scatter of u4 on the comm track";
      EXPECT_LT(reduce_queued, gather_issued) << "the gather was not queued after the reduction";
      if (apart) {
        EXPECT_LT(gather_end, reduce_end) << "the gather of u2 waited behind the reduce-scatter of u4";
      } else {
        EXPECT_GT(gather_end, reduce_end) << "the gather of u2 passed the reduce-scatter of u4 on one stream";
      }
      // Apart: no reduction or step ran on the gather track, and no gather on
      // the comm track. Together: nothing on the gather track.
      for (const auto& e : ev) {
        if (e.tid == kGatherTrack) {
          EXPECT_TRUE(apart) << e.name << " on the gather track with gather_stream=0";
          EXPECT_EQ(e.name.rfind("all_gather", 0), 0u) << e.name << " on the gather track";
        }
        if (e.tid == kCommTrack && apart) {
          EXPECT_EQ(e.name.rfind("all_gather", 0), std::string::npos) << e.name << " on the comm track";
        }
      }
    }
    EXPECT_OK(fsdp_ctx_finalize(m.ctx.get()));
  });
  }
}

// ---- the limit bounds the gathered units --------------------------------------

TEST(PrefetchLimit, NeverMoreGatheredUnitsThanTheLimit) {
  for (int limit = 1; limit <= 3; ++limit) {
    SCOPED_TRACE("limit_all_gathers=" + std::to_string(limit));
    run_ranks(2, [limit](int rank, fsdp_local_group_t* group) {
      Model m;
      build(m, {{"forward_prefetch", "1"}, {"backward_prefetch", "pre"}, {"limit_all_gathers", std::to_string(limit)}},
            group, rank, /*equal_sizes=*/true);
      if (::testing::Test::HasFatalFailure()) return;
      iterate(m, rank, 0, natural_order());
      ASSERT_OK(fsdp_memory_stats_reset_peak(m.ctx.get()));
      iterate(m, rank, 1, natural_order());
      fsdp_memory_stats_t s;
      s.struct_size = sizeof s;
      ASSERT_OK(fsdp_memory_stats(m.ctx.get(), &s));
      // 64 fp32 elements per unit at world 2: padded to 2 * 16 elements, 64 fits.
      const size_t unit_bytes = 64 * sizeof(float);
      // Prefetch looks one unit ahead, so the schedule needs at most two.
      const size_t expected = static_cast<size_t>(std::min(limit, 2)) * unit_bytes;
      EXPECT_EQ(s.gathered_params_peak_nbytes, expected);
      EXPECT_OK(fsdp_ctx_finalize(m.ctx.get()));
    });
  }
}

// ---- a changed order: one warning, correct results ----------------------------

namespace {
std::mutex g_log_mu;
std::map<int, int> g_warnings;  // rank -> count
void count_warnings(fsdp_log_level_t level, int rank, const char* message, void*) {
  std::lock_guard<std::mutex> lock(g_log_mu);
  if (level == FSDP_LOG_WARN && std::string(message).find("execution order changed") != std::string::npos) {
    g_warnings[rank]++;
  }
}
}  // namespace

TEST(PrefetchOrder, AChangedOrderInIterationThreeWarnsOnceAndStaysCorrect) {
  const auto reference = train(2, kNoPrefetch, /*changed_at=*/2);
  g_warnings.clear();
  ASSERT_OK(fsdp_log_set_callback(count_warnings, nullptr));
  const auto got = train(2, {{"forward_prefetch", "1"}, {"backward_prefetch", "post"}}, /*changed_at=*/2);
  ASSERT_OK(fsdp_log_set_callback(nullptr, nullptr));
  EXPECT_TRUE(bitwise_equal(got, reference));
  EXPECT_EQ(g_warnings[0], 1);
  EXPECT_EQ(g_warnings[1], 1);
  // And the same training without the change does differ, so the test can tell.
  EXPECT_FALSE(bitwise_equal(train(2, kNoPrefetch), reference));
}

TEST(Logging, TheLevelFiltersWhatTheCallbackReceives) {
  // A changed order produces a warning; at level error the callback sees none,
  // at level warn it sees one per rank.
  for (fsdp_log_level_t level : {FSDP_LOG_ERROR, FSDP_LOG_WARN}) {
    g_warnings.clear();
    ASSERT_OK(fsdp_log_set_level(level));
    ASSERT_OK(fsdp_log_set_callback(count_warnings, nullptr));
    train(2, {{"forward_prefetch", "1"}}, /*changed_at=*/2);
    ASSERT_OK(fsdp_log_set_callback(nullptr, nullptr));
    EXPECT_EQ(g_warnings[0] + g_warnings[1], level == FSDP_LOG_ERROR ? 0 : 2) << "level " << level;
  }
  ASSERT_OK(fsdp_log_set_level(FSDP_LOG_WARN));
}
