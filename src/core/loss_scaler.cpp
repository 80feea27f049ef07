// src/core/loss_scaler.cpp - see loss_scaler.h.
#include "loss_scaler.h"

namespace fsdp::core {

LossScaler::LossScaler(const Options& o)
    : dynamic_(o.loss_scale_mode == LossScaleMode::kDynamic ||
               (o.loss_scale_mode == LossScaleMode::kAuto && o.param_dtype == DType::kFp16)),
      initial_(o.loss_scale_mode == LossScaleMode::kStatic ? o.loss_scale_static
               : dynamic_                                  ? o.loss_scale_init
                                                           : 1.0),
      growth_(o.loss_scale_growth),
      backoff_(o.loss_scale_backoff),
      growth_interval_(o.loss_scale_growth_interval),
      scale_(initial_) {}

void LossScaler::fill(kernels::StepRule& rule) const {
  rule.dynamic = dynamic_ ? 1 : 0;
  rule.growth = growth_;
  rule.backoff = backoff_;
  rule.growth_interval = growth_interval_;
}

void LossScaler::set(double scale, long clean_steps, uint64_t skipped_steps) {
  scale_ = scale;
  clean_steps_ = clean_steps;
  skipped_ = skipped_steps;
}

}  // namespace fsdp::core
