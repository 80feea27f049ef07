// Proves that misuses among ranks (mismatched registrations, wrong call order,
// bad indices, calls after finalize, missing and aborting ranks, bad HYBRID_SHARD
// groups) fail with the documented status and a message on every rank, change
// nothing, and never hang. The helpers are misuse_util.h's.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "misuse_util.h"

using namespace fsdp_test;
using namespace fsdp_test::misuse;

namespace {

// ---- registration ------------------------------------------------------------

TEST(Registration, InvalidUnitsAreRejectedAndDoNotDesynchronizeRanks) {
  run_ranks(2, [](int rank, fsdp_local_group_t* group) {
    ConfigPtr cfg = make_config({{"timeout_s", "10"}});
    ASSERT_TRUE(cfg);
    fsdp_ctx_t* raw = nullptr;
    ASSERT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
    CtxPtr ctx(raw);
    int r = -1, w = -1;
    EXPECT_OK(fsdp_ctx_rank(ctx.get(), &r));
    EXPECT_OK(fsdp_ctx_world_size(ctx.get(), &w));
    EXPECT_EQ(r, rank);
    EXPECT_EQ(w, 2);
    fsdp_unit_t* u = nullptr;
    const char* names[] = {"a", "a"};
    const int32_t nd[] = {1, 1}, neg_nd[] = {-1, 1};
    const int64_t dims[] = {3, 2}, neg_dims[] = {3, -2};
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_unit_register(ctx.get(), "u", 0, names, nd, dims, &u));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_unit_register(ctx.get(), "u", 2, names, nd, dims, &u));  // duplicate
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, register_unit(ctx.get(), "u", {{"a", {3}}, {"b", {-2}}}, &u));
    const char* distinct[] = {"a", "b"};
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_unit_register(ctx.get(), "u", 2, distinct, neg_nd, dims, &u));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_unit_register(ctx.get(), "u", 2, distinct, nd, neg_dims, &u));
    EXPECT_EQ(u, nullptr) << "a failed registration wrote its output";
    // The failures were local: the ranks still agree on the next unit.
    ASSERT_OK(fsdp_unit_register(ctx.get(), "u", 2, distinct, nd, dims, &u));
    ASSERT_NE(u, nullptr);
    EXPECT_OK(fsdp_ctx_finalize(ctx.get()));
  });
}

const std::vector<ParamSpec> kBlock = {{"attn.qkv", {4, 3}}, {"attn.bias", {4}}};

struct Mismatch {
  const char* name;
  std::vector<ParamSpec> odd_params;  // what the last rank registers
  const char* odd_unit;
  std::vector<std::string> message_names;  // the message must contain one of these
};

class RegistrationMismatch : public ::testing::TestWithParam<std::tuple<Mismatch, int>> {};

TEST_P(RegistrationMismatch, FailsWithMismatchOnEveryRankWithoutHanging) {
  const Mismatch& m = std::get<0>(GetParam());
  const int world = std::get<1>(GetParam());
  std::vector<fsdp_status_t> got(size_t(world), FSDP_OK);
  std::vector<std::string> msgs(static_cast<size_t>(world));
  std::vector<double> took(size_t(world), 0);
  run_ranks(
      world,
      [&](int rank, fsdp_local_group_t* group) {
        ConfigPtr cfg = make_config({{"timeout_s", "20"}});
        ASSERT_TRUE(cfg);
        fsdp_ctx_t* raw = nullptr;
        ASSERT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
        CtxPtr ctx(raw);
        const bool odd = rank == world - 1;
        fsdp_unit_t* u = nullptr;
        const auto t0 = std::chrono::steady_clock::now();
        got[size_t(rank)] = register_unit(ctx.get(), odd ? m.odd_unit : "block7", odd ? m.odd_params : kBlock, &u);
        msgs[size_t(rank)] = last_error_str();
        took[size_t(rank)] = seconds_since(t0);
      },
      60);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(got[size_t(r)], FSDP_ERR_MISMATCH) << "rank " << r << ": " << msgs[size_t(r)];
    EXPECT_LT(took[size_t(r)], 10.0) << "rank " << r << " waited for a timeout instead";
    bool named = m.message_names.empty();
    for (const auto& n : m.message_names) named = named || contains(msgs[size_t(r)], n);
    EXPECT_TRUE(named) << "rank " << r << " message does not name the difference: " << msgs[size_t(r)];
  }
}

INSTANTIATE_TEST_SUITE_P(
    Differences, RegistrationMismatch,
    ::testing::Combine(
        ::testing::Values(
            Mismatch{"UnitName", kBlock, "blork9", {"block7", "blork9"}},
            Mismatch{"ParamName", {{"attn.qkv", {4, 3}}, {"mlp.bias", {4}}}, "block7", {"attn.bias", "mlp.bias"}},
            Mismatch{"Shape", {{"attn.qkv", {4, 5}}, {"attn.bias", {4}}}, "block7", {"attn.qkv"}},
            Mismatch{"ShapeRank", {{"attn.qkv", {12}}, {"attn.bias", {4}}}, "block7", {"attn.qkv"}},
            Mismatch{"ParamCount", {{"attn.qkv", {4, 3}}}, "block7", {}}),
        ::testing::Values(2, 3)),
    [](const ::testing::TestParamInfo<RegistrationMismatch::ParamType>& pi) {
      return std::string(std::get<0>(pi.param).name) + "_world" + std::to_string(std::get<1>(pi.param));
    });

// With gather_stream=1 gathers run over a communicator of their own, apart
// from the other collectives; a synchronous call (here fsdp_metrics_reduce)
// first meets the other ranks on the gathers' communicator too. So a rank
// that makes it where another issues a gather fails at once on both, naming
// both calls, instead of each waiting for the other until timeout_s (30 s
// here). With gather_stream=0 both meet on one communicator, as fast.
TEST(CollectiveMismatch, ASynchronousCallWhereAnotherRankGathersFailsBothAtOnce) {
  for (const char* apart : {"1", "0"}) {
    SCOPED_TRACE(std::string("gather_stream=") + apart);
    std::vector<fsdp_status_t> got(2, FSDP_OK);
    std::vector<std::string> msgs(2);
    std::vector<double> took(2, 0);
    run_ranks(
        2,
        [&](int rank, fsdp_local_group_t* group) {
          ConfigPtr cfg = make_config({{"timeout_s", "30"}, {"gather_stream", apart}});
          ASSERT_TRUE(cfg);
          fsdp_ctx_t* raw = nullptr;
          ASSERT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
          CtxPtr ctx(raw);
          fsdp_unit_t* u = nullptr;
          ASSERT_OK(register_unit(ctx.get(), "block0", kBlock, &u));
          const auto t0 = std::chrono::steady_clock::now();
          double v = 1.0;
          got[size_t(rank)] =
              rank == 0 ? fsdp_forward_begin(u, nullptr) : fsdp_metrics_reduce(raw, &v, 1, FSDP_REDUCE_SUM);
          msgs[size_t(rank)] = last_error_str();
          took[size_t(rank)] = seconds_since(t0);
        },
        60);
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(got[size_t(r)], FSDP_ERR_MISMATCH) << "rank " << r << ": " << msgs[size_t(r)];
      EXPECT_LT(took[size_t(r)], 10.0) << "rank " << r << " waited for a timeout instead";
      EXPECT_TRUE(contains(msgs[size_t(r)], "all_gather of unit 'block0'")) << msgs[size_t(r)];
      EXPECT_TRUE(contains(msgs[size_t(r)], "fsdp_metrics_reduce")) << msgs[size_t(r)];
    }
  }
}

// ---- call order ----------------------------------------------------------------

TEST(CallOrder, OutOfOrderCallsAreInvalidStateAndChangeNothing) {
  Single s;
  make_single(s, {{"sharding", "FULL_SHARD"}, {"optimizer", "sgd"}, {"lr", "0.1"}});
  if (HasFatalFailure()) return;
  fsdp_unit_t* u = s.unit;
  fsdp_ctx_t* ctx = s.ctx.get();
  const std::vector<float> w = Rng(1).uniform_vec(12, -1, 1), b = Rng(2).uniform_vec(4, -1, 1);
  ASSERT_OK(fsdp_param_set_values(u, 0, w.data(), w.size()));
  ASSERT_OK(fsdp_param_set_values(u, 1, b.data(), b.size()));
  void* p = nullptr;
  EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_forward_end(u, nullptr));
  EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_backward_end(u, nullptr));
  EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_param_ptr(u, 0, &p)) << "not gathered";
  EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_grad_ptr(u, 0, &p)) << "outside backward";
  ASSERT_OK(fsdp_forward_begin(u, nullptr));
  EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_grad_ptr(u, 0, &p)) << "in forward";
  EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_step(ctx, nullptr)) << "unit in forward";
  EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_param_set_values(u, 0, w.data(), 12)) << "unit in use";
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_param_ptr(u, 2, &p)) << "index out of range";
  ASSERT_OK(fsdp_param_ptr(u, 0, &p));
  ASSERT_NE(p, nullptr);
  for (size_t k = 0; k < w.size(); ++k) EXPECT_EQ(static_cast<const float*>(p)[k], w[k]);
  ASSERT_OK(fsdp_forward_end(u, nullptr));
  EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_param_ptr(u, 0, &p)) << "FULL_SHARD frees at forward_end";
  ASSERT_OK(fsdp_backward_begin(u, nullptr));
  EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_step(ctx, nullptr)) << "unit in backward";
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_grad_ptr(u, 2, &p)) << "index out of range";
  ASSERT_OK(fsdp_grad_ptr(u, 1, &p));
  for (size_t k = 0; k < 4; ++k) static_cast<float*>(p)[k] += 1.f;
  ASSERT_OK(fsdp_backward_end(u, nullptr));
  EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_grad_ptr(u, 0, &p)) << "after backward_end";
  EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_backward_end(u, nullptr)) << "twice";
  // The refused steps did nothing: one real step moves b by -lr * 1 and w not at all.
  ASSERT_OK(fsdp_step(ctx, nullptr));
  std::vector<float> got_w(12), got_b(4);
  ASSERT_OK(fsdp_gather_param(u, 0, got_w.data(), got_w.size()));
  ASSERT_OK(fsdp_gather_param(u, 1, got_b.data(), got_b.size()));
  EXPECT_EQ(got_w, w);
  for (size_t k = 0; k < 4; ++k) EXPECT_FLOAT_EQ(got_b[k], b[k] - 0.1f) << k;
  EXPECT_OK(fsdp_ctx_finalize(ctx));
}

TEST(CallOrder, ShardGradOpKeepsParamsFromForwardUntilBackwardEnd) {
  // Two ranks: at world 1 the shard is the full params and nothing is gathered
  // (CallOrder.WorldOfOneReadsTheShardInPlace).
  run_ranks(2, [](int rank, fsdp_local_group_t* group) {
    Single s;
    make_single(s, {{"sharding", "SHARD_GRAD_OP"}}, group, rank);
    if (::testing::Test::HasFatalFailure()) return;
    void* p = nullptr;
    fsdp_memory_stats_t ms;
    ms.struct_size = sizeof ms;
    ASSERT_OK(fsdp_forward_begin(s.unit, nullptr));
    EXPECT_OK(fsdp_param_ptr(s.unit, 0, &p));
    ASSERT_OK(fsdp_forward_end(s.unit, nullptr));
    // The params stay gathered (memory held) but, as for every strategy, the
    // pointer is only valid between a *_begin and its *_end.
    ASSERT_OK(fsdp_memory_stats(s.ctx.get(), &ms));
    EXPECT_GT(ms.gathered_params_nbytes, 0u) << "SHARD_GRAD_OP keeps the gathered params after forward_end";
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_param_ptr(s.unit, 0, &p));
    ASSERT_OK(fsdp_backward_begin(s.unit, nullptr));
    EXPECT_OK(fsdp_param_ptr(s.unit, 0, &p));
    ASSERT_OK(fsdp_backward_end(s.unit, nullptr));
    ASSERT_OK(fsdp_memory_stats(s.ctx.get(), &ms));
    EXPECT_EQ(ms.gathered_params_nbytes, 0u) << "backward_end frees them";
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_param_ptr(s.unit, 0, &p));
    EXPECT_OK(fsdp_ctx_finalize(s.ctx.get()));
  });
}

TEST(CallOrder, WorldOfOneReadsTheShardInPlace) {
  // Alone, every strategy's shard is the full params: no gathered copy, no
  // full grad buffer for fp32 (the grads are the grad shard), and the call
  // order rules stay the same.
  for (const char* sharding : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"}) {
    SCOPED_TRACE(sharding);
    Single s;
    make_single(s, {{"sharding", sharding}});
    if (HasFatalFailure()) return;
    void* p = nullptr;
    void* g = nullptr;
    fsdp_memory_stats_t ms;
    ms.struct_size = sizeof ms;
    ASSERT_OK(fsdp_forward_begin(s.unit, nullptr));
    EXPECT_OK(fsdp_param_ptr(s.unit, 0, &p));
    ASSERT_OK(fsdp_forward_end(s.unit, nullptr));
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_param_ptr(s.unit, 0, &p));
    ASSERT_OK(fsdp_backward_begin(s.unit, nullptr));
    EXPECT_OK(fsdp_grad_ptr(s.unit, 0, &g));
    ASSERT_OK(fsdp_memory_stats(s.ctx.get(), &ms));
    EXPECT_EQ(ms.gathered_params_nbytes, 0u);
    EXPECT_EQ(ms.unsharded_grads_nbytes, 0u);
    ASSERT_OK(fsdp_backward_end(s.unit, nullptr));
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_grad_ptr(s.unit, 0, &g));
    ASSERT_OK(fsdp_memory_stats(s.ctx.get(), &ms));
    EXPECT_EQ(ms.gathered_params_peak_nbytes, 0u);
    EXPECT_EQ(ms.unsharded_grads_peak_nbytes, 0u);
    EXPECT_OK(fsdp_step(s.ctx.get(), nullptr));
    EXPECT_OK(fsdp_ctx_finalize(s.ctx.get()));
  }
}

TEST(BadIndices, OutOfRangeParamIndexAndWrongNumelAreInvalidArgumentAndChangeNothing) {
  Single s;
  make_single(s);
  if (HasFatalFailure()) return;
  const std::vector<float> w = Rng(3).uniform_vec(12, -1, 1), other = Rng(4).uniform_vec(13, -1, 1);
  ASSERT_OK(fsdp_param_set_values(s.unit, 0, w.data(), 12));
  size_t off = 0, n = 0;
  std::vector<float> out(13, 0.f);
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_param_set_values(s.unit, 2, w.data(), 12));
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_param_set_values(s.unit, size_t(-1), w.data(), 12));
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_param_set_weight_decay(s.unit, 2, 0.0));
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_param_flat_range(s.unit, 2, &off, &n));
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_gather_param(s.unit, 2, out.data(), 4));
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_param_set_values(s.unit, 0, other.data(), 13));
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_param_set_values(s.unit, 0, other.data(), 11));
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_gather_param(s.unit, 0, out.data(), 13));
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_gather_param(s.unit, 0, out.data(), 11));
  out.assign(12, NAN);
  ASSERT_OK(fsdp_gather_param(s.unit, 0, out.data(), 12));
  EXPECT_EQ(out, w) << "a refused set_values changed the param";
  EXPECT_OK(fsdp_ctx_finalize(s.ctx.get()));
}

// ---- finalize ------------------------------------------------------------------

TEST(Finalize, EveryCallAfterFinalizeIsInvalidStateExceptDestroy) {
  run_ranks(
      2,
      [](int rank, fsdp_local_group_t* group) {
        Single s;
        make_single(s, {{"timeout_s", "10"}}, group, rank);
        if (HasFatalFailure()) return;
        fsdp_ctx_t* raw = s.ctx.get();
        fsdp_unit_t* u = s.unit;
        ASSERT_OK(fsdp_ctx_finalize(raw));
        float f[12] = {0};
        float* fp = nullptr;
        void* p = nullptr;
        size_t off = 0, n = 0;
        int i = 0;
        double d = 0;
        uint64_t u64 = 0;
        fsdp_dtype_t dt;
        fsdp_unit_t* u2 = nullptr;
        fsdp_memory_stats_t ms;
        ms.struct_size = sizeof ms;
        const std::vector<Call> calls = {
            {"ctx_finalize", [&] { return fsdp_ctx_finalize(raw); }},
            {"ctx_rank", [&] { return fsdp_ctx_rank(raw, &i); }},
            {"ctx_world_size", [&] { return fsdp_ctx_world_size(raw, &i); }},
            {"ctx_param_dtype", [&] { return fsdp_ctx_param_dtype(raw, &dt); }},
            {"ctx_async_error", [&] { return fsdp_ctx_async_error(raw); }},
            {"unit_register", [&] { return register_unit(raw, "v", kParams, &u2); }},
            {"param_set_values", [&] { return fsdp_param_set_values(u, 0, f, 12); }},
            {"param_set_weight_decay", [&] { return fsdp_param_set_weight_decay(u, 0, 0.0); }},
            {"forward_begin", [&] { return fsdp_forward_begin(u, nullptr); }},
            {"forward_end", [&] { return fsdp_forward_end(u, nullptr); }},
            {"backward_begin", [&] { return fsdp_backward_begin(u, nullptr); }},
            {"backward_end", [&] { return fsdp_backward_end(u, nullptr); }},
            {"param_ptr", [&] { return fsdp_param_ptr(u, 0, &p); }},
            {"grad_ptr", [&] { return fsdp_grad_ptr(u, 0, &p); }},
            {"step", [&] { return fsdp_step(raw, nullptr); }},
            {"set_grad_sync", [&] { return fsdp_set_grad_sync(raw, 0); }},
            {"set_lr", [&] { return fsdp_set_lr(raw, 0.1); }},
            {"last_grad_norm", [&] { return fsdp_last_grad_norm(raw, &d); }},
            {"ctx_step", [&] { return fsdp_ctx_step(raw, &u64); }},
            {"gather_param", [&] { return fsdp_gather_param(u, 0, f, 12); }},
            {"gather_grad", [&] { return fsdp_gather_grad(u, 0, f, 12); }},
            {"shard_info", [&] { return fsdp_shard_info(u, &fp, &off, &n); }},
            {"param_flat_range", [&] { return fsdp_param_flat_range(u, 0, &off, &n); }},
            {"memory_stats", [&] { return fsdp_memory_stats(raw, &ms); }},
            {"memory_stats_reset_peak", [&] { return fsdp_memory_stats_reset_peak(raw); }},
        };
        for (const auto& c : calls) {
          SCOPED_TRACE(c.first);
          EXPECT_STATUS(FSDP_ERR_INVALID_STATE, c.second());
        }
      },
      60);  // ctx_destroy at scope exit
}

// ---- missing ranks ---------------------------------------------------------------

TEST(Timeout, ARankThatNeverRegistersIsNamedAndTheContextStaysFailed) {
  const int world = 3;
  std::atomic<int> finished{0};
  std::vector<fsdp_status_t> got(2, FSDP_OK), after(2, FSDP_OK), async(2, FSDP_OK);
  std::vector<std::string> msgs(2);
  std::vector<double> took(2, 0), took_after(2, 0);
  run_ranks(
      world,
      [&](int rank, fsdp_local_group_t* group) {
        struct Done {  // ranks 0 and 1 count themselves finished however they return
          std::atomic<int>* n;
          ~Done() {
            if (n) ++*n;
          }
        } done{rank == 2 ? nullptr : &finished};
        ConfigPtr cfg = make_config({{"timeout_s", "0.5"}});
        ASSERT_TRUE(cfg);
        fsdp_ctx_t* raw = nullptr;
        const fsdp_status_t created = fsdp_ctx_create(cfg.get(), group, rank, &raw);
        CtxPtr ctx(raw);
        if (rank == 2) {  // joins ctx_create, then never registers; stays alive until the others are done
          EXPECT_EQ(created, FSDP_OK) << last_error_str();
          while (finished.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
          return;
        }
        ASSERT_EQ(created, FSDP_OK) << last_error_str();
        const size_t r = size_t(rank);
        fsdp_unit_t* u = nullptr;
        auto t0 = std::chrono::steady_clock::now();
        got[r] = register_unit(ctx.get(), "u", kParams, &u);
        msgs[r] = last_error_str();
        took[r] = seconds_since(t0);
        async[r] = fsdp_ctx_async_error(ctx.get());
        t0 = std::chrono::steady_clock::now();
        after[r] = register_unit(ctx.get(), "u2", kParams, &u);
        took_after[r] = seconds_since(t0);
      },
      60);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(got[r], FSDP_ERR_TIMEOUT) << "rank " << r << ": " << msgs[r];
    EXPECT_TRUE(contains(msgs[r], "rank 2")) << "rank " << r << ": " << msgs[r];
    EXPECT_GE(took[r], 0.25) << "rank " << r << " gave up long before timeout_s";
    EXPECT_LT(took[r], 10.0) << "rank " << r;
    EXPECT_NE(async[r], FSDP_OK) << "rank " << r << ": the failure must stay visible";
    EXPECT_TRUE(after[r] == FSDP_ERR_COMM || after[r] == FSDP_ERR_TIMEOUT)
        << "rank " << r << " next collective: " << status_str(after[r]);
    EXPECT_LT(took_after[r], 10.0) << "rank " << r;
  }
}

TEST(Timeout, ARankThatNeverCreatesItsContextIsNamed) {
  std::vector<fsdp_status_t> got(2, FSDP_OK);
  std::vector<std::string> msgs(2);
  std::vector<double> took(2, 0);
  run_ranks(
      3,
      [&](int rank, fsdp_local_group_t* group) {
        if (rank == 2) return;
        ConfigPtr cfg = make_config({{"timeout_s", "0.5"}});
        ASSERT_TRUE(cfg);
        fsdp_ctx_t* raw = nullptr;
        const auto t0 = std::chrono::steady_clock::now();
        got[size_t(rank)] = fsdp_ctx_create(cfg.get(), group, rank, &raw);
        msgs[size_t(rank)] = last_error_str();
        took[size_t(rank)] = seconds_since(t0);
        fsdp_ctx_destroy(raw);
      },
      60);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(got[r], FSDP_ERR_TIMEOUT) << "rank " << r << ": " << msgs[r];
    EXPECT_TRUE(contains(msgs[r], "rank 2")) << "rank " << r << ": " << msgs[r];
    EXPECT_LT(took[r], 10.0) << "rank " << r;
  }
}

// ---- aborting a local group -------------------------------------------------

// One rank fails in user code and aborts the group. The others, waiting in (or
// later entering) collectives with a timeout far longer than the watchdog,
// must fail with FSDP_ERR_COMM carrying the reason instead of waiting it out.
// FULL_SHARD's collectives run on the world group itself. With HYBRID_SHARD
// (shard_group_size 2 of 4) the rank that shares the aborting rank's shard
// group waits in a collective of a sub-group split from the world, which the
// abort must reach too (without that, this test hangs until the watchdog).
void expect_abort_releases_waiting_ranks(int world, const std::map<std::string, std::string>& opts) {
  const int aborter = world - 1;
  const size_t n = size_t(world);
  std::vector<fsdp_status_t> fwd(n, FSDP_OK), step(n, FSDP_OK), async(n, FSDP_OK);
  std::vector<std::string> msgs(n);
  auto all_opts = opts;
  all_opts["timeout_s"] = "600";
  run_ranks(
      world,
      [&](int rank, fsdp_local_group_t* group) {
        Single s;
        make_single(s, all_opts, group, rank);
        if (::testing::Test::HasFatalFailure()) return;
        fsdp_ctx_t* raw = s.ctx.get();
        fsdp_unit_t* u = s.unit;
        const size_t r = size_t(rank);
        if (rank == aborter) {
          // Give the others time to be waiting in a collective (arriving later is covered too).
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
          EXPECT_OK(fsdp_local_group_abort(group, "rank 3 ran out of memory in its own code"));
          return;  // destroys its context without finalize, as a failing rank does
        }
        // Forward and backward run their collectives; the last rank never joins them.
        fwd[r] = fsdp_forward_begin(u, nullptr);
        if (fwd[r] == FSDP_OK) fwd[r] = fsdp_forward_end(u, nullptr);
        if (fwd[r] == FSDP_OK) fwd[r] = fsdp_backward_begin(u, nullptr);
        if (fwd[r] == FSDP_OK) fwd[r] = fsdp_backward_end(u, nullptr);
        if (fwd[r] == FSDP_OK) fwd[r] = fsdp_step(raw, nullptr);
        msgs[r] = last_error_str();
        step[r] = fsdp_step(raw, nullptr);
        async[r] = fsdp_ctx_async_error(raw);
      },
      60);
  for (size_t r = 0; r < size_t(aborter); ++r) {
    EXPECT_EQ(fwd[r], FSDP_ERR_COMM) << "rank " << r << ": " << msgs[r];
    EXPECT_TRUE(contains(msgs[r], "aborted by the application")) << "rank " << r << ": " << msgs[r];
    EXPECT_TRUE(contains(msgs[r], "rank 3 ran out of memory in its own code")) << "rank " << r << ": " << msgs[r];
    EXPECT_NE(step[r], FSDP_OK) << "rank " << r << ": the next collective must fail too";
    EXPECT_EQ(async[r], FSDP_ERR_COMM) << "rank " << r;
  }
}

TEST(Abort, RanksWaitingInAFullShardCollectiveFailAtOnceWithTheReason) {
  expect_abort_releases_waiting_ranks(4, {{"sharding", "FULL_SHARD"}});
}

TEST(Abort, RanksWaitingInAHybridShardSubGroupFailAtOnceWithTheReason) {
  expect_abort_releases_waiting_ranks(4, {{"sharding", "HYBRID_SHARD"}, {"shard_group_size", "2"}});
}

TEST(Abort, AnAbortedGroupRefusesNewContextsAndKeepsTheFirstReason) {
  fsdp_local_group_t* group = nullptr;
  ASSERT_OK(fsdp_local_group_create(2, &group));
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_local_group_abort(nullptr, "x"));
  EXPECT_TRUE(contains(last_error_str(), "group")) << last_error_str();
  EXPECT_OK(fsdp_local_group_abort(group, "the first reason"));
  EXPECT_OK(fsdp_local_group_abort(group, nullptr));  // a second call changes nothing
  ConfigPtr cfg = make_config({{"timeout_s", "600"}});
  ASSERT_TRUE(cfg);
  fsdp_ctx_t* raw = nullptr;
  EXPECT_STATUS(FSDP_ERR_COMM, fsdp_ctx_create(cfg.get(), group, 0, &raw));
  EXPECT_TRUE(contains(last_error_str(), "the first reason")) << last_error_str();
  EXPECT_EQ(raw, nullptr);
  fsdp_local_group_destroy(group);
  // NULL reason on a fresh group.
  ASSERT_OK(fsdp_local_group_create(1, &group));
  EXPECT_OK(fsdp_local_group_abort(group, nullptr));
  EXPECT_STATUS(FSDP_ERR_COMM, fsdp_ctx_create(cfg.get(), group, 0, &raw));
  EXPECT_TRUE(contains(last_error_str(), "no reason given")) << last_error_str();
  fsdp_local_group_destroy(group);
}

}  // namespace

// ---- HYBRID_SHARD groups ----------------------------------------------------

TEST(HybridShard, AGroupSizeThatDoesNotDivideTheWorldFailsOnEveryRank) {
  const int world = 4;
  std::vector<fsdp_status_t> got(size_t(world), FSDP_OK);
  std::vector<std::string> msgs(static_cast<size_t>(world));
  run_ranks(world, [&](int rank, fsdp_local_group_t* group) {
    ConfigPtr cfg = make_config({{"sharding", "HYBRID_SHARD"}, {"shard_group_size", "3"}, {"timeout_s", "20"}});
    ASSERT_TRUE(cfg);
    fsdp_ctx_t* raw = nullptr;
    got[size_t(rank)] = fsdp_ctx_create(cfg.get(), group, rank, &raw);
    msgs[size_t(rank)] = last_error_str();
    fsdp_ctx_destroy(got[size_t(rank)] == FSDP_OK ? raw : nullptr);
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(got[size_t(r)], FSDP_ERR_INVALID_ARGUMENT) << "rank " << r << ": " << msgs[size_t(r)];
    EXPECT_TRUE(contains(msgs[size_t(r)], "shard_group_size")) << msgs[size_t(r)];
  }
}

TEST(HybridShard, ShardInfoCoversTheShardGroupNotTheWorld) {
  // world 4 in groups of 2: ranks 0 and 2 hold the first half, 1 and 3 the second.
  const std::vector<ParamSpec> params = {{"w", {10, 10}}};
  std::vector<size_t> offsets(4), numels(4);
  run_ranks(4, [&](int rank, fsdp_local_group_t* group) {
    Single s;
    make_single(s, {{"sharding", "HYBRID_SHARD"}, {"shard_group_size", "2"}, {"align_bytes", "16"}}, group, rank,
                params);
    float* p = nullptr;
    ASSERT_OK(fsdp_shard_info(s.unit, &p, &offsets[size_t(rank)], &numels[size_t(rank)]));
    EXPECT_OK(fsdp_ctx_finalize(s.ctx.get()));
  });
  // 100 elements padded to a multiple of 2 * 4 = 104, so shards of 52.
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(numels[size_t(r)], 52u) << "rank " << r;
    EXPECT_EQ(offsets[size_t(r)], size_t(r % 2) * 52u) << "rank " << r;
  }
}

TEST(Context, RankMinusOneWithoutAGroupIsRankZeroOfAWorldOfOne) {
  ConfigPtr cfg = make_config({{"comm", "local"}});
  ASSERT_TRUE(cfg);
  fsdp_ctx_t* raw = nullptr;
  ASSERT_OK(fsdp_ctx_create(cfg.get(), nullptr, -1, &raw));
  CtxPtr ctx(raw);
  int rank = -5, world = -5;
  EXPECT_OK(fsdp_ctx_rank(raw, &rank));
  EXPECT_OK(fsdp_ctx_world_size(raw, &world));
  EXPECT_EQ(rank, 0);
  EXPECT_EQ(world, 1);
}
