// kernels/cuda/quant.cu - the quantized all-gather's and reduction's kernels over
// the functions of kernels/quant.h: the CPU's bits (tests/test_cuda.cpp).
#include <algorithm>
#include <type_traits>

#include "../cast.h"
#include "../quant.h"
#include "dispatch.cuh"
#include "launch.h"

namespace fsdp::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr size_t kMaxBlocks = 65535;  // grid-stride beyond

// One thread block per quantization block: the block's absmax (a max, exact
// in any order) and whether it is finite, then each thread its values.
template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_kernel(uint8_t* packed, const T* x, size_t n, size_t block,
                                                             QType t) {
  __shared__ float amax_s[kThreads];
  __shared__ int finite_s[kThreads];
  const size_t blocks = quant_blocks(n, block);
  for (size_t k = blockIdx.x; k < blocks; k += gridDim.x) {
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
    for (size_t i = b + threadIdx.x; i < e; i += blockDim.x) packed[i] = kernels::quantize(load(x, i), scale, t);
    __syncthreads();  // the shared arrays are reused by the next block of the loop
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(T* out, const uint8_t* packed, size_t n_slices, size_t n,
                                                               size_t block, QType t) {
  const size_t stride = quant_packed_bytes(n, block), total = n_slices * n;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t s = i / n, j = i % n;
    const uint8_t* slice = packed + s * stride;
    const float scale = reinterpret_cast<const float*>(slice + quant_scales_offset(n))[j / block];
    store(out, i, kernels::dequantize(slice[j], scale, t));
  }
}

// One thread per value: the slices' dequantized values added in slice order
// (dequantize_sum_block's order and roundings), scaled once.
__global__ void __launch_bounds__(kThreads) dequantize_sum_kernel(float* out, const uint8_t* packed, size_t n_slices,
                                                                   size_t stride, size_t n, size_t block, QType t,
                                                                   float scale) {
  const size_t scales = quant_scales_offset(n);
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
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

}  // namespace

cudaError_t dequantize_sum(float* out, const void* packed, size_t n_slices, size_t slice_stride, size_t n,
                           size_t block, QType t, float scale, cudaStream_t s) {
  if (n == 0 || n_slices == 0) return cudaSuccess;
  if (block == 0 || slice_stride < quant_packed_bytes(n, block)) return cudaErrorInvalidValue;
  const auto grid = static_cast<unsigned>(std::min(kMaxBlocks, (n + kThreads - 1) / kThreads));
  dequantize_sum_kernel<<<grid, kThreads, 0, s>>>(out, static_cast<const uint8_t*>(packed), n_slices, slice_stride, n,
                                                  block, t, scale);
  return cudaGetLastError();
}

cudaError_t quantize(void* packed, const void* x, fsdp_dtype_t x_dtype, size_t n, size_t block, QType t,
                     cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  if (block == 0) return cudaErrorInvalidValue;
  const auto grid = static_cast<unsigned>(std::min(kMaxBlocks, quant_blocks(n, block)));
  return with_dtype(x_dtype, const_cast<void*>(x), [&](auto* in) {
    using T = std::remove_pointer_t<decltype(in)>;
    quantize_kernel<T><<<grid, kThreads, 0, s>>>(static_cast<uint8_t*>(packed), in, n, block, t);
    return cudaGetLastError();
  });
}

cudaError_t dequantize(void* out, fsdp_dtype_t out_dtype, const void* packed, size_t n_slices, size_t n, size_t block,
                       QType t, cudaStream_t s) {
  const size_t total = n_slices * n;
  if (total == 0) return cudaSuccess;
  if (block == 0) return cudaErrorInvalidValue;
  const auto grid = static_cast<unsigned>(std::min(kMaxBlocks, (total + kThreads - 1) / kThreads));
  return with_dtype(out_dtype, out, [&](auto* o) {
    using T = std::remove_pointer_t<decltype(o)>;
    dequantize_kernel<T><<<grid, kThreads, 0, s>>>(o, static_cast<const uint8_t*>(packed), n_slices, n, block, t);
    return cudaGetLastError();
  });
}

}  // namespace fsdp::kernels::cuda
