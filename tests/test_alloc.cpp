// Pins the heap allocations of the transition path in the steady state: after
// warm-up steps, a forward and backward pass over every unit (the calls, and
// the gathers, reductions and copies they queue on the streams) and the step
// that follows (grad norm, clipping, the optimizer) allocate nothing on the heap, on the host's NULL stream and on a
// late host stream, for every sharding strategy, fp32 and bf16, world 1 to 4 and offload. The engine's events, slots,
// labels, task captures and stream queues are the same code on a GPU, where a heap allocation per call is host time
// taken from the < 5 us per transition goal (docs/gpu.md). Counted by replacing the global operator new (every thread
// of the process). Set FSDP_ALLOC_BACKTRACE=1 to print where each counted allocation came from.
#include <execinfo.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "base/ring.h"
#include "host_stream.h"
#include "rank_runner.h"

namespace {

std::atomic<bool> g_counting{false};
std::atomic<long> g_allocs{0};
bool g_backtrace = std::getenv("FSDP_ALLOC_BACKTRACE") != nullptr;

void note_alloc() {
  if (!g_counting.load(std::memory_order_relaxed)) return;
  g_allocs.fetch_add(1, std::memory_order_relaxed);
  if (g_backtrace) {
    g_counting = false;  // backtrace_symbols_fd allocates nothing, but keep this thread's own work out
    void* frames[24];
    int n = backtrace(frames, 24);
    static const char kSep[] = "---- allocation:\n";
    (void)!write(2, kSep, sizeof(kSep) - 1);
    backtrace_symbols_fd(frames, n, 2);
    g_counting = true;
  }
}

}  // namespace

void* operator new(size_t n) {
  note_alloc();
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t n) {
  note_alloc();
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new(size_t n, std::align_val_t a) {
  note_alloc();
  size_t al = static_cast<size_t>(a);
  if (void* p = std::aligned_alloc(al, (n + al - 1) / al * al)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t n, std::align_val_t a) { return operator new(n, a); }
void* operator new(size_t n, const std::nothrow_t&) noexcept {
  note_alloc();
  return std::malloc(n == 0 ? 1 : n);
}
void* operator new[](size_t n, const std::nothrow_t&) noexcept {
  note_alloc();
  return std::malloc(n == 0 ? 1 : n);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t, std::align_val_t) noexcept { std::free(p); }

using namespace fsdp_test;

namespace {

struct AllocCase {
  std::string name;
  int world = 2;
  std::map<std::string, std::string> opts;
  int late_us = 0;  // the host's compute on a late host stream
};

void PrintTo(const AllocCase& c, std::ostream* os) { *os << c.name; }

// Units of different sizes (so that slots of several sizes cycle), one of
// them smaller than the world (pure padding on some ranks).
const std::vector<std::vector<ParamSpec>> kUnits = {
    {{"w", {32, 16}}, {"b", {32}}}, {{"w", {32, 32}}, {"b", {32}}}, {{"w", {32, 32}}, {"b", {32}}}, {{"g", {1}}}};
constexpr int kWarmup = 4, kMeasured = 6;

// The ranks' threads meet here, so that counting starts and stops for all at once.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mu_);
    int gen = gen_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return gen_ != gen; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_, arrived_ = 0, gen_ = 0;
};

// One pass: forward over the units, backward in reverse, the grads written
// by the host's compute (through `host`), then fsdp_step. With `counted`, the
// ranks meet, count the allocations of the transitions, of the work they
// queued (waited for before the step, so that it counts wherever it runs) and
// of the step, and meet again.
void pass(Host& host, std::vector<fsdp_unit_t*>& units, fsdp_ctx_t* ctx, Barrier* counted) {
  void* s = host.stream();
  if (counted != nullptr) {
    counted->arrive_and_wait();
    g_counting = true;
  }
  for (fsdp_unit_t* u : units) {
    ASSERT_OK(fsdp_forward_begin(u, s));
    ASSERT_OK(fsdp_forward_end(u, s));
  }
  for (size_t k = units.size(); k-- > 0;) {
    ASSERT_OK(fsdp_backward_begin(units[k], s));
    void* g = nullptr;
    ASSERT_OK(fsdp_grad_ptr(units[k], 0, &g));
    host.run([g] { static_cast<unsigned char*>(g)[0] = 0; });  // the host's compute touches its grads
    ASSERT_OK(fsdp_backward_end(units[k], s));
  }
  host.sync();
  // The work the transitions queued (gathers, reductions, copies) counts too,
  // and so does the step's, which runs after fsdp_step returns.
  const fsdp::core::Runtime& rt = reinterpret_cast<fsdp::core::Context*>(ctx)->runtime();
  auto drain = [&] {
    for (fsdp::device::Stream* engine : {rt.gather_stream, rt.stream, rt.copy_in, rt.copy_out, rt.host_work}) {
      if (engine != nullptr) engine->synchronize(0);
    }
  };
  drain();
  ASSERT_OK(fsdp_step(ctx, s));
  host.sync();
  drain();
  if (counted != nullptr) {
    counted->arrive_and_wait();
    g_counting = false;
  }
}

class SteadyState : public ::testing::TestWithParam<AllocCase> {};

TEST_P(SteadyState, TransitionsAndStepsAllocateNothingOnTheHeap) {
  const AllocCase& c = GetParam();
  Barrier barrier(c.world);
  long before = 0;
  run_ranks(c.world, [&](int rank, fsdp_local_group_t* group) {
    std::vector<fsdp_unit_t*> units;
    CtxPtr ctx = open_units(rank, group, c.opts, kUnits, &units);
    ASSERT_TRUE(ctx);
    fsdp_ctx_t* raw = ctx.get();
    Host host(raw, c.late_us > 0 ? c.late_us : -1);
    for (int i = 0; i < kWarmup; ++i) pass(host, units, raw, nullptr);
    if (rank == 0) before = g_allocs.load();
    for (int i = 0; i < kMeasured; ++i) pass(host, units, raw, &barrier);
  });
  if (::testing::Test::HasFailure()) return;
  const long transitions = long(kMeasured) * long(kUnits.size()) * 4 * c.world;
  EXPECT_EQ(g_allocs.load() - before, 0) << " heap allocations over " << transitions
                                         << " transition calls of every rank, the work they queued and " << kMeasured
                                         << " steps (FSDP_ALLOC_BACKTRACE=1 says where)";
}

std::vector<AllocCase> cases() {
  std::vector<AllocCase> cs;
  auto add = [&](std::string name, int world, std::map<std::string, std::string> opts) {
    for (int late : {0, 1000}) {
      AllocCase c;
      c.name = name + "_world" + std::to_string(world) + (late > 0 ? "_LateHostStream" : "");
      c.world = world;
      c.opts = opts;
      c.late_us = late;
      cs.push_back(c);
    }
  };
  for (const char* sh : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"}) {
    for (int w : {1, 2}) add(std::string(sh) + "_fp32", w, {{"sharding", sh}});
    add(std::string(sh) + "_bf16", 2, {{"sharding", sh}, {"param_dtype", "bf16"}});
  }
  add("FULL_SHARD_bf16", 1, {{"sharding", "FULL_SHARD"}, {"param_dtype", "bf16"}});
  add("FULL_SHARD_bf16_ReduceFp32", 3, {{"sharding", "FULL_SHARD"}, {"param_dtype", "bf16"}, {"reduce_dtype", "fp32"}});
  add("FULL_SHARD_bf16_KeptShard", 2,
      {{"sharding", "FULL_SHARD"}, {"param_dtype", "bf16"}, {"keep_param_dtype_shard", "1"}});
  add("HYBRID_SHARD_fp32", 4, {{"sharding", "HYBRID_SHARD"}, {"shard_group_size", "2"}});
  for (int w : {1, 2}) add("FULL_SHARD_fp32_Offload", w, {{"sharding", "FULL_SHARD"}, {"offload", "cpu"}});
  add("FULL_SHARD_bf16_Offload", 2, {{"sharding", "FULL_SHARD"}, {"param_dtype", "bf16"}, {"offload", "cpu"}});
  return cs;
}

// base::Ring (the nccl communicator's queue of collectives in flight, which
// no CPU test reaches): FIFO order across growth, and no allocation once it
// has held its deepest backlog.
TEST(Ring, KeepsFifoOrderAcrossGrowthAndAllocatesNothingOnceWarm) {
  fsdp::base::Ring<std::string> ring(2);
  int next_in = 0, next_out = 0;
  auto cycle = [&](int backlog) {
    while (static_cast<int>(ring.size()) < backlog) ring.push_back(std::string(40, char('a' + next_in++ % 26)));
    while (!ring.empty()) {
      EXPECT_EQ(ring.front(), std::string(40, char('a' + next_out++ % 26)));
      ring.pop_front();
    }
  };
  cycle(7);  // grows 2 -> 4 -> 8
  EXPECT_EQ(next_out, 7);
  long before = g_allocs.load();
  g_counting = true;
  for (int i = 0; i < 50; ++i) {
    ring.push_back(std::string());  // empty strings: nothing of their own to allocate
    ring.push_back(std::string());
    ring.pop_front();
    ring.pop_front();
  }
  g_counting = false;
  EXPECT_EQ(g_allocs.load() - before, 0);
}

INSTANTIATE_TEST_SUITE_P(Cases, SteadyState, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<AllocCase>& pi) { return pi.param.name; });

}  // namespace
