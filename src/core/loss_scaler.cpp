// src/core/loss_scaler.cpp - see loss_scaler.h.
#include "loss_scaler.h"

namespace fsdp::core {

LossScaler::LossScaler(const Options& o)
    : dynamic_(o.loss_scale_mode == LossScaleMode::kDynamic ||
               (o.loss_scale_mode == LossScaleMode::kAuto && o.param_dtype == DType::kFp16)),
      scale_(o.loss_scale_mode == LossScaleMode::kStatic ? o.loss_scale_static
             : dynamic_                                  ? o.loss_scale_init
                                                         : 1.0),
      growth_(o.loss_scale_growth),
      backoff_(o.loss_scale_backoff),
      growth_interval_(o.loss_scale_growth_interval) {}

void LossScaler::restore(double scale, long clean_steps, uint64_t skipped_steps) {
  if (dynamic_) {
    scale_ = scale;
    clean_steps_ = clean_steps;
  }
  skipped_ = skipped_steps;
}

void LossScaler::update(bool finite) {
  if (!finite) {
    ++skipped_;
    clean_steps_ = 0;
    if (dynamic_) scale_ *= backoff_;
    return;
  }
  if (dynamic_ && ++clean_steps_ >= growth_interval_) {
    scale_ *= growth_;
    clean_steps_ = 0;
  }
}

}  // namespace fsdp::core
