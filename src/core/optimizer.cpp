// src/core/optimizer.cpp - see optimizer.h. The per-element math is in
// kernels/optim.h; this file decides which ranges get which hyperparameters.
#include "optimizer.h"

#include <cmath>

namespace fsdp::core {

void Optimizer::add_unit(const Unit& unit) {
  State s;
  size_t n = unit.shard_numel();
  const Options& o = rt_.opts;
  if (o.optimizer != OptimizerKind::kSgd) {
    s.exp_avg = Buffer(rt_.state_dev, &rt_.mem, MemCategory::kOptimizerState, DType::kFp32, n);
    s.exp_avg_sq = Buffer(rt_.state_dev, &rt_.mem, MemCategory::kOptimizerState, DType::kFp32, n);
  } else if (o.momentum != 0.0) {
    s.exp_avg = Buffer(rt_.state_dev, &rt_.mem, MemCategory::kOptimizerState, DType::kFp32, n);
  }
  states_.push_back(std::move(s));
}

std::vector<std::string> Optimizer::state_names() const {
  const Options& o = rt_.opts;
  if (o.optimizer != OptimizerKind::kSgd) return {"exp_avg", "exp_avg_sq"};
  if (o.momentum != 0.0) return {"momentum"};
  return {};
}

const Buffer& Optimizer::state(size_t unit, size_t i) const {
  return i == 0 ? states_.at(unit).exp_avg : states_.at(unit).exp_avg_sq;
}

Buffer Optimizer::make_state_buffer(size_t numel) const {
  return Buffer(rt_.state_dev, &rt_.mem, MemCategory::kOptimizerState, DType::kFp32, numel, /*zeroed=*/false);
}

void Optimizer::restore(long step, double last_grad_norm, std::vector<std::vector<Buffer>> states) {
  step_ = step;
  last_grad_norm_ = last_grad_norm;
  for (size_t k = 0; k < states.size() && k < states_.size(); ++k) {
    if (states[k].size() > 0) states_[k].exp_avg = std::move(states[k][0]);
    if (states[k].size() > 1) states_[k].exp_avg_sq = std::move(states[k][1]);
  }
}

void Optimizer::on_state_device(const char* what, const std::function<void()>& launches) {
  if (rt_.state_dev->host_visible()) {
    launches();  // the host's loops: done when they return
    return;
  }
  // A GPU: every launch is queued on the comm stream (idle now: the step
  // waited for the reductions) and the host waits once, not once per launch.
  rt_.stream->submit(what, launches)->wait(rt_.opts.timeout_s);
}

double Optimizer::grad_sum_squares(const std::vector<std::unique_ptr<Unit>>& units) {
  // The reduction that wrote a grad shard summed its squares as it went; only
  // shards the host wrote itself (alone, fp32) take a pass here. Padding in
  // the sharded grads is always zero, so whole shards can be summed.
  double sq = 0.0;
  for (const auto& u : units) {
    sq += u->grad_sq_known() ? u->grad_sq() : rt_.state_dev->sum_squares(u->sharded_grad(), u->shard_numel());
  }
  // Shards of a shard group cover the model once; replicas hold the same grads.
  if (rt_.shard_world() > 1) rt_.shard_sync->all_reduce_f64(&sq, 1, comm::RedOp::kSum, "grad norm");
  return sq;
}

void Optimizer::step(const std::vector<std::unique_ptr<Unit>>& units) {
  const Options& o = rt_.opts;
  // The sum of squares is all-reduced, so inf/nan on any rank reaches all.
  double sq = grad_sum_squares(units);
  double scale = scaler_.scale();
  last_grad_norm_ = std::sqrt(sq) / scale;
  bool finite = std::isfinite(sq);
  scaler_.update(finite);
  if (!finite) {
    on_state_device("zero the grads of a skipped step", [&] {
      for (const auto& u : units) rt_.state_dev->zero(u->sharded_grad(), u->shard_numel() * sizeof(float));
    });
    return;
  }
  float grad_scale = static_cast<float>(1.0 / scale);
  if (o.max_grad_norm > 0.0) {
    double coef = o.max_grad_norm / (last_grad_norm_ + 1e-6);  // torch.nn.utils.clip_grad_norm_
    if (coef < 1.0) grad_scale = static_cast<float>(coef / scale);
  }
  ++step_;
  on_state_device("optimizer step", [&] { update(units, grad_scale); });
}

void Optimizer::update(const std::vector<std::unique_ptr<Unit>>& units, float grad_scale) {
  const Options& o = rt_.opts;
  for (size_t k = 0; k < units.size(); ++k) {
    Unit& u = *units[k];
    State& st = states_[k];
    DType out_dtype = o.param_dtype;
    size_t out_es = dtype_size(out_dtype);
    for (const ShardSegment& seg : u.segments()) {
      float* p = u.master() + seg.shard_begin;
      float* g = u.sharded_grad() + seg.shard_begin;  // read, then zeroed by the same pass
      void* out = u.lowp_shard() == nullptr ? nullptr : static_cast<char*>(u.lowp_shard()) + seg.shard_begin * out_es;
      float wd = static_cast<float>(u.weight_decay(seg.param_index));
      if (o.optimizer == OptimizerKind::kSgd) {
        kernels::SgdOp op{
            static_cast<float>(o.lr), wd, static_cast<float>(o.momentum), grad_scale, o.nesterov, step_ == 1};
        float* buf = st.exp_avg.empty() ? nullptr : st.exp_avg.as<float>() + seg.shard_begin;
        rt_.state_dev->sgd({op, p, g, buf, out, out_dtype, seg.numel, /*zero_grads=*/true});
      } else {
        auto op = kernels::AdamOp::make(static_cast<float>(o.lr), static_cast<float>(o.beta1),
                                        static_cast<float>(o.beta2), static_cast<float>(o.eps), wd,
                                        o.optimizer == OptimizerKind::kAdamW, step_, grad_scale);
        rt_.state_dev->adam({op, p, g, st.exp_avg.as<float>() + seg.shard_begin,
                             st.exp_avg_sq.as<float>() + seg.shard_begin, out, out_dtype, seg.numel,
                             /*zero_grads=*/true});
      }
    }
    // Padding between and after params was never written: it is still zero.
  }
}

}  // namespace fsdp::core
