// Pins the host-blocking waits of a steady-state step at zero: after warm-up
// steps, a forward and backward pass over every unit and fsdp_step block the
// calling thread on no stream's or event's work (fsdp_comm_stats' host_waits),
// for every sharding strategy at worlds 1 to 4, fp32 and bf16, offload=cpu,
// no_sync and a host stream running late, on the CPU device, whose streams
// are threads ordered by the same events a GPU's streams are: the step is
// queued on the device and decided there (kernels/step.h), the backward's
// throttle is a stream wait, gathers wait on their own stream. The NULL
// stream is the calling thread itself: its waits for a gather are that
// stream's ordering, not counted. A call that reads a result does wait, and
// counts: the test shows the counter sees it, so that it could fail.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "host_stream.h"
#include "rank_runner.h"

using namespace fsdp_test;

namespace {

struct WaitCase {
  std::string name;
  int world = 2;
  std::map<std::string, std::string> opts;
  int late_us = 0;       // the host's compute on a late host stream
  bool no_sync = false;  // a pass with grad sync off before each step's last
};

void PrintTo(const WaitCase& c, std::ostream* os) { *os << c.name; }

// Units of different sizes, one smaller than the world (padding only on some ranks).
const std::vector<std::vector<ParamSpec>> kUnits = {
    {{"w", {32, 16}}, {"b", {32}}}, {{"w", {32, 32}}, {"b", {32}}}, {{"w", {24, 8}}}, {{"g", {1}}}};
constexpr int kWarmup = 3, kMeasured = 4;

// One pass over the units (the grads written by the host's compute through
// `host`); with `sync` false, grad sync is off for it.
void pass(Host& host, const std::vector<fsdp_unit_t*>& units, fsdp_ctx_t* ctx, bool sync) {
  void* s = host.stream();
  ASSERT_OK(fsdp_set_grad_sync(ctx, sync ? 1 : 0));
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
}

void step(Host& host, const std::vector<fsdp_unit_t*>& units, fsdp_ctx_t* ctx, bool no_sync) {
  if (no_sync) {
    ASSERT_NO_FATAL_FAILURE(pass(host, units, ctx, false));
  }
  ASSERT_NO_FATAL_FAILURE(pass(host, units, ctx, true));
  ASSERT_OK(fsdp_step(ctx, host.stream()));
}

uint64_t host_waits(fsdp_ctx_t* ctx) {
  fsdp_comm_stats_t c{};
  c.struct_size = sizeof c;
  EXPECT_OK(fsdp_comm_stats(ctx, &c));
  return c.host_waits;
}

class SteadyState : public ::testing::TestWithParam<WaitCase> {};

TEST_P(SteadyState, AStepBlocksTheHostNowhere) {
  const WaitCase& c = GetParam();
  run_ranks(c.world, [&](int rank, fsdp_local_group_t* group) {
    std::vector<fsdp_unit_t*> units;
    CtxPtr ctx = open_units(rank, group, c.opts, kUnits, &units);
    ASSERT_TRUE(ctx);
    fsdp_ctx_t* raw = ctx.get();
    Host host(raw, c.late_us > 0 ? c.late_us : 0);
    for (int i = 0; i < kWarmup; ++i) ASSERT_NO_FATAL_FAILURE(step(host, units, raw, c.no_sync));
    ASSERT_OK(fsdp_comm_stats_reset(raw));
    for (int i = 0; i < kMeasured; ++i) ASSERT_NO_FATAL_FAILURE(step(host, units, raw, c.no_sync));
    EXPECT_EQ(host_waits(raw), 0u) << "rank " << rank << ": host-blocking waits over " << kMeasured
                                   << " steady-state steps";
    // A read of what the step wrote waits for it, and the counter sees that.
    std::vector<float> w(32 * 16);
    ASSERT_OK(fsdp_gather_param(units[0], 0, w.data(), w.size()));
    EXPECT_GE(host_waits(raw), 1u) << "rank " << rank << ": fsdp_gather_param's wait was not counted";
    host.sync();
    EXPECT_OK(fsdp_ctx_finalize(raw));
  });
}

std::vector<WaitCase> cases() {
  std::vector<WaitCase> cs;
  auto add = [&](std::string name, int world, std::map<std::string, std::string> opts, bool no_sync = false) {
    for (int late : {0, 1000}) {
      WaitCase c;
      c.name = name + "_world" + std::to_string(world) + (late > 0 ? "_LateHostStream" : "");
      c.world = world;
      c.opts = opts;
      c.late_us = late;
      c.no_sync = no_sync;
      cs.push_back(c);
    }
  };
  for (int w : {1, 2, 3, 4}) {
    add("FULL_SHARD_fp32", w, {{"sharding", "FULL_SHARD"}});
    add("FULL_SHARD_bf16", w, {{"sharding", "FULL_SHARD"}, {"param_dtype", "bf16"}, {"reduce_dtype", "fp32"}});
  }
  for (const char* sh : {"SHARD_GRAD_OP", "NO_SHARD"}) {
    for (int w : {1, 2, 3}) add(std::string(sh) + "_fp32", w, {{"sharding", sh}});
    add(std::string(sh) + "_bf16", 2, {{"sharding", sh}, {"param_dtype", "bf16"}});
  }
  add("HYBRID_SHARD_fp32", 4, {{"sharding", "HYBRID_SHARD"}, {"shard_group_size", "2"}});
  add("HYBRID_SHARD_ZERO2_bf16", 4,
      {{"sharding", "HYBRID_SHARD_ZERO2"}, {"shard_group_size", "2"}, {"param_dtype", "bf16"}});
  for (int w : {1, 2}) {
    add("FULL_SHARD_fp32_Offload", w, {{"sharding", "FULL_SHARD"}, {"offload", "cpu"}});
    add("FULL_SHARD_bf16_Offload", w, {{"sharding", "FULL_SHARD"}, {"param_dtype", "bf16"}, {"offload", "cpu"}});
    add("FULL_SHARD_fp32_NoSync", w, {{"sharding", "FULL_SHARD"}}, /*no_sync=*/true);
    add("NO_SHARD_bf16_NoSync", w, {{"sharding", "NO_SHARD"}, {"param_dtype", "bf16"}}, /*no_sync=*/true);
  }
  add("FULL_SHARD_fp16_Clipped", 2,
      {{"sharding", "FULL_SHARD"}, {"param_dtype", "fp16"}, {"max_grad_norm", "1.0"}, {"loss_scale", "dynamic"}});
  add("FULL_SHARD_fp32_PrefetchOff", 3,
      {{"sharding", "FULL_SHARD"}, {"forward_prefetch", "0"}, {"backward_prefetch", "none"}});
  add("FULL_SHARD_fp32_Sgd", 2, {{"sharding", "FULL_SHARD"}, {"optimizer", "sgd"}, {"momentum", "0.9"}});
  return cs;
}

INSTANTIATE_TEST_SUITE_P(Cases, SteadyState, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<WaitCase>& pi) { return pi.param.name; });

}  // namespace
