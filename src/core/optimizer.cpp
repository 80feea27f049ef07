// src/core/optimizer.cpp - see optimizer.h. The per-element math is in
// kernels/optim.h; this file decides which ranges get which hyperparameters.
#include "optimizer.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "../base/log.h"

namespace fsdp::core {

Optimizer::State Optimizer::make_state(size_t n) const {
  State s;
  for (size_t i = 0; i < state_names().size(); ++i) {
    s.bufs.emplace_back(rt_.state_dev, &rt_.mem, MemCategory::kOptimizerState, DType::kFp32, n);
  }
  s.fresh_at = step_;
  return s;
}

void Optimizer::add_unit(const Unit& unit) { states_.push_back(make_state(unit.trainable_shard_numel())); }

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
  std::vector<long> ages(n);
  for (size_t p = 0; p < n; ++p) ages[p] = old.frozen(p) ? step_ : param_fresh_at(k, p);
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

void Optimizer::restore(long step, double last_grad_norm) {
  step_ = step;
  for (State& s : states_) {
    s.fresh_at = 0;
    s.param_fresh_at.clear();
  }
  last_grad_norm_ = last_grad_norm;
}

void Optimizer::on_state_device(const device::Label& what, base::FunctionRef<void()> launches) {
  if (rt_.state_dev->host_visible()) {
    launches();  // the host's loops: done when they return
    return;
  }
  // A GPU: every launch is queued on the comm stream (idle now: the step
  // waited for the reductions) and the host waits once, not once per launch.
  rt_.stream->submit(what, [&launches] { launches(); })->wait(rt_.opts.timeout_s);
}

double Optimizer::grad_sum_squares(const std::vector<std::unique_ptr<Unit>>& units) {
  // The reduction that wrote a grad shard summed its squares as it went; only
  // shards the host wrote itself (alone, fp32) take a pass here. Padding in
  // the sharded grads is always zero, so whole shards can be summed.
  double sq = 0.0;
  for (const auto& u : units) {
    if (!u->trainable()) continue;
    sq += u->grad_sq_known() ? u->grad_sq() : rt_.state_dev->sum_squares(u->sharded_grad(), u->trainable_shard_numel());
  }
  // Shards of a shard group cover the model once; replicas hold the same grads.
  if (rt_.shard_world() > 1) rt_.shard_sync->all_reduce_f64(&sq, 1, comm::RedOp::kSum, "grad norm");
  return sq;
}

bool Optimizer::prepare(const std::vector<std::unique_ptr<Unit>>& units, float* grad_scale) {
  const Options& o = rt_.opts;
  // The sum of squares is all-reduced, so inf/nan on any rank reaches all.
  double sq = grad_sum_squares(units);
  double scale = scaler_.scale();
  last_grad_norm_ = std::sqrt(sq) / scale;
  bool finite = std::isfinite(sq);
  scaler_.update(finite);
  if (!finite) {
    report_skipped();
    static const device::Label kSkipped = device::make_label("zero the grads of a skipped step");
    on_state_device(kSkipped, [&] {
      for (const auto& u : units) {
        if (u->trainable()) rt_.state_dev->zero(u->sharded_grad(), u->trainable_shard_numel() * sizeof(float));
      }
    });
    return false;
  }
  *grad_scale = static_cast<float>(1.0 / scale);
  if (o.max_grad_norm > 0.0) {
    double coef = o.max_grad_norm / (last_grad_norm_ + 1e-6);  // torch.nn.utils.clip_grad_norm_
    if (coef < 1.0) *grad_scale = static_cast<float>(coef / scale);
  }
  return true;
}

void Optimizer::step(const std::vector<std::unique_ptr<Unit>>& units) {
  float grad_scale = 1.0f;
  if (!prepare(units, &grad_scale)) return;
  ++step_;
  static const device::Label kStep = device::make_label("optimizer step");
  on_state_device(kStep, [&] { update(units, grad_scale); });
}

bool Optimizer::host_begin(const std::vector<std::unique_ptr<Unit>>& units, float* grad_scale) {
  *grad_scale = 1.0f;
  return prepare(units, grad_scale);
}

void Optimizer::host_end(const std::vector<std::unique_ptr<Unit>>& units, bool updated) {
  static const device::Label kEnd = device::make_label("after the host's update");
  on_state_device(kEnd, [&] {
    for (const auto& u : units) {
      if (!u->trainable()) continue;
      if (u->lowp_shard() != nullptr) {
        rt_.state_dev->cast(u->lowp_shard(), rt_.opts.param_dtype, u->master(), DType::kFp32, u->shard_numel());
      }
      rt_.state_dev->zero(u->sharded_grad(), u->trainable_shard_numel() * sizeof(float));
    }
  });
  if (updated) ++step_;
}

void Optimizer::report_skipped() const {
  if (rt_.rank != 0) return;  // the norm is all-reduced: every rank skips, rank 0 says so
  std::string msg = "fsdp_step: the grads hold inf or nan (grad norm " + std::to_string(last_grad_norm_) +
                    "): the step is skipped on every rank, params and optimizer state unchanged (" +
                    std::to_string(scaler_.skipped_steps()) + " skipped so far)";
  if (scaler_.dynamic()) {
    base::log(FSDP_LOG_INFO, rt_.rank, msg + "; the loss scale backs off to " + std::to_string(scaler_.scale()));
    return;
  }
  base::log(FSDP_LOG_WARN, rt_.rank,
            msg + ". Without a dynamic loss scale this is a fault: a loss or a backward that made inf/nan, or a "
                  "host that read params after their unit's *_end (debug_poison=1 turns such reads into NaN)");
}

void Optimizer::collect_spans(const std::vector<std::unique_ptr<Unit>>& units) {
  for (Group& g : groups_) g.spans.clear();
  size_t out_es = dtype_size(rt_.opts.param_dtype);
  for (size_t k = 0; k < units.size(); ++k) {
    const Unit& u = *units[k];
    if (!u.trainable()) continue;
    const State& st = states_[k];
    for (const ShardSegment& seg : u.segments()) {
      if (!u.param_trainable(seg.param_index)) continue;  // frozen inside the unit: the master alone
      const Unit::Hyper& h = u.hyper(seg.param_index);
      Group key;
      key.fresh_at = param_fresh_at(k, seg.param_index);
      key.lr_scale = static_cast<float>(h.lr_scale);
      key.beta1 = static_cast<float>(std::isnan(h.beta1) ? rt_.opts.beta1 : h.beta1);
      key.beta2 = static_cast<float>(std::isnan(h.beta2) ? rt_.opts.beta2 : h.beta2);
      auto g = std::find_if(groups_.begin(), groups_.end(), [&](const Group& x) { return x.same(key); });
      if (g == groups_.end()) {
        groups_.push_back(std::move(key));
        g = groups_.end() - 1;
      }
      size_t b = seg.shard_begin;
      g->spans.push_back({u.master() + b, u.sharded_grad() + b,
                          st.bufs.size() > 0 ? st.bufs[0].as<float>() + b : nullptr,
                          st.bufs.size() > 1 ? st.bufs[1].as<float>() + b : nullptr,
                          u.lowp_shard() == nullptr ? nullptr : static_cast<char*>(u.lowp_shard()) + b * out_es,
                          seg.numel, static_cast<float>(u.weight_decay(seg.param_index))});
    }
    // Padding between and after params is never written: it stays zero.
  }
  groups_.erase(std::remove_if(groups_.begin(), groups_.end(), [](const Group& g) { return g.spans.empty(); }),
                groups_.end());
}

namespace {

bool same_spans(const std::vector<device::ShardSpan>& a, const std::vector<device::ShardSpan>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const device::ShardSpan &x = a[i], &y = b[i];
    if (x.params != y.params || x.grads != y.grads || x.state1 != y.state1 || x.state2 != y.state2 || x.out != y.out ||
        x.numel != y.numel || x.weight_decay != y.weight_decay) {
      return false;
    }
  }
  return true;
}

}  // namespace

void Optimizer::update(const std::vector<std::unique_ptr<Unit>>& units, float grad_scale) {
  const Options& o = rt_.opts;
  // A group's table is made again only when a span changed (a unit
  // registered, frozen or unfrozen, a checkpoint loaded new buffers, a
  // param's weight decay set): on a GPU that is an upload, so the step itself
  // sends nothing but its scalars.
  collect_spans(units);
  for (Group& g : groups_) {
    if (!g.table || !same_spans(g.table->spans(), g.spans)) g.table = rt_.state_dev->make_span_table(g.spans);
    const long t = step_ - g.fresh_at;  // this group's updates, this one included
    // The group's lr: fsdp_set_lr's, scaled (decoupled weight decay too, as
    // a PyTorch param group's lr).
    const float lr = g.lr_scale == 1.0f ? static_cast<float>(o.lr) : static_cast<float>(o.lr * g.lr_scale);
    if (o.optimizer == OptimizerKind::kSgd) {
      kernels::SgdOp op{lr, 0.0f, static_cast<float>(o.momentum), grad_scale, o.nesterov, t == 1};
      rt_.state_dev->sgd_spans(*g.table, op, o.param_dtype, /*zero_grads=*/true);
    } else {
      bool decoupled = o.optimizer == OptimizerKind::kAdamW;
      auto op = kernels::AdamOp::make(lr, g.beta1, g.beta2, static_cast<float>(o.eps), 0.0f, decoupled, t, grad_scale);
      rt_.state_dev->adam_spans(*g.table, op, lr, decoupled, o.param_dtype, /*zero_grads=*/true);
    }
  }
}

}  // namespace fsdp::core
