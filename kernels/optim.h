// kernels/optim.h - per-element optimizer updates (AdamW / Adam / SGD with
// momentum) and the reductions around them (scaled accumulate, sum of squares).
// Each functor updates one element; the CPU device runs it in vectorised loops
// over threads and a CUDA kernel runs it once per thread, so both compute the
// same bits. The math follows torch.optim exactly so that users can compare.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "cast.h"

namespace fsdp::kernels {

// beta^t in double by squaring: Adam's bias corrections, the same bits on
// every device (a GPU's pow may differ from glibc's, and a step decided on
// the device must give the CPU's bits). It differs from std::pow by a few
// ulps of a double, which changed no fp32 step size or 1/sqrt(bc2) for
// beta <= 0.999 over t <= 2e6 (tests/test_kernels.cpp, BiasPow).
FSDP_HD double bias_pow(double beta, long t) {
  double r = 1.0, x = beta;
  for (; t > 0; t >>= 1) {
    if (t & 1) r *= x;
    x *= x;
  }
  return r;
}

// Adam and AdamW on fp32 master values. `grad_scale` folds gradient clipping
// (and later loss-scale unscaling) into the same pass. Weight decay is given as
// two coefficients so that the loop has no branch and vectorises:
// AdamW: param_decay = 1 - lr * wd, grad_decay = 0 (torch.optim.AdamW);
// Adam:  param_decay = 1,           grad_decay = wd (L2, torch.optim.Adam).
struct AdamOp {
  float beta1;
  float beta2;
  float eps;
  float param_decay;
  float grad_decay;
  float step_size;     // lr / (1 - beta1^t)
  float inv_bc2_sqrt;  // 1 / sqrt(1 - beta2^t): a multiply, so one division per element
  float grad_scale;

  FSDP_HD static AdamOp make(float lr, float beta1, float beta2, float eps, float weight_decay, bool decoupled,
                             long step, float grad_scale) {
    double bc1 = 1.0 - bias_pow(static_cast<double>(beta1), step);
    double bc2 = 1.0 - bias_pow(static_cast<double>(beta2), step);
    float step_size = static_cast<float>(static_cast<double>(lr) / bc1);
    float inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
    AdamOp op{beta1, beta2, eps, 1.0f, 0.0f, step_size, inv_bc2_sqrt, grad_scale};
    return op.with_weight_decay(lr, weight_decay, decoupled);
  }

  // This op for a param whose weight decay is `weight_decay`: what a
  // multi-tensor pass computes for each param on the device, in the same
  // float arithmetic as make().
  FSDP_HD AdamOp with_weight_decay(float lr, float weight_decay, bool decoupled) const {
    AdamOp op = *this;
    op.param_decay = decoupled ? 1.0f - lr * weight_decay : 1.0f;
    op.grad_decay = decoupled ? 0.0f : weight_decay;
    return op;
  }

  FSDP_HD void operator()(float& p, float g, float& m, float& v) const {
    g = g * grad_scale + grad_decay * p;
    p *= param_decay;
    m = beta1 * m + (1.0f - beta1) * g;
    v = beta2 * v + (1.0f - beta2) * g * g;
    float denom = std::sqrt(v) * inv_bc2_sqrt + eps;
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

// One param's range of a unit's flat shard, as the multi-tensor optimizer
// passes take a model: every range's arrays and its weight decay.
struct OptimSpan {
  float* params;
  float* grads;
  float* state1;  // Adam's exp_avg, SGD's momentum buffer (null: SGD without momentum)
  float* state2;  // Adam's exp_avg_sq (null for SGD)
  void* out;      // the next step's param_dtype copy (null: none)
  size_t numel;
  float weight_decay;
  uint32_t group;  // its param group in the pass's table (kernels/step.h StepGroup)
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
