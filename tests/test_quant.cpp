// Quantized param gathers (gather_dtype=int8|fp8_e4m3, kernels/quant.h).
//
// The kernels against references written here from the formats' definitions:
// every E4M3FN code decoded by its formula, the encoder against the nearest
// code (ties to the even code) found by search, int8 by nearbyint, and the
// block rules (zeros, NaN and infinity, underflow, a short last block). Then
// the engine: what a rank reads through fsdp_param_ptr after a quantized
// gather equals the test's own model of it (each rank's slice of each block
// of the fp32 master quantized in blocks, dequantized, rounded to
// param_dtype), for every strategy, worlds 1-4, fp32 and bf16, offload, a
// frozen param, the late host stream (one unit: prefetch is not exercised
// here); the all-gathers move exactly
// the packed bytes; the master, grads and optimizer stay full precision (a
// step's update is the unquantized run's, bit for bit).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "../kernels/quant.h"
#include "../src/device/cpu/cpu_device.h"
#include "../src/device/cpu/quant_avx512.h"
#include "host_stream.h"
#include "quant_ref.h"
#include "rank_runner.h"

using namespace fsdp_test;
namespace k = fsdp::kernels;

// ---- the kernels ----

TEST(QuantKernels, E4m3DecodesEveryCodeByItsDefinitionAndEncodesToTheNearestTiesToEven) {
  for (int c = 0; c < 256; ++c) {
    const float got = k::e4m3_bits_to_f32(static_cast<uint8_t>(c));
    const double want = e4m3_value(c);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
    } else {
      EXPECT_EQ(double(got), want) << "code " << c;
    }
  }
  std::vector<float> xs = {0.0f, -0.0f, 448.0f, -448.0f, 449.0f, 463.9f, 464.0f, 1e6f, INFINITY, -INFINITY,
                           std::ldexp(1.0f, -10), std::nextafter(std::ldexp(1.0f, -10), 1.0f), std::ldexp(1.0f, -12),
                           std::ldexp(1.0f, -6), 1e-30f, -3.3f};
  // Every code, the midpoints between neighbours (ties) and a hair on either side.
  for (int c = 0; c < 0x7e; ++c) {
    const float lo = float(e4m3_value(c)), hi = float(e4m3_value(c + 1));
    const float mid = float((double(lo) + double(hi)) / 2);
    for (float v : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      xs.push_back(v);
      xs.push_back(-v);
    }
  }
  Rng rng(5);
  for (int i = 0; i < 2000; ++i) xs.push_back(rng.uniform(-500.f, 500.f) * (i % 3 == 0 ? 0.01f : 1.0f));
  for (float x : xs) {
    EXPECT_EQ(int(k::f32_to_e4m3_bits(x)), e4m3_nearest(x)) << "x = " << x;
  }
  EXPECT_EQ(int(k::f32_to_e4m3_bits(NAN) & 0x7f), 0x7f);
}

TEST(QuantKernels, BlocksFollowTheirRulesZerosNanUnderflowAndAShortLastBlock) {
  for (k::QType t : kTypes) {
    SCOPED_TRACE(type_name(t));
    const size_t block = 16;
    std::vector<float> x(16 * 5 + 7, 0.0f);  // block 0: zeros
    Rng rng(11);
    for (size_t i = 16; i < x.size(); ++i) x[i] = rng.uniform(-3.f, 3.f);
    x[16 + 3] = NAN;                 // block 1: a NaN
    x[32 + 9] = -INFINITY;           // block 2: an infinity
    for (size_t i = 48; i < 64; ++i) x[i] = 1e-44f * float(i % 3);  // block 3: absmax / qmax underflows to 0
    std::vector<uint8_t> packed(k::quant_packed_bytes(x.size(), block));
    for (size_t b = 0; b < k::quant_blocks(x.size(), block); ++b) k::quantize_block(x.data(), x.size(), block, b, t, packed.data());
    std::vector<float> out(x.size(), 7.0f);
    for (size_t b = 0; b < k::quant_blocks(x.size(), block); ++b) k::dequantize_block(packed.data(), x.size(), block, b, t, out.data());
    const std::vector<float> want = ref_round_trip(x.data(), x.size(), block, t);
    for (size_t i = 0; i < x.size(); ++i) ASSERT_TRUE(same_value(out[i], want[i])) << i << ": " << out[i] << " vs " << want[i];
    for (size_t i = 0; i < 16; ++i) EXPECT_EQ(out[i], 0.0f) << "a zero block dequantizes to zeros";
    for (size_t i = 16; i < 48; ++i) EXPECT_TRUE(std::isnan(out[i])) << "a NaN or an infinity makes its whole block NaN";
    for (size_t i = 48; i < 64; ++i) EXPECT_EQ(out[i], 0.0f) << "an underflowing scale gives zeros";
    // The rest: within half a step of the code grid (int8) or 2^-4 relative plus the subnormal step (fp8).
    for (size_t b = 64; b < x.size(); b += block) {
      const size_t e = std::min(x.size(), b + block);
      float amax = 0.0f;
      for (size_t i = b; i < e; ++i) amax = std::max(amax, std::fabs(x[i]));
      const float scale = amax / qmax_of(t);
      for (size_t i = b; i < e; ++i) {
        const float bound = t == k::QType::kInt8 ? scale * 0.5f : std::fabs(x[i]) / 16 + scale * std::ldexp(1.0f, -10);
        EXPECT_LE(std::fabs(out[i] - x[i]), bound * 1.0001f) << i;
      }
    }
  }
}

TEST(QuantKernels, TheCpuDevicePacksAndUnpacksAsTheReferenceInEveryDtype) {
  fsdp::device::CpuDevice cpu(2, fsdp::device::Pool::kDevice);
  const fsdp::DType dts[] = {fsdp::DType::kFp32, fsdp::DType::kBf16, fsdp::DType::kFp16};
  for (k::QType t : kTypes) {
    for (fsdp::DType out_dt : dts) {
      for (size_t n : {size_t(1), size_t(255), size_t(256), size_t(3000)}) {
        SCOPED_TRACE(std::string(type_name(t)) + " into " + fsdp::dtype_name(out_dt) + " n=" + std::to_string(n));
        const size_t block = 256, slices = 3;
        std::vector<float> x(n * slices);
        Rng rng(n);
        for (size_t i = 0; i < x.size(); ++i) x[i] = rng.uniform(-1.f, 1.f) * std::ldexp(1.0f, int(i / 256 % 9) - 4);
        std::vector<uint8_t> packed(k::quant_packed_bytes(n, block) * slices);
        for (size_t s = 0; s < slices; ++s) {
          cpu.quantize(packed.data() + s * k::quant_packed_bytes(n, block), x.data() + s * n, fsdp::DType::kFp32, n,
                       block, t);
        }
        std::vector<uint8_t> out(x.size() * fsdp::dtype_size(out_dt));
        cpu.dequantize(out.data(), out_dt, packed.data(), slices, n, block, t);
        const fsdp_dtype_t odt = static_cast<fsdp_dtype_t>(out_dt);
        for (size_t s = 0; s < slices; ++s) {
          const std::vector<float> want = ref_round_trip(x.data() + s * n, n, block, t);
          for (size_t i = 0; i < n; ++i) {
            ASSERT_TRUE(same_value(load_elem(out.data(), s * n + i, odt), round_to(odt, want[i])))
                << "slice " << s << " element " << i;
          }
        }
      }
    }
  }
}

namespace {

// The packed bytes of a slice as the format defines them: scale = absmax /
// qmax in fp32 (NaN with a NaN or an infinity in the block), each code the
// nearest to value / scale (int8 by nearbyint, E4M3 by search), zeros where
// the scale is 0 or NaN.
std::vector<uint8_t> ref_packed(const std::vector<float>& x, size_t block, k::QType t) {
  const size_t n = x.size();
  std::vector<uint8_t> out(k::quant_packed_bytes(n, block), 0);
  for (size_t b = 0, kb = 0; b < n; b += block, ++kb) {
    const size_t e = std::min(n, b + block);
    float amax = 0.0f;
    bool finite = true;
    for (size_t i = b; i < e; ++i) finite = finite && std::isfinite(x[i]), amax = std::max(amax, std::fabs(x[i]));
    const float scale = finite ? amax / qmax_of(t) : NAN;
    std::memcpy(out.data() + k::quant_scales_offset(n) + kb * 4, &scale, 4);
    if (!(scale > 0.0f)) continue;
    for (size_t i = b; i < e; ++i) {
      const float v = x[i] / scale;
      out[i] = t == k::QType::kInt8
                   ? static_cast<uint8_t>(static_cast<int8_t>(std::min(127.0, std::max(-127.0, std::nearbyint(double(v))))))
                   : static_cast<uint8_t>(e4m3_nearest(v));
    }
  }
  return out;
}

// Values placed on the half-steps between codes and a few ulps either side:
// the cases where a code computed any way but by the quotient itself (the
// CPU device's AVX-512 loops multiply by the scale's reciprocal and must
// notice) would round the other way.
std::vector<float> values_at_ties(size_t n, size_t block, k::QType t, fsdp_dtype_t dt, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> x(n);
  for (size_t b = 0; b < n; b += block) {
    const size_t e = std::min(n, b + block);
    // Half the blocks with a power-of-two scale (exact ties in every dtype),
    // half with a random one (ties to within an ulp of the quotient).
    const bool exact = (b / block) % 2 == 0;
    const float amax = exact ? qmax_of(t) * std::ldexp(1.0f, -8) : rng.uniform(0.01f, 4.0f);
    const float scale = amax / qmax_of(t);
    x[b] = amax;
    for (size_t i = b + 1; i < e; ++i) {
      float mid;
      if (t == k::QType::kInt8) {
        mid = float(int(rng.next() % 253) - 126) + 0.5f;
      } else {
        const int c = int(rng.next() % 126);  // 0..125: midpoints below 448
        mid = float((e4m3_value(c) + e4m3_value(c + 1)) / 2) * ((rng.next() & 1) ? -1.0f : 1.0f);
      }
      float v = mid * scale;
      for (int u = int(rng.next() % 5) - 2; u != 0; u += u > 0 ? -1 : 1) v = std::nextafter(v, u > 0 ? INFINITY : -INFINITY);
      x[i] = std::fabs(round_to(dt, v)) <= amax ? round_to(dt, v) : 0.0f;
    }
    x[b] = round_to(dt, x[b]);
  }
  return x;
}

}  // namespace

// The 0-3 bytes between a slice's codes and its scales are zeros, whatever
// the buffer held: every byte the all-gather moves is defined, and the CPU
// and the GPU (tests/test_cuda.cpp) pack the same bytes.
TEST(QuantKernels, ThePaddingBeforeTheScalesIsZeroed) {
  fsdp::device::CpuDevice cpu(2, fsdp::device::Pool::kDevice);
  for (size_t n : {size_t(1), size_t(2), size_t(3), size_t(4), size_t(257), size_t(1027)}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    std::vector<float> x(n, 0.5f);
    std::vector<uint8_t> packed(k::quant_packed_bytes(n, 256), 0xff);
    cpu.quantize(packed.data(), x.data(), fsdp::DType::kFp32, n, 256, k::QType::kInt8);
    for (size_t i = n; i < k::quant_scales_offset(n); ++i) EXPECT_EQ(packed[i], 0) << "byte " << i;
    EXPECT_EQ(packed[0], 127) << "the codes are there";  // 0.5 / (0.5 / 127)
  }
}

TEST(QuantKernels, TheCpuDevicePacksTheFormatsCodesOnAndNextToEveryTieAndUnpacksThemInEveryDtype) {
  fsdp::device::CpuDevice cpu(2, fsdp::device::Pool::kDevice);
  for (k::QType t : kTypes) {
    for (fsdp_dtype_t dt : {FSDP_DTYPE_FP32, FSDP_DTYPE_BF16, FSDP_DTYPE_FP16}) {
      for (size_t block : {size_t(16), size_t(20), size_t(48), size_t(256)}) {
        SCOPED_TRACE(std::string(type_name(t)) + " from " + dtype_config_name(dt) + " block " + std::to_string(block));
        const size_t n = block * 40 + 7;  // a short last block
        std::vector<float> x = values_at_ties(n, block, t, dt, block * 7 + size_t(dt));
        // The edges' blocks: zeros, a NaN, an infinity, a subnormal scale.
        for (size_t i = 0; i < block; ++i) x[block + i] = 0.0f;
        x[2 * block + 1] = NAN;
        x[3 * block + 2] = -INFINITY;
        for (size_t i = 0; i < block; ++i) x[4 * block + i] = round_to(dt, std::ldexp(float(i % 5), -140));
        // A normal scale below 2^-117: products that are fp32 subnormals.
        for (size_t i = 0; i < block; ++i)
          x[5 * block + i] = round_to(dt, i == 0 ? std::ldexp(1.0f, -110) : std::ldexp(float(i % 7) - 3.0f, -128));
        std::vector<uint8_t> in(n * dtype_nbytes(dt));
        for (size_t i = 0; i < n; ++i) {
          if (dt == FSDP_DTYPE_FP32) std::memcpy(in.data() + 4 * i, &x[i], 4);
          else {
            const uint16_t h = dt == FSDP_DTYPE_BF16 ? f32_to_bf16(x[i]) : f32_to_fp16(x[i]);
            std::memcpy(in.data() + 2 * i, &h, 2);
          }
        }
        std::vector<uint8_t> got(k::quant_packed_bytes(n, block), 0xee);
        cpu.quantize(got.data(), in.data(), static_cast<fsdp::DType>(dt), n, block, t);
        const std::vector<uint8_t> want = ref_packed(x, block, t);
        for (size_t i = 0; i < n; ++i) {
          ASSERT_EQ(int(got[i]), int(want[i])) << "value " << i << " = " << x[i] << " (block " << i / block << ")";
        }
        for (size_t kb = 0; kb < k::quant_blocks(n, block); ++kb) {
          float gs, ws;
          std::memcpy(&gs, got.data() + k::quant_scales_offset(n) + 4 * kb, 4);
          std::memcpy(&ws, want.data() + k::quant_scales_offset(n) + 4 * kb, 4);
          ASSERT_TRUE(same_value(gs, ws)) << "scale of block " << kb;
        }
        // And back, into every dtype: the reference's value rounded once.
        const std::vector<float> back = ref_round_trip(x.data(), n, block, t);
        for (fsdp_dtype_t odt : {FSDP_DTYPE_FP32, FSDP_DTYPE_BF16, FSDP_DTYPE_FP16}) {
          std::vector<uint8_t> out(n * dtype_nbytes(odt), 0xee);
          cpu.dequantize(out.data(), static_cast<fsdp::DType>(odt), got.data(), 1, n, block, t);
          for (size_t i = 0; i < n; ++i) {
            ASSERT_TRUE(same_value(load_elem(out.data(), i, odt), round_to(odt, back[i])))
                << "into " << dtype_config_name(odt) << ": value " << i << " (block " << i / block << ")";
          }
        }
      }
    }
  }
}

namespace {

// Value i of a packed slice as the format defines it: its code's value times
// its block's scale, in fp32.
float ref_dequantized_of(const uint8_t* packed, size_t n, size_t block, size_t i, k::QType t) {
  float scale;
  std::memcpy(&scale, packed + k::quant_scales_offset(n) + 4 * (i / block), 4);
  const float v = t == k::QType::kInt8 ? float(static_cast<int8_t>(packed[i])) : float(e4m3_value(packed[i]));
  return v * scale;
}

}  // namespace

// Outputs larger than the threads' caches are written with non-temporal
// stores where aligned (quant_avx512.h): the same bytes as the ordinary
// stores, on aligned and misaligned outputs alike.
TEST(QuantKernels, TheAvx512LoopsStreamedStoresWriteWhatTheirOrdinaryStoresWrite) {
  if (!fsdp::device::avx512::quant_available()) {
    GTEST_SKIP() << "this CPU (or FSDP_CPU_SIMD=generic) runs the generic loops, which have no streamed stores";
  }
  const size_t n = 4096 + 16 * 7, block = 256, slices = 3;
  Rng rng(5);
  std::vector<float> x(n * slices);
  for (size_t i = 0; i < x.size(); ++i) x[i] = rng.uniform(-2.f, 2.f) * std::ldexp(1.0f, int(i / 256 % 5) - 2);
  for (k::QType t : kTypes) {
    const size_t stride = k::quant_packed_bytes(n, block);
    std::vector<uint8_t> packed(stride * slices);
    for (size_t s = 0; s < slices; ++s) {
      fsdp::device::avx512::quantize(x.data() + s * n, fsdp::DType::kFp32, n, block, t, packed.data() + s * stride, 0,
                                     k::quant_blocks(n, block), false);
    }
    // The codes streamed: the reference's bytes where aligned and where not.
    const std::vector<uint8_t> want_packed = ref_packed(std::vector<float>(x.begin(), x.begin() + n), block, t);
    for (size_t offset : {size_t(0), size_t(16)}) {
      std::vector<uint8_t> buf(stride + 128, 0x33);
      uint8_t* p = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64 + offset;
      fsdp::device::avx512::quantize(x.data(), fsdp::DType::kFp32, n, block, t, p, 0, k::quant_blocks(n, block), true);
      ASSERT_EQ(std::memcmp(p, packed.data(), stride), 0) << type_name(t) << " codes streamed, offset " << offset;
      ASSERT_EQ(std::memcmp(p, want_packed.data(), stride), 0) << type_name(t) << " codes, offset " << offset;
    }
    for (fsdp_dtype_t odt : {FSDP_DTYPE_FP32, FSDP_DTYPE_BF16, FSDP_DTYPE_FP16}) {
      for (size_t offset : {size_t(0), size_t(16)}) {  // bytes: aligned, then not
        SCOPED_TRACE(std::string(type_name(t)) + " into " + dtype_config_name(odt) + " offset " +
                     std::to_string(offset));
        const size_t bytes = n * slices * dtype_nbytes(odt);
        std::vector<uint8_t> a(bytes + 128, 0x11), b(bytes + 128, 0x22);
        uint8_t* pa = a.data() + (64 - reinterpret_cast<uintptr_t>(a.data()) % 64) % 64 + offset;
        uint8_t* pb = b.data() + (64 - reinterpret_cast<uintptr_t>(b.data()) % 64) % 64 + offset;
        const size_t blocks = slices * k::quant_blocks(n, block);
        fsdp::device::avx512::dequantize(packed.data(), n, block, t, pa, static_cast<fsdp::DType>(odt), 0, blocks,
                                         true);
        fsdp::device::avx512::dequantize(packed.data(), n, block, t, pb, static_cast<fsdp::DType>(odt), 0, blocks,
                                         false);
        ASSERT_EQ(std::memcmp(pa, pb, bytes), 0);
        const std::vector<float> want = ref_round_trip(x.data() + n, n, block, t);  // slice 1
        for (size_t i = 0; i < n; ++i) {
          ASSERT_TRUE(same_value(load_elem(pa, n + i, odt), round_to(odt, want[i]))) << "slice 1 value " << i;
        }
      }
    }
    for (size_t offset : {size_t(0), size_t(16)}) {
      std::vector<float> a(n + 32, 1.0f), b(n + 32, 2.0f);
      float* pa = a.data() + (16 - reinterpret_cast<uintptr_t>(a.data()) % 64 / 4) % 16 + offset / 4;
      float* pb = b.data() + (16 - reinterpret_cast<uintptr_t>(b.data()) % 64 / 4) % 16 + offset / 4;
      const size_t slice_bytes = k::quant_packed_bytes(n, block);
      fsdp::device::avx512::dequantize_sum(packed.data(), slices, slice_bytes, n, block, t, 0.5f, pa, 0,
                                           k::quant_blocks(n, block), true);
      fsdp::device::avx512::dequantize_sum(packed.data(), slices, slice_bytes, n, block, t, 0.5f, pb, 0,
                                           k::quant_blocks(n, block), false);
      ASSERT_EQ(std::memcmp(pa, pb, n * sizeof(float)), 0) << type_name(t) << " sum, offset " << offset;
      float first = 0.0f;  // value 0: the three slices' dequantized values summed in order, halved
      for (size_t s = 0; s < slices; ++s) {
        first = s == 0 ? ref_dequantized_of(packed.data() + s * stride, n, block, 0, t)
                       : first + ref_dequantized_of(packed.data() + s * stride, n, block, 0, t);
      }
      ASSERT_TRUE(same_value(pa[0], first * 0.5f)) << type_name(t) << " sum, offset " << offset;
    }
  }
}

// fp8's NaN codes (0x7f, 0xff) under a finite scale: the quantizer never
// writes them there, but a packed buffer that has them must decode to NaN in
// every dtype, as the functor does, through the loops that pair bf16 values.
TEST(QuantKernels, Fp8NaNCodesUnderAFiniteScaleDecodeToNaNInEveryDtype) {
  fsdp::device::CpuDevice cpu(1, fsdp::device::Pool::kDevice);
  const size_t n = 512, block = 256;
  std::vector<uint8_t> packed(k::quant_packed_bytes(n, block));
  for (size_t i = 0; i < n; ++i) packed[i] = static_cast<uint8_t>((i * 37) % 0x7f | (i % 2) << 7);  // no NaN
  packed[5] = 0x7f;
  packed[300] = 0xff;
  const float scales[2] = {0.5f, 3.0f};
  std::memcpy(packed.data() + k::quant_scales_offset(n), scales, sizeof scales);
  for (fsdp_dtype_t odt : {FSDP_DTYPE_FP32, FSDP_DTYPE_BF16, FSDP_DTYPE_FP16}) {
    std::vector<uint8_t> out(n * dtype_nbytes(odt));
    cpu.dequantize(out.data(), static_cast<fsdp::DType>(odt), packed.data(), 1, n, block, k::QType::kFp8E4m3);
    for (size_t i = 0; i < n; ++i) {
      const float want = round_to(odt, float(e4m3_value(packed[i]) * double(scales[i / block])));
      ASSERT_TRUE(same_value(load_elem(out.data(), i, odt), want)) << dtype_config_name(odt) << " value " << i;
    }
    EXPECT_TRUE(std::isnan(load_elem(out.data(), 5, odt)) && std::isnan(load_elem(out.data(), 300, odt)));
  }
}

// ---- the engine ----

namespace {

struct Case {
  const char* sharding;
  int world;
  fsdp_dtype_t dtype;
  k::QType qtype;
  bool offload;
  bool frozen;  // param "c" frozen: a second block
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(c.sharding) + "_world" + std::to_string(c.world) + "_" + dtype_config_name(c.dtype) + "_" +
         type_name(c.qtype) + (c.offload ? "_offload" : "") + (c.frozen ? "_frozen" : "");
}

const std::vector<ParamSpec> kParams = {{"a", {7, 13}}, {"b", {40}}, {"c", {9, 11}}};
constexpr size_t kBlock = 16;

std::vector<float> values_of(size_t p) {
  Rng rng(300 + p);
  std::vector<float> v(numel_of(kParams[p].shape));
  // Magnitudes that differ across the buffer, so that blocks get different scales.
  for (size_t i = 0; i < v.size(); ++i) v[i] = rng.uniform(-1.f, 1.f) * std::ldexp(1.0f, int(i % 23 / 4) - 3);
  return v;
}

std::map<std::string, std::string> options_of(const Case& c) {
  std::map<std::string, std::string> o = {{"sharding", c.sharding},
                                          {"param_dtype", dtype_config_name(c.dtype)},
                                          {"gather_dtype", type_name(c.qtype)},
                                          {"gather_block", std::to_string(kBlock)},
                                          {"optimizer", "sgd"},
                                          {"lr", "0.5"},
                                          {"loss_scale", "off"},
                                          {"timeout_s", "30"}};
  if (c.offload) o["offload"] = "cpu";
  if (std::string(c.sharding).rfind("HYBRID", 0) == 0) o["shard_group_size"] = "2";
  return o;
}

}  // namespace

class QuantizedGather : public ::testing::TestWithParam<Case> {};

TEST_P(QuantizedGather, EachRankReadsTheDequantizedSlicesAndTheGathersMoveThePackedBytes) {
  const Case c = GetParam();
  const int shard_world = std::string(c.sharding) == "NO_SHARD" ? 1
                          : std::string(c.sharding).rfind("HYBRID", 0) == 0 ? 2
                                                                             : c.world;
  run_ranks(c.world, [&](int rank, fsdp_local_group_t* group) {
    ConfigPtr cfg = make_config(options_of(c));
    ASSERT_TRUE(cfg);
    fsdp_ctx_t* raw = nullptr;
    ASSERT_OK(fsdp_ctx_create(cfg.get(), group, group ? rank : -1, &raw));
    CtxPtr ctx(raw);
    fsdp_unit_t* unit = nullptr;
    const std::vector<int32_t> trainable = {1, 1, c.frozen ? 0 : 1};
    ASSERT_OK(register_unit(raw, "u", kParams, &unit, &trainable));
    for (size_t p = 0; p < kParams.size(); ++p) {
      const std::vector<float> v = values_of(p);
      ASSERT_OK(fsdp_param_set_values(unit, p, v.data(), v.size()));
    }
    // The test's model of the full buffer: the flat fp32 master, cut into its
    // blocks (the trainable one, then the frozen one), each rank's slice of a
    // block quantized on its own.
    float* shard = nullptr;
    size_t shard_off = 0, shard_n = 0;
    ASSERT_OK(fsdp_shard_info(unit, &shard, &shard_off, &shard_n));
    const size_t padded = shard_n * size_t(shard_world);
    std::vector<float> flat(padded, 0.0f);
    std::vector<size_t> offsets(kParams.size());
    for (size_t p = 0; p < kParams.size(); ++p) {
      size_t off = 0, n = 0;
      ASSERT_OK(fsdp_param_flat_range(unit, p, &off, &n));
      offsets[p] = off;
      const std::vector<float> v = values_of(p);
      std::copy(v.begin(), v.end(), flat.begin() + static_cast<ptrdiff_t>(off));
    }
    std::vector<size_t> bounds = {0};
    if (c.frozen) bounds.push_back(offsets[2]);
    bounds.push_back(padded);
    const bool gathers = shard_world > 1;
    // What each rank reads after a gather of the master `m` (flat, fp32).
    auto model = [&](const std::vector<float>& m) {
      std::vector<float> out = m;
      if (!gathers) return out;
      for (size_t b = 0; b + 1 < bounds.size(); ++b) {
        const size_t slice = (bounds[b + 1] - bounds[b]) / size_t(shard_world);
        for (int r = 0; r < shard_world; ++r) {
          const size_t at = bounds[b] + size_t(r) * slice;
          const std::vector<float> q = ref_round_trip(m.data() + at, slice, kBlock, c.qtype);
          std::copy(q.begin(), q.end(), out.begin() + static_cast<ptrdiff_t>(at));
        }
      }
      return out;
    };
    // Pass 0 reads the values set; pass 1 those after one SGD step (lr 0.5) on
    // grads of 0.25 everywhere (every rank: their mean is 0.25), in fp32 on
    // the exact master: p - 0.5 * 0.25, the frozen param unchanged.
    std::vector<float> stepped = flat;
    for (size_t p = 0; p < kParams.size(); ++p) {
      if (c.frozen && p == 2) continue;
      for (size_t i = 0; i < numel_of(kParams[p].shape); ++i) stepped[offsets[p] + i] -= 0.5f * 0.25f;
    }
    const std::vector<float> wants[2] = {model(flat), model(stepped)};
    Host host(raw);
    // The all-gathers' bytes of the passes (fsdp_gather_param's own gathers,
    // full fp32, left out).
    uint64_t gathered_bytes = 0;
    auto gather_bytes_now = [raw] {
      fsdp_comm_stats_t st{};
      st.struct_size = sizeof st;
      EXPECT_OK(fsdp_comm_stats(raw, &st));
      return st.all_gather_nbytes;
    };
    uint64_t since = gather_bytes_now();
    for (int pass = 0; pass < 2; ++pass) {  // the second forward gathers again after the step below
      ASSERT_OK(fsdp_forward_begin(unit, host.stream()));
      std::vector<void*> ptrs(kParams.size());
      for (size_t p = 0; p < kParams.size(); ++p) ASSERT_OK(fsdp_param_ptr(unit, p, &ptrs[p]));
      std::vector<std::vector<float>> seen(kParams.size());
      host.run([&seen, ptrs, dt = c.dtype] {
        for (size_t p = 0; p < kParams.size(); ++p) {
          for (size_t i = 0; i < numel_of(kParams[p].shape); ++i) seen[p].push_back(load_elem(ptrs[p], i, dt));
        }
      });
      host.sync();
      ASSERT_OK(fsdp_forward_end(unit, host.stream()));
      for (size_t p = 0; p < kParams.size(); ++p) {
        for (size_t i = 0; i < seen[p].size(); ++i) {
          const float w = round_to(c.dtype, wants[pass][offsets[p] + i]);
          ASSERT_TRUE(same_value(seen[p][i], w)) << "pass " << pass << " param " << kParams[p].name << " element " << i
                                                 << ": read " << seen[p][i] << ", the model says " << w;
        }
      }
      if (pass == 1) break;
      // The step: full-precision grads on the exact master (nothing of the
      // quantized copy may leak into it).
      ASSERT_OK(fsdp_backward_begin(unit, host.stream()));
      std::vector<void*> grads;
      for (size_t p = 0; p < 2 + (c.frozen ? 0 : 1); ++p) {
        grads.push_back(nullptr);
        ASSERT_OK(fsdp_grad_ptr(unit, p, &grads.back()));
      }
      host.run([grads, dt = c.dtype] {
        for (size_t p = 0; p < grads.size(); ++p) {
          for (size_t i = 0; i < numel_of(kParams[p].shape); ++i) add_elem(grads[p], i, dt, 0.25f);
        }
      });
      ASSERT_OK(fsdp_backward_end(unit, host.stream()));
      ASSERT_OK(fsdp_step(raw, host.stream()));
      double norm = 0.0;  // waits for the step, and so for the gathers before it (late, they may still run)
      ASSERT_OK(fsdp_last_grad_norm(raw, &norm));
      gathered_bytes += gather_bytes_now() - since;
      for (size_t p = 0; p < kParams.size(); ++p) {
        std::vector<float> master(numel_of(kParams[p].shape), NAN);
        ASSERT_OK(fsdp_gather_param(unit, p, master.data(), master.size()));
        for (size_t i = 0; i < master.size(); ++i) {
          ASSERT_EQ(f32_bits(master[i]), f32_bits(stepped[offsets[p] + i]))
              << "the fp32 master after the step: " << kParams[p].name << " " << i;
        }
      }
      since = gather_bytes_now();
    }
    gathered_bytes += gather_bytes_now() - since;
    if (gathers) {
      // Per gather of the unit (forward twice, and backward's under
      // FULL_SHARD and HYBRID_SHARD): each block's packed slice from every
      // rank of the shard group.
      size_t per_gather = 0;
      for (size_t b = 0; b + 1 < bounds.size(); ++b) {
        per_gather += k::quant_packed_bytes((bounds[b + 1] - bounds[b]) / size_t(shard_world), kBlock) *
                      size_t(shard_world);
      }
      const bool again = std::string(c.sharding) == "FULL_SHARD" || std::string(c.sharding) == "HYBRID_SHARD";
      const size_t gathers_run = 2 + (again ? 1 : 0);
      EXPECT_EQ(gathered_bytes, per_gather * gathers_run);
    }
    EXPECT_OK(fsdp_ctx_finalize(raw));
  });
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, QuantizedGather,
    ::testing::Values(Case{"FULL_SHARD", 2, FSDP_DTYPE_FP32, k::QType::kInt8, false, false},
                      Case{"FULL_SHARD", 2, FSDP_DTYPE_BF16, k::QType::kFp8E4m3, false, false},
                      Case{"FULL_SHARD", 3, FSDP_DTYPE_BF16, k::QType::kInt8, false, true},
                      Case{"FULL_SHARD", 4, FSDP_DTYPE_FP32, k::QType::kFp8E4m3, false, true},
                      Case{"SHARD_GRAD_OP", 2, FSDP_DTYPE_BF16, k::QType::kInt8, false, false},
                      Case{"HYBRID_SHARD", 4, FSDP_DTYPE_FP32, k::QType::kInt8, false, false},
                      Case{"HYBRID_SHARD_ZERO2", 4, FSDP_DTYPE_BF16, k::QType::kFp8E4m3, false, true},
                      Case{"NO_SHARD", 2, FSDP_DTYPE_FP32, k::QType::kInt8, false, false},
                      Case{"FULL_SHARD", 1, FSDP_DTYPE_BF16, k::QType::kInt8, true, false},
                      Case{"FULL_SHARD", 2, FSDP_DTYPE_FP32, k::QType::kInt8, true, false},
                      Case{"FULL_SHARD", 3, FSDP_DTYPE_BF16, k::QType::kFp8E4m3, true, true}),
    case_name);
