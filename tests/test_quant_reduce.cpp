// Quantized grad reduction (reduce_dtype=int8|fp8_e4m3, kernels/quant.h).
//
// The kernel's sum against the test's own model: each slice quantized and
// dequantized by the references of quant_ref.h (the formats' definitions),
// added in fp32 in slice order, scaled once. Then the engine: after a
// backward, each rank's reduced grad shard (read through optimizer=host's
// fsdp_shard_tensors) equals, bit for bit, the test's model of the
// reduction: every rank of the shard group packs its part of the grads for
// each rank in blocks of reduce_block, and a rank sums the dequantized parts
// it receives in rank order in fp32, times 1/shard world for an average;
// HYBRID's replicas then average the shards in fp32. For every sharded
// strategy, worlds 1-4, fp32 and bf16 grads, sum and average, offload, a
// frozen param, two reductions accumulating, the late host stream. The
// collectives move exactly the packed bytes (an all-to-all, no
// reduce-scatter); a world of one adds the grads exactly; NO_SHARD is
// refused with a reason.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "../kernels/quant.h"
#include "../src/device/cpu/cpu_device.h"
#include "host_stream.h"
#include "quant_ref.h"
#include "rank_runner.h"

using namespace fsdp_test;
namespace k = fsdp::kernels;

namespace {

// Equal values (a -0 and a +0 are equal: the sum's sign of zero is the
// accumulation's), or both NaN.
bool equal_value(float a, float b) { return a == b || (std::isnan(a) && std::isnan(b)); }

// slices x[s][0, n) packed one after another, as the all-to-all delivers them.
std::vector<uint8_t> pack_slices(fsdp::device::CpuDevice& cpu, const std::vector<std::vector<float>>& x, size_t n,
                                 size_t block, k::QType t) {
  const size_t part = k::quant_packed_bytes(n, block);
  std::vector<uint8_t> packed(part * x.size());
  for (size_t s = 0; s < x.size(); ++s)
    cpu.quantize(packed.data() + s * part, x[s].data(), fsdp::DType::kFp32, n, block, t);
  return packed;
}

// The model of a rank's sum: each slice's round trip, added in slice order
// in fp32 (the first two, then each next), scaled once.
std::vector<float> ref_sum(const std::vector<std::vector<float>>& x, size_t n, size_t block, k::QType t, float scale) {
  std::vector<float> acc;
  for (size_t s = 0; s < x.size(); ++s) {
    const std::vector<float> d = ref_round_trip(x[s].data(), n, block, t);
    if (s == 0) {
      acc = d;
    } else {
      for (size_t i = 0; i < n; ++i) acc[i] = acc[i] + d[i];
    }
  }
  for (float& v : acc) v = v * scale;
  return acc;
}

}  // namespace

TEST(QuantReduceKernels, DequantizeSumAddsTheRanksDequantizedPartsInRankOrder) {
  fsdp::device::CpuDevice cpu(2, fsdp::device::Pool::kDevice);
  for (k::QType t : kTypes) {
    for (size_t slices : {size_t(1), size_t(2), size_t(3), size_t(5)}) {
      for (size_t n : {size_t(1), size_t(100), size_t(1000)}) {
        for (size_t block : {size_t(64), size_t(256)}) {  // 256: the CPU device's tiles of 128
          SCOPED_TRACE(std::string(type_name(t)) + " slices=" + std::to_string(slices) + " n=" + std::to_string(n) +
                       " block=" + std::to_string(block));
          std::vector<std::vector<float>> x(slices, std::vector<float>(n));
          Rng rng(17 * n + slices);
          for (size_t s = 0; s < slices; ++s) {
            for (size_t i = 0; i < n; ++i)
              x[s][i] = rng.uniform(-1.f, 1.f) * std::ldexp(1.0f, int((i / 64 + s) % 7) - 3);
          }
          if (n >= 200 && slices >= 2) x[1][130] = NAN;  // block 2 of slice 1: the sum's block 2 is NaN
          const std::vector<uint8_t> dense = pack_slices(cpu, x, n, block, t);
          // The slices one after another, and 64 bytes of junk apart (the
          // hierarchical reduction's layout: one part of each rank's chunk).
          const size_t pb = k::quant_packed_bytes(n, block);
          std::vector<uint8_t> gapped(slices * (pb + 64), 0xA5);
          for (size_t s = 0; s < slices; ++s) std::memcpy(&gapped[s * (pb + 64)], &dense[s * pb], pb);
          for (auto [packed, stride] : {std::pair<const std::vector<uint8_t>*, size_t>(&dense, pb),
                                        std::pair<const std::vector<uint8_t>*, size_t>(&gapped, pb + 64)})
            for (float scale : {1.0f, 1.0f / static_cast<float>(slices)}) {
              SCOPED_TRACE("slice stride " + std::to_string(stride));
              std::vector<float> out(n, 7.0f);
              cpu.dequantize_sum(out.data(), packed->data(), slices, stride, n, block, t, scale);
              const std::vector<float> want = ref_sum(x, n, block, t, scale);
              for (size_t i = 0; i < n; ++i) {
                ASSERT_TRUE(equal_value(out[i], want[i])) << "element " << i << ": " << out[i] << " vs " << want[i];
              }
              if (n >= 200 && slices >= 2) {
                for (size_t i = 128; i < 192; ++i)
                  ASSERT_TRUE(std::isnan(out[i])) << "a NaN in one rank's block: " << i;
                ASSERT_FALSE(std::isnan(out[block == 64 ? 127 : 256])) << "the next block is not";
              }
            }
        }
      }
    }
  }
}

// Every E4M3 code through the sum: the CPU device decodes a tile of 128
// codes with no zero, subnormal or NaN among them without checking each
// value, and the others value by value. Here two ranks' slices of 512 codes
// (tiles of 128 in blocks of 256): rank 0's all normal, rank 1's with every
// code 0..255 in its middle two tiles (beside normal ones in the same
// block); each sum against the format's values times the scales, in slice
// order, in fp32.
TEST(QuantReduceKernels, EveryFp8CodeSumsAsItsValueInTilesWithAndWithoutTheOddCodes) {
  fsdp::device::CpuDevice cpu(1, fsdp::device::Pool::kDevice);
  const size_t n = 512, block = 256, pb = k::quant_packed_bytes(n, block);
  const float block_scales[2][2] = {{0.75f, 1.5f}, {0.5f, 0x1p-3f}};
  std::vector<uint8_t> packed(2 * pb, 0);
  std::vector<int> normal;  // the finite normal codes, both signs
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) >= 8 && (c & 0x7f) != 0x7f) normal.push_back(c);
  }
  for (size_t s = 0; s < 2; ++s) {
    for (size_t i = 0; i < n; ++i) {
      const bool every = s == 1 && i >= 128 && i < 384;
      packed[s * pb + i] = uint8_t(every ? int(i - 128) : normal[(i * 7 + s * 3) % normal.size()]);
    }
    std::memcpy(&packed[s * pb + k::quant_scales_offset(n)], block_scales[s], sizeof(block_scales[s]));
  }
  for (const float scale : {1.0f, 0.5f}) {
    std::vector<float> out(n, 7.0f);
    cpu.dequantize_sum(out.data(), packed.data(), 2, pb, n, block, k::QType::kFp8E4m3, scale);
    for (size_t i = 0; i < n; ++i) {
      const float a = float(e4m3_value(packed[i])) * block_scales[0][i / block];
      const float b = float(e4m3_value(packed[pb + i])) * block_scales[1][i / block];
      const float want = (a + b) * scale;
      ASSERT_TRUE(equal_value(out[i], want))
          << "element " << i << " (rank 1's code " << int(packed[pb + i]) << "): " << out[i] << " vs " << want;
    }
  }
}

// The GPU packs take each code from v * (1 / scale) where that gives
// quantize()'s code (the division's): checked on and within 64 ulps of every
// rounding boundary of both code grids (int8's half-integers, and some past
// the clamp; E4M3's midpoints, negative ones too) times scales of every kind (random
// mantissas, powers of two, all mantissa bits set, the smallest normal, a
// subnormal one whose reciprocal overflows), and on random values of
// N(0, 0.02)-like blocks, where the product must decide nearly always.
TEST(QuantReduceKernels, TheReciprocalPathGivesTheDivisionsCodesOnAndAroundEveryBoundary) {
  Rng rng(41);
  std::vector<float> scales = {1.0f, 0.5f, 0x1p-20f, 0x1.fffffep-1f, 0x1.fffffep-8f, 0x1p-126f, 3e-38f, 1e-39f, 1e30f};
  for (int i = 0; i < 16; ++i) scales.push_back(rng.uniform(1e-6f, 1e-3f) * (i % 2 ? 1.0f : 1e-20f));
  for (const k::QType t : kTypes) {
    std::vector<float> bounds;  // in code units
    if (t == k::QType::kInt8) {
      for (int c = -128; c < 128; ++c) bounds.push_back(float(c) + 0.5f);
      for (const float f : {128.5f, -200.5f, 1e6f, 9e6f}) bounds.push_back(f);  // clamped either way
    } else {
      for (int c = 0; c < 0x7e; ++c) {  // midpoints of consecutive finite codes, and past 448
        const float mid = float((e4m3_value(c) + e4m3_value(c + 1)) / 2);
        bounds.push_back(mid);
        bounds.push_back(-mid);
      }
      bounds.push_back(464.0f);
    }
    size_t checked = 0;
    for (const float s : scales) {
      const float inv = 1.0f / s;
      for (const float b : bounds) {
        const float x0 = b * s;
        for (int d = -64; d <= 64; ++d) {
          const float x = f32_from_bits(uint32_t(int64_t(f32_bits(x0)) + d));
          if (!std::isfinite(x)) continue;
          ASSERT_EQ(k::quantize_by_reciprocal(x, s, inv, t), k::quantize(x, s, t))
              << type_name(t) << " x " << x << " scale " << s << " (boundary " << b << ")";
          ++checked;
        }
      }
    }
    EXPECT_GT(checked, scales.size() * bounds.size() * 100);
    size_t near = 0, n = 0;
    for (int blk = 0; blk < 256; ++blk) {
      std::vector<float> x(256);
      float most = 0;
      for (auto& v : x) {
        v = rng.uniform(-0.05f, 0.05f) * rng.uniform(0.f, 1.f);
        most = std::max(most, std::fabs(v));
      }
      const float s = most / qmax_of(t), inv = 1.0f / s;
      for (const float v : x) {
        ASSERT_EQ(k::quantize_by_reciprocal(v, s, inv, t), k::quantize(v, s, t)) << type_name(t) << " x " << v;
        near += k::near_code_boundary(v * inv, t) ? 1 : 0;
        ++n;
      }
    }
    EXPECT_LT(near, n / 1000) << type_name(t) << ": the division decided " << near << " of " << n << " codes";
  }
}

// ---- the engine ----

namespace {

struct Case {
  const char* sharding;
  int world;
  fsdp_dtype_t dtype;
  k::QType qtype;
  bool offload = false;
  bool frozen = false;  // param "c" frozen: the reduction covers the trainable block only
  bool sum = false;     // reduce_op=sum (else avg)
  int group = 2;        // HYBRID: shard_group_size
  int hier = 0;         // reduce_hierarchy's group size (0: unset, node: one host here, so one all-to-all)
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(c.sharding) + "_world" + std::to_string(c.world) + "_" + dtype_config_name(c.dtype) + "_" +
         type_name(c.qtype) + (c.offload ? "_offload" : "") + (c.frozen ? "_frozen" : "") + (c.sum ? "_sum" : "") +
         (c.group != 2 ? "_group" + std::to_string(c.group) : "") +
         (c.hier != 0 ? "_hierarchy" + std::to_string(c.hier) : "");
}

const std::vector<ParamSpec> kParams = {{"a", {7, 13}}, {"b", {40}}, {"c", {9, 11}}};
constexpr size_t kBlock = 16;
constexpr int kMicro = 2;  // two reductions per step accumulate in the grad shard

// The grad a rank writes for element i of param p in micro-batch m: varying
// magnitudes across the buffer (blocks get different scales) and per rank.
float grad_value(int rank, int micro, size_t p, size_t i) {
  const int h = static_cast<int>((size_t(rank) * 131 + size_t(micro) * 71 + p * 17 + i * 7) % 97) - 48;
  return static_cast<float>(h) / 48.0f * std::ldexp(1.0f, int(i % 23 / 4) - 3) * (1.0f + 0.25f * float(rank));
}

bool hybrid(const Case& c) { return std::string(c.sharding).rfind("HYBRID", 0) == 0; }

std::map<std::string, std::string> options_of(const Case& c) {
  std::map<std::string, std::string> o = {{"sharding", c.sharding},
                                          {"param_dtype", dtype_config_name(c.dtype)},
                                          {"reduce_dtype", type_name(c.qtype)},
                                          {"reduce_block", std::to_string(kBlock)},
                                          {"reduce_op", c.sum ? "sum" : "avg"},
                                          {"optimizer", "host"},
                                          {"loss_scale", "off"},
                                          {"timeout_s", "30"}};
  if (c.offload) o["offload"] = "cpu";
  if (hybrid(c)) o["shard_group_size"] = std::to_string(c.group);
  if (c.hier != 0) o["reduce_hierarchy"] = std::to_string(c.hier);
  return o;
}

}  // namespace

class QuantizedReduction : public ::testing::TestWithParam<Case> {};

TEST_P(QuantizedReduction, EachShardIsTheRankOrderSumOfTheDequantizedPartsAndTheWireMovesThePackedBytes) {
  const Case c = GetParam();
  const int shard_world = hybrid(c) ? c.group : c.world;
  // reduce_hierarchy: groups of h ranks of the shard group reduce first.
  const int h = c.hier > 1 && c.hier < shard_world ? c.hier : 1, groups = shard_world / h;
  const int replicas = c.world / shard_world;
  run_ranks(c.world, [&](int rank, fsdp_local_group_t* group) {
    ConfigPtr cfg = make_config(options_of(c));
    ASSERT_TRUE(cfg);
    char got_dtype[32] = {};
    ASSERT_OK(fsdp_config_get(cfg.get(), "reduce_dtype", got_dtype, sizeof got_dtype, nullptr));
    EXPECT_STREQ(got_dtype, type_name(c.qtype));
    fsdp_ctx_t* raw = nullptr;
    ASSERT_OK(fsdp_ctx_create(cfg.get(), group, group ? rank : -1, &raw));
    CtxPtr ctx(raw);
    fsdp_unit_t* unit = nullptr;
    const std::vector<int32_t> trainable = {1, 1, c.frozen ? 0 : 1};
    ASSERT_OK(register_unit(raw, "u", kParams, &unit, &trainable));
    const size_t n_trainable = c.frozen ? 2 : 3;
    std::vector<size_t> offsets(kParams.size());
    for (size_t p = 0; p < kParams.size(); ++p) {
      size_t n = 0;
      ASSERT_OK(fsdp_param_flat_range(unit, p, &offsets[p], &n));
    }
    ASSERT_OK(fsdp_comm_stats_reset(raw));
    Host host(raw);
    for (int m = 0; m < kMicro; ++m) {
      ASSERT_OK(fsdp_forward_begin(unit, host.stream()));
      ASSERT_OK(fsdp_forward_end(unit, host.stream()));
      ASSERT_OK(fsdp_backward_begin(unit, host.stream()));
      std::vector<void*> grads(n_trainable);
      for (size_t p = 0; p < n_trainable; ++p) ASSERT_OK(fsdp_grad_ptr(unit, p, &grads[p]));
      host.run([grads, rank, m, dt = c.dtype] {
        for (size_t p = 0; p < grads.size(); ++p) {
          for (size_t i = 0; i < numel_of(kParams[p].shape); ++i) add_elem(grads[p], i, dt, grad_value(rank, m, p, i));
        }
      });
      ASSERT_OK(fsdp_backward_end(unit, host.stream()));
    }
    int update = 0;
    float grad_scale = 0.0f;
    ASSERT_OK(fsdp_step_begin(raw, host.stream(), &update, &grad_scale));
    ASSERT_EQ(update, 1);
    ASSERT_EQ(grad_scale, 1.0f);
    float *params = nullptr, *sgrad = nullptr;
    size_t n = 0;
    ASSERT_OK(fsdp_shard_tensors(raw, unit, &params, &sgrad, nullptr, 0, &n));
    const std::vector<float> got(sgrad, sgrad + n);
    double norm = 0.0;
    ASSERT_OK(fsdp_last_grad_norm(raw, &norm));
    ASSERT_OK(fsdp_step_end(raw, host.stream()));

    // The model. A rank's flat trainable grads of micro-batch m, as it stored
    // them (param_dtype), zero in the padding.
    const size_t padded = n * size_t(shard_world);
    auto flat_of = [&](int r, int m) {
      std::vector<float> f(padded, 0.0f);
      for (size_t p = 0; p < n_trainable; ++p) {
        for (size_t i = 0; i < numel_of(kParams[p].shape); ++i) {
          f[offsets[p] + i] = round_to(c.dtype, grad_value(r, m, p, i));
        }
      }
      return f;
    };
    const int shard_rank = rank % shard_world;
    // Shard s of the reduction of micro-batch m inside the shard group of replica q.
    auto group_sum = [&](int q, int m, int s) -> std::vector<float> {
      if (c.world == 1) {  // alone: nothing to reduce, the grads added exactly
        const std::vector<float> f = flat_of(0, m);
        return std::vector<float>(f.begin(), f.begin() + long(n));
      }
      // Each group's members' parts summed (unscaled), then the groups' sums
      // summed as parts again, in group order (one group: the flat sum).
      std::vector<std::vector<float>> partials;
      for (int g = 0; g < groups; ++g) {
        std::vector<std::vector<float>> parts;
        for (int j = 0; j < h; ++j) {
          const std::vector<float> f = flat_of(q * shard_world + g * h + j, m);
          parts.emplace_back(f.begin() + long(size_t(s) * n), f.begin() + long(size_t(s + 1) * n));
        }
        if (h == 1) {
          partials.push_back(parts[0]);
        } else {
          partials.push_back(ref_sum(parts, n, kBlock, c.qtype, 1.0f));
        }
      }
      return ref_sum(partials, n, kBlock, c.qtype, c.sum ? 1.0f : 1.0f / float(shard_world));
    };
    auto shard_of = [&](int s) {
      std::vector<float> acc(n, 0.0f);  // the grad shard starts from zero; each reduction adds into it
      for (int m = 0; m < kMicro; ++m) {
        std::vector<float> red = group_sum(0, m, s);
        if (replicas > 1) {
          // HYBRID: across the replicas, the shard cut into one part per
          // replica (the last padded with zeros); part t summed as the shard
          // group sums (each replica's part quantized, added in replica order,
          // scaled once), then that sum quantized once more and dequantized
          // (the all-gather's bytes, which every replica decodes alike).
          const size_t per = (n + size_t(replicas) - 1) / size_t(replicas);
          std::vector<std::vector<float>> shards;
          for (int q = 0; q < replicas; ++q) {
            shards.push_back(group_sum(q, m, s));
            shards.back().resize(per * size_t(replicas), 0.0f);
          }
          for (size_t t = 0; t < size_t(replicas); ++t) {
            std::vector<std::vector<float>> parts;
            for (const auto& sh : shards)
              parts.emplace_back(sh.begin() + long(t * per), sh.begin() + long((t + 1) * per));
            const std::vector<float> sum = ref_sum(parts, per, kBlock, c.qtype, c.sum ? 1.0f : 1.0f / float(replicas));
            const std::vector<float> back = ref_round_trip(sum.data(), per, kBlock, c.qtype);
            for (size_t i = 0; i < per && t * per + i < n; ++i) red[t * per + i] = back[i];
          }
        }
        for (size_t i = 0; i < n; ++i) acc[i] = acc[i] + red[i];
      }
      return acc;
    };
    const std::vector<float> want = shard_of(shard_rank);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < n; ++i) {
      ASSERT_TRUE(equal_value(got[i], want[i]))
          << "shard element " << i << ": libfsdp reduced " << got[i] << ", the model says " << want[i];
    }
    // The test's power: the unquantized reduction is not the model (int8
    // and fp8 change these grads beyond any rounding of the sum).
    // (Over every shard: a rank's own may be all padding.)
    if (c.world > 1) {
      double off = 0.0;
      for (int s = 0; s < shard_world; ++s) {
        const std::vector<float> model = shard_of(s);
        for (size_t i = 0; i < n; ++i) {
          float exact = 0.0f;
          for (int m = 0; m < kMicro; ++m)
            for (int r = 0; r < c.world; ++r) exact += flat_of(r, m)[size_t(s) * n + i];
          if (!c.sum) exact /= float(c.world);
          off = std::max(off, double(std::fabs(exact - model[i])));
        }
      }
      EXPECT_GT(off, 1e-4) << "the model is indistinguishable from an unquantized reduction";
    }
    // The global grad norm: over the shard group's shards (replicas hold the same).
    double sq = 0.0;
    for (int s = 0; s < shard_world; ++s)
      for (float v : shard_of(s)) sq += double(v) * double(v);
    EXPECT_NEAR(norm, std::sqrt(sq), 1e-6 * std::sqrt(sq));

    fsdp_comm_stats_t st{};
    st.struct_size = sizeof st;
    ASSERT_OK(fsdp_comm_stats(raw, &st));
    EXPECT_EQ(st.reduce_scatter_calls, 0u) << "the quantized reduction replaces the reduce-scatter";
    if (c.world == 1) {
      EXPECT_EQ(st.all_to_all_calls, 0u) << "a world of one has nothing to reduce";
    } else {
      // HYBRID: an all-to-all and an all-gather of packed parts across the replicas too.
      const uint64_t replica_part =
          replicas > 1 ? k::quant_packed_bytes((n + size_t(replicas) - 1) / size_t(replicas), kBlock) * size_t(replicas)
                       : 0u;
      // reduce_hierarchy: an all-to-all inside the groups (every rank's part
      // of each shard) and one across them (one part per group).
      const uint64_t shard_bytes = k::quant_packed_bytes(n, kBlock) * size_t(shard_world + (h > 1 ? groups : 0));
      EXPECT_EQ(st.all_to_all_calls, uint64_t(kMicro) * ((replicas > 1 ? 2u : 1u) + (h > 1 ? 1u : 0u)));
      EXPECT_EQ(st.all_to_all_nbytes, uint64_t(kMicro) * (shard_bytes + replica_part));
      // The shard group's bytes: the params' gathers and the reduction's
      // all-to-alls, the hierarchy's groups' included (not the replicas').
      EXPECT_EQ(hybrid(c) ? st.shard_group_nbytes : st.world_group_nbytes,
                st.all_gather_nbytes - uint64_t(kMicro) * replica_part + uint64_t(kMicro) * shard_bytes)
          << "the hierarchy's groups count as the shard group's";
      EXPECT_EQ(st.replica_group_nbytes, uint64_t(kMicro) * 2 * replica_part);
      EXPECT_EQ(st.all_reduce_nbytes, 0u) << "no fp32 all-reduce across the replicas either";
    }
    EXPECT_OK(fsdp_ctx_finalize(raw));
  });
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, QuantizedReduction,
    ::testing::Values(Case{"FULL_SHARD", 1, FSDP_DTYPE_BF16, k::QType::kInt8},
                      Case{"FULL_SHARD", 2, FSDP_DTYPE_FP32, k::QType::kInt8},
                      Case{"FULL_SHARD", 2, FSDP_DTYPE_BF16, k::QType::kFp8E4m3},
                      Case{"FULL_SHARD", 3, FSDP_DTYPE_BF16, k::QType::kInt8, false, true},
                      Case{"FULL_SHARD", 3, FSDP_DTYPE_FP32, k::QType::kInt8, false, false, true},
                      Case{"FULL_SHARD", 4, FSDP_DTYPE_FP32, k::QType::kFp8E4m3, false, true},
                      Case{"SHARD_GRAD_OP", 2, FSDP_DTYPE_BF16, k::QType::kInt8},
                      Case{"HYBRID_SHARD", 4, FSDP_DTYPE_FP32, k::QType::kInt8},
                      Case{"HYBRID_SHARD", 6, FSDP_DTYPE_BF16, k::QType::kInt8},  // 3 replicas
                      Case{"HYBRID_SHARD_ZERO2", 4, FSDP_DTYPE_BF16, k::QType::kFp8E4m3, false, true, true},
                      Case{"FULL_SHARD", 2, FSDP_DTYPE_BF16, k::QType::kInt8, true},
                      Case{"FULL_SHARD", 3, FSDP_DTYPE_FP32, k::QType::kFp8E4m3, true, true},
                      // reduce_hierarchy: 4 groups of 2, 2 of 3, and a HYBRID
                      // shard group of 4 in 2 groups of 2 (2 replicas).
                      Case{"FULL_SHARD", 8, FSDP_DTYPE_BF16, k::QType::kInt8, false, false, false, 2, 2},
                      Case{"FULL_SHARD", 6, FSDP_DTYPE_FP32, k::QType::kFp8E4m3, false, true, true, 2, 3},
                      Case{"SHARD_GRAD_OP", 4, FSDP_DTYPE_BF16, k::QType::kFp8E4m3, true, false, false, 2, 2},
                      Case{"HYBRID_SHARD", 8, FSDP_DTYPE_BF16, k::QType::kInt8, false, false, false, 4, 2}),
    case_name);

TEST(QuantizedReductionRefusals, NoShardIsUnsupportedWithItsReasonAndBadValuesNameTheChoices) {
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    ConfigPtr cfg = make_config({{"sharding", "NO_SHARD"}, {"reduce_dtype", "int8"}, {"timeout_s", "30"}});
    ASSERT_TRUE(cfg);
    fsdp_ctx_t* raw = nullptr;
    EXPECT_STATUS(FSDP_ERR_UNSUPPORTED, fsdp_ctx_create(cfg.get(), group, group ? rank : -1, &raw));
    EXPECT_EQ(raw, nullptr);
    EXPECT_NE(last_error_str().find("reduce_dtype=int8"), std::string::npos) << last_error_str();
    EXPECT_NE(last_error_str().find("NO_SHARD"), std::string::npos) << last_error_str();
  });
  // reduce_hierarchy: a group size for a reduction that is no all-to-all,
  // or one that does not divide the shard group, fails on every rank.
  run_ranks(4, [&](int rank, fsdp_local_group_t* group) {
    for (auto [dtype, size, status, says] :
         {std::make_tuple("fp32", "2", FSDP_ERR_UNSUPPORTED, "reduce_dtype=fp32 reduces by a reduce-scatter"),
          std::make_tuple("int8", "3", FSDP_ERR_INVALID_ARGUMENT, "divides the shard group's 4 ranks, not 3")}) {
      ConfigPtr cfg = make_config(
          {{"sharding", "FULL_SHARD"}, {"reduce_dtype", dtype}, {"reduce_hierarchy", size}, {"timeout_s", "30"}});
      ASSERT_TRUE(cfg);
      fsdp_ctx_t* raw = nullptr;
      EXPECT_STATUS(status, fsdp_ctx_create(cfg.get(), group, group ? rank : -1, &raw));
      EXPECT_EQ(raw, nullptr);
      EXPECT_NE(last_error_str().find(says), std::string::npos) << last_error_str();
    }
  });
  ConfigPtr cfg = make_config({});
  ASSERT_TRUE(cfg);
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_set(cfg.get(), "reduce_hierarchy", "rack"));
  EXPECT_NE(last_error_str().find("node, off, or a group size"), std::string::npos) << last_error_str();
  for (auto [in, out] : {std::make_pair("off", "off"), std::make_pair("4", "4"), std::make_pair("NODE", "node")}) {
    ASSERT_OK(fsdp_config_set(cfg.get(), "reduce_hierarchy", in));
    char got[32] = {};
    ASSERT_OK(fsdp_config_get(cfg.get(), "reduce_hierarchy", got, sizeof got, nullptr));
    EXPECT_STREQ(got, out);
  }
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_set(cfg.get(), "reduce_dtype", "int4"));
  EXPECT_NE(last_error_str().find("int8, fp8_e4m3"), std::string::npos) << last_error_str();
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_set(cfg.get(), "reduce_block", "8"));
  // Setting a dtype again turns the quantization off.
  ASSERT_OK(fsdp_config_set(cfg.get(), "reduce_dtype", "fp8_e4m3"));
  ASSERT_OK(fsdp_config_set(cfg.get(), "reduce_dtype", "bf16"));
  char got[32] = {};
  ASSERT_OK(fsdp_config_get(cfg.get(), "reduce_dtype", got, sizeof got, nullptr));
  EXPECT_STREQ(got, "bf16");
}
