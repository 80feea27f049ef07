// src/core/optimizer.h - Optimizer: AdamW / Adam / SGD on the flat fp32 shards
// of every unit, with per-param weight decay inside a shard (from the layout's
// segments), global grad-norm clipping across ranks, and the fused write of the
// next step's param_dtype shard.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "../base/function_ref.h"

#include "loss_scaler.h"
#include "memory.h"
#include "runtime.h"
#include "unit.h"

namespace fsdp::core {

class Optimizer {
 public:
  explicit Optimizer(Runtime& rt) : rt_(rt), scaler_(rt.opts) {}

  // Allocates the unit's state (moments or momentum) next to its shard.
  void add_unit(const Unit& unit);
  // Unit `k` was frozen (its state goes) or unfrozen (fresh state, zeros,
  // whose Adam bias correction counts from the next step, as PyTorch's
  // per-param step count does for a param that gets its first grad).
  void set_trainable(const Unit& unit, bool trainable);
  // The unit was laid out again (params frozen or unfrozen in it): its state
  // moves from the `old` layout, whose full trainable block of each state
  // is `old_states[i]` (host memory, Unit::gather_to_host). A param that
  // stays trainable keeps its state and age; one unfrozen now starts fresh
  // (zeros, its own bias correction from the next step).
  void relayout(const Unit& unit, const FlatLayout& old, const std::vector<std::vector<float>>& old_states);
  // One update of every unit from its sharded grads (unscaled by the loss
  // scale); zeroes the grads. Collective (the global norm). A step whose grads
  // hold inf/nan on any rank changes no param and no optimizer state.
  void step(const std::vector<std::unique_ptr<Unit>>& units);
  // optimizer=host, fsdp_step_begin: the norm, the loss scaler's verdict and
  // clipping as step() does them; returns false for a skipped step (inf/nan:
  // the grads are zeroed, the host updates nothing), else true with
  // *grad_scale the factor the host applies to the grads (1 / loss scale,
  // times the clip coefficient).
  bool host_begin(const std::vector<std::unique_ptr<Unit>>& units, float* grad_scale);
  // fsdp_step_end: the param_dtype copies follow the masters, the grads are
  // zeroed, and an update that ran counts as a step.
  void host_end(const std::vector<std::unique_ptr<Unit>>& units, bool updated);
  const LossScaler& loss_scaler() const { return scaler_; }
  double last_grad_norm() const { return last_grad_norm_; }
  // Updates applied (Adam's bias-correction step), and fsdp_step calls that
  // ran, skipped ones included (also across a checkpoint load).
  long step_count() const { return step_; }
  uint64_t steps_run() const { return static_cast<uint64_t>(step_) + scaler_.skipped_steps(); }
  void set_lr(double lr) { rt_.opts.lr = lr; }

  // Checkpoints: the per-element state tensors by name ({"exp_avg",
  // "exp_avg_sq"}, {"momentum"} or none), unit `unit`'s i-th of them, and
  // the restore of everything a checkpoint holds (`states[unit][i]`).
  std::vector<std::string> state_names() const;
  const Buffer& state(size_t unit, size_t i) const;
  // A checkpoint is read into the state in place (state_for_load), then the
  // counters it holds are restored.
  float* state_for_load(size_t unit, size_t i) { return const_cast<Buffer&>(state(unit, i)).as<float>(); }
  // The state of every trainable unit counts as fresh at step 0 (a load
  // that holds older state says so with set_ages).
  void restore(long step, double last_grad_norm);
  // The step at which the unit's state was fresh (its updates: step_count()
  // minus it), and each param's where one was unfrozen on its own.
  long fresh_at(size_t unit) const { return states_.at(unit).fresh_at; }
  long param_fresh_at(size_t unit, size_t param) const {
    const State& s = states_.at(unit);
    return param < s.param_fresh_at.size() ? s.param_fresh_at[param] : s.fresh_at;
  }
  // Each param's age, `ages[i]` (frozen params' entries are not used): one
  // for the whole unit where its trainable params share it.
  void set_ages(const Unit& unit, std::vector<long> ages);
  LossScaler& loss_scaler() { return scaler_; }

 private:
  // fsdp_step found inf/nan grads: says so on rank 0 (a warning unless the
  // loss scale is dynamic, where skipped steps are routine).
  void report_skipped() const;
  // One buffer per state_names() entry: Adam's exp_avg and exp_avg_sq,
  // SGD's momentum, or the host's (optimizer=host); none while frozen.
  struct State {
    std::vector<Buffer> bufs;
    long fresh_at = 0;  // step_ when this state was zero (its updates: step_ - fresh_at)
    // Per param where one differs (unfrozen inside the unit on its own);
    // empty: every param's is fresh_at.
    std::vector<long> param_fresh_at;
  };
  State make_state(size_t numel) const;
  double grad_sum_squares(const std::vector<std::unique_ptr<Unit>>& units);
  // The norm, the scaler and clipping: false for a skipped step (grads
  // zeroed), else true with the factor for the grads.
  bool prepare(const std::vector<std::unique_ptr<Unit>>& units, float* grad_scale);
  // The update of every unit's shard (grads scaled by `grad_scale`), which
  // also writes the param_dtype copy and clears the grads.
  void update(const std::vector<std::unique_ptr<Unit>>& units, float grad_scale);
  // Every param range of every trainable unit's shard, with its state and
  // weight decay, into groups_ (kept: a step allocates nothing once warm).
  void collect_spans(const std::vector<std::unique_ptr<Unit>>& units);
  // Runs `launches` (state device operations) so that they are done on
  // return, with one host wait where the state device is a GPU.
  void on_state_device(const device::Label& what, base::FunctionRef<void()> launches);

  Runtime& rt_;
  LossScaler scaler_;
  std::vector<State> states_;
  // The spans of the trainable units, in groups of one update each (units
  // whose state is as old: one Adam bias correction), and each group's table
  // as the state device keeps it.
  struct Group {
    long fresh_at = 0;
    float lr_scale = 1.0f, beta1 = 0.0f, beta2 = 0.0f;  // the param group's (fsdp_set_param_group)
    std::vector<device::ShardSpan> spans;
    std::unique_ptr<device::SpanTable> table;
    bool same(const Group& o) const {
      return fresh_at == o.fresh_at && lr_scale == o.lr_scale && beta1 == o.beta1 && beta2 == o.beta2;
    }
  };
  std::vector<Group> groups_;
  long step_ = 0;
  double last_grad_norm_ = 0.0;
};

}  // namespace fsdp::core
