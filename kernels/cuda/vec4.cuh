// kernels/cuda/vec4.cuh - 4 consecutive elements of a storage type, loaded
// and stored as one 16-byte (fp32) or 8-byte (16-bit) access and converted
// with the functions of cast.h (inside the .cu files only: elementwise.cu,
// quant.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../cast.h"

namespace fsdp::kernels::cuda {

__device__ __forceinline__ void load4(const float* p, size_t j, float (&x)[4]) {
  float4 r = reinterpret_cast<const float4*>(p)[j];
  x[0] = r.x;
  x[1] = r.y;
  x[2] = r.z;
  x[3] = r.w;
}
__device__ __forceinline__ void store4(float* p, size_t j, const float (&x)[4]) {
  reinterpret_cast<float4*>(p)[j] = make_float4(x[0], x[1], x[2], x[3]);
}
template <typename Half>
__device__ __forceinline__ float half_to_f32(uint16_t h);
template <>
__device__ __forceinline__ float half_to_f32<bf16_t>(uint16_t h) {
  return bf16_bits_to_f32(h);
}
template <>
__device__ __forceinline__ float half_to_f32<fp16_t>(uint16_t h) {
  return fp16_bits_to_f32(h);
}
template <typename Half>
__device__ __forceinline__ uint32_t f32_to_half(float f);
template <>
__device__ __forceinline__ uint32_t f32_to_half<bf16_t>(float f) {
  return f32_to_bf16_bits(f);
}
template <>
__device__ __forceinline__ uint32_t f32_to_half<fp16_t>(float f) {
  return f32_to_fp16_bits(f);
}
template <typename Half>
__device__ __forceinline__ void load4(const Half* p, size_t j, float (&x)[4]) {
  uint2 r = reinterpret_cast<const uint2*>(p)[j];  // little endian: element 0 in the low half
  x[0] = half_to_f32<Half>(static_cast<uint16_t>(r.x & 0xffffu));
  x[1] = half_to_f32<Half>(static_cast<uint16_t>(r.x >> 16));
  x[2] = half_to_f32<Half>(static_cast<uint16_t>(r.y & 0xffffu));
  x[3] = half_to_f32<Half>(static_cast<uint16_t>(r.y >> 16));
}
template <typename Half>
__device__ __forceinline__ void store4(Half* p, size_t j, const float (&x)[4]) {
  uint2 r;
  r.x = f32_to_half<Half>(x[0]) | (f32_to_half<Half>(x[1]) << 16);
  r.y = f32_to_half<Half>(x[2]) | (f32_to_half<Half>(x[3]) << 16);
  reinterpret_cast<uint2*>(p)[j] = r;
}
template <typename T>
__device__ __forceinline__ void zero4(T* p, size_t j) {
  const float z[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  store4(p, j, z);
}

__host__ __device__ __forceinline__ bool aligned(const void* p, size_t bytes) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

}  // namespace fsdp::kernels::cuda
