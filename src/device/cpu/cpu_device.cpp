// src/device/cpu/cpu_device.cpp - CPU loops over the kernels/ functors. Each
// loop body is one functor call on plain arrays so that the compiler
// vectorises it (the library is built with -fno-math-errno so that sqrt does).
#include "cpu_device.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

#include "../../../kernels/norm.h"
#include "../../base/dtype_dispatch.h"
#include "../../base/error.h"
#include "../../base/reduce.h"
#include "../../base/simd.h"
#include "quant_avx512.h"

namespace fsdp::device {
namespace {

using base::kStreamStep;
using base::prefetch_next_step;
using base::with_dtype;

constexpr size_t kGrain = 1024;  // elements; a multiple of every vector width

// A stand-in output that stores nothing, so that "no param_dtype copy" is a
// template instance instead of a branch in the inner loop.
struct NoOut {};
FSDP_HD void store_out(NoOut*, size_t, float) {}
template <typename T>
FSDP_HD void store_out(T* out, size_t i, float v) {
  kernels::store(out, i, v);
}

// Squares of one step of grads summed in the order of kernels/norm.h (16
// interleaved fp32 lane sums, folded pairwise), which a CUDA kernel computes
// too; vectorised here as four 4-wide GCC vectors, which hold the 16 lanes in
// order: the loop vectoriser turns an array of lane sums into shuffles, and
// GCC lowers a 16-wide vector type through memory where the target has no
// 16-wide registers. Test: CpuSumSquares.FollowsTheOrderOfKernelsNorm.
typedef float Lanes4 __attribute__((vector_size(4 * sizeof(float))));
static_assert(kernels::kSqLanes == 16, "four Lanes4 hold the lanes");
static_assert(base::kStreamStep == kernels::kSqStep, "a streaming step is a norm step");
FSDP_HD float block_sum_squares(const float* x, size_t b, size_t e) {
  constexpr size_t kLanes = kernels::kSqLanes;
  Lanes4 acc[4] = {};
  size_t i = b;
  for (; i + kLanes <= e; i += kLanes) {
    Lanes4 xi[4];
    std::memcpy(xi, x + i, sizeof xi);
    acc[0] += xi[0] * xi[0];
    acc[1] += xi[1] * xi[1];
    acc[2] += xi[2] * xi[2];
    acc[3] += xi[3] * xi[3];
  }
  float lane[kLanes];
  std::memcpy(lane, acc, sizeof lane);
  for (size_t l = 0; i + l < e; ++l) lane[l] = kernels::add_square(lane[l], x[i + l]);
  return kernels::fold_lanes(lane);
}

static_assert(kGrain % kStreamStep == 0, "chunks start on a step boundary");

// Runs body(lo, hi) over [b, e) in steps of kStreamStep; with kGradSq each step
// first sums the squares of its grads (prefetched by the step before, and in
// L1 when body reads them), the steps' fp32 sums added in double. Returns that
// sum (0 without kGradSq). sum_squares uses the same steps, so the fused
// passes return its bits.
template <bool kGradSq, typename Body>
FSDP_HD double steps(const float* g, size_t b, size_t e, Body&& body) {
  double total = 0.0;
  for (size_t lo = b; lo < e; lo += kStreamStep) {
    size_t hi = lo + kStreamStep < e ? lo + kStreamStep : e;
    if constexpr (kGradSq) total += block_sum_squares(g, lo, hi);
    body(lo, hi);
  }
  return total;
}

// The optimizer loops take their variants (output dtype, whether grads are
// cleared and their squares summed, SGD momentum) as template parameters, so
// that each inner loop is branch-free and vectorises.
template <typename Out, bool kZeroGrads, bool kGradSq>
FSDP_SIMD_CLONES double adam_loop(const AdamArgs& a, Out* out, size_t b, size_t e) {
  const kernels::AdamOp op = a.op;
  float* __restrict p = a.params;
  float* __restrict g = a.grads;
  float* __restrict m = a.exp_avg;
  float* __restrict v = a.exp_avg_sq;
  return steps<kGradSq>(g, b, e, [&](size_t lo, size_t hi) FSDP_LAMBDA_INLINE {
    prefetch_next_step(hi, e, p, g, m, v);
    for (size_t i = lo; i < hi; ++i) {
      float pi = p[i], gi = g[i], mi = m[i], vi = v[i];
      if constexpr (kZeroGrads) g[i] = 0.0f;
      op(pi, gi, mi, vi);
      p[i] = pi;
      m[i] = mi;
      v[i] = vi;
      store_out(out, i, pi);
    }
  });
}

template <typename Out, bool kZeroGrads, bool kGradSq, bool kMomentum>
FSDP_SIMD_CLONES double sgd_loop(const SgdArgs& a, Out* out, size_t b, size_t e) {
  const kernels::SgdOp op = a.op;
  float* __restrict p = a.params;
  float* __restrict g = a.grads;
  float* __restrict buf = a.momentum_buf;
  return steps<kGradSq>(g, b, e, [&](size_t lo, size_t hi) FSDP_LAMBDA_INLINE {
    if constexpr (kMomentum) {
      prefetch_next_step(hi, e, p, g, buf);
    } else {
      prefetch_next_step(hi, e, p, g);
    }
    for (size_t i = lo; i < hi; ++i) {
      float pi = p[i], gi = g[i];
      if constexpr (kZeroGrads) g[i] = 0.0f;
      if constexpr (kMomentum) {
        float bi = buf[i];
        op(pi, gi, bi);
        buf[i] = bi;
      } else {
        op(pi, gi);
      }
      p[i] = pi;
      store_out(out, i, pi);
    }
  });
}

// The element-wise passes; with kClear each also stores a zero over the
// source element it has just read (the grads' clearing, fused).
template <bool kClear, typename Out, typename In>
FSDP_SIMD_CLONES void cast_loop(Out* out, In* in, size_t b, size_t e) {
  kernels::CastOp op;
  for (size_t i = b; i < e; ++i) {
    op(out, in, i);
    if constexpr (kClear) kernels::store(in, i, 0.0f);
  }
}

template <typename Acc, typename Src>
FSDP_SIMD_CLONES void add_loop(Acc* acc, const Src* src, size_t b, size_t e) {
  kernels::AddOp op;
  for (size_t i = b; i < e; ++i) op(acc, src, i);
}

template <bool kClear, typename In>
FSDP_HD void accumulate_range(float* acc, In* in, float scale, size_t b, size_t e) {
  kernels::AccumulateOp op{scale};
  for (size_t i = b; i < e; ++i) {
    op(acc, in, i);
    if constexpr (kClear) kernels::store(in, i, 0.0f);
  }
}

template <bool kClear, typename In>
FSDP_SIMD_CLONES void accumulate_loop(float* acc, In* in, float scale, size_t b, size_t e) {
  accumulate_range<kClear>(acc, in, scale, b, e);
}

// The accumulation in the steps of sum_squares_loop, each step's squares
// summed right after it is written (still in L1): sum_squares' bits.
template <bool kClear, typename In>
FSDP_SIMD_CLONES double accumulate_sq_loop(float* acc, In* in, float scale, size_t b, size_t e) {
  double total = 0.0;
  steps<false>(acc, b, e, [&](size_t lo, size_t hi) FSDP_LAMBDA_INLINE {
    prefetch_next_step(hi, e, acc);
    accumulate_range<kClear>(acc, in, scale, lo, hi);
    total += block_sum_squares(acc, lo, hi);
  });
  return total;
}

FSDP_SIMD_CLONES double sum_squares_loop(const float* x, size_t b, size_t e) {
  return steps<true>(x, b, e, [&](size_t, size_t hi) FSDP_LAMBDA_INLINE { prefetch_next_step(hi, e, x); });
}

// Runs fn(b, e) -> double over the pool and adds the chunks' results in chunk
// order: the sum does not depend on thread timing, so runs are bitwise
// reproducible.
template <typename Fn>
double sum_over_chunks(ThreadPool& pool, size_t n, Fn&& fn) {
  size_t chunk = pool.chunk_size(n, kGrain);
  // The caller's own, kept: a pass allocates nothing once warm (test_alloc).
  // (A reference: the pool's threads would see their own thread_local.)
  thread_local std::vector<double> kept;
  std::vector<double>& partial = kept;
  partial.assign(chunk == 0 ? 0 : (n + chunk - 1) / chunk, 0.0);
  pool.parallel_for(n, kGrain, [&](size_t b, size_t e) { partial[b / chunk] = fn(b, e); });
  double s = 0.0;
  for (double v : partial) s += v;
  return s;
}

// One optimizer pass of `a` over the pool: picks the loop instance for the
// runtime flags (loop(out, zero_grads, grad_sq, b, e) receives them as
// std::bool_constant) and stores the grads' sum of squares where asked.
template <typename Args, typename Loop>
void optimizer_pass(ThreadPool& pool, const Args& a, Loop&& loop) {
  auto run = [&](auto zero_grads, auto grad_sq) {
    auto chunk = [&](size_t b, size_t e) {
      double sq = 0.0;
      if (a.out == nullptr) {
        sq = loop(static_cast<NoOut*>(nullptr), zero_grads, grad_sq, b, e);
      } else {
        with_dtype(a.out_dtype, a.out, [&](auto* out) { sq = loop(out, zero_grads, grad_sq, b, e); });
      }
      return sq;
    };
    if constexpr (decltype(grad_sq)::value) {
      *a.grad_sq = sum_over_chunks(pool, a.numel, chunk);
    } else {
      pool.parallel_for(a.numel, kGrain, [&](size_t b, size_t e) { chunk(b, e); });
    }
  };
  using T = std::true_type;
  using F = std::false_type;
  if (a.zero_grads) {
    a.grad_sq != nullptr ? run(T{}, T{}) : run(T{}, F{});
  } else {
    a.grad_sq != nullptr ? run(F{}, T{}) : run(F{}, F{});
  }
}

}  // namespace

std::unique_ptr<Stream> CpuDevice::create_stream(std::string name, int /*priority*/, StreamHooks hooks) {
  // One worker thread per stream: priorities would only matter between
  // streams sharing a thread.
  return std::make_unique<WorkerStream>(std::move(name), std::move(hooks));
}

Stream& CpuDevice::caller_stream(void* native, const char* call) {
  if (native == nullptr) return inline_;
  std::lock_guard<std::mutex> lock(host_streams_mu_);
  for (const auto& s : host_streams_) {
    if (s.get() == native) return *s;
  }
  fail(FSDP_ERR_INVALID_ARGUMENT, std::string(call) +
                                      ": stream must be NULL on the cpu device (the calling thread); it is a "
                                      "cudaStream_t only on cuda");
}

Stream* CpuDevice::create_host_stream(std::chrono::microseconds delay) {
  std::lock_guard<std::mutex> lock(host_streams_mu_);
  host_streams_.push_back(std::make_unique<WorkerStream>("host", StreamHooks{}, delay));
  return host_streams_.back().get();
}

void* CpuDevice::alloc(size_t nbytes) {
  void* p = cache_.alloc(nbytes);
  if (p == nullptr) {
    fail(FSDP_ERR_OUT_OF_MEMORY, "cpu device: could not allocate " + std::to_string(nbytes) + " bytes");
  }
  return p;
}

void CpuDevice::free(void* ptr) noexcept { cache_.free(ptr); }

void* CpuDevice::alloc_zeroed(size_t nbytes) {
  bool is_zero = false;
  void* p = cache_.alloc(nbytes, /*want_zero=*/true, &is_zero);
  if (p == nullptr) {
    fail(FSDP_ERR_OUT_OF_MEMORY, "cpu device: could not allocate " + std::to_string(nbytes) + " bytes");
  }
  if (!is_zero) zero(p, nbytes);
  return p;
}

void CpuDevice::free_zeroed(void* ptr) noexcept { cache_.free_zeroed(ptr); }

void CpuDevice::zero(void* ptr, size_t nbytes) {
  pool_.parallel_for(nbytes, kGrain * 4,
                     [&](size_t b, size_t e) { std::memset(static_cast<char*>(ptr) + b, 0, e - b); });
}

void CpuDevice::fill_nan(void* ptr, size_t nbytes) {
  pool_.parallel_for(nbytes, kGrain * 4,
                     [&](size_t b, size_t e) { std::memset(static_cast<char*>(ptr) + b, 0xFF, e - b); });
}

void CpuDevice::copy(void* dst, const void* src, size_t nbytes) {
  pool_.parallel_for(nbytes, kGrain * 4, [&](size_t b, size_t e) {
    std::memcpy(static_cast<char*>(dst) + b, static_cast<const char*>(src) + b, e - b);
  });
}

void CpuDevice::copy_from_host(void* dst, const void* host_src, size_t nbytes) { copy(dst, host_src, nbytes); }
void CpuDevice::copy_to_host(void* host_dst, const void* src, size_t nbytes) { copy(host_dst, src, nbytes); }

template <bool kClear>
void CpuDevice::cast_pass(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t numel) {
  if (dst_dtype == src_dtype && !kClear) {
    copy(dst, src, numel * dtype_size(dst_dtype));
    return;
  }
  with_dtype(dst_dtype, dst, [&](auto* out) {
    with_dtype(src_dtype, const_cast<void*>(src), [&](auto* in) {
      pool_.parallel_for(numel, kGrain, [&](size_t b, size_t e) { cast_loop<kClear>(out, in, b, e); });
    });
  });
}

template <bool kClear>
void CpuDevice::accumulate_pass(float* acc, const void* src, DType src_dtype, float scale, size_t numel,
                                double* acc_sq) {
  with_dtype(src_dtype, const_cast<void*>(src), [&](auto* in) {
    if (acc_sq != nullptr) {
      *acc_sq = sum_over_chunks(pool_, numel,
                                [&](size_t b, size_t e) { return accumulate_sq_loop<kClear>(acc, in, scale, b, e); });
    } else {
      pool_.parallel_for(numel, kGrain, [&](size_t b, size_t e) { accumulate_loop<kClear>(acc, in, scale, b, e); });
    }
  });
}

void CpuDevice::cast(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t numel) {
  cast_pass<false>(dst, dst_dtype, src, src_dtype, numel);
}

void CpuDevice::cast_clear(void* dst, DType dst_dtype, void* src, DType src_dtype, size_t numel) {
  cast_pass<true>(dst, dst_dtype, src, src_dtype, numel);
}

void CpuDevice::add(void* acc, DType acc_dtype, const void* src, DType src_dtype, size_t numel) {
  with_dtype(acc_dtype, acc, [&](auto* out) {
    with_dtype(src_dtype, const_cast<void*>(src), [&](auto* in) {
      pool_.parallel_for(numel, kGrain, [&](size_t b, size_t e) { add_loop(out, in, b, e); });
    });
  });
}

// The quantized gather's passes over the quantization blocks [kb, ke): one
// slice's blocks, or blocks of n_slices slices of n values (j / blocks is the slice).
template <typename T>
FSDP_SIMD_CLONES void quantize_loop(const T* in, size_t n, size_t block, kernels::QType t, uint8_t* out, size_t kb,
                                    size_t ke) {
  for (size_t k = kb; k < ke; ++k) kernels::quantize_block(in, n, block, k, t, out);
}

// Every E4M3 code's value (kernels::e4m3_bits_to_f32's bits): a lookup per
// value instead of the decode's arithmetic, which the compiler leaves scalar.
const float* e4m3_table() {
  static const auto table = [] {
    std::vector<float> v(256);
    for (int c = 0; c < 256; ++c) v[static_cast<size_t>(c)] = kernels::e4m3_bits_to_f32(static_cast<uint8_t>(c));
    return v;
  }();
  return table.data();
}

template <typename T>
FSDP_SIMD_CLONES void dequantize_loop(const uint8_t* in, size_t n, size_t block, kernels::QType t, T* out, size_t kb,
                                      size_t ke) {
  const size_t blocks = kernels::quant_blocks(n, block), stride = kernels::quant_packed_bytes(n, block);
  const float* fp8 = e4m3_table();
  for (size_t j = kb; j < ke; ++j) {
    const size_t s = j / blocks, k = j % blocks;
    const uint8_t* slice = in + s * stride;
    if (t == kernels::QType::kInt8) {
      kernels::dequantize_block(slice, n, block, k, t, out + s * n);
      continue;
    }
    // dequantize_block's fp8 arm, the decode looked up.
    const float scale = reinterpret_cast<const float*>(slice + kernels::quant_scales_offset(n))[k];
    T* o = out + s * n;
    for (size_t i = k * block, e = std::min(n, i + block); i < e; ++i) kernels::store(o, i, fp8[slice[i]] * scale);
  }
}

void CpuDevice::quantize(void* packed, const void* x, DType x_dtype, size_t n, size_t block, kernels::QType t) {
  auto* out = static_cast<uint8_t*>(packed);
  const bool simd = avx512::quant_available();
  // Codes larger than the threads' own caches are streamed, as dequantize's outputs.
  const bool stream = n > avx512::stream_store_bytes() * size_t(pool_.size());
  with_dtype(x_dtype, const_cast<void*>(x), [&](auto* in) {
    // Chunks of whole quantization blocks.
    pool_.parallel_for(kernels::quant_blocks(n, block), std::max<size_t>(1, 16 * kGrain / block),
                       [&](size_t b, size_t e) {
                         if (!simd || !avx512::quantize(in, x_dtype, n, block, t, out, b, e, stream)) {
                           quantize_loop(in, n, block, t, out, b, e);
                         }
                       });
  });
  // The 0-3 bytes between the codes and the scales: zeros, so that every
  // byte the all-gather moves is defined, the same on every device.
  std::memset(out + n, 0, kernels::quant_scales_offset(n) - n);
}

void CpuDevice::dequantize(void* out, DType out_dtype, const void* packed, size_t n_slices, size_t n, size_t block,
                           kernels::QType t) {
  const auto* in = static_cast<const uint8_t*>(packed);
  const bool simd = avx512::quant_available();
  // Outputs larger than the threads' own caches are streamed (quant_avx512.h).
  const bool stream = n_slices * n * dtype_size(out_dtype) > avx512::stream_store_bytes() * size_t(pool_.size());
  with_dtype(out_dtype, out, [&](auto* o) {
    pool_.parallel_for(n_slices * kernels::quant_blocks(n, block), std::max<size_t>(1, 16 * kGrain / block),
                       [&](size_t b, size_t e) {
                         if (!simd || !avx512::dequantize(in, n, block, t, o, out_dtype, b, e, stream)) {
                           dequantize_loop(in, n, block, t, o, b, e);
                         }
                       });
  });
}

void CpuDevice::dequantize_sum(float* out, const void* packed, size_t n_slices, size_t stride, size_t n, size_t block,
                               kernels::QType t, float scale) {
  const auto* in = static_cast<const uint8_t*>(packed);
  const float* fp8 = e4m3_table();
  const size_t scales = kernels::quant_scales_offset(n);
  const bool simd = avx512::quant_available();
  const bool stream = n * sizeof(float) > avx512::stream_store_bytes() * size_t(pool_.size());
  pool_.parallel_for(kernels::quant_blocks(n, block), std::max<size_t>(1, 16 * kGrain / block),
                     [&](size_t b, size_t e) {
                       if (simd) {
                         avx512::dequantize_sum(in, n_slices, stride, n, block, t, scale, out, b, e, stream);
                         return;
                       }
                       for (size_t k = b; k < e; ++k) {
                         if (t == kernels::QType::kInt8) {
                           kernels::dequantize_sum_block(in, n_slices, stride, n, block, k, t, scale, out);
                           continue;
                         }
                         // dequantize_sum_block's fp8 arm, the decode looked up (the same bits).
                         const size_t i0 = k * block, i1 = std::min(n, i0 + block);
                         for (size_t sl = 0; sl < n_slices; ++sl) {
                           const uint8_t* slice = in + sl * stride;
                           const float sc = reinterpret_cast<const float*>(slice + scales)[k];
                           if (sl == 0) {
                             for (size_t i = i0; i < i1; ++i) out[i] = fp8[slice[i]] * sc;
                           } else {
                             for (size_t i = i0; i < i1; ++i) out[i] = out[i] + fp8[slice[i]] * sc;
                           }
                         }
                         for (size_t i = i0; i < i1; ++i) out[i] = out[i] * scale;
                       }
                     });
}

void CpuDevice::accumulate(float* acc, const void* src, DType src_dtype, float scale, size_t numel, double* acc_sq) {
  accumulate_pass<false>(acc, src, src_dtype, scale, numel, acc_sq);
}

void CpuDevice::accumulate_clear(float* acc, void* src, DType src_dtype, float scale, size_t numel, double* acc_sq) {
  accumulate_pass<true>(acc, src, src_dtype, scale, numel, acc_sq);
}

void CpuDevice::adam(const AdamArgs& a) {
  optimizer_pass(pool_, a, [&](auto* out, auto zero_grads, auto grad_sq, size_t b, size_t e) {
    using Out = std::remove_pointer_t<decltype(out)>;
    return adam_loop<Out, decltype(zero_grads)::value, decltype(grad_sq)::value>(a, out, b, e);
  });
}

void CpuDevice::sgd(const SgdArgs& a) {
  optimizer_pass(pool_, a, [&](auto* out, auto zero_grads, auto grad_sq, size_t b, size_t e) {
    using Out = std::remove_pointer_t<decltype(out)>;
    constexpr bool kZero = decltype(zero_grads)::value, kSq = decltype(grad_sq)::value;
    return a.momentum_buf != nullptr ? sgd_loop<Out, kZero, kSq, true>(a, out, b, e)
                                     : sgd_loop<Out, kZero, kSq, false>(a, out, b, e);
  });
}

double CpuDevice::sum_squares(const float* x, size_t numel) {
  return sum_over_chunks(pool_, numel, [&](size_t b, size_t e) { return sum_squares_loop(x, b, e); });
}

void CpuDevice::reduce_sum(void* out, void* const* ins, size_t n_ins, size_t numel, DType dtype, float scale,
                           bool clear) {
  size_t es = dtype_size(dtype);
  pool_.parallel_for(numel, kGrain, [&](size_t b, size_t e) {
    std::vector<void*> from(n_ins);
    for (size_t k = 0; k < n_ins; ++k) from[k] = static_cast<char*>(ins[k]) + b * es;
    void* to = static_cast<char*>(out) + b * es;
    if (clear) {
      base::reduce_sum_clear(to, from.data(), n_ins, e - b, dtype, scale);
    } else {
      base::reduce_sum(to, from.data(), n_ins, e - b, dtype, scale);
    }
  });
}

std::unique_ptr<SpanTable> CpuDevice::make_span_table(std::vector<ShardSpan> spans,
                                                      std::vector<kernels::StepGroup> groups) {
  return std::make_unique<SpanTable>(std::move(spans), std::move(groups));
}

namespace {

// A skipped step's pass: the grads cleared, nothing else written.
template <typename Table>
void clear_span_grads(CpuDevice& dev, const Table& table) {
  for (const ShardSpan& s : table.spans()) dev.zero(s.grads, s.numel * sizeof(float));
}

}  // namespace

void CpuDevice::adam_spans(const SpanTable& table, const kernels::StepRule& rule, const kernels::StepState* st,
                           DType out_dtype, bool zero_grads) {
  if (st->skip != 0) {
    if (zero_grads) clear_span_grads(*this, table);
    return;
  }
  const bool decoupled = rule.decoupled != 0;
  for (const ShardSpan& s : table.spans()) {
    const kernels::StepGroup& g = table.groups().at(s.group);
    const kernels::AdamOp op = kernels::step_adam_op(*st, g, rule);
    adam({op.with_weight_decay(kernels::group_lr(*st, g), s.weight_decay, decoupled), s.params, s.grads, s.state1,
          s.state2, s.out, out_dtype, s.numel, zero_grads});
  }
}

void CpuDevice::sgd_spans(const SpanTable& table, const kernels::StepRule& rule, const kernels::StepState* st,
                          DType out_dtype, bool zero_grads) {
  if (st->skip != 0) {
    if (zero_grads) clear_span_grads(*this, table);
    return;
  }
  for (const ShardSpan& s : table.spans()) {
    kernels::SgdOp o = kernels::step_sgd_op(*st, table.groups().at(s.group), rule);
    o.weight_decay = s.weight_decay;
    sgd({o, s.params, s.grads, s.state1, s.out, out_dtype, s.numel, zero_grads});
  }
}

void CpuDevice::step_scalars(kernels::StepState* st, const double* unit_sq, size_t n_units,
                             const kernels::StepRule* rule) {
  if (unit_sq != nullptr) kernels::step_sum_units(*st, unit_sq, n_units);
  if (rule != nullptr) kernels::step_decide(*st, *rule);
}

std::unique_ptr<SquaresTable> CpuDevice::make_squares_table(std::vector<SquaresSpan> spans) {
  return std::make_unique<SquaresTable>(std::move(spans));
}

void CpuDevice::sum_squares_table(const SquaresTable& table) {
  for (const SquaresSpan& s : table.spans()) *s.out = sum_squares(s.x, s.numel);
}

void CpuDevice::reduce_sum_f64(double* out, const double* const* ins, size_t n_ins, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    double acc = ins[0][i];
    for (size_t k = 1; k < n_ins; ++k) acc += ins[k][i];
    out[i] = acc;
  }
}

EventPtr CpuDevice::mark() { return CpuEvent::completed(); }

void CpuDevice::wait_mark(const EventPtr& ev) {
  if (ev) ev->wait(0);
}

}  // namespace fsdp::device
