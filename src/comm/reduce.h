// src/comm/reduce.h - the reductions of the CPU communicators: the element-wise
// sums of base/reduce.h, and the small double reductions every rank combines
// in the same order.
#pragma once

#include <cstddef>

#include "../base/reduce.h"
#include "communicator.h"

namespace fsdp::comm {

// The host's element-wise sums (base/reduce.h), as every CPU communicator runs them.
using base::reduce_sum;
using base::reduce_sum_clear;

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
