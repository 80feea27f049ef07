// kernels/norm.h - the one order in which libfsdp sums the squares of fp32
// grads (the grad norm of clipping, the finiteness check), so that the CPU
// loops and the CUDA kernels compute the same bits for every step of it.
//
// The grads are cut into steps of kSqStep elements. A step is summed in fp32
// in kSqLanes interleaved lanes (lane l takes elements l, l + 16, l + 32, ...
// in that order), and the lanes are then added pairwise: lane[l] +=
// lane[l + w] for w = 8, 4, 2, 1. Each square is a multiply and then an add,
// never a fused multiply-add (the CPU loops are built without contraction, the
// CUDA kernels with --fmad=false). The steps' sums are then added in double:
// that last sum is the only part whose order differs between devices (the
// CPU adds them in index order per thread chunk, a CUDA kernel in a fixed
// tree), so a device is reproducible bit for bit, and two devices agree to
// the rounding of a double sum.
#pragma once

#include <cstddef>

#include "cast.h"

namespace fsdp::kernels {

constexpr size_t kSqLanes = 16;
constexpr size_t kSqStep = 256;
static_assert(kSqStep % kSqLanes == 0, "a step is whole rows of lanes");

FSDP_HD float add_square(float acc, float x) {
  float sq = x * x;
  return acc + sq;
}

// One lane of the step [b, e): the squares of x[b + lane], x[b + lane + 16],
// ... summed in index order.
FSDP_HD float lane_sum_squares(const float* x, size_t b, size_t e, size_t lane) {
  float acc = 0.0f;
  for (size_t i = b + lane; i < e; i += kSqLanes) acc = add_square(acc, x[i]);
  return acc;
}

// The lanes of one step added pairwise; `lane` is overwritten.
FSDP_HD float fold_lanes(float* lane) {
  for (size_t w = kSqLanes / 2; w > 0; w /= 2) {
    for (size_t l = 0; l < w; ++l) lane[l] += lane[l + w];
  }
  return lane[0];
}

// The reference for one step (scalar; the CPU loops vectorise the same order,
// and tests compare them with this).
FSDP_HD float step_sum_squares(const float* x, size_t b, size_t e) {
  float lane[kSqLanes];
  for (size_t l = 0; l < kSqLanes; ++l) lane[l] = lane_sum_squares(x, b, e, l);
  return fold_lanes(lane);
}

// Whether x is an infinity or a NaN (an exponent of all ones), as bits, so
// that fast-math flags cannot fold it away.
FSDP_HD bool non_finite(float x) { return (f32_bits(x) & 0x7f800000u) == 0x7f800000u; }

}  // namespace fsdp::kernels
