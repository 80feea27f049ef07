// kernels/step.h - the scalars of one optimizer step as they live in the
// state device's memory (StepState), and the rules that compute them there:
// the grad norm from the units' sums of squares, the inf/NaN verdict, the
// loss scale's update, the clip coefficient, the step count, and each param
// group's optimizer op with its bias correction. One functor serves the CPU
// device (run in a stream task) and a CUDA kernel of one thread, so that a
// step decides on the device with the CPU's bits and no host reads anything
// between the backward passes and the update (a step a CUDA graph can
// capture: docs/architecture.md, "Step").
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "optim.h"

namespace fsdp::kernels {

// What one step decided, in the state device's memory. Written only by the
// step's work in stream order (and by loads, between steps); the host reads
// a copy (Optimizer's mirror) once the step's event has completed.
struct StepState {
  double sq_rank;     // the grads' sum of squares over this rank's units
  double sq;          // the same over the shard group (sq_rank alone)
  double norm;        // sqrt(sq) / the loss scale the grads carried: fsdp_last_grad_norm
  double loss_scale;  // what the host multiplies its next loss by
  double lr;          // fsdp_set_lr's, as the next update uses it
  int64_t t;          // updates applied: Adam's step count
  int64_t skipped;    // steps skipped for inf/nan grads
  int64_t clean;      // clean steps since the dynamic scale last changed
  float grad_scale;   // the update's factor for the grads: 1 / scale, times the clip coefficient
  int32_t skip;       // the last step was skipped: the update only clears the grads
  double clip;        // fsdp_clip_grad_norm's coefficient for the coming update alone (0: none)
};

// The context's options a step decides by (fixed for its life).
struct StepRule {
  double max_grad_norm;  // 0: no clipping
  double growth;         // dynamic loss scale: factor after growth_interval clean steps
  double backoff;        // and after a step with inf/nan grads
  int64_t growth_interval;
  int32_t dynamic;  // the loss scale moves
  int32_t count;    // an update that is not skipped counts (optimizer=host counts at fsdp_step_end)
  // The optimizer's fixed hyperparameters.
  float eps;
  float momentum;
  int32_t decoupled;  // AdamW (else Adam's L2)
  int32_t nesterov;
};

// A param group's constants (fsdp_set_param_group, and the step its state
// started at): one per group of a span table, fixed between steps.
struct StepGroup {
  int64_t fresh_at;  // the step count when the state was zero: its updates are t - fresh_at
  float lr_scale;
  float beta1;
  float beta2;
  float pad_ = 0.0f;
};

// Whether a double is an infinity or a NaN, as bits (no fast-math folding).
FSDP_HD bool non_finite_f64(double x) {
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return (u & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
}

// sq = the units' sums added in unit order (a frozen unit's is 0: adding it
// changes no bit), as the host added them before the step moved here.
FSDP_HD void step_sum_units(StepState& s, const double* unit_sq, size_t n_units) {
  double sq = 0.0;
  for (size_t k = 0; k < n_units; ++k) sq += unit_sq[k];
  s.sq_rank = sq;
  s.sq = sq;
}

// The verdict, after sq is the shard group's: the norm, the loss scaler's
// update (torch.cuda.amp.GradScaler's rules), and for a step that runs the
// grads' factor (1 / the scale they carried, times clip_grad_norm_'s
// coefficient) and the count.
FSDP_HD void step_decide(StepState& s, const StepRule& r) {
  const double scale = s.loss_scale;
  const double clip = s.clip;  // this update's alone, skipped or not
  s.clip = 0.0;
  s.norm = std::sqrt(s.sq) / scale;
  if (non_finite_f64(s.sq)) {
    s.skip = 1;
    ++s.skipped;
    s.clean = 0;
    if (r.dynamic) s.loss_scale = scale * r.backoff;
    return;
  }
  if (r.dynamic && ++s.clean >= r.growth_interval) {
    s.loss_scale = scale * r.growth;
    s.clean = 0;
  }
  double factor = 1.0 / scale;
  if (r.max_grad_norm > 0.0) {
    double coef = r.max_grad_norm / (s.norm + 1e-6);  // torch.nn.utils.clip_grad_norm_
    if (coef < 1.0) factor = coef / scale;
  }
  if (clip > 0.0) factor *= clip;  // fsdp_clip_grad_norm's, on top
  s.grad_scale = static_cast<float>(factor);
  s.skip = 0;
  if (r.count) ++s.t;
}

// A group's lr: fsdp_set_lr's, scaled (in double, then rounded once).
FSDP_HD float group_lr(const StepState& s, const StepGroup& g) {
  return g.lr_scale == 1.0f ? static_cast<float>(s.lr) : static_cast<float>(s.lr * g.lr_scale);
}

// The update op of a group for this step (weight decay 0: each span adds its own).
FSDP_HD AdamOp step_adam_op(const StepState& s, const StepGroup& g, const StepRule& r) {
  return AdamOp::make(group_lr(s, g), g.beta1, g.beta2, r.eps, 0.0f, r.decoupled != 0, s.t - g.fresh_at,
                             s.grad_scale);
}
FSDP_HD SgdOp step_sgd_op(const StepState& s, const StepGroup& g, const StepRule& r) {
  return SgdOp{group_lr(s, g), 0.0f, r.momentum, s.grad_scale, r.nesterov != 0, s.t - g.fresh_at == 1};
}

}  // namespace fsdp::kernels
