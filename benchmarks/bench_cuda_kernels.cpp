// benchmarks/bench_cuda_kernels.cpp - the CUDA device's kernels beside the
// GPU's device-to-device copy bandwidth measured in the same run: the
// engine's optimizer pass (the multi-tensor AdamW launch over a model's
// spans, the grads cleared, with and without the bf16 params copy, reading
// its op from the step's scalars in device memory: what fsdp_step runs), the
// per-range fused AdamW pass (with the same clearing, the row to compare the
// multi-tensor pass with), the grad shard's accumulation with and without its
// fused sum of squares, the multi-tensor sum of squares, the casts, and the
// quantized all-gather's and reduction's passes (quantize a shard in blocks of
// 256 to int8 / fp8_e4m3, dequantize 8 gathered slices, the quantized
// reduction's dequantize-and-sum of 8 slices; goal >= 0.8). Each
// line is one JSON object: bytes moved per second and its ratio to the copy's
// (goal for the engine's optimizer pass, the adamw_spans rows: >= 0.85).
// Without a GPU it prints one line saying it was skipped and exits 0.
//
//   bench_cuda_kernels [--log2n 28] [--reps 20]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench_cuda_util.h"
#include "bench_util.h"
#include "device/cuda/cuda_device.h"
#include "kernels/quant.h"

using fsdp::DType;
using fsdp::bench::best_gpu_seconds;
using fsdp::bench::JsonLine;
using fsdp::device::cuda::CudaDevice;
using fsdp::device::cuda::CudaStream;

// The quantized gather's and reduction's passes (issue 37), on values that
// fill every block (zeros would take the kernels' shortcut for scale 0):
// quantize n values from fp32 and bf16, dequantize them as 8 gathered
// slices of n / 8 into bf16 and fp32, and sum 8 slices of n / 8 values in
// fp32 (the quantized reduce-scatter's end). Bytes: what each pass reads and
// writes once, the scales included.
template <typename Array, typename Report>
void quant_rows(CudaDevice& gpu, CudaStream& s, size_t n, int reps, float* f32, void* bf16, float* f32_out,
                Array& array, Report& report) {
  using fsdp::kernels::QType;
  constexpr size_t kBlock = 256, kSlices = 8;
  {
    std::vector<float> host(n);
    uint32_t x = 12345;
    for (size_t i = 0; i < n; ++i) {
      x = x * 1664525u + 1013904223u;
      host[i] = static_cast<float>(static_cast<int32_t>(x)) * 1e-9f;  // -2.1 .. 2.1
    }
    gpu.copy_from_host(f32, host.data(), n * 4);
  }
  gpu.cast(bf16, DType::kBf16, f32, DType::kFp32, n);
  const size_t n_slice = n / kSlices, stride = fsdp::kernels::quant_packed_bytes(n_slice, kBlock);
  const double scales = 4.0 * static_cast<double>(fsdp::kernels::quant_blocks(n, kBlock));
  auto* packed =
      reinterpret_cast<uint8_t*>(array(std::max(fsdp::kernels::quant_packed_bytes(n, kBlock), kSlices * stride)));
  for (QType t : {QType::kInt8, QType::kFp8E4m3}) {
    const std::string q = t == QType::kInt8 ? "int8" : "fp8_e4m3";
    for (DType from : {DType::kFp32, DType::kBf16}) {
      const void* x = from == DType::kFp32 ? static_cast<const void*>(f32) : bf16;
      report(("quantize_" + std::string(fsdp::dtype_name(from)) + "_to_" + q).c_str(),
             static_cast<double>(n) * (fsdp::dtype_size(from) + 1) + scales,
             best_gpu_seconds(s, reps, [&] { gpu.quantize(packed, x, from, n, kBlock, t); }));
    }
    // 8 ranks' slices, as the all-gather lays them out.
    for (size_t k = 0; k < kSlices; ++k)
      gpu.quantize(packed + k * stride, f32 + k * n_slice, DType::kFp32, n_slice, kBlock, t);
    const double packed_bytes = static_cast<double>(kSlices * stride);
    for (DType to : {DType::kBf16, DType::kFp32}) {
      void* out = to == DType::kFp32 ? static_cast<void*>(f32_out) : bf16;
      report(("dequantize_" + q + "_to_" + std::string(fsdp::dtype_name(to)) + " (8 slices)").c_str(),
             packed_bytes + static_cast<double>(kSlices * n_slice * fsdp::dtype_size(to)),
             best_gpu_seconds(s, reps, [&] { gpu.dequantize(out, to, packed, kSlices, n_slice, kBlock, t); }));
    }
    report(("dequantize_sum_" + q + " (8 slices)").c_str(), packed_bytes + 4.0 * static_cast<double>(n_slice),
           best_gpu_seconds(s, reps, [&] {
             gpu.dequantize_sum(f32_out, packed, kSlices, stride, n_slice, kBlock, t, 1.0f / kSlices);
           }));
  }
}

int main(int argc, char** argv) {
  int log2n = 28, reps = 20;
  size_t stagger = 0;  // --stagger B: the k-th array starts k*B bytes into its block (B a multiple of 256)
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--log2n")) log2n = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--stagger")) stagger = std::strtoull(argv[i + 1], nullptr, 10) / 256 * 256;
  }
  if (CudaDevice::count() == 0) {
    std::printf(
        "%s\n",
        JsonLine().add("bench", "cuda_kernels").add("skipped", "no CUDA device can be used here").str().c_str());
    return 0;
  }
  CudaDevice gpu(0);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  const size_t n = size_t(1) << log2n;
  // Equal blocks from the pool lie a multiple of their size apart; --stagger
  // moves each array off that alignment (DRAM channel conflicts, if any, show
  // as a difference between the two runs).
  std::vector<void*> blocks;
  auto array = [&](size_t nbytes) {
    const size_t skew = stagger * blocks.size();
    blocks.push_back(gpu.alloc(nbytes + skew));
    return static_cast<char*>(blocks.back()) + skew;
  };
  float* p = reinterpret_cast<float*>(array(n * 4));
  float* g = reinterpret_cast<float*>(array(n * 4));
  float* m = reinterpret_cast<float*>(array(n * 4));
  float* v = reinterpret_cast<float*>(array(n * 4));
  void* lowp = array(n * 2);
  for (float* x : {p, g, m, v}) gpu.zero(x, n * 4);

  auto stream = gpu.create_stream("bench", 0, fsdp::device::StreamHooks{});
  auto& s = static_cast<CudaStream&>(*stream);
  double copy_s = best_gpu_seconds(s, reps, [&] { gpu.copy(m, p, n * 4); });
  double copy_bw = 2.0 * n * 4 / copy_s;  // read + write
  auto report = [&](const char* what, double bytes, double t) {
    std::printf("%s\n", JsonLine()
                            .add("bench", "cuda_kernels")
                            .add("gpu", prop.name)
                            .add("kernel", what)
                            .add("stagger_bytes", static_cast<double>(stagger))
                            .add("numel", static_cast<double>(n))
                            .add("seconds", t)
                            .add("GBps", bytes / t / 1e9)
                            .add("copy_GBps", copy_bw / 1e9)
                            .add("ratio_to_copy", bytes / t / copy_bw)
                            .str()
                            .c_str());
  };
  report("copy_d2d", 2.0 * n * 4, copy_s);
  auto op = fsdp::kernels::AdamOp::make(1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, true, 10, 1.0f);
  struct Variant {
    const char* name;
    void* out;
    bool zero_grads;
    double bytes_per_elem;  // reads p g m v, writes p m v (+ bf16 copy, + zeroed grads)
  };
  for (const Variant& var : {Variant{"adamw", nullptr, false, 28}, Variant{"adamw+zero_grads", nullptr, true, 32},
                             Variant{"adamw+bf16", lowp, false, 30}, Variant{"adamw+bf16+zero_grads", lowp, true, 34}}) {
    double t = best_gpu_seconds(s, reps, [&] {
      fsdp::device::AdamArgs a{op, p, g, m, v, var.out, DType::kBf16, n, var.zero_grads, nullptr};
      gpu.adam(a);
    });
    report(var.name, var.bytes_per_elem * n, t);
  }
  // The engine's pass: one launch over the spans of a model (here 64 params
  // of n/64 elements, every other one without weight decay), as fsdp_step
  // runs it: the grads cleared, the bf16 params copy where the units keep one.
  {
    const size_t n_spans = 64, per = n / n_spans;
    std::vector<fsdp::device::ShardSpan> plain, with_copy;
    std::vector<fsdp::device::SquaresSpan> squares;
    double* sums = static_cast<double*>(gpu.alloc(n_spans * sizeof(double)));
    for (size_t k = 0; k < n_spans; ++k) {
      const size_t at = k * per;
      const float wd = k % 2 == 0 ? 0.01f : 0.0f;
      plain.push_back({p + at, g + at, m + at, v + at, nullptr, per, wd, 0});
      with_copy.push_back({p + at, g + at, m + at, v + at, static_cast<char*>(lowp) + at * 2, per, wd, 0});
      squares.push_back({g + at, per, sums + k});
    }
    const std::vector<fsdp::kernels::StepGroup> groups = {{0, 1.0f, 0.9f, 0.999f}};
    auto plain_table = gpu.make_span_table(plain, groups);
    auto copy_table = gpu.make_span_table(with_copy, groups);
    auto squares_table = gpu.make_squares_table(squares);
    fsdp::kernels::StepState st{};
    st.lr = 1e-3;
    st.t = 10;
    st.grad_scale = 1.0f;
    fsdp::kernels::StepRule rule{};
    rule.eps = 1e-8f;
    rule.decoupled = 1;
    auto* dst = static_cast<fsdp::kernels::StepState*>(gpu.alloc(sizeof st));
    gpu.copy_from_host(dst, &st, sizeof st);
    const double elems = static_cast<double>(per * n_spans);
    report("adamw_spans+zero_grads", 32 * elems,
           best_gpu_seconds(s, reps, [&] { gpu.adam_spans(*plain_table, rule, dst, DType::kBf16, true); }));
    report("adamw_spans+bf16+zero_grads", 34 * elems,
           best_gpu_seconds(s, reps, [&] { gpu.adam_spans(*copy_table, rule, dst, DType::kBf16, true); }));
    report("sum_squares_table", 4 * elems, best_gpu_seconds(s, reps, [&] { gpu.sum_squares_table(*squares_table); }));
    // The grad shard's accumulation (a reduction's result added in), alone
    // and with its sum of squares fused: the same bytes, read and written once.
    report("accumulate", 12.0 * n,
           best_gpu_seconds(s, reps, [&] { gpu.accumulate(p, m, DType::kFp32, 1.0f, n, nullptr); }));
    report("accumulate+sum_squares", 12.0 * n,
           best_gpu_seconds(s, reps, [&] { gpu.accumulate(p, m, DType::kFp32, 1.0f, n, sums); }));
    gpu.free(dst);
    gpu.free(sums);
  }
  report("cast_fp32_to_bf16", 6.0 * n,
         best_gpu_seconds(s, reps, [&] { gpu.cast(lowp, DType::kBf16, p, DType::kFp32, n); }));
  report("cast_bf16_to_fp32", 6.0 * n,
         best_gpu_seconds(s, reps, [&] { gpu.cast(p, DType::kFp32, lowp, DType::kBf16, n); }));
  report("sum_squares (read by the host)", 4.0 * n, best_gpu_seconds(s, reps, [&] { (void)gpu.sum_squares(g, n); }));
  quant_rows(gpu, s, n, reps, p, lowp, m, array, report);
  for (void* b : blocks) gpu.free(b);
  return 0;
}
