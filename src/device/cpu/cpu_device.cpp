// src/device/cpu/cpu_device.cpp - CPU loops over the kernels/ functors. Each
// loop body is one functor call on plain arrays so that the compiler
// vectorises it (the library is built with -fno-math-errno so that sqrt does).
#include "cpu_device.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "../../core/error.h"
#include "../dtype_dispatch.h"
#include "simd.h"

namespace fsdp::device {
namespace {

constexpr size_t kGrain = 1024;  // elements; a multiple of every vector width

// A stand-in output that stores nothing, so that "no param_dtype copy" is a
// template instance instead of a branch in the inner loop.
struct NoOut {};
inline void store_out(NoOut*, size_t, float) {}
template <typename T>
inline void store_out(T* out, size_t i, float v) {
  kernels::store(out, i, v);
}

template <typename Out>
FSDP_SIMD_CLONES void adam_loop(const AdamArgs& a, Out* out, size_t b, size_t e) {
  const kernels::AdamOp op = a.op;
  float* __restrict p = a.params;
  const float* __restrict g = a.grads;
  float* __restrict m = a.exp_avg;
  float* __restrict v = a.exp_avg_sq;
  for (size_t i = b; i < e; ++i) {
    float pi = p[i], mi = m[i], vi = v[i];
    op(pi, g[i], mi, vi);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    store_out(out, i, pi);
  }
}

template <typename Out>
FSDP_SIMD_CLONES void sgd_loop(const SgdArgs& a, Out* out, size_t b, size_t e) {
  const kernels::SgdOp op = a.op;
  float* __restrict p = a.params;
  const float* __restrict g = a.grads;
  float* __restrict buf = a.momentum_buf;
  if (buf != nullptr) {
    for (size_t i = b; i < e; ++i) {
      float pi = p[i], bi = buf[i];
      op(pi, g[i], bi);
      p[i] = pi;
      buf[i] = bi;
      store_out(out, i, pi);
    }
  } else {
    for (size_t i = b; i < e; ++i) {
      float pi = p[i];
      op(pi, g[i]);
      p[i] = pi;
      store_out(out, i, pi);
    }
  }
}

template <typename Out, typename In>
FSDP_SIMD_CLONES void cast_loop(Out* out, const In* in, size_t b, size_t e) {
  kernels::CastOp op;
  for (size_t i = b; i < e; ++i) op(out, in, i);
}

template <typename In>
FSDP_SIMD_CLONES void accumulate_loop(float* acc, const In* in, float scale, size_t b, size_t e) {
  kernels::AccumulateOp op{scale};
  for (size_t i = b; i < e; ++i) op(acc, in, i);
}

// fp32 partial sums over short blocks keep the loop vectorised; the blocks are
// added in double.
FSDP_SIMD_CLONES double sum_squares_loop(const float* x, size_t b, size_t e) {
  double total = 0.0;
  for (size_t blk = b; blk < e; blk += kGrain) {
    size_t end = blk + kGrain < e ? blk + kGrain : e;
    float s = 0.0f;
    for (size_t i = blk; i < end; ++i) s += x[i] * x[i];
    total += s;
  }
  return total;
}

}  // namespace

void* CpuDevice::alloc(size_t nbytes) {
  void* p = cache_.alloc(nbytes);
  if (p == nullptr) {
    fail(FSDP_ERR_OUT_OF_MEMORY, "cpu device: could not allocate " + std::to_string(nbytes) + " bytes");
  }
  return p;
}

void CpuDevice::free(void* ptr) noexcept { cache_.free(ptr); }

void CpuDevice::zero(void* ptr, size_t nbytes) {
  pool_.parallel_for(nbytes, kGrain * 4,
                     [&](size_t b, size_t e) { std::memset(static_cast<char*>(ptr) + b, 0, e - b); });
}

void CpuDevice::copy(void* dst, const void* src, size_t nbytes) {
  pool_.parallel_for(nbytes, kGrain * 4, [&](size_t b, size_t e) {
    std::memcpy(static_cast<char*>(dst) + b, static_cast<const char*>(src) + b, e - b);
  });
}

void CpuDevice::copy_from_host(void* dst, const void* host_src, size_t nbytes) { copy(dst, host_src, nbytes); }
void CpuDevice::copy_to_host(void* host_dst, const void* src, size_t nbytes) { copy(host_dst, src, nbytes); }

void CpuDevice::cast(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t numel) {
  if (dst_dtype == src_dtype) {
    copy(dst, src, numel * dtype_size(dst_dtype));
    return;
  }
  with_dtype(dst_dtype, dst, [&](auto* out) {
    with_dtype(src_dtype, const_cast<void*>(src), [&](auto* in) {
      pool_.parallel_for(numel, kGrain, [&](size_t b, size_t e) { cast_loop(out, in, b, e); });
    });
  });
}

void CpuDevice::accumulate(float* acc, const void* src, DType src_dtype, float scale, size_t numel) {
  with_dtype(src_dtype, const_cast<void*>(src), [&](auto* in) {
    pool_.parallel_for(numel, kGrain, [&](size_t b, size_t e) { accumulate_loop(acc, in, scale, b, e); });
  });
}

void CpuDevice::adam(const AdamArgs& a) {
  pool_.parallel_for(a.numel, kGrain, [&](size_t b, size_t e) {
    if (a.out == nullptr) {
      adam_loop(a, static_cast<NoOut*>(nullptr), b, e);
    } else {
      with_dtype(a.out_dtype, a.out, [&](auto* out) { adam_loop(a, out, b, e); });
    }
  });
}

void CpuDevice::sgd(const SgdArgs& a) {
  pool_.parallel_for(a.numel, kGrain, [&](size_t b, size_t e) {
    if (a.out == nullptr) {
      sgd_loop(a, static_cast<NoOut*>(nullptr), b, e);
    } else {
      with_dtype(a.out_dtype, a.out, [&](auto* out) { sgd_loop(a, out, b, e); });
    }
  });
}

double CpuDevice::sum_squares(const float* x, size_t numel) {
  // One partial per chunk, added in chunk order: the result does not depend on
  // thread timing, so runs are bitwise reproducible.
  size_t chunk = pool_.chunk_size(numel, kGrain);
  std::vector<double> partial(chunk == 0 ? 0 : (numel + chunk - 1) / chunk, 0.0);
  pool_.parallel_for(numel, kGrain, [&](size_t b, size_t e) { partial[b / chunk] = sum_squares_loop(x, b, e); });
  double s = 0.0;
  for (double v : partial) s += v;
  return s;
}

}  // namespace fsdp::device
