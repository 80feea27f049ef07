// src/device/cpu/quant_avx512.h - AVX-512 loops for the quantized gather's
// and the quantized reduction's passes (kernels/quant.h), which the CPU
// device runs where the CPU has AVX-512 (F, BW, VL, DQ) and that give the
// functors' bits. GCC's vectoriser leaves these passes at 0.3-0.6 of the
// copy bandwidth (a division per value, an absmax pass before the codes, the
// fp8 encode and decode mostly scalar); see docs/benchmarks.md for the
// figures before and after.
//
// What makes them fast while keeping the bits:
// - The codes come from x * (1 / scale) instead of x / scale. The product is
//   within 1.5 ulp of the true quotient, the quotient's rounding within 0.5
//   ulp; for |x / scale| <= qmax (which the absmax guarantees) the two fp32
//   values are less than 2^-15 apart in units of the code's step (int8: 1;
//   fp8: the E4M3 quantum), so they round to the same code unless the product
//   lies within 2^-14 of a half-step. Those 16 values (about 1 vector in 500
//   for model weights) are coded again from the quotient itself; a block
//   whose scale is not a normal fp32 number (0, NaN, subnormal: 1 / scale
//   could overflow) is coded by the functor. fp8 rounds in the integer bits
//   of the product (half up, which differs from ties-to-even only at the
//   flagged half-steps). tests/test_quant.cpp feeds values on and next to
//   every tie.
// - Codes are packed 64 at a time (two word packs, a byte pack and one
//   permutation, where vpmovdb takes two shuffles per 16), bf16 outputs
//   without AVX512-BF16 32 at a time the same way; both the shuffle port's
//   limit on this kind of loop.
// - fp8 codes below 2^-6 (zeros among them) round as m + 2^-6 in the next
//   binade's integer bits, without a branch (e4m3_codes).
// - A block's values are read twice (absmax, then codes): each 16 values of
//   the codes' pass prefetch the line 4 KiB ahead, so that memory keeps
//   streaming while the core computes (0.65 -> 0.9 of copy on one thread).
// - fp8 decodes by moving the code's bits into fp32's (normal codes), the
//   rest only where a vector has one; bf16 outputs round with AVX512-BF16's
//   instruction where the CPU has it and the block's products are normal
//   fp32 numbers (the instruction reads subnormals as zero); the reduction's
//   sums keep 128 values in registers while each rank's codes stream in.
//
// Each call covers the quantization blocks [kb, ke) of kernels/quant.h's
// layout; blocks that are not whole or whose size is not a multiple of 16
// go through the functors.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../../../kernels/common.h"
#include "../../../kernels/quant.h"
#include "../../base/dtype.h"

namespace fsdp::device::avx512 {

// True when this CPU runs the loops below (checked once). FSDP_CPU_SIMD=generic
// in the environment turns them off (the functors' loops run instead).
bool quant_available();

// Returns false (having done nothing) for an input or output type it does not
// take (then the caller runs the generic loop): inputs fp32, bf16, fp16.
// stream: the codes of blocks of a multiple of 64 values are stored
// non-temporally (where out is 64-byte aligned), as for dequantize below.
bool quantize(const void* x, DType x_dtype, size_t n, size_t block, kernels::QType t, uint8_t* out, size_t kb,
              size_t ke, bool stream);

// Dequantizes the blocks [kb, ke) of n_slices packed slices laid one after
// another (j / blocks is the slice) into out (fp32, bf16 or fp16). stream:
// non-temporal stores (where the output is aligned), for an output larger
// than the writing cores' caches (stream_store_bytes() each), which then
// does not first read every line it overwrites (int8 -> bf16 on one thread
// here: 0.78 -> 1.2 of copy; the copy measured against, glibc's memcpy, does
// the same at these sizes).
bool dequantize(const uint8_t* packed, size_t n, size_t block, kernels::QType t, void* out, DType out_dtype, size_t kb,
                size_t ke, bool stream);

// kernels::dequantize_sum_block over the blocks [kb, ke); stream as above.
void dequantize_sum(const uint8_t* packed, size_t n_slices, size_t slice_stride, size_t n, size_t block,
                    kernels::QType t, float scale, float* out, size_t kb, size_t ke, bool stream);

// A core's private cache (L2) in bytes, or 2 MiB where the system does not say.
size_t stream_store_bytes();

}  // namespace fsdp::device::avx512
