// src/base/reduce.h - the element-wise sum of a reduction over ranks on the
// host: what the CPU communicators run (local: over peers' buffers; mpi: a
// ring step's received partial plus this rank's own part) and the CPU
// device's reduce_sum. The bits of kernels/reduce.h (fp32 accumulation in
// rank order, one rounding), in block passes that vectorise, so results do
// not depend on thread timing or on the device.
#pragma once

#include <cstddef>

#include "dtype.h"

namespace fsdp::base {

// out[i] = scale * sum over k in order of ins[k][i], accumulated in fp32 and
// rounded once to `dtype`. `out` must not overlap any input.
void reduce_sum(void* out, const void* const* ins, size_t n_ins, size_t numel, DType dtype, float scale);
// The same, and every input element is set to zero right after it is read
// (while its block is in L1): a reduce-scatter of grads leaves the grad buffer
// ready for the next backward with no pass of its own.
void reduce_sum_clear(void* out, void* const* ins, size_t n_ins, size_t numel, DType dtype, float scale);

}  // namespace fsdp::base
