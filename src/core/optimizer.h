// src/core/optimizer.h - Optimizer: AdamW / Adam / SGD on the flat fp32 shards
// of every unit, with per-param weight decay inside a shard (from the layout's
// segments), global grad-norm clipping across ranks, dynamic loss scaling,
// and the fused write of the next step's param_dtype shard. The step runs on
// the state device in stream order (kernels/step.h): the norm, the verdict,
// the scale, the clip coefficient and the count are decided there, so
// fsdp_step queues its work and returns; whatever reads a result waits for
// the step's event (docs/architecture.md, "Step").
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
  explicit Optimizer(Runtime& rt);
  ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Allocates the unit's state (moments or momentum) next to its shard, and
  // its sum of squares' slot (Runtime::unit_sq).
  void add_unit(const Unit& unit);
  // Whether the next add_unit moves the units' sums of squares to a larger
  // buffer: the Context first waits for every pass that writes one.
  bool unit_slots_full() const;
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
  // Queues one update of every unit from its sharded grads (unscaled by the
  // loss scale), after the work `caller` (the host's stream) has queued, and
  // returns: the norm, the verdict and the update run on `run` (the caller
  // alone, the comm stream over ranks, the host's work stream with
  // offload=cpu; Context::step_stream). Collective (the norm's sum over the
  // shard group, on the device). A step whose grads hold inf/nan on any rank
  // changes no param and no optimizer state; every step leaves the grads zero.
  // Runtime::step_done is its event, which `caller` waits for.
  void step(const std::vector<std::unique_ptr<Unit>>& units, device::Stream& caller, device::Stream& run);
  // optimizer=host, fsdp_step_begin: the norm, the loss scaler's verdict and
  // clipping as step() does them, waited for; returns false for a skipped
  // step (inf/nan: the grads are zeroed, the host updates nothing), else
  // true with *grad_scale the factor the host applies to the grads (1 / loss
  // scale, times the clip coefficient).
  bool host_begin(const std::vector<std::unique_ptr<Unit>>& units, device::Stream& caller, device::Stream& run,
                  float* grad_scale);
  // fsdp_step_end: the param_dtype copies follow the masters, the grads are
  // zeroed, and an update that ran counts as a step.
  void host_end(const std::vector<std::unique_ptr<Unit>>& units, bool updated);
  // fsdp_clip_grad_norm: the grads' global norm now (unscaled by the loss
  // scale, as fsdp_last_grad_norm), queued as the step queues it and waited
  // for; set_clip makes the coming update alone multiply the grads by
  // `coef`, written in stream order on `run`.
  double grad_norm(const std::vector<std::unique_ptr<Unit>>& units, device::Stream& caller, device::Stream& run);
  void set_clip(double coef, device::Stream& run);

  // What the steps decided, once the last one is done (waits for it: a read
  // of the step's results is a host wait). The loss scaler's scale, clean
  // steps and skipped steps are loss_scaler()'s after it.
  const kernels::StepState& settled() const;
  const LossScaler& loss_scaler() const;
  // Where the step keeps the loss scale (the state device's memory): a
  // kernel that scales the loss reads it there, after the last step in stream
  // order, as a captured step's replays need (fsdp_loss_scale_device).
  const double* loss_scale_device();
  double last_grad_norm() const { return settled().norm; }
  // Updates applied (Adam's bias-correction step), and fsdp_step calls that
  // ran, skipped ones included (also across a checkpoint load).
  long step_count() const { return static_cast<long>(settled().t); }
  uint64_t steps_run() const { return static_cast<uint64_t>(settled().t + settled().skipped); }
  // fsdp_set_lr: the next update's lr, written in stream order after the
  // last step (on the stream it was queued from: a captured step replayed
  // there sees it).
  void set_lr(double lr);

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
  // A loaded loss scale: the scale and its clean steps where it is dynamic
  // (a static or disabled scale stays what the options say), the skipped steps always.
  void restore_scaler(double scale, long clean_steps, uint64_t skipped_steps);
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

 private:
  // One buffer per state_names() entry: Adam's exp_avg and exp_avg_sq,
  // SGD's momentum, or the host's (optimizer=host); none while frozen.
  struct State {
    std::vector<Buffer> bufs;
    long fresh_at = 0;  // step count when this state was zero (its updates: t - fresh_at)
    // Per param where one differs (unfrozen inside the unit on its own);
    // empty: every param's is fresh_at.
    std::vector<long> param_fresh_at;
  };
  State make_state(size_t numel) const;
  // Every param range of every trainable unit's shard, with its state,
  // weight decay and param group, into spans_ and groups_ (kept: a step
  // allocates nothing once warm), and the units whose grads no pass summed
  // into squares_. The device tables are made again only where these changed.
  void collect(const std::vector<std::unique_ptr<Unit>>& units);
  // What a step and a norm wait for and read: the last step's results, the
  // tables made again where a span changed, the streams' order.
  void prepare(const std::vector<std::unique_ptr<Unit>>& units, device::Stream& caller, device::Stream& run);
  // The step's sum of squares into the state: the units' sums, over the
  // shard group with `over_ranks` (a stream task).
  void sum_squares(bool over_ranks);
  // Queues the norm and the verdict (and, with `update`, the update, the
  // clearing of the sums and the mirror's copy) after `caller`'s work, on
  // `run`; the event in Runtime::step_done.
  void queue(const std::vector<std::unique_ptr<Unit>>& units, device::Stream& caller, device::Stream& run,
             bool update);
  // Reads the last step's results into view_ if it has completed, without
  // waiting (logs the steps it skipped).
  void poll() const;
  // view_ from the live state (the device's work done): a synchronous read.
  void read_state() const;
  // Writes `s` over the live state (no step in flight: settled() first).
  void write_state(const kernels::StepState& s);
  void report_skipped(const kernels::StepState& s) const;
  // Makes the step's state (if not yet) and grows the units' sums of squares
  // to hold `n` (between steps, nothing in flight).
  void reserve_units(size_t n);

  Runtime& rt_;
  mutable LossScaler scaler_;  // the options; its values are the device's as last read (view_)
  kernels::StepRule rule_{};
  std::vector<State> states_;
  size_t n_units_ = 0;
  Buffer step_state_;  // one kernels::StepState, state device
  Buffer unit_sq_;     // a double per unit (capacity), state device
  // The last two steps' results, copied by each step into host memory
  // (pinned for a GPU): the host reads the newest whose event completed.
  struct Mirror;
  std::unique_ptr<Mirror> mirror_;
  uint64_t queued_ = 0;  // steps queued (the mirror slot of the next: queued_ % 2)
  mutable kernels::StepState view_{};
  mutable uint64_t view_of_ = 0;       // the step view_ shows (0: the state as made, restored or written)
  mutable int64_t reported_skips_ = 0;  // skipped steps already logged
  // The spans of the trainable units (one table for the model, each span
  // with its param group), the units summed in the step, and their tables as
  // the state device keeps them.
  std::vector<device::ShardSpan> spans_;
  std::vector<kernels::StepGroup> groups_;
  std::unique_ptr<device::SpanTable> table_;
  std::vector<device::SquaresSpan> squares_;
  std::unique_ptr<device::SquaresTable> squares_table_;
  std::vector<std::unique_ptr<device::SpanTable>> retired_;  // replaced after a capture: a graph may launch them
  std::vector<std::unique_ptr<device::SquaresTable>> retired_squares_;
  device::Stream* last_caller_ = nullptr;  // the stream of the last fsdp_step (set_lr's writes go there)
  mutable EventPtr lr_written_;            // set_lr's write, queued there
  EventPtr clip_written_;                  // set_clip's write: the next step waits for it
};

}  // namespace fsdp::core
