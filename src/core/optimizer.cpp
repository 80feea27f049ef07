// src/core/optimizer.cpp - see optimizer.h. The per-element math is in
// kernels/optim.h and the step's scalars in kernels/step.h; this file decides
// which ranges get which hyperparameters, and where and in which order the
// step's work is queued.
#include "optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "../base/log.h"

namespace fsdp::core {
namespace {

using kernels::StepState;

constexpr size_t kUnitsReserved = 64;  // sums of squares a context starts with room for

size_t floats_for(size_t nbytes) { return (nbytes + sizeof(float) - 1) / sizeof(float); }

bool same_spans(const std::vector<device::ShardSpan>& a, const std::vector<device::ShardSpan>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const device::ShardSpan &x = a[i], &y = b[i];
    if (x.params != y.params || x.grads != y.grads || x.state1 != y.state1 || x.state2 != y.state2 || x.out != y.out ||
        x.numel != y.numel || x.weight_decay != y.weight_decay || x.group != y.group) {
      return false;
    }
  }
  return true;
}

bool same_group(const kernels::StepGroup& a, const kernels::StepGroup& b) {
  return a.fresh_at == b.fresh_at && a.lr_scale == b.lr_scale && a.beta1 == b.beta1 && a.beta2 == b.beta2;
}

bool same_groups(const std::vector<kernels::StepGroup>& a, const std::vector<kernels::StepGroup>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!same_group(a[i], b[i])) return false;
  }
  return true;
}

bool same_squares(const std::vector<device::SquaresSpan>& a, const std::vector<device::SquaresSpan>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].x != b[i].x || a[i].numel != b[i].numel || a[i].out != b[i].out) return false;
  }
  return true;
}

}  // namespace

// Two StepStates in host memory the device's copies reach fastest (pinned
// for a GPU): each step copies its results into slot (its number % 2); a
// third, `probe`, takes fsdp_clip_grad_norm's sum of squares.
struct Optimizer::Mirror {
  explicit Mirror(device::HostMemory m) : mem(m) {
    slots = static_cast<StepState*>(mem.alloc(3 * sizeof(StepState)));
    if (slots == nullptr) fail(FSDP_ERR_OUT_OF_MEMORY, "fsdp: no host memory for the step's results");
    std::memset(static_cast<void*>(slots), 0, 3 * sizeof(StepState));
    probe = slots + 2;
  }
  ~Mirror() { mem.free(slots); }
  Mirror(const Mirror&) = delete;
  Mirror& operator=(const Mirror&) = delete;
  device::HostMemory mem;
  StepState* slots = nullptr;
  StepState* probe = nullptr;
};

Optimizer::Optimizer(Runtime& rt) : rt_(rt), scaler_(rt.opts) {
  const Options& o = rt.opts;
  rule_.max_grad_norm = o.max_grad_norm;
  scaler_.fill(rule_);
  rule_.count = o.optimizer == OptimizerKind::kHost ? 0 : 1;  // the host's update counts at fsdp_step_end
  rule_.eps = static_cast<float>(o.eps);
  rule_.momentum = static_cast<float>(o.momentum);
  rule_.decoupled = o.optimizer == OptimizerKind::kAdamW ? 1 : 0;
  rule_.nesterov = o.nesterov ? 1 : 0;
  view_.loss_scale = scaler_.initial_scale();
  view_.lr = o.lr;
}

Optimizer::~Optimizer() = default;

Optimizer::State Optimizer::make_state(size_t n) const {
  State s;
  for (size_t i = 0; i < state_names().size(); ++i) {
    s.bufs.emplace_back(rt_.state_dev, &rt_.mem, MemCategory::kOptimizerState, DType::kFp32, n);
  }
  s.fresh_at = static_cast<long>(settled().t);
  return s;
}

void Optimizer::reserve_units(size_t n) {
  if (step_state_.empty()) {
    // The step's scalars and its copies for the host: a few hundred bytes,
    // not counted in fsdp_memory_stats (docs/architecture.md, "Step").
    step_state_ = Buffer(rt_.state_dev, nullptr, MemCategory::kScratch, DType::kFp32, floats_for(sizeof(StepState)));
    mirror_ = std::make_unique<Mirror>(rt_.state_dev->host_memory());
    write_state(view_);
  }
  const size_t cap = unit_sq_.numel() * sizeof(float) / sizeof(double);
  if (n <= cap && cap > 0) return;  // (made with the state: the step sums them even when there is none)
  size_t grown = std::max(kUnitsReserved, 2 * cap);
  while (grown < n) grown *= 2;
  Buffer bigger(rt_.state_dev, nullptr, MemCategory::kScratch, DType::kFp32, floats_for(grown * sizeof(double)));
  // Registration is between steps: the Context waited for every pass that
  // writes a sum (Context::register_unit).
  if (cap > 0) rt_.state_dev->copy(bigger.data(), unit_sq_.data(), cap * sizeof(double));
  unit_sq_ = std::move(bigger);
  rt_.unit_sq = unit_sq_.as<double>();
}

bool Optimizer::unit_slots_full() const { return n_units_ >= unit_sq_.numel() * sizeof(float) / sizeof(double); }

void Optimizer::add_unit(const Unit& unit) {
  reserve_units(unit.index() + 1);
  states_.push_back(unit.trainable() ? make_state(unit.trainable_shard_numel()) : State{});
  n_units_ = states_.size();
}

void Optimizer::set_trainable(const Unit& unit, bool trainable) {
  states_.at(unit.index()) = trainable ? make_state(unit.trainable_shard_numel()) : State{};
}

void Optimizer::set_ages(const Unit& unit, std::vector<long> ages) {
  State& st = states_.at(unit.index());
  long first = -1;
  bool same = true;
  for (size_t p = 0; p < ages.size(); ++p) {
    if (!unit.param_trainable(p)) continue;
    if (first < 0) first = ages[p];
    same = same && ages[p] == first;
  }
  if (first >= 0) st.fresh_at = first;
  st.param_fresh_at = same ? std::vector<long>{} : std::move(ages);
}

void Optimizer::relayout(const Unit& unit, const FlatLayout& old, const std::vector<std::vector<float>>& old_states) {
  State& st = states_.at(unit.index());
  if (!unit.trainable()) return;  // a frozen unit keeps no state in either layout
  const size_t k = unit.index(), n = unit.layout().n_params();
  const long now = static_cast<long>(settled().t);
  std::vector<long> ages(n);
  for (size_t p = 0; p < n; ++p) ages[p] = old.frozen(p) ? now : param_fresh_at(k, p);
  State fresh = make_state(unit.trainable_shard_numel());
  std::vector<float> shard(unit.trainable_shard_numel());
  for (size_t i = 0; i < fresh.bufs.size(); ++i) {
    std::fill(shard.begin(), shard.end(), 0.0f);
    for (const ShardSegment& seg : unit.segments()) {
      if (!unit.param_trainable(seg.param_index) || old.frozen(seg.param_index)) continue;  // unfrozen now: zeros
      const float* from = old_states.at(i).data() + old.param_offset(seg.param_index) + seg.param_begin;
      std::copy(from, from + seg.numel, shard.begin() + static_cast<ptrdiff_t>(seg.shard_begin));
    }
    rt_.state_dev->copy_from_host(fresh.bufs[i].data(), shard.data(), shard.size() * sizeof(float));
  }
  st = std::move(fresh);
  set_ages(unit, std::move(ages));
}

std::vector<std::string> Optimizer::state_names() const {
  const Options& o = rt_.opts;
  if (o.optimizer == OptimizerKind::kHost) {
    std::vector<std::string> names;
    for (int i = 0; i < o.host_state; ++i) names.push_back("host" + std::to_string(i));
    return names;
  }
  if (o.optimizer != OptimizerKind::kSgd) return {"exp_avg", "exp_avg_sq"};
  if (o.momentum != 0.0) return {"momentum"};
  return {};
}

const Buffer& Optimizer::state(size_t unit, size_t i) const {
  static const Buffer kNone;  // a frozen unit's
  const State& s = states_.at(unit);
  return i < s.bufs.size() ? s.bufs[i] : kNone;
}

// ---- the step's results on the host ----------------------------------------

void Optimizer::poll() const {
  if (queued_ == 0 || view_of_ == queued_) return;
  const EventPtr& ev = rt_.step_done;
  if (!ev || !ev->done() || ev->status() != FSDP_OK) return;  // a failure is reported by whoever waits
  // The newest step's slot: no later step is queued to write it.
  view_ = mirror_->slots[(queued_ - 1) % 2];
  view_.lr = rt_.opts.lr;
  view_of_ = queued_;
  scaler_.set(view_.loss_scale, static_cast<long>(view_.clean), static_cast<uint64_t>(view_.skipped));
  report_skipped(view_);
}

const StepState& Optimizer::settled() const {
  if (rt_.graph_origin != nullptr && queued_ > 0) {
    // A captured step runs each time the host launches its graph, which
    // queues no fsdp_step here: the live state, once its runs are done.
    rt_.wait_step();
    read_state();
    report_skipped(view_);
    return view_;
  }
  if (queued_ > 0 && view_of_ != queued_) {
    rt_.wait_step();  // throws the step's failure
    poll();
  }
  if (lr_written_) {
    EventPtr ev = std::move(lr_written_);
    ev->wait(rt_.opts.timeout_s);
  }
  return view_;
}

const LossScaler& Optimizer::loss_scaler() const {
  settled();
  return scaler_;
}

const double* Optimizer::loss_scale_device() {
  reserve_units(n_units_);
  return &step_state_.as<StepState>()->loss_scale;
}

void Optimizer::read_state() const {
  rt_.state_dev->copy_to_host(&view_, step_state_.data(), sizeof(StepState));
  view_.lr = rt_.opts.lr;
  view_of_ = queued_;
  scaler_.set(view_.loss_scale, static_cast<long>(view_.clean), static_cast<uint64_t>(view_.skipped));
}

void Optimizer::write_state(const StepState& s) {
  view_ = s;
  view_.lr = rt_.opts.lr;
  view_of_ = queued_;
  scaler_.set(view_.loss_scale, static_cast<long>(view_.clean), static_cast<uint64_t>(view_.skipped));
  if (!step_state_.empty()) rt_.state_dev->copy_from_host(step_state_.data(), &view_, sizeof(StepState));
}

void Optimizer::restore(long step, double last_grad_norm) {
  StepState s = settled();
  s.t = step;
  s.norm = last_grad_norm;
  write_state(s);
  for (State& st : states_) {
    st.fresh_at = 0;
    st.param_fresh_at.clear();
  }
}

void Optimizer::restore_scaler(double scale, long clean_steps, uint64_t skipped_steps) {
  StepState s = settled();
  if (scaler_.dynamic()) {
    s.loss_scale = scale;
    s.clean = clean_steps;
  }
  s.skipped = static_cast<int64_t>(skipped_steps);
  reported_skips_ = s.skipped;  // a checkpoint's skips were logged by the run that made them
  write_state(s);
}

void Optimizer::set_lr(double lr) {
  rt_.opts.lr = lr;
  view_.lr = lr;
  if (step_state_.empty()) return;  // written when the state is made
  if (last_caller_ == nullptr) {
    write_state(settled());  // no step queued yet: nothing reads it meanwhile
    return;
  }
  // After the last step (its caller's stream waited for it) and before the
  // next, which waits for this: in stream order, so that a step the host
  // captured into a CUDA graph and replays on that stream sees it too.
  static const device::Label kSetLr = device::make_label("fsdp_set_lr: write the lr the next update uses");
  device::Device* dev = rt_.state_dev;
  double* at = &step_state_.as<StepState>()->lr;
  lr_written_ = last_caller_->submit(kSetLr, [dev, at, lr] { dev->copy_from_host(at, &lr, sizeof lr); });
}

void Optimizer::report_skipped(const StepState& s) const {
  if (s.skipped <= reported_skips_) return;
  const int64_t n = s.skipped - reported_skips_;
  reported_skips_ = s.skipped;
  if (rt_.rank != 0) return;  // the norm is all-reduced: every rank skips, rank 0 says so
  // Said once the host learns of it: at the step on a synchronous stream,
  // else at the next call that reads the step's results or queues a step.
  std::string msg = n == 1 ? "fsdp_step: the grads hold inf or nan (grad norm " + std::to_string(s.norm) +
                                 "): the step is skipped on every rank"
                           : "fsdp_step: the grads held inf or nan in " + std::to_string(n) +
                                 " steps (the last's grad norm " + std::to_string(s.norm) +
                                 "): the steps were skipped on every rank";
  msg += ", params and optimizer state unchanged (" + std::to_string(s.skipped) + " skipped so far)";
  if (scaler_.dynamic()) {
    base::log(FSDP_LOG_INFO, rt_.rank, msg + "; the loss scale backs off to " + std::to_string(s.loss_scale));
    return;
  }
  base::log(FSDP_LOG_WARN, rt_.rank,
            msg + ". Without a dynamic loss scale this is a fault: a loss or a backward that made inf/nan, or a "
                  "host that read params after their unit's *_end (debug_poison=1 turns such reads into NaN)");
}

// ---- the step ----------------------------------------------------------------

void Optimizer::collect(const std::vector<std::unique_ptr<Unit>>& units) {
  spans_.clear();
  groups_.clear();
  squares_.clear();
  size_t out_es = dtype_size(rt_.opts.param_dtype);
  for (size_t k = 0; k < units.size(); ++k) {
    const Unit& u = *units[k];
    if (!u.trainable()) continue;
    // A shard the host wrote itself (alone, fp32): no pass of ours summed its
    // squares; the step does, all such units in one pass. Padding in the
    // sharded grads is always zero, so whole shards can be summed.
    if (!u.grad_sq_known() && u.trainable_shard_numel() > 0) {
      squares_.push_back({u.sharded_grad(), u.trainable_shard_numel(), rt_.unit_sq + k});
    }
    const State& st = states_[k];
    for (const ShardSegment& seg : u.segments()) {
      if (!u.param_trainable(seg.param_index)) continue;  // frozen inside the unit: the master alone
      const Unit::Hyper& h = u.hyper(seg.param_index);
      kernels::StepGroup key{};
      key.fresh_at = param_fresh_at(k, seg.param_index);
      key.lr_scale = static_cast<float>(h.lr_scale);
      key.beta1 = static_cast<float>(std::isnan(h.beta1) ? rt_.opts.beta1 : h.beta1);
      key.beta2 = static_cast<float>(std::isnan(h.beta2) ? rt_.opts.beta2 : h.beta2);
      auto g = std::find_if(groups_.begin(), groups_.end(), [&](const kernels::StepGroup& x) { return same_group(x, key); });
      if (g == groups_.end()) {
        groups_.push_back(key);
        g = groups_.end() - 1;
      }
      size_t b = seg.shard_begin;
      spans_.push_back({u.master() + b, u.sharded_grad() + b, st.bufs.size() > 0 ? st.bufs[0].as<float>() + b : nullptr,
                        st.bufs.size() > 1 ? st.bufs[1].as<float>() + b : nullptr,
                        u.lowp_shard() == nullptr ? nullptr : static_cast<char*>(u.lowp_shard()) + b * out_es,
                        seg.numel, static_cast<float>(u.weight_decay(seg.param_index)),
                        static_cast<uint32_t>(g - groups_.begin())});
    }
    // Padding between and after params is never written: it stays zero.
  }
}

void Optimizer::prepare(const std::vector<std::unique_ptr<Unit>>& units, device::Stream& caller,
                        device::Stream& run) {
  reserve_units(n_units_);  // the step's state, also where no unit is registered
  poll();                   // the last step's results, if it is done (its skips logged now)
  collect(units);
  // A table is made again only when a span changed (a unit registered,
  // frozen or unfrozen, a checkpoint loaded new buffers, a param's weight
  // decay or group set): on a GPU that is an upload, so the step itself
  // sends nothing. The old table may still be read by the step in flight.
  const bool spans_changed = !table_ || !same_spans(table_->spans(), spans_) || !same_groups(table_->groups(), groups_);
  const bool squares_changed = squares_.empty() ? squares_table_ != nullptr
                                                : !squares_table_ || !same_squares(squares_table_->spans(), squares_);
  if ((spans_changed || squares_changed) && rt_.step_done) rt_.wait_step();
  // A table a captured graph may still launch stays (the graph holds its
  // pointers): kept until the context goes, once a step was captured.
  if (rt_.capture_joined != 0) {
    if (spans_changed && table_) retired_.push_back(std::move(table_));
    if (squares_changed && squares_table_) retired_squares_.push_back(std::move(squares_table_));
  }
  if (spans_changed) table_ = rt_.state_dev->make_span_table(spans_, groups_);
  if (squares_changed) squares_table_ = squares_.empty() ? nullptr : rt_.state_dev->make_squares_table(squares_);

  // The step follows the last one (the state it reads and writes), the
  // host's stream (its compute wrote the grads and read the params), the
  // host's last use of a unit it reads in place on another stream, and a
  // queued lr.
  run.wait(rt_.step_done);
  if (&run != &caller) run.wait(caller.record());
  if (!rt_.gathers()) {
    for (const auto& u : units) {
      if (u->host_use_stream() != &run) run.wait(u->host_use());
    }
  }
  if (lr_written_) run.wait(lr_written_);
  if (clip_written_) run.wait(clip_written_);
}

void Optimizer::sum_squares(bool over_ranks) {
  device::Device& dev = *rt_.state_dev;
  StepState* st = step_state_.as<StepState>();
  if (squares_table_) dev.sum_squares_table(*squares_table_);
  dev.step_scalars(st, rt_.unit_sq, n_units_, nullptr);
  // Shards of a shard group cover the model once; replicas hold the same
  // grads. The sum runs on the device: NCCL, or the local communicator
  // over the GPU's memory (rank order), or host memory on the CPU.
  if (over_ranks) rt_.shard_comm->sum_f64(&st->sq_rank, &st->sq, 1, "grad norm");
}

// The norm's part of the step alone, its sums copied to the probe slot, and
// a wait for them: the sums it writes are written again by the step.
double Optimizer::grad_norm(const std::vector<std::unique_ptr<Unit>>& units, device::Stream& caller,
                            device::Stream& run) {
  prepare(units, caller, run);
  const bool over_ranks = rt_.shard_world() > 1;
  static const device::Label kNorm = device::make_label("grad norm (sum over the shard group)");
  static const device::Label kProbe = device::make_label("fsdp_clip_grad_norm: the grads' norm");
  StepState* probe = mirror_->probe;
  auto copy = [this, probe] { rt_.state_dev->copy_to_host(probe, step_state_.data(), sizeof(StepState)); };
  EventPtr done;
  if (over_ranks && &run != rt_.stream) {  // as the step: the collective on the comm stream
    rt_.stream->wait(run.record());
    rt_.stream->wait(caller.record());
    EventPtr summed = rt_.stream->submit(kNorm, [this] { sum_squares(true); });
    run.wait(summed);
    done = run.submit(kProbe, copy);
  } else {
    done = run.submit(kProbe, [this, over_ranks, copy] {
      sum_squares(over_ranks);
      copy();
    });
  }
  done->wait(rt_.opts.timeout_s);
  return std::sqrt(probe->sq) / probe->loss_scale;
}

void Optimizer::set_clip(double coef, device::Stream& run) {
  static const device::Label kClip = device::make_label("fsdp_clip_grad_norm: the coming update's coefficient");
  device::Device* dev = rt_.state_dev;
  double* at = &step_state_.as<StepState>()->clip;
  clip_written_ = run.submit(kClip, [dev, at, coef] { dev->copy_from_host(at, &coef, sizeof coef); });
}

void Optimizer::queue(const std::vector<std::unique_ptr<Unit>>& units, device::Stream& caller, device::Stream& run,
                      bool update) {
  prepare(units, caller, run);
  const size_t slot = queued_ % 2;
  const bool over_ranks = rt_.shard_world() > 1;
  // offload=cpu over ranks: the norm's sum is a collective, which runs on the
  // comm stream (after the host's work stream has added the last grads);
  // the verdict and the update follow on the host's work stream.
  const bool split = over_ranks && &run != rt_.stream;
  static const device::Label kNorm = device::make_label("grad norm (sum over the shard group)");
  static const device::Label kStep = device::make_label("optimizer step");
  static const device::Label kVerdict = device::make_label("grad norm, loss scale and clipping");
  auto sum = [this, over_ranks] { sum_squares(over_ranks); };
  auto finish = [this, slot, update] {
    device::Device& dev = *rt_.state_dev;
    StepState* st = step_state_.as<StepState>();
    dev.step_scalars(st, nullptr, 0, &rule_);
    if (update) {
      if (rt_.opts.optimizer == OptimizerKind::kSgd) {
        dev.sgd_spans(*table_, rule_, st, rt_.opts.param_dtype, /*zero_grads=*/true);
      } else {
        dev.adam_spans(*table_, rule_, st, rt_.opts.param_dtype, /*zero_grads=*/true);
      }
      if (n_units_ > 0) dev.zero(rt_.unit_sq, n_units_ * sizeof(double));  // every grad shard is zero now
    }
    dev.copy_to_host(&mirror_->slots[slot], st, sizeof(StepState));
  };
  EventPtr done;
  if (split) {
    rt_.stream->wait(run.record());  // the host's work stream added the last grads (and their sums)
    rt_.stream->wait(caller.record());
    EventPtr summed = rt_.stream->submit(kNorm, [sum] { sum(); });
    run.wait(summed);
    done = run.submit(kVerdict, [finish] { finish(); });
  } else {
    done = run.submit(update ? kStep : kVerdict, [sum, finish] {
      sum();
      finish();
    });
  }
  rt_.step_done = done;
  last_caller_ = &caller;
  ++queued_;
  ++rt_.step_seq;
  rt_.step_waiter = &caller;  // it waits below, or ran the step itself
  rt_.step_waiter_seq = rt_.step_seq;
  // What reads the shards next starts after the update: the gathers (and
  // offload's copies to the device), and the host's stream, which reads the
  // shards in place where nothing is gathered (on the CPU's NULL stream this
  // blocks: that stream is the calling thread).
  if (rt_.gather_stream != nullptr) rt_.gather_stream->wait(done);
  if (rt_.copy_in != nullptr) rt_.copy_in->wait(done);
  if (&run != &caller) caller.wait(done);
  poll();  // done already on a synchronous stream: its skip is said now
}

void Optimizer::step(const std::vector<std::unique_ptr<Unit>>& units, device::Stream& caller, device::Stream& run) {
  queue(units, caller, run, /*update=*/true);
}

bool Optimizer::host_begin(const std::vector<std::unique_ptr<Unit>>& units, device::Stream& caller,
                           device::Stream& run, float* grad_scale) {
  *grad_scale = 1.0f;
  queue(units, caller, run, /*update=*/false);
  const StepState& s = settled();  // the host's update needs the verdict now
  if (s.skip != 0) {
    for (const auto& u : units) {
      if (u->trainable()) rt_.state_dev->zero(u->sharded_grad(), u->trainable_shard_numel() * sizeof(float));
    }
    if (n_units_ > 0) rt_.state_dev->zero(rt_.unit_sq, n_units_ * sizeof(double));
    return false;
  }
  *grad_scale = s.grad_scale;
  return true;
}

void Optimizer::host_end(const std::vector<std::unique_ptr<Unit>>& units, bool updated) {
  auto launches = [&] {
    for (const auto& u : units) {
      if (!u->trainable()) continue;
      if (u->lowp_shard() != nullptr) {
        rt_.state_dev->cast(u->lowp_shard(), rt_.opts.param_dtype, u->master(), DType::kFp32, u->shard_numel());
      }
      rt_.state_dev->zero(u->sharded_grad(), u->trainable_shard_numel() * sizeof(float));
    }
    if (n_units_ > 0) rt_.state_dev->zero(rt_.unit_sq, n_units_ * sizeof(double));
  };
  if (rt_.state_dev->host_visible()) {
    launches();  // the host's loops: done when they return
  } else {
    // A GPU: every launch is queued on the comm stream and the host waits
    // once, not once per launch.
    static const device::Label kEnd = device::make_label("after the host's update");
    rt_.stream->submit(kEnd, [&launches] { launches(); })->wait(rt_.opts.timeout_s);
  }
  if (updated) {
    StepState s = settled();
    ++s.t;
    write_state(s);
  }
}

}  // namespace fsdp::core
