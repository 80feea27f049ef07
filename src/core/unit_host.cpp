// src/core/unit_host.cpp - what the host reads and writes of a unit: its
// values (fsdp_param_set_values, a checkpoint's load), the pointers it
// computes on, the grads a framework adds from its own memory
// (fsdp_grad_accumulate), full copies of params and grads gathered for it,
// and the layout change that freezing a param makes (see unit.h). The state
// machine, gathers and reductions are unit.cpp's.
#include <algorithm>
#include <cstring>

#include "../base/error.h"
#include "../base/text.h"
#include "unit.h"

namespace fsdp::core {

void Unit::set_values(size_t param_index, const float* values, size_t numel) {
  // With sync_module_states the call is collective, so validate together: one
  // rank's bad argument must fail every rank, not leave them waiting.
  bool sync = rt_.opts.sync_module_states && rt_.world > 1;
  std::string problem;
  if (param_index >= layout_.n_params()) {
    problem = "index " + std::to_string(param_index) + " is out of range (unit has " +
              std::to_string(layout_.n_params()) + " params)";
  } else if (numel != layout_.param(param_index).numel) {
    problem = "param " + base::quote(layout_.param(param_index).name) + " has " +
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
      fail(FSDP_ERR_INVALID_ARGUMENT, "fsdp_param_set_values on unit " + base::quote(name_) + " (" + rt_.where() +
                                          "): another rank passed a bad argument (see its error); "
                                          "nothing was changed");
    }
  }
  if (status != FSDP_OK) {
    fail(status, "fsdp_param_set_values on unit " + base::quote(name_) + " (" + rt_.where() + "): " + problem);
  }
  std::vector<float> from_root;
  if (sync) {
    from_root.resize(numel);
    if (rt_.rank == 0) std::memcpy(from_root.data(), values, numel * sizeof(float));
    rt_.comm->broadcast(from_root.data(), numel * sizeof(float), 0, label("fsdp_param_set_values broadcast"));
    values = from_root.data();
  }
  // A prefetched gather may be reading the shard: wait for it, and drop the
  // gathered copy that the new values make stale. Without gathers the
  // caller's stream reads the shard itself: wait until it is done.
  drop_stale_gathered();
  if (!rt_.gathers()) wait_host_use();
  rt_.wait_step();  // the update in flight writes the shard too
  for (const ShardSegment& seg : segments_) {
    if (seg.param_index != param_index) continue;
    size_t dst = seg.shard_begin;
    rt_.state_dev->copy_from_host(master() + dst, values + seg.param_begin, seg.numel * sizeof(float));
    if (!lowp_.empty()) {
      size_t es = dtype_size(lowp_.dtype());
      rt_.state_dev->cast(static_cast<char*>(lowp_.data()) + dst * es, lowp_.dtype(), master() + dst, DType::kFp32,
                          seg.numel);
    }
  }
}

float* Unit::master_for_load() {
  if (in_use() || holds_gathered()) {
    fail(FSDP_ERR_INTERNAL, "master_for_load on unit " + base::quote(name_) + " in state " + unit_state_name(state_));
  }
  if (!rt_.gathers()) wait_host_use();  // the caller's stream may still read the shard in place
  rt_.wait_step();
  return master();
}

void Unit::master_loaded() {
  if (!lowp_.empty()) rt_.state_dev->cast(lowp_.data(), lowp_.dtype(), master_.data(), DType::kFp32, shard_numel());
  if (!sgrad_.empty()) rt_.state_dev->zero(sgrad_.data(), sgrad_.nbytes());
  grads_pending_ = false;
  grads_in_shard_ = false;
  grads_reset();
}

void* Unit::param_ptr(size_t param_index) {
  check_param_index(param_index, "fsdp_param_ptr");
  if (!in_use()) bad_state("fsdp_param_ptr", "the unit in forward or backward (between *_begin and *_end)");
  return static_cast<char*>(full_params()) + layout_.param_offset(param_index) * dtype_size(rt_.opts.param_dtype);
}

void Unit::set_trainable(bool trainable) {
  if (trainable == trainable_) return;
  trainable_ = trainable;
  sgrad_ = trainable ? Buffer(rt_.state_dev, &rt_.mem, MemCategory::kShardedGrads, DType::kFp32, trainable_shard_numel())
                     : Buffer();
  grads_reset();
  trace_memory();
}

void Unit::refuse_frozen(const char* call) const {
  if (trainable_) return;
  fail(FSDP_ERR_INVALID_STATE, std::string(call) + " on unit " + base::quote(name_) + " (" + rt_.where() +
                                   "): the unit is frozen (fsdp_unit_set_trainable(unit, 0)), so its params have "
                                   "no grads; its backward computes only the grads of its inputs");
}

void Unit::refuse_frozen_param(size_t param_index, const char* call) const {
  if (param_trainable(param_index)) return;
  fail(FSDP_ERR_INVALID_STATE, std::string(call) + ": param " + base::quote(layout_.param(param_index).name) +
                                   " of unit " + base::quote(name_) + " (" + rt_.where() +
                                   ") is frozen (fsdp_param_set_trainable), so it has no grads");
}

void* Unit::grad_at(size_t param_index, const char* call) {
  check_param_index(param_index, call);
  if (state_ != UnitState::kBackward) {
    bad_state(call, "the unit in backward (between fsdp_backward_begin and fsdp_backward_end)");
  }
  refuse_frozen(call);
  refuse_frozen_param(param_index, call);
  void* grads = grads_in_shard_ ? sgrad_.data() : ugrad_.data();
  return static_cast<char*>(grads) + layout_.param_offset(param_index) * dtype_size(rt_.opts.param_dtype);
}

void* Unit::grad_ptr(size_t param_index) { return grad_at(param_index, "fsdp_grad_ptr"); }

void Unit::grad_accumulate(size_t param_index, const void* src, DType src_dtype, size_t numel, device::Stream& s) {
  static const char* const kCall = "fsdp_grad_accumulate";
  void* grad = grad_at(param_index, kCall);
  const ParamSpec& p = layout_.param(param_index);
  if (numel != p.numel) {
    fail(FSDP_ERR_INVALID_ARGUMENT, std::string(kCall) + ": param " + base::quote(p.name) + " of unit " + unit_tag() +
                                        " has " + std::to_string(p.numel) + " elements, not " + std::to_string(numel));
  }
  if (numel == 0) return;
  // The grad buffer is the compute device's (the grad shard itself only
  // where that lives there too: alone, without offload).
  device::Device* dev = grads_in_shard_ ? rt_.state_dev : rt_.dev;
  if (!dev->readable(src)) {
    fail(FSDP_ERR_INVALID_ARGUMENT, std::string(kCall) + ": src for param " +
                                        base::quote(p.name) + " of unit " + unit_tag() + " is memory the " +
                                        dev->name() + " device cannot read; pass a pointer on the unit's device");
  }
  const DType dt = rt_.opts.param_dtype;
  // Queued on the caller's stream after its work so far (the framework's
  // grad is written there), before the *_end that reduces the grads.
  s.submit(tasks_.add_grad, [dev, grad, dt, src, src_dtype, numel] { dev->add(grad, dt, src, src_dtype, numel); });
}

void Unit::check_gather_out(size_t param_index, size_t numel, const char* call) const {
  check_param_index(param_index, call);
  if (numel != layout_.param(param_index).numel) {
    fail(FSDP_ERR_INVALID_ARGUMENT, std::string(call) + ": param " + base::quote(layout_.param(param_index).name) +
                                        " has " + std::to_string(layout_.param(param_index).numel) + " elements, not " +
                                        std::to_string(numel));
  }
  if (in_use()) bad_state(call, "the unit outside forward and backward");
}

void Unit::gather_param(size_t param_index, float* out, size_t numel) {
  check_gather_out(param_index, numel, "fsdp_gather_param");
  rt_.wait_step();  // the update in flight writes the master
  gather_shard(master(), /*grads=*/false, param_index, out, numel, "fsdp_gather_param");
}

void Unit::gather_grad(size_t param_index, float* out, size_t numel) {
  check_gather_out(param_index, numel, "fsdp_gather_grad");
  refuse_frozen("fsdp_gather_grad");
  refuse_frozen_param(param_index, "fsdp_gather_grad");
  if (grads_pending_) {
    fail(FSDP_ERR_INVALID_STATE, "fsdp_gather_grad on unit " + base::quote(name_) + " (" + rt_.where() +
                                     "): its grads were accumulated with gradient sync off and are not reduced yet; "
                                     "turn sync on (fsdp_set_grad_sync) and run a backward pass first");
  }
  // The grad shard is complete once the reduction queued for it and the
  // caller's stream's own writes into it (a world of one) are done.
  wait_host_use();
  wait_reductions();
  rt_.wait_step();
  gather_shard(sharded_grad(), /*grads=*/true, param_index, out, numel, "fsdp_gather_grad");
}

void Unit::gather_shard(const float* shard, bool grads, size_t param_index, float* out, size_t numel,
                        const char* call) {
  size_t off = layout_.param_offset(param_index);
  if (rt_.shard_world() == 1) {  // this rank's shard holds every param
    rt_.state_dev->copy_to_host(out, shard + off, numel * sizeof(float));
    return;
  }
  Buffer full = gather_on_device(shard, grads, call);
  rt_.dev->copy_to_host(out, full.as<float>() + off, numel * sizeof(float));
}

Buffer Unit::gather_on_device(const float* shard, bool trainable_block, const char* call) {
  rt_.wait_step();  // the shard (a master, a state) is the update's until it is done
  const size_t n = trainable_block ? trainable_shard_numel() : shard_numel();
  // The collective runs on the compute device: an offloaded shard is staged there.
  const float* src = shard;
  Buffer staged;
  if (rt_.offload()) {
    staged = Buffer(rt_.dev, &rt_.mem, MemCategory::kScratch, DType::kFp32, n, /*zeroed=*/false);
    rt_.dev->copy_from_host(staged.data(), shard, n * sizeof(float));
    src = staged.as<float>();
  }
  Buffer full(rt_.dev, &rt_.mem, MemCategory::kScratch, DType::kFp32, n * static_cast<size_t>(rt_.shard_world()),
              /*zeroed=*/false);
  gather_blocks(*rt_.shard_sync, src, full.data(), sizeof(float), trainable_block, label(call));
  return full;
}

std::vector<float> Unit::gather_to_host(const float* shard, bool trainable_block, const char* call) {
  const size_t n = trainable_block ? trainable_shard_numel() : shard_numel();
  const size_t w = static_cast<size_t>(rt_.shard_world());
  std::vector<float> out(n * w);
  if (n == 0) return out;
  if (w == 1) {
    rt_.wait_step();
    rt_.state_dev->copy_to_host(out.data(), shard, n * sizeof(float));
    return out;
  }
  Buffer full = gather_on_device(shard, trainable_block, call);
  rt_.dev->copy_to_host(out.data(), full.data(), n * w * sizeof(float));
  return out;
}

void Unit::relayout(const std::vector<bool>& frozen) {
  drop_stale_gathered();
  if (!rt_.gathers()) wait_host_use();
  const std::vector<float> old_flat = gather_to_host(master(), false, "fsdp_param_set_trainable");
  const FlatLayout old = layout_;
  layout_ = FlatLayout(old.params(), rt_.opts.align_bytes / sizeof(float), rt_.shard_world(), frozen);
  segments_ = layout_.shard_segments(rt_.shard_rank());
  block_slices_ = layout_.shard_ranges(0);
  std::vector<float> shard(layout_.shard_numel(), 0.0f);  // padding: zero
  for (const ShardSegment& seg : segments_) {
    const float* from = old_flat.data() + old.param_offset(seg.param_index) + seg.param_begin;
    std::copy(from, from + seg.numel, shard.begin() + static_cast<ptrdiff_t>(seg.shard_begin));
  }
  master_ = Buffer(rt_.state_dev, &rt_.mem, MemCategory::kShardedParams, DType::kFp32, shard.size());
  rt_.state_dev->copy_from_host(master_.data(), shard.data(), shard.size() * sizeof(float));
  if (!lowp_.empty()) {
    lowp_ = Buffer(rt_.state_dev, &rt_.mem, MemCategory::kShardedParams, lowp_.dtype(), shard.size());
    rt_.state_dev->cast(lowp_.data(), lowp_.dtype(), master_.data(), DType::kFp32, shard.size());
  }
  if (trainable_) {
    sgrad_ = Buffer(rt_.state_dev, &rt_.mem, MemCategory::kShardedGrads, DType::kFp32, trainable_shard_numel());
  }
  grads_reset();
  make_task_labels();
  trace_memory();
}

}  // namespace fsdp::core
