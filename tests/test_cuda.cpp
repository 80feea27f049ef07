// The CUDA device's kernels against the CPU device on random data: the same
// bits where the order of operations is the same, which is everywhere but
// the double sum of a sum of squares's steps. The streams and events, the
// memory, and what the review of the GPU path found are in
// test_cuda_streams.cpp, linked into the same binary (test_cuda, whose
// name and filters tools/gpu-check.sh's stages use). Skips, saying so,
// where no GPU can be used.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "base/error.h"
#include "device/cpu/cpu_device.h"
#include "device/cuda/cuda_device.h"
#include "gpu_presence.h"
#include "kernels/cast.h"
#include "kernels/cuda/launch.h"
#include "kernels/norm.h"

#include "cuda_test_util.h"

using fsdp::DType;
using fsdp::device::AdamArgs;
using fsdp::device::CpuDevice;
using fsdp::device::Pool;
using fsdp::device::SgdArgs;
using fsdp::device::cuda::CudaDevice;
using namespace fsdp_test::cuda;

TEST(CudaKernels, CastMatchesTheCpuBitwiseAndClearsItsSource) {
  SKIP_WITHOUT_GPU();
  CudaDevice gpu(0);
  CpuDevice cpu(1, Pool::kDevice);
  for (size_t n : kSizes) {
    for (DType from : kDtypes) {
      for (DType to : kDtypes) {
        for (bool clear : {false, true}) {
          SCOPED_TRACE("n=" + std::to_string(n) + " " + fsdp::dtype_name(from) + "->" + fsdp::dtype_name(to) +
                       (clear ? " clear" : ""));
          std::vector<uint8_t> src = storage(cpu, from, random_floats(n, 1, 7e4f));
          std::vector<uint8_t> want(n * fsdp::dtype_size(to));
          std::vector<uint8_t> cpu_src = src;
          clear ? cpu.cast_clear(want.data(), to, cpu_src.data(), from, n)
                : cpu.cast(want.data(), to, cpu_src.data(), from, n);
          DeviceArray d_src = upload(gpu, src), d_out(gpu, nullptr, want.size());
          clear ? gpu.cast_clear(d_out.ptr, to, d_src.ptr, from, n) : gpu.cast(d_out.ptr, to, d_src.ptr, from, n);
          EXPECT_EQ(first_difference(want, d_out.read<uint8_t>()), -1);
          EXPECT_EQ(first_difference(cpu_src, d_src.read<uint8_t>()), -1) << "source after the pass";
        }
      }
    }
  }
}

// fsdp_grad_accumulate's pass: every pair of grad and source dtypes, aligned
// and not (the scalar path), and which pointers it may be handed.
TEST(CudaKernels, AddMatchesTheCpuBitwiseForEveryDtypePair) {
  SKIP_WITHOUT_GPU();
  CudaDevice gpu(0);
  CpuDevice cpu(1, Pool::kDevice);
  for (size_t n : kSizes) {
    for (DType acc_t : kDtypes) {
      for (DType src_t : kDtypes) {
        for (size_t skew : {size_t(0), size_t(1)}) {
          SCOPED_TRACE("n=" + std::to_string(n) + " " + fsdp::dtype_name(src_t) + " into " + fsdp::dtype_name(acc_t) +
                       (skew ? " unaligned" : ""));
          std::vector<uint8_t> acc = storage(cpu, acc_t, random_floats(n + skew, 6, 3e4f));
          std::vector<uint8_t> src = storage(cpu, src_t, random_floats(n + skew, 7, 3e4f));
          std::vector<uint8_t> want = acc;
          const size_t ao = skew * fsdp::dtype_size(acc_t), so = skew * fsdp::dtype_size(src_t);
          cpu.add(want.data() + ao, acc_t, src.data() + so, src_t, n);
          DeviceArray d_acc = upload(gpu, acc), d_src = upload(gpu, src);
          gpu.add(d_acc.as<uint8_t>() + ao, acc_t, d_src.as<uint8_t>() + so, src_t, n);
          EXPECT_EQ(first_difference(want, d_acc.read<uint8_t>()), -1);
        }
      }
    }
  }
  DeviceArray d(gpu, nullptr, 64);
  EXPECT_TRUE(gpu.readable(d.ptr));
  std::vector<float> pageable(16);
  EXPECT_FALSE(gpu.readable(pageable.data())) << "pageable host memory: a kernel reading it would fault";
  EXPECT_FALSE(gpu.readable(nullptr));
}

// The first element of `t` storage where a and b differ in their bits, or -1;
// two NaNs are equal whatever their payloads (the GPU's arithmetic makes its
// canonical NaN, x86 keeps the operand's).
long first_difference_nan_equal(DType t, const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  const size_t es = fsdp::dtype_size(t);
  if (a.size() != b.size()) return static_cast<long>(std::min(a.size(), b.size()) / es);
  std::vector<float> fa(a.size() / es), fb(b.size() / es);
  CpuDevice cpu(1, Pool::kDevice);
  cpu.cast(fa.data(), DType::kFp32, a.data(), t, fa.size());
  cpu.cast(fb.data(), DType::kFp32, b.data(), t, fb.size());
  for (size_t i = 0; i < fa.size(); ++i) {
    const bool same = std::memcmp(a.data() + i * es, b.data() + i * es, es) == 0;
    if (!same && !(std::isnan(fa[i]) && std::isnan(fb[i]))) return static_cast<long>(i);
  }
  return -1;
}

// The GPU's dequantize (into every storage type) and dequantize_sum of
// `slices` packed slices give the CPU's bits: `packed` on the host, `g_q`
// its copy on the GPU; the outputs `skew` elements off the pool's alignment.
static void expect_dequantized_as_on_the_cpu(CudaDevice& gpu, CpuDevice& cpu, const std::vector<uint8_t>& packed,
                                             const uint8_t* g_q, size_t slices, size_t n, size_t block,
                                             fsdp::kernels::QType t, size_t skew) {
  for (DType out_t : kDtypes) {
    const size_t os = fsdp::dtype_size(out_t);
    std::vector<uint8_t> out(n * slices * os);
    cpu.dequantize(out.data(), out_t, packed.data(), slices, n, block, t);
    DeviceArray d_out(gpu, nullptr, out.size() + skew * os);
    gpu.dequantize(d_out.as<uint8_t>() + skew * os, out_t, g_q, slices, n, block, t);
    std::vector<uint8_t> got_out = d_out.read<uint8_t>();
    got_out.erase(got_out.begin(), got_out.begin() + static_cast<long>(skew * os));
    EXPECT_EQ(first_difference_nan_equal(out_t, out, got_out), -1) << "into " << fsdp::dtype_name(out_t);
  }
  // The quantized reduction's end: the slices' sum, scaled (average of 2).
  const size_t bytes = fsdp::kernels::quant_packed_bytes(n, block);
  std::vector<uint8_t> sum(n * sizeof(float));
  cpu.dequantize_sum(reinterpret_cast<float*>(sum.data()), packed.data(), slices, bytes, n, block, t, 0.5f);
  DeviceArray d_sum(gpu, nullptr, (n + skew) * sizeof(float));
  gpu.dequantize_sum(d_sum.as<float>() + skew, g_q, slices, bytes, n, block, t, 0.5f);
  std::vector<uint8_t> got_sum = d_sum.read<uint8_t>();
  got_sum.erase(got_sum.begin(), got_sum.begin() + static_cast<long>(skew * sizeof(float)));
  EXPECT_EQ(first_difference_nan_equal(DType::kFp32, sum, got_sum), -1) << "dequantize_sum";
}

// The quantized all-gather's and reduction's passes (kernels/quant.h): the
// GPU packs, unpacks and sums as the CPU, including NaN, infinite, zero and
// short blocks, through the warp-per-block kernels (blocks of 128, 256 and
// 1024 values, aligned arrays) and the plain ones (a block of 100 values,
// arrays one element off their alignment, the last partial block).
TEST(CudaKernels, QuantizeAndDequantizeMatchTheCpuBitwise) {
  SKIP_WITHOUT_GPU();
  CudaDevice gpu(0);
  CpuDevice cpu(1, Pool::kDevice);
  struct Case {
    size_t block, skew;  // skew: elements (values, outputs) / 4 bytes (packed) off the pool's alignment
  };
  for (const Case c : {Case{256, 0}, Case{128, 0}, Case{1024, 0}, Case{100, 0}, Case{256, 1}}) {
    for (fsdp::kernels::QType t : {fsdp::kernels::QType::kInt8, fsdp::kernels::QType::kFp8E4m3}) {
      for (size_t n : kSizes) {
        for (DType in_t : kDtypes) {
          SCOPED_TRACE("block=" + std::to_string(c.block) + " skew=" + std::to_string(c.skew) +
                       " n=" + std::to_string(n) + " from " + fsdp::dtype_name(in_t) +
                       (t == fsdp::kernels::QType::kInt8 ? " int8" : " fp8"));
          const size_t block = c.block, slices = 2;
          std::vector<float> v = random_floats(n * slices, 8, 50.0f);
          if (v.size() > 300) v[3] = NAN, v[290] = INFINITY;                                       // two blocks of NaN
          // Whole blocks of zeros (scale 0), and of subnormals up to 190 * 2^-149,
          // whose int8 scale of 2^-149 makes codes past 127 before the clamp.
          if (v.size() >= 6144) {
            std::fill(v.begin() + 2048, v.begin() + 4096, 0.0f);
            for (size_t i = 4096; i < 6144; ++i)
              v[i] = (i % 3 == 0 ? -1.0f : 1.0f) * std::ldexp(float(i % 190 + 1), -149);
          }
          for (size_t i = 0; i < std::min<size_t>(v.size(), 16); ++i) v[v.size() - 1 - i] = 0.0f;  // zeros
          std::vector<uint8_t> src = storage(cpu, in_t, v);
          const size_t bytes = fsdp::kernels::quant_packed_bytes(n, block), es = fsdp::dtype_size(in_t);
          std::vector<uint8_t> want(bytes * slices);
          for (size_t s = 0; s < slices; ++s) {
            cpu.quantize(want.data() + s * bytes, src.data() + s * n * es, in_t, n, block, t);
          }
          DeviceArray d_src(gpu, nullptr, src.size() + c.skew * es), d_q(gpu, nullptr, want.size() + 4 * c.skew);
          uint8_t* g_src = d_src.as<uint8_t>() + c.skew * es;
          uint8_t* g_q = d_q.as<uint8_t>() + 4 * c.skew;
          gpu.copy_from_host(g_src, src.data(), src.size());
          for (size_t s = 0; s < slices; ++s) gpu.quantize(g_q + s * bytes, g_src + s * n * es, in_t, n, block, t);
          std::vector<uint8_t> got = d_q.read<uint8_t>();
          got.erase(got.begin(), got.begin() + static_cast<long>(4 * c.skew));
          EXPECT_EQ(first_difference(want, got), -1) << "packed bytes";
          expect_dequantized_as_on_the_cpu(gpu, cpu, want, g_q, slices, n, block, t, c.skew);
          if (::testing::Test::HasFailure()) return;
        }
      }
    }
  }
  // A packed buffer off the 4-byte alignment of its fp32 scales is refused,
  // naming the pass, and the device goes on working.
  DeviceArray d_x(gpu, nullptr, 1024 * 4), d_p(gpu, nullptr, fsdp::kernels::quant_packed_bytes(1024, 256) + 4);
  gpu.zero(d_x.ptr, 1024 * 4);
  expect_error(FSDP_ERR_INVALID_ARGUMENT, "quantize failed", [&] {
    gpu.quantize(d_p.as<uint8_t>() + 2, d_x.ptr, DType::kFp32, 1024, 256, fsdp::kernels::QType::kInt8);
  });
  expect_error(FSDP_ERR_INVALID_ARGUMENT, "dequantize failed", [&] {
    gpu.dequantize(d_x.ptr, DType::kFp32, d_p.as<uint8_t>() + 2, 1, 1024, 256, fsdp::kernels::QType::kInt8);
  });
  gpu.quantize(d_p.ptr, d_x.ptr, DType::kFp32, 1024, 256, fsdp::kernels::QType::kInt8);
  EXPECT_EQ(d_p.read<uint8_t>()[0], 0) << "the device works after the refusals";
}

// Every code of both formats, as any packed buffer may hold them (the NaN
// codes 0x7f / 0xff included, which quantize never makes): the GPU decodes
// each as the CPU does, into each storage type and in the sum, through the
// warp kernels' decode (from sm_89 on, the GPU's own E4M3 conversion).
TEST(CudaKernels, EveryCodeDequantizesAsOnTheCpu) {
  SKIP_WITHOUT_GPU();
  CudaDevice gpu(0);
  CpuDevice cpu(1, Pool::kDevice);
  const size_t n = 256, block = 256, slices = 2;
  const size_t bytes = fsdp::kernels::quant_packed_bytes(n, block);
  const float scales[slices] = {0.75f, 3.0e-3f};
  std::vector<uint8_t> packed(bytes * slices);
  for (size_t s = 0; s < slices; ++s) {
    for (size_t i = 0; i < n; ++i) packed[s * bytes + i] = static_cast<uint8_t>(s == 0 ? i : 255 - i);
    std::memcpy(packed.data() + s * bytes + fsdp::kernels::quant_scales_offset(n), &scales[s], sizeof(float));
  }
  DeviceArray d_q = upload(gpu, packed);
  for (fsdp::kernels::QType t : {fsdp::kernels::QType::kInt8, fsdp::kernels::QType::kFp8E4m3}) {
    SCOPED_TRACE(t == fsdp::kernels::QType::kInt8 ? "int8" : "fp8");
    expect_dequantized_as_on_the_cpu(gpu, cpu, packed, d_q.as<uint8_t>(), slices, n, block, t, 0);
  }
}

TEST(CudaKernels, UnalignedArraysTakeTheScalarPathWithTheSameBits) {
  SKIP_WITHOUT_GPU();
  CudaDevice gpu(0);
  CpuDevice cpu(1, Pool::kDevice);
  const size_t n = 1001;
  std::vector<float> acc = random_floats(n + 1, 2), src = random_floats(n + 1, 3);
  std::vector<float> want = acc;
  cpu.accumulate(want.data() + 1, src.data() + 1, DType::kFp32, 0.5f, n, nullptr);
  DeviceArray d_acc = upload(gpu, acc), d_src = upload(gpu, src);
  gpu.accumulate(d_acc.as<float>() + 1, d_src.as<float>() + 1, DType::kFp32, 0.5f, n, nullptr);
  EXPECT_EQ(first_difference(want, d_acc.read<float>()), -1);
}

TEST(CudaKernels, AccumulateMatchesTheCpuBitwiseAndItsSumOfSquaresClosely) {
  SKIP_WITHOUT_GPU();
  CudaDevice gpu(0);
  CpuDevice cpu(1, Pool::kDevice);
  for (size_t n : kSizes) {
    for (DType from : kDtypes) {
      for (bool clear : {false, true}) {
        SCOPED_TRACE("n=" + std::to_string(n) + " src=" + fsdp::dtype_name(from) + (clear ? " clear" : ""));
        std::vector<float> acc = random_floats(n, 4);
        std::vector<uint8_t> src = storage(cpu, from, random_floats(n, 5));
        std::vector<float> want = acc;
        std::vector<uint8_t> cpu_src = src;
        double want_sq = 0;
        clear ? cpu.accumulate_clear(want.data(), cpu_src.data(), from, 0.25f, n, &want_sq)
              : cpu.accumulate(want.data(), cpu_src.data(), from, 0.25f, n, &want_sq);
        DeviceArray d_acc = upload(gpu, acc), d_src = upload(gpu, src), d_sq(gpu, nullptr, sizeof(double));
        // The sum goes to device memory (the step reads it there).
        clear ? gpu.accumulate_clear(d_acc.as<float>(), d_src.ptr, from, 0.25f, n, d_sq.as<double>())
              : gpu.accumulate(d_acc.as<float>(), d_src.ptr, from, 0.25f, n, d_sq.as<double>());
        const double got_sq = d_sq.read<double>()[0];
        EXPECT_EQ(first_difference(want, d_acc.read<float>()), -1);
        EXPECT_EQ(first_difference(cpu_src, d_src.read<uint8_t>()), -1) << "source after the pass";
        // The steps' fp32 sums are the same bits; only their double sum's
        // order differs: a few double roundings per step, relative 1e-13.
        EXPECT_NEAR(got_sq, want_sq, 1e-13 * want_sq);
        // Fused into the pass, the sum is sum_squares' of what it wrote, bit for bit.
        EXPECT_EQ(got_sq, gpu.sum_squares(d_acc.as<float>(), n));
      }
    }
  }
}

TEST(CudaKernels, SumSquaresIsReproducibleAndClose) {
  SKIP_WITHOUT_GPU();
  CudaDevice gpu(0);
  CpuDevice cpu(1, Pool::kDevice);
  for (size_t n : kSizes) {
    SCOPED_TRACE("n=" + std::to_string(n));
    std::vector<float> x = random_floats(n, 6, 3e3f);
    DeviceArray d = upload(gpu, x);
    double got = gpu.sum_squares(d.as<float>(), n);
    double want = cpu.sum_squares(x.data(), n);
    if (n <= fsdp::kernels::kSqStep) {
      EXPECT_EQ(got, want) << "one step: the same bits";
    } else {
      EXPECT_NEAR(got, want, 1e-13 * want);
    }
    EXPECT_EQ(gpu.sum_squares(d.as<float>(), n), got) << "the same bits every run";
  }
  EXPECT_EQ(gpu.sum_squares(nullptr, 0), 0.0);
}

TEST(CudaKernels, OptimizerPassesMatchTheCpuBitwise) {
  SKIP_WITHOUT_GPU();
  CudaDevice gpu(0);
  CpuDevice cpu(1, Pool::kDevice);
  for (size_t n : kSizes) {
    for (int opt = 0; opt < 4; ++opt) {    // AdamW, Adam (L2), SGD, SGD with Nesterov momentum
      for (int out = 0; out < 4; ++out) {  // none, fp32, bf16, fp16
        for (bool zero_grads : {false, true}) {
          SCOPED_TRACE("n=" + std::to_string(n) + " opt=" + std::to_string(opt) + " out=" + std::to_string(out) +
                       " zero_grads=" + std::to_string(zero_grads));
          std::vector<float> p = random_floats(n, 7), g = random_floats(n, 8, 3.0f), m = random_floats(n, 9, 1e-2f),
                             v = random_floats(n, 10, 1e-2f);
          for (float& x : v) x = std::abs(x);
          DType out_dtype = out == 2 ? DType::kBf16 : out == 3 ? DType::kFp16 : DType::kFp32;
          std::vector<uint8_t> out_host(out == 0 ? 0 : n * fsdp::dtype_size(out_dtype), 0xab);
          std::vector<float> cp = p, cg = g, cm = m, cv = v;
          std::vector<uint8_t> cout = out_host;
          DeviceArray dp = upload(gpu, p), dg = upload(gpu, g), dm = upload(gpu, m), dv = upload(gpu, v),
                      dout(gpu, out_host.data(), out_host.size());
          double want_sq = 0;
          DeviceArray d_sq(gpu, nullptr, sizeof(double));
          void* cpu_out = out == 0 ? nullptr : cout.data();
          void* gpu_out = out == 0 ? nullptr : dout.ptr;
          if (opt < 2) {
            auto op = fsdp::kernels::AdamOp::make(1e-3f, 0.9f, 0.999f, 1e-8f, 0.1f, opt == 0, 3, 0.75f);
            cpu.adam(
                AdamArgs{op, cp.data(), cg.data(), cm.data(), cv.data(), cpu_out, out_dtype, n, zero_grads, &want_sq});
            gpu.adam(AdamArgs{op, dp.as<float>(), dg.as<float>(), dm.as<float>(), dv.as<float>(), gpu_out, out_dtype, n,
                              zero_grads, d_sq.as<double>()});
          } else {
            bool momentum = opt == 3;
            fsdp::kernels::SgdOp op{0.05f, 0.01f, momentum ? 0.9f : 0.0f, 0.75f, momentum, false};
            cpu.sgd(SgdArgs{op, cp.data(), cg.data(), momentum ? cm.data() : nullptr, cpu_out, out_dtype, n, zero_grads,
                            &want_sq});
            gpu.sgd(SgdArgs{op, dp.as<float>(), dg.as<float>(), momentum ? dm.as<float>() : nullptr, gpu_out, out_dtype,
                            n, zero_grads, d_sq.as<double>()});
          }
          const double got_sq = d_sq.read<double>()[0];
          expect_same_pass(cp, cg, cm, cv, cout, dp, dg, dm, dv, dout);
          EXPECT_NEAR(got_sq, want_sq, 1e-13 * want_sq) << "sum of squares of the raw grads";
        }
      }
    }
  }
}

// The multi-tensor passes: one launch over spans of one flat model (sizes
// below, at and over a chunk, each with its own weight decay, in two param
// groups of other lrs, betas and ages) gives the bits of the CPU device's
// pass span by span, each block making its group's op from the StepState in
// device memory; a skipped step only clears the grads. The spans after an
// odd gap are not 16-byte aligned, so the launch takes the vector path for
// some spans and the scalar path for others.
TEST(CudaKernels, MultiTensorOptimizerPassesMatchTheCpuSpanBySpan) {
  SKIP_WITHOUT_GPU();
  CudaDevice gpu(0);
  CpuDevice cpu(1, Pool::kDevice);
  const size_t chunk = fsdp::kernels::cuda::kSpanChunk;
  const std::vector<size_t> sizes = {7, chunk, chunk + 3, 1, 3 * chunk + 129, 256};
  auto gap = [](size_t k) { return k == 2 || k == 4 ? size_t(17) : size_t(16); };  // a layout's padding, or not
  size_t total = 0;
  for (size_t k = 0; k < sizes.size(); ++k) total += sizes[k] + gap(k);
  const std::vector<fsdp::kernels::StepGroup> groups = {{0, 1.0f, 0.9f, 0.999f}, {2, 0.5f, 0.8f, 0.99f}};
  for (int opt = 0; opt < 4; ++opt) {    // AdamW, Adam (L2), SGD, SGD with momentum
    for (int out = 0; out < 4; ++out) {  // none, bf16, fp16; 3: none, a skipped step
      SCOPED_TRACE("opt=" + std::to_string(opt) + " out=" + std::to_string(out));
      DType out_dtype = out == 1 ? DType::kBf16 : DType::kFp16;
      size_t es = fsdp::dtype_size(out_dtype);
      const bool has_out = out == 1 || out == 2;
      std::vector<float> p = random_floats(total, 17), g = random_floats(total, 18, 3.0f),
                         m = random_floats(total, 19, 1e-2f), v = random_floats(total, 20, 1e-2f);
      for (float& x : v) x = std::abs(x);
      std::vector<uint8_t> out_host(has_out ? total * es : 0, 0xab);
      std::vector<float> cp = p, cg = g, cm = m, cv = v;
      std::vector<uint8_t> cout = out_host;
      DeviceArray dp = upload(gpu, p), dg = upload(gpu, g), dm = upload(gpu, m), dv = upload(gpu, v),
                  dout(gpu, out_host.data(), out_host.size());
      bool sgd = opt >= 2, momentum = opt == 3;
      fsdp::kernels::StepState st{};
      st.lr = sgd ? 0.05 : 1e-3;
      st.t = 3;
      st.grad_scale = 0.75f;
      st.skip = out == 3 ? 1 : 0;
      fsdp::kernels::StepRule rule{};
      rule.eps = 1e-8f;
      rule.momentum = momentum ? 0.9f : 0.0f;
      rule.decoupled = opt == 0 ? 1 : 0;
      rule.nesterov = momentum ? 1 : 0;
      DeviceArray dst(gpu, &st, sizeof st);
      std::vector<fsdp::device::ShardSpan> cspans, gspans;
      size_t at = 0;
      for (size_t k = 0; k < sizes.size(); ++k) {
        float wd = k % 2 == 0 ? 0.1f : 0.0f;
        auto span = [&](float* pp, float* gg, float* mm, float* vv, uint8_t* oo) {
          return fsdp::device::ShardSpan{pp + at,
                                         gg + at,
                                         sgd && !momentum ? nullptr : mm + at,
                                         sgd ? nullptr : vv + at,
                                         has_out ? oo + at * es : nullptr,
                                         sizes[k],
                                         wd,
                                         static_cast<uint32_t>(k % 2)};
        };
        cspans.push_back(span(cp.data(), cg.data(), cm.data(), cv.data(), cout.data()));
        gspans.push_back(span(dp.as<float>(), dg.as<float>(), dm.as<float>(), dv.as<float>(), dout.as<uint8_t>()));
        at += sizes[k] + gap(k);
      }
      auto ctable = cpu.make_span_table(cspans, groups);
      auto gtable = gpu.make_span_table(gspans, groups);
      if (!sgd) {
        cpu.adam_spans(*ctable, rule, &st, out_dtype, true);
        gpu.adam_spans(*gtable, rule, dst.as<fsdp::kernels::StepState>(), out_dtype, true);
      } else {
        cpu.sgd_spans(*ctable, rule, &st, out_dtype, true);
        gpu.sgd_spans(*gtable, rule, dst.as<fsdp::kernels::StepState>(), out_dtype, true);
      }
      expect_same_pass(cp, cg, cm, cv, cout, dp, dg, dm, dv, dout);
      if (st.skip != 0) {
        EXPECT_EQ(first_difference(p, cp), -1) << "a skipped step changed the params";
      }
    }
  }
}

// The step on the device: the units' sums added and the verdict decided by
// one thread running kernels/step.h's functors give the CPU's bits (double
// add, sqrt and division are correctly rounded on both), for a clean step, a
// clipped one, a dynamic scale's growth and an inf that skips.
TEST(CudaKernels, TheStepsScalarsMatchTheCpuBitwise) {
  SKIP_WITHOUT_GPU();
  CudaDevice gpu(0);
  CpuDevice cpu(1, Pool::kDevice);
  using fsdp::kernels::StepRule;
  using fsdp::kernels::StepState;
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<std::vector<double>> sums = {{3.25, 0.0, 1e-3, 7.5}, {1e6, 2e6}, {1.0, inf}};
  for (size_t c = 0; c < sums.size(); ++c) {
    for (double clip : {0.0, 0.5}) {
      SCOPED_TRACE("case " + std::to_string(c) + " clip " + std::to_string(clip));
      StepRule rule{};
      rule.max_grad_norm = clip;
      rule.dynamic = 1;
      rule.growth = 2.0;
      rule.backoff = 0.5;
      rule.growth_interval = 2;
      rule.count = 1;
      StepState cs{};
      cs.loss_scale = 1024.0;
      cs.clean = 1;
      cs.t = 5;
      DeviceArray ds(gpu, &cs, sizeof cs), dsq = upload(gpu, sums[c]);
      cpu.step_scalars(&cs, sums[c].data(), sums[c].size(), &rule);
      gpu.step_scalars(ds.as<StepState>(), dsq.as<double>(), sums[c].size(), &rule);
      const StepState gs = ds.read<StepState>()[0];
      EXPECT_EQ(std::memcmp(&gs, &cs, sizeof cs), 0)
          << "norm " << gs.norm << " / " << cs.norm << ", grad_scale " << gs.grad_scale << " / " << cs.grad_scale;
    }
  }
}

// The multi-tensor sum of squares (one launch over many arrays, then each
// one's fold) gives each array sum_squares' bits; the rank-order sum of
// doubles adds in rank order.
TEST(CudaKernels, ASquaresTableAndTheRankOrderSumMatchTheirSingleForms) {
  SKIP_WITHOUT_GPU();
  CudaDevice gpu(0);
  std::vector<std::vector<float>> xs;
  for (size_t n : kSizes) xs.push_back(random_floats(n, 61 + static_cast<unsigned>(xs.size()), 2.0f));
  std::vector<std::unique_ptr<DeviceArray>> dx;
  DeviceArray outs(gpu, nullptr, (xs.size() + 1) * sizeof(double));
  std::vector<fsdp::device::SquaresSpan> spans;
  for (size_t k = 0; k < xs.size(); ++k) {
    dx.push_back(std::make_unique<DeviceArray>(gpu, xs[k].data(), xs[k].size() * sizeof(float)));
    spans.push_back({dx[k]->as<float>(), xs[k].size(), outs.as<double>() + k});
  }
  spans.push_back({nullptr, 0, outs.as<double>() + xs.size()});  // an empty one: 0
  auto table = gpu.make_squares_table(spans);
  gpu.sum_squares_table(*table);
  const std::vector<double> got = outs.read<double>();
  for (size_t k = 0; k < xs.size(); ++k) {
    EXPECT_EQ(got[k], gpu.sum_squares(dx[k]->as<float>(), xs[k].size())) << "array " << k;
  }
  EXPECT_EQ(got[xs.size()], 0.0);
  // 1e16 + 1 rounds back to 1e16 (ties to even); 1 + 1 first would keep 2.
  const std::vector<double> a = {1e16, 1.0}, b = {1.0, 2.0}, c = {1.0, 3.0};
  DeviceArray da = upload(gpu, a), db = upload(gpu, b), dc = upload(gpu, c), sum(gpu, nullptr, 2 * sizeof(double));
  const double* ins[3] = {da.as<double>(), db.as<double>(), dc.as<double>()};
  gpu.reduce_sum_f64(sum.as<double>(), ins, 3, 2);
  EXPECT_EQ(sum.read<double>(), (std::vector<double>{1e16, 6.0}));
}

TEST(CudaKernels, NonFiniteFlagFindsOneInfOrNanAnywhere) {
  SKIP_WITHOUT_GPU();
  CudaDevice gpu(0);
  const size_t n = 100003;
  for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN(), 0.0f}) {
    for (size_t at : {size_t(0), n / 2, n - 1}) {
      // Finite values up to 1e38 (a scale of 3e38 made the distribution's
      // width, 6e38, overflow to inf, and it drew infinities: the first H100 run).
      std::vector<float> x = random_floats(n, 12, 1e38f);
      ASSERT_TRUE(std::all_of(x.begin(), x.end(), [](float v) { return std::isfinite(v); }));
      x[at] = bad;
      DeviceArray d = upload(gpu, x);
      int zero = 0;
      DeviceArray flag(gpu, &zero, sizeof(int));
      ASSERT_EQ(fsdp::kernels::cuda::flag_non_finite(d.as<float>(), n, flag.as<int>(), nullptr), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(flag.read<int>()[0], bad == 0.0f ? 0 : 1) << "bad=" << bad << " at " << at;
    }
  }
}

// The reduction over ranks of the local communicator on a GPU: 1 to 4 inputs
// (and the most one launch takes), every dtype, with and without clearing.
TEST(CudaKernels, ReduceSumMatchesTheCpuBitwiseAndClearsItsInputs) {
  SKIP_WITHOUT_GPU();
  CudaDevice gpu(0);
  CpuDevice cpu(1, Pool::kDevice);
  for (size_t n : kSizes) {
    for (size_t n_ins : {size_t(1), size_t(2), size_t(3), size_t(4), fsdp::kernels::cuda::kMaxReduceInputs}) {
      if (n_ins > 4 && n > 4096) continue;  // the widest launch on the small sizes only
      for (DType t : kDtypes) {
        for (bool clear : {false, true}) {
          SCOPED_TRACE("n=" + std::to_string(n) + " inputs=" + std::to_string(n_ins) + " " + fsdp::dtype_name(t) +
                       (clear ? " clear" : ""));
          std::vector<std::vector<uint8_t>> ins;
          std::vector<void*> cpu_ins;
          std::vector<std::unique_ptr<DeviceArray>> d_ins;
          std::vector<void*> gpu_ins;
          for (size_t k = 0; k < n_ins; ++k) ins.push_back(storage(cpu, t, random_floats(n, 10 + unsigned(k), 3e3f)));
          for (size_t k = 0; k < n_ins; ++k) {
            cpu_ins.push_back(ins[k].data());
            d_ins.push_back(std::make_unique<DeviceArray>(gpu, ins[k].data(), ins[k].size()));
            gpu_ins.push_back(d_ins.back()->ptr);
          }
          std::vector<uint8_t> want(n * fsdp::dtype_size(t));
          cpu.reduce_sum(want.data(), cpu_ins.data(), n_ins, n, t, 0.25f, clear);
          DeviceArray d_out(gpu, nullptr, want.size());
          gpu.reduce_sum(d_out.ptr, gpu_ins.data(), n_ins, n, t, 0.25f, clear);
          EXPECT_EQ(first_difference(want, d_out.read<uint8_t>()), -1);
          for (size_t k = 0; k < n_ins; ++k) {
            EXPECT_EQ(first_difference(ins[k], d_ins[k]->read<uint8_t>()), -1) << "input " << k << " after the pass";
          }
        }
      }
    }
  }
  std::vector<void*> too_many(fsdp::kernels::cuda::kMaxReduceInputs + 1, nullptr);
  expect_error(FSDP_ERR_UNSUPPORTED, "ranks can share a GPU",
               [&] { gpu.reduce_sum(nullptr, too_many.data(), too_many.size(), 1, DType::kFp32, 1.0f, false); });
}
