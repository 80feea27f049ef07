// src/core/unit.cpp - unit state machine, gathers and grad reductions (see unit.h).
#include "unit.h"

#include <fnmatch.h>

#include <algorithm>
#include <cstring>

#include "error.h"

namespace fsdp::core {

const char* unit_state_name(UnitState s) {
  switch (s) {
    case UnitState::kSharded:
      return "sharded";
    case UnitState::kGathered:
      return "gathered (idle)";
    case UnitState::kForward:
      return "in forward";
    case UnitState::kBackward:
      return "in backward";
  }
  return "?";
}

Unit::Unit(Runtime& rt, size_t index, std::string name, std::vector<ParamSpec> params)
    : rt_(rt),
      index_(index),
      name_(std::move(name)),
      layout_(std::move(params), rt.opts.align_bytes / sizeof(float), rt.shard_world()) {
  segments_ = layout_.shard_segments(rt_.shard_rank());
  for (size_t i = 0; i < layout_.n_params(); ++i) {
    double wd = rt_.opts.weight_decay;
    for (const std::string& pat : rt_.opts.no_weight_decay) {
      if (fnmatch(pat.c_str(), layout_.param(i).name.c_str(), 0) == 0) wd = 0.0;
    }
    weight_decay_.push_back(wd);
  }
  size_t s = layout_.shard_numel();
  master_ = Buffer(rt_.dev, &rt_.mem, MemCategory::kShardedParams, DType::kFp32, s);
  if (rt_.opts.param_dtype != DType::kFp32) {
    lowp_ = Buffer(rt_.dev, &rt_.mem, MemCategory::kShardedParams, rt_.opts.param_dtype, s);
  }
  sgrad_ = Buffer(rt_.dev, &rt_.mem, MemCategory::kShardedGrads, DType::kFp32, s);
  if (!rt_.sharded()) state_ = UnitState::kGathered;  // NO_SHARD params are always full
}

std::string Unit::label(const char* what) const {
  return std::string(what) + " of unit '" + name_ + "' (#" + std::to_string(index_) + ")";
}

void Unit::check_param_index(size_t param_index, const char* call) const {
  if (param_index >= layout_.n_params()) {
    fail(FSDP_ERR_INVALID_ARGUMENT, std::string(call) + ": unit '" + name_ + "' has " +
                                        std::to_string(layout_.n_params()) + " params; index " +
                                        std::to_string(param_index) + " is out of range");
  }
}

void Unit::bad_state(const char* call, const char* expected) const {
  fail(FSDP_ERR_INVALID_STATE, std::string(call) + " on unit '" + name_ + "' (" + rt_.where() + "): expected " +
                                   expected + ", but the unit is " + unit_state_name(state_));
}

void* Unit::full_params() const {
  if (rt_.sharded()) return gathered_.data();
  return lowp_.empty() ? master_.data() : lowp_.data();
}

void Unit::set_values(size_t param_index, const float* values, size_t numel) {
  // With sync_module_states the call is collective, so validate together: one
  // rank's bad argument must fail every rank, not leave them waiting.
  bool sync = rt_.opts.sync_module_states && rt_.world > 1;
  std::string problem;
  if (param_index >= layout_.n_params()) {
    problem = "index " + std::to_string(param_index) + " is out of range (unit has " +
              std::to_string(layout_.n_params()) + " params)";
  } else if (numel != layout_.param(param_index).numel) {
    problem = "param '" + layout_.param(param_index).name + "' has " +
              std::to_string(layout_.param(param_index).numel) + " elements, not " + std::to_string(numel);
  } else if (values == nullptr && !(sync && rt_.rank != 0)) {
    problem = "values is NULL";
  }
  fsdp_status_t status = problem.empty() ? FSDP_OK : FSDP_ERR_INVALID_ARGUMENT;
  if (problem.empty() && in_use()) {
    status = FSDP_ERR_INVALID_STATE;
    problem = std::string("the unit is ") + unit_state_name(state_) + "; set values only between steps";
  }
  if (sync) {
    double bad = status == FSDP_OK ? 0.0 : 1.0;
    rt_.comm->all_reduce_f64(&bad, 1, comm::RedOp::kMax, label("fsdp_param_set_values check"));
    if (bad != 0.0 && status == FSDP_OK) {
      fail(FSDP_ERR_INVALID_ARGUMENT, "fsdp_param_set_values on unit '" + name_ + "' (" + rt_.where() +
                                          "): another rank passed a bad argument (see its error); "
                                          "nothing was changed");
    }
  }
  if (status != FSDP_OK) {
    fail(status, "fsdp_param_set_values on unit '" + name_ + "' (" + rt_.where() + "): " + problem);
  }
  std::vector<float> from_root;
  if (sync) {
    from_root.resize(numel);
    if (rt_.rank == 0) std::memcpy(from_root.data(), values, numel * sizeof(float));
    rt_.comm->broadcast(from_root.data(), numel * sizeof(float), 0, label("fsdp_param_set_values broadcast"));
    values = from_root.data();
  }
  size_t off = layout_.param_offset(param_index);
  size_t lo = std::max(off, shard_offset());
  size_t hi = std::min(off + numel, shard_offset() + shard_numel());
  if (lo < hi) {
    size_t dst = lo - shard_offset();
    rt_.dev->copy_from_host(master() + dst, values + (lo - off), (hi - lo) * sizeof(float));
    if (!lowp_.empty()) {
      size_t es = dtype_size(lowp_.dtype());
      rt_.dev->cast(static_cast<char*>(lowp_.data()) + dst * es, lowp_.dtype(), master() + dst, DType::kFp32, hi - lo);
    }
  }
  drop_stale_gathered();
}

void Unit::set_weight_decay(size_t param_index, double weight_decay) {
  check_param_index(param_index, "fsdp_param_set_weight_decay");
  if (!(weight_decay >= 0.0 && weight_decay < 1e9)) {
    fail(FSDP_ERR_INVALID_ARGUMENT,
         "fsdp_param_set_weight_decay: weight decay must be a number >= 0, not " + std::to_string(weight_decay));
  }
  weight_decay_[param_index] = weight_decay;
}

void Unit::gather() {
  size_t es = dtype_size(rt_.opts.param_dtype);
  Buffer full(rt_.dev, &rt_.mem, MemCategory::kGatheredParams, rt_.opts.param_dtype, layout_.padded_numel(),
              /*zeroed=*/false);
  const void* src = lowp_.empty() ? master_.data() : lowp_.data();
  rt_.comm->all_gather(src, full.data(), shard_numel() * es, label("all_gather"));
  gathered_ = std::move(full);
}

void Unit::forward_begin() {
  if (state_ != UnitState::kSharded && state_ != UnitState::kGathered) {
    bad_state("fsdp_forward_begin", "the unit outside forward and backward");
  }
  if (state_ == UnitState::kSharded) gather();
  state_ = UnitState::kForward;
}

void Unit::forward_end() {
  if (state_ != UnitState::kForward) bad_state("fsdp_forward_end", "the unit in forward (after fsdp_forward_begin)");
  if (rt_.opts.sharding == Sharding::kFullShard) {
    gathered_.reset();
    state_ = UnitState::kSharded;
  } else {
    state_ = UnitState::kGathered;  // kept for backward
  }
}

void Unit::backward_begin() {
  if (state_ != UnitState::kSharded && state_ != UnitState::kGathered) {
    bad_state("fsdp_backward_begin", "the unit outside forward and backward");
  }
  if (state_ == UnitState::kSharded) gather();
  if (!grads_pending_) {
    ugrad_ = Buffer(rt_.dev, &rt_.mem, MemCategory::kUnshardedGrads, rt_.opts.param_dtype, layout_.padded_numel());
  }
  state_ = UnitState::kBackward;
}

void Unit::backward_end() {
  if (state_ != UnitState::kBackward) {
    bad_state("fsdp_backward_end", "the unit in backward (after fsdp_backward_begin)");
  }
  if (rt_.grad_sync) {
    reduce_grads();
  } else {
    grads_pending_ = true;
  }
  if (rt_.sharded()) {
    gathered_.reset();
    state_ = UnitState::kSharded;
  } else {
    state_ = UnitState::kGathered;
  }
}

void Unit::reduce_grads() {
  DType pd = rt_.opts.param_dtype;
  DType rd = rt_.opts.reduce_dtype();
  size_t padded = layout_.padded_numel();
  Buffer converted;
  void* src = ugrad_.data();
  if (rd != pd) {
    converted = Buffer(rt_.dev, &rt_.mem, MemCategory::kScratch, rd, padded, /*zeroed=*/false);
    rt_.dev->cast(converted.data(), rd, ugrad_.data(), pd, padded);
    src = converted.data();
  }
  auto op = rt_.opts.reduce_op == ReduceOp::kAvg ? comm::RedOp::kAvg : comm::RedOp::kSum;
  if (rt_.sharded()) {
    Buffer reduced(rt_.dev, &rt_.mem, MemCategory::kScratch, rd, shard_numel(), /*zeroed=*/false);
    rt_.comm->reduce_scatter(src, reduced.data(), shard_numel(), rd, op, label("reduce_scatter"));
    rt_.dev->accumulate(sharded_grad(), reduced.data(), rd, 1.0f, shard_numel());
  } else {
    rt_.comm->all_reduce(src, src, padded, rd, op, label("all_reduce"));
    rt_.dev->accumulate(sharded_grad(), src, rd, 1.0f, padded);
  }
  ugrad_.reset();
  grads_pending_ = false;
}

void Unit::reduce_pending_grads() {
  if (grads_pending_) reduce_grads();
}

void Unit::drop_stale_gathered() {
  if (state_ == UnitState::kGathered && rt_.sharded()) {
    gathered_.reset();
    state_ = UnitState::kSharded;
  }
}

void* Unit::param_ptr(size_t param_index) {
  check_param_index(param_index, "fsdp_param_ptr");
  if (!in_use()) bad_state("fsdp_param_ptr", "the unit in forward or backward (between *_begin and *_end)");
  return static_cast<char*>(full_params()) + layout_.param_offset(param_index) * dtype_size(rt_.opts.param_dtype);
}

void* Unit::grad_ptr(size_t param_index) {
  check_param_index(param_index, "fsdp_grad_ptr");
  if (state_ != UnitState::kBackward) {
    bad_state("fsdp_grad_ptr", "the unit in backward (between fsdp_backward_begin and fsdp_backward_end)");
  }
  return static_cast<char*>(ugrad_.data()) + layout_.param_offset(param_index) * dtype_size(rt_.opts.param_dtype);
}

void Unit::gather_param(size_t param_index, float* out, size_t numel) {
  check_param_index(param_index, "fsdp_gather_param");
  if (numel != layout_.param(param_index).numel) {
    fail(FSDP_ERR_INVALID_ARGUMENT, "fsdp_gather_param: param '" + layout_.param(param_index).name + "' has " +
                                        std::to_string(layout_.param(param_index).numel) + " elements, not " +
                                        std::to_string(numel));
  }
  if (in_use()) bad_state("fsdp_gather_param", "the unit outside forward and backward");
  size_t off = layout_.param_offset(param_index);
  if (!rt_.sharded()) {
    rt_.dev->copy_to_host(out, master() + off, numel * sizeof(float));
    return;
  }
  Buffer full(rt_.dev, &rt_.mem, MemCategory::kScratch, DType::kFp32, layout_.padded_numel(), /*zeroed=*/false);
  rt_.comm->all_gather(master(), full.data(), shard_numel() * sizeof(float), label("fsdp_gather_param"));
  rt_.dev->copy_to_host(out, full.as<float>() + off, numel * sizeof(float));
}

}  // namespace fsdp::core
