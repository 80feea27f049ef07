// src/comm/reduce.h - the element-wise sum that reductions of every CPU
// communicator run (local: over peers' buffers; mpi: a ring step's received
// partial plus this rank's own part). One fixed order, fp32 accumulation and
// one rounding per call, so results do not depend on thread timing.
#pragma once

#include <cstddef>

#include "../base/dtype.h"
#include "communicator.h"

namespace fsdp::comm {

// out[i] = scale * sum over k in order of ins[k][i], accumulated in fp32 and
// rounded once to `dtype`. `out` must not overlap any input.
void reduce_sum(void* out, const void* const* ins, size_t n_ins, size_t numel, DType dtype, float scale);
// The same, and every input element is set to zero right after it is read
// (while its block is in L1): a reduce-scatter of grads leaves the grad buffer
// ready for the next backward with no pass of its own.
void reduce_sum_clear(void* out, void* const* ins, size_t n_ins, size_t numel, DType dtype, float scale);

// out[i] = op over ranks r in order of rank_values(r)[i], for the small double
// reductions (norms, flags, host metrics): every rank combines the same
// values in the same order, so all get the same bits.
template <typename RankValues>
void reduce_f64(double* out, size_t n, int world, RedOp op, RankValues rank_values) {
  for (size_t i = 0; i < n; ++i) {
    double acc = rank_values(0)[i];
    for (int r = 1; r < world; ++r) {
      double x = rank_values(r)[i];
      acc = op == RedOp::kMax ? (x > acc ? x : acc) : op == RedOp::kMin ? (x < acc ? x : acc) : acc + x;
    }
    out[i] = op == RedOp::kAvg ? acc / world : acc;
  }
}

}  // namespace fsdp::comm
