// kernels/cuda/quant.cu - the quantized all-gather's and reduction's kernels over
// the functions of kernels/quant.h: the CPU's bits (tests/test_cuda.cpp).
// Where the block is 128, 256, 512 or 1024 values and the arrays are aligned
// for 4-element accesses (the pool's buffers are), one warp takes a block:
// each lane holds 4 values per 128, loaded and stored as one vector access
// (vec4.cuh) and its 4 codes as one 32-bit word; the block's absmax is a
// warp shuffle of the values' bits (kernels::block_scale's order). Other
// blocks, the last partial block and misaligned arrays take the plain
// kernels (one value per thread).
#include <algorithm>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "../cast.h"
#include "../quant.h"
#include "dispatch.cuh"
#include "launch.h"
#include "vec4.cuh"

namespace fsdp::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr size_t kMaxBlocks = 65535;  // grid-stride beyond

// One thread block per quantization block: the block's absmax (a max, exact
// in any order) and whether it is finite, then each thread its values.
template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_kernel(uint8_t* packed, const T* x, size_t n, size_t block,
                                                             size_t k0, QType t) {
  __shared__ float amax_s[kThreads];
  __shared__ int finite_s[kThreads];
  const size_t blocks = quant_blocks(n, block);
  for (size_t k = k0 + blockIdx.x; k < blocks; k += gridDim.x) {
    const size_t b = k * block, e = min(b + block, n);
    float amax = 0.0f;
    int finite = 1;
    for (size_t i = b + threadIdx.x; i < e; i += blockDim.x) {
      const uint32_t a = f32_bits(load(x, i)) & 0x7fffffffu;
      finite &= a < 0x7f800000u ? 1 : 0;
      if (a < 0x7f800000u) amax = fmaxf(amax, f32_from_bits(a));
    }
    amax_s[threadIdx.x] = amax;
    finite_s[threadIdx.x] = finite;
    __syncthreads();
    for (int w = kThreads / 2; w > 0; w /= 2) {
      if (threadIdx.x < w) {
        amax_s[threadIdx.x] = fmaxf(amax_s[threadIdx.x], amax_s[threadIdx.x + w]);
        finite_s[threadIdx.x] &= finite_s[threadIdx.x + w];
      }
      __syncthreads();
    }
    const float scale = finite_s[0] ? amax_s[0] / qmax(t) : f32_from_bits(0x7fc00000u);
    if (threadIdx.x == 0) reinterpret_cast<float*>(packed + quant_scales_offset(n))[k] = scale;
    // The 0-3 bytes between the codes and the scales: zeros, so that every
    // byte the all-gather moves is defined (and the same on every device).
    if (k + 1 == blocks && n + threadIdx.x < quant_scales_offset(n)) packed[n + threadIdx.x] = 0;
    for (size_t i = b + threadIdx.x; i < e; i += blockDim.x) packed[i] = kernels::quantize(load(x, i), scale, t);
    __syncthreads();  // the shared arrays are reused by the next block of the loop
  }
}

// Slice blockIdx.y (and every gridDim.y-th after it), values [j0, n).
template <typename T>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(T* out, const uint8_t* packed, size_t n_slices, size_t n,
                                                               size_t block, size_t j0, QType t) {
  const size_t stride = quant_packed_bytes(n, block);
  for (size_t s = blockIdx.y; s < n_slices; s += gridDim.y) {
    const uint8_t* slice = packed + s * stride;
    const float* scales = reinterpret_cast<const float*>(slice + quant_scales_offset(n));
    for (size_t j = j0 + static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
         j += static_cast<size_t>(gridDim.x) * blockDim.x) {
      store(out, s * n + j, kernels::dequantize(slice[j], scales[j / block], t));
    }
  }
}

// One thread per value: the slices' dequantized values added in slice order
// (dequantize_sum_block's order and roundings), scaled once.
__global__ void __launch_bounds__(kThreads) dequantize_sum_kernel(float* out, const uint8_t* packed, size_t n_slices,
                                                                   size_t stride, size_t n, size_t block, size_t i0,
                                                                   QType t, float scale) {
  const size_t scales = quant_scales_offset(n);
  for (size_t i = i0 + static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float acc = 0.0f;
    for (size_t s = 0; s < n_slices; ++s) {
      const uint8_t* slice = packed + s * stride;
      const float v = kernels::dequantize(slice[i], reinterpret_cast<const float*>(slice + scales)[i / block], t);
      acc = s == 0 ? v : acc + v;
    }
    out[i] = acc * scale;
  }
}

// ---- one warp per block of J * 128 values (J = 1, 2, 4, 8)

constexpr int kWarpsPerBlock = kThreads / 32;

__device__ __forceinline__ size_t warp_index() {
  return (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
}
__device__ __forceinline__ size_t warp_count() { return static_cast<size_t>(gridDim.x) * blockDim.x / 32; }

// The warp's largest value of `most` (bits of magnitudes: an order-free max).
__device__ __forceinline__ uint32_t warp_max(uint32_t most) {
  for (int o = 16; o > 0; o /= 2) most = max(most, __shfl_xor_sync(0xffffffffu, most, o));
  return most;
}

// Blocks a warp takes at once, so that each lane has 64 bytes of loads in
// flight before the blocks' shuffles wait for them. (Loading the next
// blocks' vectors before working on these measured slower on an H200:
// docs/gpu.md, "GPU runs".)
template <typename T, int J>
constexpr int kUnroll = 16 / static_cast<int>(sizeof(T)) / J > 0 ? 16 / static_cast<int>(sizeof(T)) / J : 1;

// The 4 codes of v / scale (quantize()'s bits): the quotients as products
// with inv = 1 / scale, each by the division where near_code_boundary() says
// the product might round to another code (rare: quantize_by_reciprocal's
// rule, tested on the CPU; an IEEE division is about ten instructions, and
// these passes are bound by instructions, docs/gpu.md). Then int8's
// quotients clamped to +-127 and rounded to nearest even by one addition of
// 1.5 * 2^23 (the sum's low byte is the code), the 4 bytes gathered by byte
// permutations; fp8 by the GPU's own E4M3 conversion, round to nearest even
// and saturating, where it has one. A zero or NaN scale (its inv infinite or
// NaN, so the division runs) gives zero codes, by a select rather than a
// branch.
template <QType Q>
__device__ __forceinline__ uint32_t encode4(const float (&v)[4], float scale, float inv) {
  float q[4];
  bool near = !(inv <= 0x1.fffffep127f);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    q[e] = __fmul_rn(v[e], inv);
    near |= near_code_boundary(q[e], Q);
  }
  if (near) {
#pragma unroll
    for (int e = 0; e < 4; ++e) q[e] = __fdiv_rn(v[e], scale);
  }
  uint32_t word = 0;
  if constexpr (Q == QType::kInt8) {
    uint32_t c[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) c[e] = __float_as_uint(__fadd_rn(fminf(127.0f, fmaxf(-127.0f, q[e])), 12582912.0f));
    word = __byte_perm(__byte_perm(c[0], c[1], 0x0040u), __byte_perm(c[2], c[3], 0x0040u), 0x5410u);
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(q[0], q[1]), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(q[2], q[3]), __NV_SATFINITE, __NV_E4M3);
    word = lo | (hi << 16);
#else
#pragma unroll
    for (int e = 0; e < 4; ++e) word |= static_cast<uint32_t>(f32_to_e4m3_bits(q[e])) << (8 * e);
#endif
  }
  return scale > 0.0f ? word : 0u;
}

// The 4 codes' exact values times the scale (dequantize()'s bits). int8
// through the 1.5 * 2^23 magic number. E4M3 from sm_89 on by the GPU's own
// conversion, two codes to two fp16 values per instruction (exact: every
// E4M3 value is an fp16 value; 0x7f / 0xff give a NaN, which the product
// with the scale makes the GPU's 0x7fffffff), then to fp32 (exact). Before
// sm_89, in FP32 arithmetic and bit operations: the fp32 whose exponent and
// mantissa fields are the code's (a subnormal fp32 for E4M3's subnormals)
// times 2^120 (exact), each code moved to the top byte by one byte
// permutation; 0x7f / 0xff are NaN.
template <QType Q>
__device__ __forceinline__ void decode4(uint32_t word, float scale, float (&v)[4]) {
  if constexpr (Q == QType::kInt8) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = static_cast<int8_t>(word >> (8 * e));
      v[e] = (__int_as_float(0x4b400000 + c) - 12582912.0f) * scale;
    }
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    const float2 lo = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(
        static_cast<__nv_fp8x2_storage_t>(word & 0xffffu), __NV_E4M3)));
    const float2 hi = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(
        static_cast<__nv_fp8x2_storage_t>(word >> 16), __NV_E4M3)));
    v[0] = lo.x * scale;
    v[1] = lo.y * scale;
    v[2] = hi.x * scale;
    v[3] = hi.y * scale;
#else
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const uint32_t top = __byte_perm(word, 0u, 0x0444u | (static_cast<uint32_t>(e) << 12));  // code e << 24
      v[e] = (__uint_as_float((top & 0x80000000u) | ((top >> 4) & 0x07f00000u)) * 0x1p120f) * scale;
    }
    if (((word & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u) {  // a NaN code (magnitude 0x7f) among them
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (((word >> (8 * e)) & 0x7fu) == 0x7fu) v[e] = __uint_as_float(0x7fffffffu);
      }
    }
#endif
  }
}

// 4 values rounded to the storage type by the GPU's conversions (round to
// nearest even: cast.h's bits, its NaN included, since every NaN the GPU's
// arithmetic makes is 0x7fffffff).
__device__ __forceinline__ void store4_rn(float* p, size_t g, const float (&v)[4]) { store4(p, g, v); }
__device__ __forceinline__ void store4_rn(bf16_t* p, size_t g, const float (&v)[4]) {
  const __nv_bfloat162 a = __floats2bfloat162_rn(v[0], v[1]), b = __floats2bfloat162_rn(v[2], v[3]);
  reinterpret_cast<uint2*>(p)[g] = make_uint2(reinterpret_cast<const uint32_t&>(a), reinterpret_cast<const uint32_t&>(b));
}
__device__ __forceinline__ void store4_rn(fp16_t* p, size_t g, const float (&v)[4]) {
  const __half2 a = __floats2half2_rn(v[0], v[1]), b = __floats2half2_rn(v[2], v[3]);
  reinterpret_cast<uint2*>(p)[g] = make_uint2(reinterpret_cast<const uint32_t&>(a), reinterpret_cast<const uint32_t&>(b));
}

// The U blocks from block k0 of x, each J * 128 values, into packed's codes
// (32-bit words) and scales. Lane l holds the groups of 4 at j * 32 + l of
// each block; its loads and stores are at constant offsets from its own
// pointers (no index arithmetic per access).
template <typename T, int J, QType Q, int U>
__device__ __forceinline__ void quantize_blocks(const T* x, uint32_t* codes, float* scales, size_t k0,
                                                unsigned lane) {
  constexpr unsigned kGroups = J * 32;  // groups of 4 per block
  const T* xl = x + (k0 * kGroups + lane) * 4;
  uint32_t* cl = codes + k0 * kGroups + lane;
  float v[U][J][4];
  uint32_t most[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int j = 0; j < J; ++j) load4(xl, u * kGroups + j * 32, v[u][j]);
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    most[u] = 0;
#pragma unroll
    for (int j = 0; j < J; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) most[u] = max(most[u], f32_bits(v[u][j][e]) & 0x7fffffffu);
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) most[u] = warp_max(most[u]);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const float scale = most[u] < 0x7f800000u ? f32_from_bits(most[u]) / qmax(Q) : f32_from_bits(0x7fc00000u);
    const float inv = __frcp_rn(scale);
    if (lane == 0) scales[k0 + u] = scale;
#pragma unroll
    for (int j = 0; j < J; ++j) cl[u * kGroups + j * 32] = encode4<Q>(v[u][j], scale, inv);
  }
}

// Blocks [0, full) of x, each J * 128 values: kUnroll at a time, then the
// rest one at a time; packed's codes and scales as quantize_kernel writes
// them.
template <typename T, int J, QType Q>
__global__ void __launch_bounds__(kThreads) quantize_warp_kernel(uint8_t* packed, const T* x, size_t n, size_t full) {
  constexpr int U = kUnroll<T, J>;
  const unsigned lane = threadIdx.x % 32;
  auto* codes = reinterpret_cast<uint32_t*>(packed);
  float* scales = reinterpret_cast<float*>(packed + quant_scales_offset(n));
  const size_t whole = full / U * U;
  for (size_t k0 = warp_index() * U; k0 < whole; k0 += warp_count() * U) {
    quantize_blocks<T, J, Q, U>(x, codes, scales, k0, lane);
  }
  for (size_t k = whole + warp_index(); k < full; k += warp_count()) {
    quantize_blocks<T, J, Q, 1>(x, codes, scales, k, lane);
  }
}

// Blocks [0, full) of slice blockIdx.y (and every gridDim.y-th after it).
template <typename T, int J, QType Q>
__global__ void __launch_bounds__(kThreads) dequantize_warp_kernel(T* out, const uint8_t* packed, size_t n_slices,
                                                                    size_t n, size_t full) {
  constexpr size_t kBlock = size_t(J) * 128, kGroups = size_t(J) * 32;
  const size_t stride = quant_packed_bytes(n, kBlock);
  const unsigned lane = threadIdx.x % 32;
  for (size_t s = blockIdx.y; s < n_slices; s += gridDim.y) {
    const uint8_t* slice = packed + s * stride;
    const float* scales = reinterpret_cast<const float*>(slice + quant_scales_offset(n));
    T* o = out + s * n;
    for (size_t k = warp_index(); k < full; k += warp_count()) {
      const float scale = scales[k];
      uint32_t words[J];
#pragma unroll
      for (int j = 0; j < J; ++j) words[j] = reinterpret_cast<const uint32_t*>(slice)[k * kGroups + j * 32 + lane];
#pragma unroll
      for (int j = 0; j < J; ++j) {
        float v[4];
        decode4<Q>(words[j], scale, v);
        store4_rn(o, k * kGroups + j * 32 + lane, v);
      }
    }
  }
}

// Blocks [0, full) of the sum: each lane adds its 4 values over the slices in
// slice order (dequantize_sum_block's order and roundings), scaled once.
template <int J, QType Q>
__global__ void __launch_bounds__(kThreads) dequantize_sum_warp_kernel(float* out, const uint8_t* packed,
                                                                        size_t n_slices, size_t stride, size_t n,
                                                                        size_t full, float scale) {
  constexpr size_t kGroups = size_t(J) * 32;
  const size_t scales = quant_scales_offset(n);
  const unsigned lane = threadIdx.x % 32;
  for (size_t k = warp_index(); k < full; k += warp_count()) {
    float acc[J][4];
#pragma unroll 4
    for (size_t s = 0; s < n_slices; ++s) {
      const uint8_t* slice = packed + s * stride;
      const float sc = reinterpret_cast<const float*>(slice + scales)[k];
#pragma unroll
      for (int j = 0; j < J; ++j) {
        float v[4];
        decode4<Q>(reinterpret_cast<const uint32_t*>(slice)[k * kGroups + j * 32 + lane], sc, v);
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = s == 0 ? v[e] : acc[j][e] + v[e];
      }
    }
#pragma unroll
    for (int j = 0; j < J; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = acc[j][e] * scale;
      store4(out, k * kGroups + j * 32 + lane, acc[j]);
    }
  }
}

// J for a block of J * 128 values (1, 2, 4 or 8), else 0: the plain kernels.
int warp_groups(size_t block) {
  return block % 128 == 0 && (block / 128 == 1 || block / 128 == 2 || block / 128 == 4 || block / 128 == 8)
             ? static_cast<int>(block / 128)
             : 0;
}

// Calls fn(std::integral_constant<int, J>) for J = 1, 2, 4 or 8.
template <typename Fn>
void with_groups(int j, Fn&& fn) {
  switch (j) {
    case 1:
      fn(std::integral_constant<int, 1>{});
      break;
    case 2:
      fn(std::integral_constant<int, 2>{});
      break;
    case 4:
      fn(std::integral_constant<int, 4>{});
      break;
    default:
      fn(std::integral_constant<int, 8>{});
      break;
  }
}

// Calls fn(std::integral_constant<QType, Q>) for t.
template <typename Fn>
void with_qtype(QType t, Fn&& fn) {
  if (t == QType::kInt8) {
    fn(std::integral_constant<QType, QType::kInt8>{});
  } else {
    fn(std::integral_constant<QType, QType::kFp8E4m3>{});
  }
}

unsigned warp_grid(size_t blocks) {
  return static_cast<unsigned>(std::min(kMaxBlocks, (blocks + kWarpsPerBlock - 1) / kWarpsPerBlock));
}
unsigned plain_grid(size_t n) { return static_cast<unsigned>(std::min(kMaxBlocks, (n + kThreads - 1) / kThreads)); }
unsigned slice_grid(size_t n_slices) { return static_cast<unsigned>(std::min<size_t>(n_slices, 65535)); }

}  // namespace

cudaError_t dequantize_sum(float* out, const void* packed, size_t n_slices, size_t slice_stride, size_t n,
                           size_t block, QType t, float scale, cudaStream_t s) {
  if (n == 0 || n_slices == 0) return cudaSuccess;
  if (block == 0 || slice_stride < quant_packed_bytes(n, block)) return cudaErrorInvalidValue;
  if (!aligned(packed, 4) || slice_stride % 4 != 0) return cudaErrorInvalidValue;  // the fp32 scales misaligned
  const auto* q = static_cast<const uint8_t*>(packed);
  const int groups = warp_groups(block);
  size_t done = 0;
  if (groups > 0 && aligned(out, 16) && n >= block) {
    const size_t full = n / block;
    with_groups(groups, [&](auto j) {
      with_qtype(t, [&](auto qt) {
        dequantize_sum_warp_kernel<decltype(j)::value, decltype(qt)::value>
            <<<warp_grid(full), kThreads, 0, s>>>(out, q, n_slices, slice_stride, n, full, scale);
      });
    });
    done = full * block;
  }
  if (done < n) {
    dequantize_sum_kernel<<<plain_grid(n - done), kThreads, 0, s>>>(out, q, n_slices, slice_stride, n, block, done, t,
                                                                   scale);
  }
  return cudaGetLastError();
}

cudaError_t quantize(void* packed, const void* x, fsdp_dtype_t x_dtype, size_t n, size_t block, QType t,
                     cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  if (block == 0) return cudaErrorInvalidValue;
  if (!aligned(packed, 4)) return cudaErrorInvalidValue;  // the fp32 scales misaligned
  auto* q = static_cast<uint8_t*>(packed);
  return with_dtype(x_dtype, const_cast<void*>(x), [&](auto* in) {
    using T = std::remove_pointer_t<decltype(in)>;
    const int groups = warp_groups(block);
    size_t full = 0;
    if (groups > 0 && aligned(in, 4 * sizeof(T))) {
      full = n / block;
      if (full > 0) {
        with_groups(groups, [&](auto j) {
          with_qtype(t, [&](auto qt) {
            constexpr int kJ = decltype(j)::value;
            quantize_warp_kernel<T, kJ, decltype(qt)::value>
                <<<warp_grid((full + kUnroll<T, kJ> - 1) / kUnroll<T, kJ>), kThreads, 0, s>>>(q, in, n, full);
          });
        });
      }
    }
    const size_t blocks = quant_blocks(n, block);
    if (full < blocks) {
      const auto grid = static_cast<unsigned>(std::min(kMaxBlocks, blocks - full));
      quantize_kernel<T><<<grid, kThreads, 0, s>>>(q, in, n, block, full, t);
    }
    return cudaGetLastError();
  });
}

cudaError_t dequantize(void* out, fsdp_dtype_t out_dtype, const void* packed, size_t n_slices, size_t n, size_t block,
                       QType t, cudaStream_t s) {
  if (n_slices == 0 || n == 0) return cudaSuccess;
  if (block == 0) return cudaErrorInvalidValue;
  if (!aligned(packed, 4)) return cudaErrorInvalidValue;  // the fp32 scales misaligned
  const auto* q = static_cast<const uint8_t*>(packed);
  return with_dtype(out_dtype, out, [&](auto* o) {
    using T = std::remove_pointer_t<decltype(o)>;
    const int groups = warp_groups(block);
    size_t done = 0;
    // Every slice's first value aligned too: n * sizeof(T) a multiple of the vector's bytes.
    if (groups > 0 && aligned(o, 4 * sizeof(T)) && (n_slices == 1 || n % 4 == 0) && n >= block) {
      const size_t full = n / block;
      with_groups(groups, [&](auto j) {
        with_qtype(t, [&](auto qt) {
          dequantize_warp_kernel<T, decltype(j)::value, decltype(qt)::value>
              <<<dim3(warp_grid(full), slice_grid(n_slices)), kThreads, 0, s>>>(o, q, n_slices, n, full);
        });
      });
      done = full * block;
    }
    if (done < n) {
      dequantize_kernel<T><<<dim3(plain_grid(n - done), slice_grid(n_slices)), kThreads, 0, s>>>(o, q, n_slices, n,
                                                                                                 block, done, t);
    }
    return cudaGetLastError();
  });
}

}  // namespace fsdp::kernels::cuda
