// kernels/optim.h - per-element optimizer updates (AdamW / Adam / SGD with
// momentum) and the reductions around them (scaled accumulate, sum of squares).
// Each functor updates one element; the CPU device runs it in vectorised loops
// over threads and a CUDA kernel runs it once per thread, so both compute the
// same bits. The math follows torch.optim exactly so that users can compare.
#pragma once

#include <cmath>
#include <cstddef>

#include "cast.h"

namespace fsdp::kernels {

// Adam and AdamW on fp32 master values. `grad_scale` folds gradient clipping
// (and later loss-scale unscaling) into the same pass.
struct AdamOp {
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay;
  float step_size;     // lr / (1 - beta1^t)
  float bc2_sqrt;      // sqrt(1 - beta2^t)
  float grad_scale;
  bool decoupled;      // AdamW: decay the weight, not the gradient

  FSDP_HD void operator()(float& p, float g, float& m, float& v) const {
    g *= grad_scale;
    if (decoupled) {
      p *= 1.0f - lr * weight_decay;
    } else {
      g += weight_decay * p;
    }
    m = beta1 * m + (1.0f - beta1) * g;
    v = beta2 * v + (1.0f - beta2) * g * g;
    float denom = std::sqrt(v) / bc2_sqrt + eps;
    p -= step_size * (m / denom);
  }
};

// SGD with optional (Nesterov) momentum, L2 weight decay added to the gradient.
struct SgdOp {
  float lr;
  float weight_decay;
  float momentum;
  float grad_scale;
  bool nesterov;
  bool first_step;  // torch initialises the momentum buffer to the first grad

  FSDP_HD void operator()(float& p, float g, float& buf) const {
    g = g * grad_scale + weight_decay * p;
    buf = first_step ? g : momentum * buf + g;
    float d = nesterov ? g + momentum * buf : buf;
    p -= lr * d;
  }
  FSDP_HD void operator()(float& p, float g) const {  // momentum == 0: no state
    g = g * grad_scale + weight_decay * p;
    p -= lr * g;
  }
};

// acc[i] += scale * src[i], src in any storage dtype (grad shard accumulation).
struct AccumulateOp {
  float scale;
  template <typename T>
  FSDP_HD void operator()(float* acc, const T* src, size_t i) const {
    acc[i] += scale * load(src, i);
  }
};

}  // namespace fsdp::kernels
