// src/comm/reduce.h - the element-wise sum that reductions of every CPU
// communicator run (local: over peers' buffers; mpi: a ring step's received
// partial plus this rank's own part). One fixed order, fp32 accumulation and
// one rounding per call, so results do not depend on thread timing.
#pragma once

#include <cstddef>

#include "../core/dtype.h"

namespace fsdp::comm {

// out[i] = scale * sum over k in order of ins[k][i], accumulated in fp32 and
// rounded once to `dtype`. `out` must not overlap any input.
void reduce_sum(void* out, const void* const* ins, size_t n_ins, size_t numel, DType dtype, float scale);

}  // namespace fsdp::comm
