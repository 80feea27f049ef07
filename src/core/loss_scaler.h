// src/core/loss_scaler.h - LossScaler: the scale the host multiplies its loss
// by (dynamic for fp16 by default, or static, or off), and what a step does
// with it: unscale the grads, skip the step on inf/nan found on any rank, back
// off after an overflow, grow after growth_interval clean steps
// (torch.cuda.amp.GradScaler's rules).
#pragma once

#include <cstdint>

#include "config.h"

namespace fsdp::core {

class LossScaler {
 public:
  explicit LossScaler(const Options& o);
  double scale() const { return scale_; }
  uint64_t skipped_steps() const { return skipped_; }
  // Whether the scale moves (loss_scale dynamic, or auto with fp16): then a
  // skipped step is how it finds its level, not a fault.
  bool dynamic() const { return dynamic_; }
  long clean_steps() const { return clean_steps_; }
  // From a checkpoint. A static or disabled scale stays what the options say.
  void restore(double scale, long clean_steps, uint64_t skipped_steps);
  // Called once per step with whether the global grads were all finite.
  void update(bool finite);

 private:
  bool dynamic_;
  double scale_;
  double growth_;
  double backoff_;
  long growth_interval_;
  long clean_steps_ = 0;
  uint64_t skipped_ = 0;
};

}  // namespace fsdp::core
