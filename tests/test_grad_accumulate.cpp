// fsdp_grad_accumulate: a framework's grad added from memory of its own, for
// frameworks whose arrays cannot be written in place (JAX) or live in their
// own allocator. Two units of the same params in one context: into "acc" the
// grads go through the call, into "ref" through the host's own add into
// fsdp_grad_ptr (each element in fp32, rounded once to param_dtype). After
// the backward the reduced grads (fsdp_gather_grad) of the two must be the
// same bits, and both must match the mean over the ranks that the test
// computes itself. Every strategy, worlds 1-4, offload, every param dtype and
// every source dtype, two calls per param per pass (they add up) over two
// passes. In the .late CTests the framework's grad is written by a task on
// the late host stream just before the call: an add that did not wait for the
// stream's queued work would read the buffer before that write. Then the
// refusals, which change nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "host_stream.h"
#include "rank_runner.h"

using namespace fsdp_test;

namespace {

const std::vector<ParamSpec> kShapes = {{"a", {5, 7}}, {"b", {13}}, {"c", {3, 3}}};
constexpr int kPasses = 2;
constexpr int kCallsPerPass = 2;

std::vector<ParamSpec> named(const char* prefix) {
  std::vector<ParamSpec> out = kShapes;
  for (auto& p : out) p.name = std::string(prefix) + "." + p.name;
  return out;
}

struct Case {
  const char* sharding;
  int world;
  fsdp_dtype_t param_dtype;
  fsdp_dtype_t src_dtype;
  bool offload;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(c.sharding) + "_world" + std::to_string(c.world) + "_" + dtype_config_name(c.param_dtype) +
         "_from_" + dtype_config_name(c.src_dtype) + (c.offload ? "_offload" : "");
}

// The grad the framework holds for param p in call `call` of pass `pass` on
// `rank`, as fp32 values already rounded to the source dtype.
std::vector<float> framework_grad(int rank, int pass, int call, size_t p, fsdp_dtype_t src_dtype) {
  Rng rng(7000 + 131 * uint64_t(rank) + 17 * uint64_t(pass) + 5 * uint64_t(call) + p);
  std::vector<float> g = rng.uniform_vec(numel_of(kShapes[p].shape), -1.f, 1.f);
  for (float& x : g) x = round_to(src_dtype, x);
  return g;
}

// The framework's buffer: `values` stored in `dt`.
std::vector<uint8_t> as_buffer(const std::vector<float>& values, fsdp_dtype_t dt) {
  std::vector<uint8_t> out(values.size() * dtype_nbytes(dt), 0);
  for (size_t i = 0; i < values.size(); ++i) add_elem(out.data(), i, dt, values[i]);  // 0 + v: v in dt
  return out;
}

class GradAccumulate : public ::testing::TestWithParam<Case> {};

TEST_P(GradAccumulate, AddsWhatTheHostsOwnAddWouldBitForBit) {
  const Case c = GetParam();
  std::map<std::string, std::string> options = {{"sharding", c.sharding},
                                                {"param_dtype", dtype_config_name(c.param_dtype)},
                                                {"reduce_dtype", "fp32"},
                                                {"timeout_s", "30"}};
  if (c.offload) options["offload"] = "cpu";
  if (std::string(c.sharding) == "HYBRID_SHARD") options["shard_group_size"] = "2";
  // What each rank's grad buffer holds after each pass (the host's adds: each
  // call's values added in fp32 and rounded to param_dtype), then the mean
  // over the ranks in double: the reduced grad up to fp32 rounding.
  std::vector<std::vector<std::vector<double>>> expected(kPasses);
  for (int k = 0; k < kPasses; ++k) {
    for (size_t p = 0; p < kShapes.size(); ++p) {
      expected[k].push_back(k > 0 ? expected[k - 1][p] : std::vector<double>(numel_of(kShapes[p].shape), 0.0));
      for (int r = 0; r < c.world; ++r) {
        std::vector<float> buf(expected[k][p].size(), 0.f);  // the pass's buffer starts at zero
        for (int call = 0; call < kCallsPerPass; ++call) {
          const std::vector<float> g = framework_grad(r, k, call, p, c.src_dtype);
          for (size_t i = 0; i < g.size(); ++i) buf[i] = round_to(c.param_dtype, buf[i] + g[i]);
        }
        for (size_t i = 0; i < buf.size(); ++i) expected[k][p][i] += double(buf[i]) / c.world;
      }
    }
  }
  run_ranks(c.world, [&](int rank, fsdp_local_group_t* group) {
    ConfigPtr cfg = make_config(options);
    ASSERT_TRUE(cfg);
    fsdp_ctx_t* raw = nullptr;
    ASSERT_OK(fsdp_ctx_create(cfg.get(), group, group ? rank : -1, &raw));
    CtxPtr ctx(raw);
    fsdp_unit_t* acc = nullptr;
    fsdp_unit_t* ref = nullptr;
    ASSERT_OK(register_unit(raw, "acc", named("acc"), &acc));
    ASSERT_OK(register_unit(raw, "ref", named("ref"), &ref));
    Host host(raw);
    for (int k = 0; k < kPasses; ++k) {
      ASSERT_OK(fsdp_backward_begin(ref, host.stream()));
      ASSERT_OK(fsdp_backward_begin(acc, host.stream()));
      // The framework's buffers live until the host stream has run the adds.
      std::vector<std::shared_ptr<std::vector<uint8_t>>> bufs;
      for (size_t p = 0; p < kShapes.size(); ++p) {
        void* ref_grad = nullptr;
        ASSERT_OK(fsdp_grad_ptr(ref, p, &ref_grad));
        for (int call = 0; call < kCallsPerPass; ++call) {
          const std::vector<float> g = framework_grad(rank, k, call, p, c.src_dtype);
          // Written by the framework's own queued work (late: after this
          // thread has moved on), then added by libfsdp on the same stream.
          auto buf = std::make_shared<std::vector<uint8_t>>(g.size() * dtype_nbytes(c.src_dtype), 0xff);
          bufs.push_back(buf);
          host.run([buf, g, dt = c.src_dtype] {
            const std::vector<uint8_t> bytes = as_buffer(g, dt);
            std::memcpy(buf->data(), bytes.data(), bytes.size());
          });
          ASSERT_OK(fsdp_grad_accumulate(acc, p, buf->data(), c.src_dtype, g.size(), host.stream()));
          host.run([ref_grad, g, dt = c.param_dtype] {
            for (size_t i = 0; i < g.size(); ++i) add_elem(ref_grad, i, dt, g[i]);
          });
        }
      }
      ASSERT_OK(fsdp_backward_end(acc, host.stream()));
      ASSERT_OK(fsdp_backward_end(ref, host.stream()));
      host.sync();
      bufs.clear();
      for (size_t p = 0; p < kShapes.size(); ++p) {
        const size_t n = expected[k][p].size();
        std::vector<float> got(n, NAN), want(n, NAN);
        ASSERT_OK(fsdp_gather_grad(acc, p, got.data(), n));
        ASSERT_OK(fsdp_gather_grad(ref, p, want.data(), n));
        for (size_t i = 0; i < n; ++i) {
          ASSERT_EQ(f32_bits(got[i]), f32_bits(want[i]))
              << "param " << kShapes[p].name << " element " << i << " after pass " << k << ": " << got[i]
              << " through fsdp_grad_accumulate, " << want[i] << " through the host's add";
          // Sums of world * passes * calls terms of magnitude <= 1 in fp32.
          ASSERT_NEAR(got[i], expected[k][p][i], 1e-6 * kPasses * kCallsPerPass)
              << "param " << kShapes[p].name << " element " << i << " after pass " << k;
        }
      }
    }
    EXPECT_OK(fsdp_ctx_finalize(raw));
  });
}

std::vector<Case> cases() {
  std::vector<Case> out;
  const fsdp_dtype_t dts[] = {FSDP_DTYPE_FP32, FSDP_DTYPE_BF16, FSDP_DTYPE_FP16};
  // Every pair of param and source dtypes alone (world 1: the fp32 grads go
  // straight into the grad shard) and sharded at world 2.
  for (fsdp_dtype_t pd : dts) {
    for (fsdp_dtype_t sd : dts) {
      out.push_back({"FULL_SHARD", 1, pd, sd, false});
      out.push_back({"FULL_SHARD", 2, pd, sd, false});
    }
  }
  out.push_back({"SHARD_GRAD_OP", 3, FSDP_DTYPE_BF16, FSDP_DTYPE_FP32, false});
  out.push_back({"NO_SHARD", 2, FSDP_DTYPE_FP32, FSDP_DTYPE_BF16, false});
  out.push_back({"HYBRID_SHARD", 4, FSDP_DTYPE_BF16, FSDP_DTYPE_FP16, false});
  out.push_back({"FULL_SHARD", 1, FSDP_DTYPE_FP32, FSDP_DTYPE_FP32, true});
  out.push_back({"FULL_SHARD", 3, FSDP_DTYPE_BF16, FSDP_DTYPE_BF16, true});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GradAccumulate, ::testing::ValuesIn(cases()), case_name);

TEST(GradAccumulateMisuse, EachBadCallIsRefusedByNameAndChangesNothing) {
  FSDP_SKIP_WHEN_LATE("the refusals are checked before anything is queued; one mode covers them");
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    ConfigPtr cfg = make_config({{"sharding", "FULL_SHARD"}, {"timeout_s", "30"}});
    ASSERT_TRUE(cfg);
    fsdp_ctx_t* raw = nullptr;
    ASSERT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
    CtxPtr ctx(raw);
    fsdp_unit_t* unit = nullptr;
    const std::vector<int32_t> trainable = {1, 1, 0};  // c is frozen
    ASSERT_OK(register_unit(raw, "u", kShapes, &unit, &trainable));
    const size_t n = numel_of(kShapes[1].shape);
    std::vector<float> src(n, float(rank + 1));
    auto expect_refused = [&](fsdp_status_t want, fsdp_status_t got, const char* says) {
      EXPECT_EQ(got, want) << status_str(got);
      const std::string err = fsdp_last_error();
      EXPECT_NE(err.find("fsdp_grad_accumulate"), std::string::npos) << err;
      EXPECT_NE(err.find(says), std::string::npos) << err;
    };
    // Outside the backward bracket.
    expect_refused(FSDP_ERR_INVALID_STATE, fsdp_grad_accumulate(unit, 1, src.data(), FSDP_DTYPE_FP32, n, nullptr),
                   "in backward");
    ASSERT_OK(fsdp_forward_begin(unit, nullptr));
    expect_refused(FSDP_ERR_INVALID_STATE, fsdp_grad_accumulate(unit, 1, src.data(), FSDP_DTYPE_FP32, n, nullptr),
                   "in backward");
    ASSERT_OK(fsdp_forward_end(unit, nullptr));
    ASSERT_OK(fsdp_backward_begin(unit, nullptr));
    expect_refused(FSDP_ERR_INVALID_ARGUMENT, fsdp_grad_accumulate(unit, 1, src.data(), FSDP_DTYPE_FP32, n + 1, nullptr),
                   "elements");
    expect_refused(FSDP_ERR_INVALID_ARGUMENT, fsdp_grad_accumulate(unit, 3, src.data(), FSDP_DTYPE_FP32, n, nullptr),
                   "out of range");
    expect_refused(FSDP_ERR_INVALID_ARGUMENT, fsdp_grad_accumulate(unit, 1, nullptr, FSDP_DTYPE_FP32, n, nullptr),
                   "src");
    expect_refused(FSDP_ERR_INVALID_ARGUMENT,
                   fsdp_grad_accumulate(unit, 1, src.data(), static_cast<fsdp_dtype_t>(7), n, nullptr), "src_dtype");
    expect_refused(FSDP_ERR_INVALID_STATE,
                   fsdp_grad_accumulate(unit, 2, src.data(), FSDP_DTYPE_FP32, numel_of(kShapes[2].shape), nullptr),
                   "frozen");
    expect_refused(FSDP_ERR_INVALID_ARGUMENT, fsdp_grad_accumulate(nullptr, 1, src.data(), FSDP_DTYPE_FP32, n, nullptr),
                   "unit");
    // One good call: only it reached the grads.
    ASSERT_OK(fsdp_grad_accumulate(unit, 1, src.data(), FSDP_DTYPE_FP32, n, nullptr));
    ASSERT_OK(fsdp_backward_end(unit, nullptr));
    std::vector<float> got(n, NAN);
    ASSERT_OK(fsdp_gather_grad(unit, 1, got.data(), n));
    for (float v : got) ASSERT_EQ(v, 1.5f) << "mean of 1 and 2";
    got.assign(numel_of(kShapes[0].shape), NAN);
    ASSERT_OK(fsdp_gather_grad(unit, 0, got.data(), got.size()));
    for (float v : got) ASSERT_EQ(v, 0.f) << "a refused call added something";
    EXPECT_OK(fsdp_ctx_finalize(raw));
  });
}

}  // namespace
