// benchmarks/bench_quant.cpp - the quantized all-gather's and the quantized
// reduction's passes on the CPU device (kernels/quant.h through CpuDevice::
// quantize / dequantize / dequantize_sum), as a fraction of the memory
// bandwidth a plain copy reaches on the same threads in the same run.
// quantize reads fp32 (the master) or bf16 (the grads) and writes one byte
// per value plus a scale per block; dequantize reads those and writes
// param_dtype; dequantize_sum reads 4 ranks' packed parts and writes their
// fp32 sum. Prints one JSON object per line.
//
//   bench_quant [numel [reps [threads,...]]]   (defaults: 2^24, 5, "1,2")
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench_util.h"
#include "device/cpu/cpu_device.h"

using fsdp::DType;
using fsdp::bench::JsonLine;
namespace k = fsdp::kernels;

namespace {

constexpr size_t kBlock = 256;

void report(const char* name, int threads, size_t n, double seconds, double bytes, double copy_gbs) {
  const double gbs = bytes / seconds / 1e9;
  std::printf("%s\n", JsonLine()
                          .add("benchmark", name)
                          .add("threads", threads)
                          .add("numel", static_cast<double>(n))
                          .add("block", static_cast<double>(kBlock))
                          .add("seconds", seconds)
                          .add("bytes_per_element", bytes / static_cast<double>(n))
                          .add("gb_per_s", gbs)
                          .add("copy_gb_per_s", copy_gbs)
                          .add("fraction_of_copy", gbs / copy_gbs)
                          .str()
                          .c_str());
}

template <typename T>
struct Buffer {
  explicit Buffer(size_t count) : p(static_cast<T*>(std::aligned_alloc(64, (count * sizeof(T) + 63) / 64 * 64))) {
    std::memset(static_cast<void*>(p), 0, count * sizeof(T));
  }
  ~Buffer() { std::free(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  T* data() { return p; }
  T& operator[](size_t i) { return p[i]; }
  T* p;
};

double seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  const size_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : (size_t(1) << 24);
  const int reps = argc > 2 ? std::atoi(argv[2]) : 5;
  std::vector<int> thread_counts = {1, 2};
  if (argc > 3) {
    thread_counts.clear();
    for (const char* p = argv[3]; *p != '\0';) {
      char* end = nullptr;
      thread_counts.push_back(static_cast<int>(std::strtol(p, &end, 10)));
      p = *end == ',' ? end + 1 : end;
    }
  }
  const size_t packed = k::quant_packed_bytes(n, kBlock);
  for (int threads : thread_counts) {
    fsdp::device::CpuDevice dev(threads, fsdp::device::Pool::kDevice);
    // 64-byte aligned, as the engine's buffers are (the device's allocator).
    Buffer<float> x(n);
    // Weights as a model holds them: about N(0, 0.02) (a sum of four uniform
    // draws of a fixed generator), each block's values of one distribution.
    uint64_t state = 0x9e3779b97f4a7c15ull;
    auto uniform = [&] {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      return static_cast<float>(state >> 40) * 0x1p-24f - 0.5f;
    };
    for (size_t i = 0; i < n; ++i) x[i] = 0.02f * 1.732f * (uniform() + uniform() + uniform() + uniform());
    Buffer<uint8_t> q(packed);
    Buffer<uint16_t> out(n);
    Buffer<float> copy_dst(n);
    // The limit: the device's own copy of the fp32 array (read 4, write 4
    // bytes per value), timed alternately with each pass (the best of each
    // over the same reps), so that both see the same state of a shared
    // machine: one copy figure for a whole run drifted by 20-30% here.
    auto run = [&](const std::string& name, double bytes, const std::function<void()>& pass) {
      double copy_s = 1e30, pass_s = 1e30;
      pass();
      dev.copy(copy_dst.data(), x.data(), n * 4);
      for (int r = 0; r < reps; ++r) {
        copy_s = std::min(copy_s, seconds([&] { dev.copy(copy_dst.data(), x.data(), n * 4); }));
        pass_s = std::min(pass_s, seconds(pass));
      }
      report(name.c_str(), threads, n, pass_s, bytes, 8.0 * static_cast<double>(n) / copy_s / 1e9);
    };
    Buffer<float> sum_out(n);
    for (k::QType t : {k::QType::kInt8, k::QType::kFp8E4m3}) {
      const std::string tn = t == k::QType::kInt8 ? "int8" : "fp8_e4m3";
      run("quantize_fp32_to_" + tn, 4.0 * double(n) + double(packed),
          [&] { dev.quantize(q.data(), x.data(), DType::kFp32, n, kBlock, t); });
      run("dequantize_" + tn + "_to_bf16", double(packed) + 2.0 * double(n),
          [&] { dev.dequantize(out.data(), DType::kBf16, q.data(), 1, n, kBlock, t); });
      // The reduction's ends: bf16 grads packed; 4 ranks' parts of n/4 summed.
      run("quantize_bf16_to_" + tn, 2.0 * double(n) + double(packed),
          [&] { dev.quantize(q.data(), out.data(), DType::kBf16, n, kBlock, t); });
      const size_t part = n / 4, part_bytes = k::quant_packed_bytes(part, kBlock);
      Buffer<uint8_t> parts(4 * part_bytes);
      for (size_t r = 0; r < 4; ++r) dev.quantize(parts.data() + r * part_bytes, x.data() + r * part, DType::kFp32, part, kBlock, t);
      run("dequantize_sum_4x" + tn + "_to_fp32", 4.0 * double(part_bytes) + 4.0 * double(part),
          [&] { dev.dequantize_sum(sum_out.data(), parts.data(), 4, part_bytes, part, kBlock, t, 0.25f); });
    }
  }
  return 0;
}
