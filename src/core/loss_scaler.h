// src/core/loss_scaler.h - LossScaler: the scale the host multiplies its loss
// by (dynamic for fp16 by default, or static, or off), and the rules a step
// applies with it: unscale the grads, skip the step on inf/nan found on any
// rank, back off after an overflow, grow after growth_interval clean steps
// (torch.cuda.amp.GradScaler's rules). The rules run on the device with the
// step (kernels::step_decide); this holds the options and the values the
// host last read back.
#pragma once

#include <cstdint>

#include "../../kernels/step.h"
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
  // The scale a context starts with.
  double initial_scale() const { return initial_; }
  // The rule's loss-scale fields, for the step on the device.
  void fill(kernels::StepRule& rule) const;
  // The values as the device holds them.
  void set(double scale, long clean_steps, uint64_t skipped_steps);

 private:
  bool dynamic_;
  double initial_;
  double growth_;
  double backoff_;
  long growth_interval_;
  double scale_;
  long clean_steps_ = 0;
  uint64_t skipped_ = 0;
};

}  // namespace fsdp::core
