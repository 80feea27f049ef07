// The CPU device's streams and events (white-box), and how failures and stalls
// of work queued on streams reach the host through the public API: the next
// call that waits on it, fsdp_ctx_async_error, and timeout_s on every wait.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "base/error.h"
#include "core/context.h"
#include "device/cpu/cpu_device.h"
#include "device/cpu/cpu_stream.h"
#include "rank_runner.h"

using namespace fsdp_test;
using fsdp::device::CpuEvent;
using fsdp::device::EventPtr;
using fsdp::device::StreamHooks;
using fsdp::device::WorkerStream;
using Clock = std::chrono::steady_clock;

namespace {

// The status and message an event's wait throws (FSDP_OK: it did not throw).
std::pair<fsdp_status_t, std::string> wait_outcome(const EventPtr& ev, double timeout_s) {
  try {
    ev->wait(timeout_s);
    return {FSDP_OK, ""};
  } catch (const fsdp::Error& e) {
    return {e.status(), e.what()};
  }
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

fsdp::device::CpuDevice& cpu_device(fsdp_ctx_t* ctx) {
  return dynamic_cast<fsdp::device::CpuDevice&>(reinterpret_cast<fsdp::core::Context*>(ctx)->device());
}

// fsdp_ctx_async_error once it is set (it never blocks), or FSDP_OK after 10 s.
fsdp_status_t first_async_error(fsdp_ctx_t* ctx) {
  auto t0 = Clock::now();
  fsdp_status_t async = FSDP_OK;
  while (async == FSDP_OK && seconds_since(t0) < 10) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    async = fsdp_ctx_async_error(ctx);
  }
  return async;
}

// A context of rank `rank` with `timeout_s` and one unit, or an empty pointer
// after a failed assertion.
CtxPtr one_unit_context(int rank, fsdp_local_group_t* group, const char* timeout_s, const std::vector<int64_t>& shape,
                        fsdp_unit_t** unit) {
  ConfigPtr cfg = make_config({{"sharding", "FULL_SHARD"}, {"timeout_s", timeout_s}});
  EXPECT_TRUE(cfg);
  if (!cfg) return CtxPtr();
  fsdp_ctx_t* raw = nullptr;
  EXPECT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
  CtxPtr ctx(raw);
  if (raw != nullptr) {
    EXPECT_OK(register_unit(ctx.get(), "layer", {{"w", shape}}, unit));
  }
  return *unit != nullptr ? std::move(ctx) : CtxPtr();
}

}  // namespace

TEST(CpuStreams, TasksRunInOrderAndAWaitOrdersAcrossStreams) {
  WorkerStream a("a", StreamHooks{}), b("b", StreamHooks{});
  std::atomic<int> stage{0};
  a.submit("slow", [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    stage = 1;
  });
  EventPtr done_a = a.record();
  b.wait(done_a);
  int seen = -1;
  EventPtr read = b.submit("read", [&] { seen = stage.load(); });
  read->wait(10);
  EXPECT_EQ(seen, 1) << "b's task ran before the event it waits for";
  EXPECT_EQ(a.failure(), FSDP_OK);
  EXPECT_EQ(b.failure(), FSDP_OK);
}

TEST(CpuStreams, AFailedTaskFailsItsEventAndTheWorkThatWaitsForIt) {
  WorkerStream a("a", StreamHooks{}), b("b", StreamHooks{});
  EventPtr bad = a.submit("bad", [] { fsdp::fail(FSDP_ERR_COMM, "the collective failed"); });
  b.wait(bad);
  bool ran = false;
  EventPtr after = b.submit("after", [&] { ran = true; });
  auto [status, message] = wait_outcome(after, 10);
  EXPECT_EQ(status, FSDP_ERR_COMM);
  EXPECT_EQ(message, "the collective failed");
  EXPECT_FALSE(ran) << "a task whose awaited event failed must not run";
  EXPECT_EQ(a.failure(), FSDP_ERR_COMM);
  EXPECT_EQ(b.failure(), FSDP_ERR_COMM);
  // Later work that does not wait for the failure runs normally.
  bool later = false;
  b.submit("later", [&] { later = true; })->wait(10);
  EXPECT_TRUE(later);
}

TEST(CpuStreams, AWaitForWorkThatStallsTimesOutNamingIt) {
  WorkerStream stalled("host", StreamHooks{});
  std::atomic<bool> release{false};
  EventPtr ev = stalled.submit("stuck compute", [&] {
    while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  auto t0 = Clock::now();
  auto [status, message] = wait_outcome(ev, 0.2);
  EXPECT_EQ(status, FSDP_ERR_TIMEOUT);
  EXPECT_NE(message.find("'stuck compute' on the host stream"), std::string::npos) << message;
  EXPECT_LT(seconds_since(t0), 5.0);
  // A stream bounded by timeout_s fails a task whose awaited event stalls.
  StreamHooks bounded;
  bounded.timeout_s = 0.2;
  WorkerStream comm("comm", bounded);
  comm.wait(ev);
  bool ran = false;
  auto [s2, m2] = wait_outcome(comm.submit("reduce_scatter", [&] { ran = true; }), 10);
  EXPECT_EQ(s2, FSDP_ERR_TIMEOUT);
  EXPECT_NE(m2.find("'stuck compute' on the host stream"), std::string::npos) << m2;
  EXPECT_FALSE(ran);
  EXPECT_EQ(comm.failure(), FSDP_ERR_TIMEOUT);
  release = true;
  ev->wait(10);
}

TEST(CpuStreams, ANullStreamIsTheCallingThreadAndOtherHandlesAreRefused) {
  fsdp::device::CpuDevice dev(1, fsdp::device::Pool::kDevice);
  fsdp::device::Stream& s = dev.caller_stream(nullptr, "test");
  EXPECT_TRUE(s.synchronous());
  std::thread::id ran_on;
  s.submit("here", [&] { ran_on = std::this_thread::get_id(); });
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  int not_a_stream = 0;
  try {
    dev.caller_stream(&not_a_stream, "fsdp_forward_begin");
    ADD_FAILURE() << "a pointer that is no stream of this device was accepted";
  } catch (const fsdp::Error& e) {
    EXPECT_EQ(e.status(), FSDP_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("fsdp_forward_begin: stream must be NULL"), std::string::npos) << e.what();
  }
  fsdp::device::Stream* host = dev.create_host_stream(std::chrono::microseconds(0));
  EXPECT_EQ(&dev.caller_stream(host, "test"), host);
  EXPECT_FALSE(host->synchronous());
}

// Rank 0 computes on a late host stream; rank 1 never joins the first gather.
// forward_begin returns at once (nothing waits on the host), the host's
// forward does not run, and the gather's timeout reaches the host through
// fsdp_ctx_async_error and through fsdp_step, naming rank 1.
TEST(LateHostStream, AFailedGatherReachesTheHostThroughAsyncErrorAndTheStep) {
  run_ranks(2, [](int rank, fsdp_local_group_t* group) {
    fsdp_unit_t* unit = nullptr;
    CtxPtr ctx = one_unit_context(rank, group, "1", {64, 64}, &unit);
    ASSERT_TRUE(ctx);
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::seconds(3));  // alive, but never gathers
      return;
    }
    fsdp::device::Stream* hs = cpu_device(ctx.get()).create_host_stream(std::chrono::microseconds(0));
    auto t0 = Clock::now();
    ASSERT_OK(fsdp_forward_begin(unit, hs));
    EXPECT_LT(seconds_since(t0), 0.5) << "forward_begin on a host stream must not wait for the gather";
    EXPECT_EQ(fsdp_ctx_async_error(ctx.get()), FSDP_OK) << "nothing has failed yet";
    std::atomic<bool> ran{false};
    hs->submit("forward", [&] { ran = true; });
    ASSERT_OK(fsdp_forward_end(unit, hs));
    EXPECT_EQ(first_async_error(ctx.get()), FSDP_ERR_TIMEOUT);
    EXPECT_EQ(fsdp_step(ctx.get(), hs), FSDP_ERR_TIMEOUT);
    EXPECT_NE(std::string(fsdp_last_error()).find("rank 1"), std::string::npos) << fsdp_last_error();
    EXPECT_FALSE(ran) << "the host's forward ran although the gather it waits for failed";
  });
}

// A host stream whose work never finishes: fsdp_step queues the step behind
// it and returns at once (the step runs on the host's stream at a world of
// one); the call that reads the step's result waits for it no longer than
// timeout_s and says what it waited for.
TEST(LateHostStream, AStalledHostStreamFailsTheReadOfTheStepAfterTimeout) {
  run_ranks(1, [](int rank, fsdp_local_group_t* group) {
    fsdp_unit_t* unit = nullptr;
    CtxPtr ctx = one_unit_context(rank, group, "0.5", {8}, &unit);
    ASSERT_TRUE(ctx);
    fsdp::device::Stream* hs = cpu_device(ctx.get()).create_host_stream(std::chrono::microseconds(0));
    ASSERT_OK(fsdp_forward_begin(unit, hs));
    hs->submit("stalled compute", [] { std::this_thread::sleep_for(std::chrono::seconds(2)); });
    ASSERT_OK(fsdp_forward_end(unit, hs));
    auto t0 = Clock::now();
    EXPECT_OK(fsdp_step(ctx.get(), hs));
    EXPECT_LT(seconds_since(t0), 0.4) << "fsdp_step waited for the host's stream";
    double norm = 0.0;
    t0 = Clock::now();
    EXPECT_EQ(fsdp_last_grad_norm(ctx.get(), &norm), FSDP_ERR_TIMEOUT);
    EXPECT_LT(seconds_since(t0), 1.8) << "the read waited for the stalled work past timeout_s";
    EXPECT_NE(std::string(fsdp_last_error())
                  .find("'optimizer step' on the host stream did not finish within timeout_s = 0.5 s"),
              std::string::npos)
        << fsdp_last_error();
    hs->synchronize(0);  // the stalled work ends; the context is destroyed after it
    EXPECT_EQ(fsdp_last_grad_norm(ctx.get(), &norm), FSDP_OK) << "the step ran once the host's work did";
  });
}

// The comm stream waits for the host's grads no longer than timeout_s: when
// the host's backward stalls, the reduction fails with FSDP_ERR_TIMEOUT naming
// the host's work, and fsdp_ctx_async_error reports it while the host's work
// is still running (no collective has failed: the failure is the stream's).
TEST(LateHostStream, AReductionThatWaitsTooLongForTheHostsGradsIsReportedByAsyncError) {
  run_ranks(2, [](int rank, fsdp_local_group_t* group) {
    fsdp_unit_t* unit = nullptr;
    CtxPtr ctx = one_unit_context(rank, group, "0.5", {64, 64}, &unit);
    ASSERT_TRUE(ctx);
    fsdp::device::Stream* hs = cpu_device(ctx.get()).create_host_stream(std::chrono::microseconds(0));
    ASSERT_OK(fsdp_backward_begin(unit, hs));
    std::atomic<bool> release{false};
    hs->submit("stalled backward", [&] {
      while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    });
    ASSERT_OK(fsdp_backward_end(unit, hs));
    EXPECT_EQ(first_async_error(ctx.get()), FSDP_ERR_TIMEOUT);
    // The step is refused at once: the work it would follow failed.
    EXPECT_EQ(fsdp_step(ctx.get(), hs), FSDP_ERR_TIMEOUT);
    EXPECT_NE(std::string(fsdp_last_error()).find("'stalled backward' on the host stream did not finish"),
              std::string::npos)
        << fsdp_last_error();
    release = true;
    hs->synchronize(0);
  });
}

// ---- rewriting params while the host's stream still reads them (review finding 10)

namespace {

// A context of `world` ranks' rank `rank` with units "a" and "b" of kNumel
// fp32 elements each (values va, vb), prefetch off, or an empty pointer.
constexpr size_t kNumel = 64;
struct TwoUnits {
  CtxPtr ctx;
  fsdp_unit_t* a = nullptr;
  fsdp_unit_t* b = nullptr;
};
TwoUnits two_units(int rank, fsdp_local_group_t* group, const char* sharding, const std::vector<float>& va,
                   const std::vector<float>& vb) {
  TwoUnits t;
  ConfigPtr cfg = make_config(
      {{"sharding", sharding}, {"timeout_s", "10"}, {"forward_prefetch", "0"}, {"backward_prefetch", "none"}});
  EXPECT_TRUE(cfg);
  if (!cfg) return t;
  fsdp_ctx_t* raw = nullptr;
  EXPECT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
  t.ctx.reset(raw);
  if (raw == nullptr) return t;
  EXPECT_OK(register_unit(raw, "a", {{"w", {int64_t(kNumel)}}}, &t.a));
  EXPECT_OK(register_unit(raw, "b", {{"w", {int64_t(kNumel)}}}, &t.b));
  if (t.a == nullptr || t.b == nullptr) return TwoUnits();
  EXPECT_OK(fsdp_param_set_values(t.a, 0, va.data(), kNumel));
  EXPECT_OK(fsdp_param_set_values(t.b, 0, vb.data(), kNumel));
  return t;
}

std::vector<float> filled(float v) { return std::vector<float>(kNumel, v); }

// Queues on `hs` a read of unit `u`'s params (taken now) into `seen`.
void read_later(fsdp::device::Stream* hs, fsdp_unit_t* u, std::vector<float>* seen) {
  void* p = nullptr;
  ASSERT_OK(fsdp_param_ptr(u, 0, &p));
  hs->submit("forward", [p, seen] {
    const auto* f = static_cast<const float*>(p);
    seen->assign(f, f + kNumel);
  });
}

}  // namespace

// Without gathers (a world of one) the host reads the fp32 master in place:
// fsdp_param_set_values must not rewrite it before the host's stream has read
// it (the read was queued before the call).
TEST(LateHostStream, SetValuesWaitsForTheHostsReadOfParamsItReadsInPlace) {
  for (const char* sharding : {"FULL_SHARD", "NO_SHARD"}) {
    SCOPED_TRACE(sharding);
    run_ranks(1, [sharding](int rank, fsdp_local_group_t* group) {
      TwoUnits t = two_units(rank, group, sharding, filled(1.f), filled(2.f));
      ASSERT_TRUE(t.ctx);
      fsdp::device::Stream* hs = cpu_device(t.ctx.get()).create_host_stream(std::chrono::milliseconds(20));
      std::vector<float> seen;
      ASSERT_OK(fsdp_forward_begin(t.a, hs));
      read_later(hs, t.a, &seen);
      ASSERT_OK(fsdp_forward_end(t.a, hs));
      EXPECT_OK(fsdp_param_set_values(t.a, 0, filled(9.f).data(), kNumel));
      hs->synchronize(0);
      EXPECT_EQ(seen, filled(1.f)) << "the host's forward read the values set after it";
    });
  }
}

// SHARD_GRAD_OP keeps the gathered params after forward. New values drop
// them; the slot must go back to the pool only after the host's stream has
// read it, or the next unit's gather (same size: the same slot) overwrites
// what that read sees.
TEST(LateHostStream, ADroppedGatherIsNotReusedWhileTheHostStillReadsIt) {
  run_ranks(2, [](int rank, fsdp_local_group_t* group) {
    TwoUnits t = two_units(rank, group, "SHARD_GRAD_OP", filled(1.f), filled(2.f));
    ASSERT_TRUE(t.ctx);
    fsdp::device::Stream* hs = cpu_device(t.ctx.get()).create_host_stream(std::chrono::milliseconds(20));
    std::vector<float> seen_a, seen_b;
    ASSERT_OK(fsdp_forward_begin(t.a, hs));
    read_later(hs, t.a, &seen_a);
    ASSERT_OK(fsdp_forward_end(t.a, hs));
    EXPECT_OK(fsdp_param_set_values(t.a, 0, filled(9.f).data(), kNumel));
    ASSERT_OK(fsdp_forward_begin(t.b, hs));
    read_later(hs, t.b, &seen_b);
    ASSERT_OK(fsdp_forward_end(t.b, hs));
    hs->synchronize(0);
    EXPECT_EQ(seen_a, filled(1.f)) << "unit a's slot was gathered into before the host's read of it";
    EXPECT_EQ(seen_b, filled(2.f));
  });
}

// fsdp_load replaces the master shard that a world of one reads in place: it
// must wait for the host's read first (the old buffer is freed; AddressSanitizer
// sees the read otherwise, and the read may see the loaded values).
TEST(LateHostStream, LoadWaitsForTheHostsReadOfParamsItReadsInPlace) {
  const std::string dir = ::testing::TempDir() + "fsdp_late_load_" + std::to_string(::getpid());
  run_ranks(1, [&dir](int rank, fsdp_local_group_t* group) {
    TwoUnits t = two_units(rank, group, "FULL_SHARD", filled(5.f), filled(6.f));
    ASSERT_TRUE(t.ctx);
    ASSERT_OK(fsdp_save(t.ctx.get(), dir.c_str(), "sharded"));
    EXPECT_OK(fsdp_param_set_values(t.a, 0, filled(1.f).data(), kNumel));
    fsdp::device::Stream* hs = cpu_device(t.ctx.get()).create_host_stream(std::chrono::milliseconds(20));
    std::vector<float> seen;
    ASSERT_OK(fsdp_forward_begin(t.a, hs));
    read_later(hs, t.a, &seen);
    ASSERT_OK(fsdp_forward_end(t.a, hs));
    EXPECT_OK(fsdp_load(t.ctx.get(), dir.c_str()));
    hs->synchronize(0);
    EXPECT_EQ(seen, filled(1.f)) << "the host's forward read the loaded values (or freed memory)";
    std::vector<float> now(kNumel);
    EXPECT_OK(fsdp_gather_param(t.a, 0, now.data(), kNumel));
    EXPECT_EQ(now, filled(5.f));
  });
  std::filesystem::remove_all(dir);
}
