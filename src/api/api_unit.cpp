// src/api/api_unit.cpp - C ABI for units, the training step, parameter access
// and memory statistics.
#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "../base/text.h"
#include "../core/context.h"
#include "guard.h"

namespace base = fsdp::base;
using fsdp::fail;
using fsdp::ParamSpec;
using fsdp::api::guard;
using fsdp::api::require;
using fsdp::core::Context;
using fsdp::core::Unit;

namespace {

Context* ctx_of(fsdp_ctx_t* c) { return reinterpret_cast<Context*>(c); }
const Context* ctx_of(const fsdp_ctx_t* c) { return reinterpret_cast<const Context*>(c); }

// The unit behind a handle, after the checks every unit call shares.
Unit& live_unit(fsdp_unit_t* u, const char* call) {
  require(u, call, "unit");
  Unit& unit = *reinterpret_cast<Unit*>(u);
  unit.runtime().check_live(call);
  return unit;
}

// A call on a unit of `ctx`: both live, and the unit is the context's.
Unit& ctx_unit(fsdp_ctx_t* ctx, fsdp_unit_t* unit, const char* call) {
  require(ctx, call, "ctx");
  ctx_of(ctx)->check_live(call);
  Unit& u = live_unit(unit, call);
  if (!ctx_of(ctx)->owns(u)) {
    fail(FSDP_ERR_INVALID_ARGUMENT,
         std::string(call) + ": unit " + base::quote(u.name()) + " belongs to another context");
  }
  return u;
}

// A versioned struct (fsdp_memory_stats_t, fsdp_comm_stats_t): `fill` sets
// every field of a whole one, of which the caller's struct_size bytes (at
// most the whole) are copied out, struct_size saying how many.
template <typename T, typename Fill>
void write_versioned(const fsdp_ctx_t* ctx, T* out, const char* call, const char* type, Fill fill) {
  require(ctx, call, "ctx");
  require(out, call, "stats");
  ctx_of(ctx)->check_live(call);
  if (out->struct_size < sizeof(size_t)) {
    fail(FSDP_ERR_INVALID_ARGUMENT,
         std::string(call) + ": set stats->struct_size = sizeof(" + type + ") before the call");
  }
  T full;
  fill(full);
  full.struct_size = std::min(out->struct_size, sizeof(full));
  std::memcpy(out, &full, full.struct_size);
}

// The four *_begin/*_end calls: same checks, one Unit transition each.
fsdp_status_t phase_call(fsdp_unit_t* unit, void* stream, const char* call,
                         void (Unit::*transition)(fsdp::device::Stream&)) {
  return guard([&] {
    Unit& u = live_unit(unit, call);
    (u.*transition)(u.caller_stream(stream, call));
  });
}

// Builds the param specs from the C arrays; returns why they are invalid ("" if
// they are fine) instead of throwing, so that registration can still join the
// other ranks.
std::string read_params(const char* name, size_t n_params, const char* const* names, const int32_t* ndims,
                        const int64_t* dims, const fsdp_unit_t* const* out, std::vector<ParamSpec>& params) {
  if (name == nullptr || name[0] == '\0') return "the unit name is NULL or empty";
  if (std::string why = base::name_problem(name); !why.empty()) return "the unit name " + why;
  if (out == nullptr) return "out is NULL";
  if (n_params == 0) return "n_params is 0; a unit needs at least one param";
  if (names == nullptr) return "names is NULL";
  if (ndims == nullptr) return "ndims is NULL";
  size_t dim_pos = 0;
  for (size_t i = 0; i < n_params; ++i) {
    if (names[i] == nullptr || names[i][0] == '\0') return "names[" + std::to_string(i) + "] is NULL or empty";
    if (std::string why = base::name_problem(names[i]); !why.empty()) {
      return "names[" + std::to_string(i) + "] " + base::quote(names[i]) + " " + why;
    }
    if (ndims[i] < 0 || ndims[i] > 16) {
      return "param " + base::quote(names[i]) + " has ndims " + std::to_string(ndims[i]) + "; expected 0 to 16";
    }
    if (ndims[i] > 0 && dims == nullptr) return "dims is NULL";
    ParamSpec p;
    p.name = names[i];
    p.numel = 1;
    for (int32_t d = 0; d < ndims[i]; ++d) {
      int64_t extent = dims[dim_pos++];
      if (extent < 0) {
        return "param " + base::quote(p.name) + " has a negative dimension (" + std::to_string(extent) + ")";
      }
      if (extent != 0 && p.numel > (std::numeric_limits<size_t>::max() >> 8) / static_cast<size_t>(extent)) {
        return "param " + base::quote(p.name) + " is too large";
      }
      p.shape.push_back(extent);
      p.numel *= static_cast<size_t>(extent);
    }
    params.push_back(std::move(p));
  }
  return "";
}

}  // namespace

extern "C" {

fsdp_status_t fsdp_unit_register(fsdp_ctx_t* ctx, const char* name, size_t n_params, const char* const* names,
                                 const int32_t* ndims, const int64_t* dims, fsdp_unit_t** out) {
  return guard([&] {
    require(ctx, "fsdp_unit_register", "ctx");
    ctx_of(ctx)->check_live("fsdp_unit_register");
    std::vector<ParamSpec> params;
    std::string problem = read_params(name, n_params, names, ndims, dims, out, params);
    Unit& unit = ctx_of(ctx)->register_unit(name != nullptr ? name : "", std::move(params), problem);
    *out = reinterpret_cast<fsdp_unit_t*>(&unit);
  });
}

fsdp_status_t fsdp_unit_register_trainable(fsdp_ctx_t* ctx, const char* name, size_t n_params,
                                           const char* const* names, const int32_t* ndims, const int64_t* dims,
                                           const int32_t* trainable, fsdp_unit_t** out) {
  return guard([&] {
    const char* call = "fsdp_unit_register_trainable";
    require(ctx, call, "ctx");
    ctx_of(ctx)->check_live(call);
    std::vector<ParamSpec> params;
    std::string problem = read_params(name, n_params, names, ndims, dims, out, params);
    std::vector<bool> frozen;
    if (trainable != nullptr && problem.empty()) {
      for (size_t i = 0; i < n_params; ++i) {
        if (trainable[i] != 0 && trainable[i] != 1 && problem.empty()) {
          problem = "trainable[" + std::to_string(i) + "] is " + std::to_string(trainable[i]) + ", not 0 or 1";
        }
        frozen.push_back(trainable[i] == 0);
      }
    }
    Unit& unit = ctx_of(ctx)->register_unit(name != nullptr ? name : "", std::move(params), problem,
                                            std::move(frozen));
    *out = reinterpret_cast<fsdp_unit_t*>(&unit);
  });
}

fsdp_status_t fsdp_param_set_values(fsdp_unit_t* unit, size_t param_index, const float* values, size_t numel) {
  return guard([&] { live_unit(unit, "fsdp_param_set_values").set_values(param_index, values, numel); });
}

fsdp_status_t fsdp_param_set_weight_decay(fsdp_unit_t* unit, size_t param_index, double weight_decay) {
  return guard([&] { live_unit(unit, "fsdp_param_set_weight_decay").set_weight_decay(param_index, weight_decay); });
}

fsdp_status_t fsdp_unit_set_trainable(fsdp_ctx_t* ctx, fsdp_unit_t* unit, int trainable) {
  return guard([&] {
    const char* call = "fsdp_unit_set_trainable";
    Unit& u = ctx_unit(ctx, unit, call);
    if (trainable != 0 && trainable != 1) {
      fail(FSDP_ERR_INVALID_ARGUMENT,
           std::string(call) + ": trainable is " + std::to_string(trainable) + "; pass 1 (train) or 0 (freeze)");
    }
    ctx_of(ctx)->set_trainable(u, trainable == 1);
  });
}

fsdp_status_t fsdp_unit_trainable(const fsdp_unit_t* unit, int* trainable) {
  return guard([&] {
    require(unit, "fsdp_unit_trainable", "unit");
    require(trainable, "fsdp_unit_trainable", "trainable");
    const Unit& u = *reinterpret_cast<const Unit*>(unit);
    u.runtime().check_live("fsdp_unit_trainable");
    *trainable = u.trainable() ? 1 : 0;
  });
}

fsdp_status_t fsdp_param_set_trainable(fsdp_ctx_t* ctx, fsdp_unit_t* unit, size_t param_index, int trainable) {
  return guard([&] {
    const char* call = "fsdp_param_set_trainable";
    Unit& u = ctx_unit(ctx, unit, call);
    u.check_param_index(param_index, call);
    if (trainable != 0 && trainable != 1) {
      fail(FSDP_ERR_INVALID_ARGUMENT,
           std::string(call) + ": trainable is " + std::to_string(trainable) + "; pass 1 (train) or 0 (freeze)");
    }
    ctx_of(ctx)->set_param_trainable(u, param_index, trainable == 1);
  });
}

fsdp_status_t fsdp_param_trainable(const fsdp_unit_t* unit, size_t param_index, int* trainable) {
  return guard([&] {
    require(unit, "fsdp_param_trainable", "unit");
    require(trainable, "fsdp_param_trainable", "trainable");
    const Unit& u = *reinterpret_cast<const Unit*>(unit);
    u.runtime().check_live("fsdp_param_trainable");
    u.check_param_index(param_index, "fsdp_param_trainable");
    *trainable = u.param_trainable(param_index) ? 1 : 0;
  });
}

fsdp_status_t fsdp_set_param_group(fsdp_ctx_t* ctx, const char* pattern, const char* options, size_t* matched) {
  return guard([&] {
    const char* call = "fsdp_set_param_group";
    require(ctx, call, "ctx");
    require(pattern, call, "pattern");
    require(options, call, "options");
    ctx_of(ctx)->check_live(call);
    size_t n = ctx_of(ctx)->set_param_group(pattern, options);
    if (matched != nullptr) *matched = n;
  });
}

fsdp_status_t fsdp_step_begin(fsdp_ctx_t* ctx, void* stream, int* update, float* grad_scale) {
  return guard([&] {
    const char* call = "fsdp_step_begin";
    require(ctx, call, "ctx");
    require(update, call, "update");
    require(grad_scale, call, "grad_scale");
    ctx_of(ctx)->check_live(call);
    float scale = 1.0f;
    bool go = ctx_of(ctx)->step_begin(ctx_of(ctx)->caller_stream(stream, call), &scale);
    *update = go ? 1 : 0;
    *grad_scale = go ? scale : 0.0f;
  });
}

fsdp_status_t fsdp_shard_tensors(fsdp_ctx_t* ctx, fsdp_unit_t* unit, float** params, float** grads, float** states,
                                 size_t n_states, size_t* numel) {
  return guard([&] {
    const char* call = "fsdp_shard_tensors";
    Unit& u = ctx_unit(ctx, unit, call);
    require(params, call, "params");
    require(grads, call, "grads");
    require(numel, call, "numel");
    if (n_states > 0) require(states, call, "states");
    if (u.runtime().opts.optimizer != fsdp::core::OptimizerKind::kHost) {
      fail(FSDP_ERR_INVALID_STATE, std::string(call) + " on unit " + base::quote(u.name()) +
                                       ": only with optimizer=host (the host updates the shards itself)");
    }
    // Outside the host's step: the same buffers, once the step in flight is
    // done, for a binding to make its views of them (written only inside).
    if (!u.runtime().host_step_open) u.runtime().wait_step();
    if (!u.trainable()) {
      fail(FSDP_ERR_INVALID_STATE, std::string(call) + " on unit " + base::quote(u.name()) +
                                       ": the unit is frozen, so it has no grads or state to update");
    }
    const size_t have = static_cast<size_t>(u.runtime().opts.host_state);
    if (n_states != have) {
      fail(FSDP_ERR_INVALID_ARGUMENT, std::string(call) + ": n_states is " + std::to_string(n_states) +
                                          ", but host_state=" + std::to_string(have) + " buffers are kept");
    }
    *params = u.master();
    *grads = u.sharded_grad();
    for (size_t i = 0; i < n_states; ++i) states[i] = ctx_of(ctx)->optimizer_state(u, i);
    *numel = u.trainable_shard_numel();  // the trainable block's slice: the front of the master
  });
}

fsdp_status_t fsdp_step_end(fsdp_ctx_t* ctx, void* stream) {
  return guard([&] {
    const char* call = "fsdp_step_end";
    require(ctx, call, "ctx");
    ctx_of(ctx)->check_live(call);
    ctx_of(ctx)->step_end(ctx_of(ctx)->caller_stream(stream, call));
  });
}

fsdp_status_t fsdp_forward_begin(fsdp_unit_t* unit, void* stream) {
  return phase_call(unit, stream, "fsdp_forward_begin", &Unit::forward_begin);
}

fsdp_status_t fsdp_forward_end(fsdp_unit_t* unit, void* stream) {
  return phase_call(unit, stream, "fsdp_forward_end", &Unit::forward_end);
}

fsdp_status_t fsdp_backward_begin(fsdp_unit_t* unit, void* stream) {
  return phase_call(unit, stream, "fsdp_backward_begin", &Unit::backward_begin);
}

fsdp_status_t fsdp_backward_end(fsdp_unit_t* unit, void* stream) {
  return phase_call(unit, stream, "fsdp_backward_end", &Unit::backward_end);
}

fsdp_status_t fsdp_param_ptr(fsdp_unit_t* unit, size_t param_index, void** ptr) {
  return guard([&] {
    Unit& u = live_unit(unit, "fsdp_param_ptr");
    require(ptr, "fsdp_param_ptr", "ptr");
    *ptr = u.param_ptr(param_index);
  });
}

fsdp_status_t fsdp_grad_ptr(fsdp_unit_t* unit, size_t param_index, void** ptr) {
  return guard([&] {
    Unit& u = live_unit(unit, "fsdp_grad_ptr");
    require(ptr, "fsdp_grad_ptr", "ptr");
    *ptr = u.grad_ptr(param_index);
  });
}

fsdp_status_t fsdp_grad_accumulate(fsdp_unit_t* unit, size_t param_index, const void* src, fsdp_dtype_t src_dtype,
                                   size_t numel, void* stream) {
  // Any int may come in as the enum (see fsdp_metrics_reduce): its bytes.
  int dtype_value = 0;
  static_assert(sizeof dtype_value == sizeof src_dtype, "fsdp_dtype_t is an int");
  std::memcpy(&dtype_value, &src_dtype, sizeof dtype_value);
  return guard([&] {
    const char* call = "fsdp_grad_accumulate";
    Unit& u = live_unit(unit, call);
    if (numel != 0) require(src, call, "src");
    if (dtype_value != FSDP_DTYPE_FP32 && dtype_value != FSDP_DTYPE_BF16 && dtype_value != FSDP_DTYPE_FP16) {
      fail(FSDP_ERR_INVALID_ARGUMENT, std::string(call) + ": src_dtype " + std::to_string(dtype_value) +
                                          " is none of FSDP_DTYPE_FP32, FSDP_DTYPE_BF16, FSDP_DTYPE_FP16");
    }
    u.grad_accumulate(param_index, src, static_cast<fsdp::DType>(dtype_value), numel, u.caller_stream(stream, call));
  });
}

fsdp_status_t fsdp_step(fsdp_ctx_t* ctx, void* stream) {
  return guard([&] {
    require(ctx, "fsdp_step", "ctx");
    ctx_of(ctx)->check_live("fsdp_step");
    ctx_of(ctx)->step(ctx_of(ctx)->caller_stream(stream, "fsdp_step"));
  });
}

fsdp_status_t fsdp_clip_grad_norm(fsdp_ctx_t* ctx, void* stream, double max_norm, double* total_norm) {
  return guard([&] {
    const char* call = "fsdp_clip_grad_norm";
    require(ctx, call, "ctx");
    require(total_norm, call, "total_norm");
    ctx_of(ctx)->check_live(call);
    *total_norm = ctx_of(ctx)->clip_grad_norm(ctx_of(ctx)->caller_stream(stream, call), max_norm);
  });
}

fsdp_status_t fsdp_set_grad_sync(fsdp_ctx_t* ctx, int enabled) {
  return guard([&] {
    require(ctx, "fsdp_set_grad_sync", "ctx");
    ctx_of(ctx)->check_live("fsdp_set_grad_sync");
    ctx_of(ctx)->set_grad_sync(enabled != 0);
  });
}

fsdp_status_t fsdp_set_lr(fsdp_ctx_t* ctx, double lr) {
  return guard([&] {
    require(ctx, "fsdp_set_lr", "ctx");
    ctx_of(ctx)->check_live("fsdp_set_lr");
    ctx_of(ctx)->set_lr(lr);
  });
}

fsdp_status_t fsdp_last_grad_norm(const fsdp_ctx_t* ctx, double* norm) {
  return guard([&] {
    require(ctx, "fsdp_last_grad_norm", "ctx");
    require(norm, "fsdp_last_grad_norm", "norm");
    ctx_of(ctx)->check_live("fsdp_last_grad_norm");
    *norm = ctx_of(ctx)->last_grad_norm();
  });
}

fsdp_status_t fsdp_ctx_step(const fsdp_ctx_t* ctx, uint64_t* step) {
  return guard([&] {
    require(ctx, "fsdp_ctx_step", "ctx");
    require(step, "fsdp_ctx_step", "step");
    ctx_of(ctx)->check_live("fsdp_ctx_step");
    *step = ctx_of(ctx)->step_count();
  });
}

fsdp_status_t fsdp_metrics_reduce(fsdp_ctx_t* ctx, double* values, size_t count, fsdp_reduce_op_t op) {
  // A C caller may pass any int as the enum; in C++ reading a value outside
  // the enumerators' range as the enum type is undefined, so take its bytes.
  int op_value = 0;
  static_assert(sizeof op_value == sizeof op, "fsdp_reduce_op_t is an int");
  std::memcpy(&op_value, &op, sizeof op_value);
  return guard([&] {
    require(ctx, "fsdp_metrics_reduce", "ctx");
    if (count > 0) require(values, "fsdp_metrics_reduce", "values");
    ctx_of(ctx)->check_live("fsdp_metrics_reduce");
    ctx_of(ctx)->metrics_reduce(values, count, op_value);
  });
}

fsdp_status_t fsdp_loss_scale(const fsdp_ctx_t* ctx, double* scale, uint64_t* skipped_steps) {
  return guard([&] {
    require(ctx, "fsdp_loss_scale", "ctx");
    require(scale, "fsdp_loss_scale", "scale");
    require(skipped_steps, "fsdp_loss_scale", "skipped_steps");
    ctx_of(ctx)->check_live("fsdp_loss_scale");
    *scale = ctx_of(ctx)->loss_scaler().scale();
    *skipped_steps = ctx_of(ctx)->loss_scaler().skipped_steps();
  });
}

fsdp_status_t fsdp_loss_scale_device(fsdp_ctx_t* ctx, const double** scale) {
  return guard([&] {
    require(ctx, "fsdp_loss_scale_device", "ctx");
    require(scale, "fsdp_loss_scale_device", "scale");
    ctx_of(ctx)->check_live("fsdp_loss_scale_device");
    *scale = ctx_of(ctx)->loss_scale_device();
  });
}

fsdp_status_t fsdp_gather_param(fsdp_unit_t* unit, size_t param_index, float* out, size_t numel) {
  return guard([&] {
    Unit& u = live_unit(unit, "fsdp_gather_param");
    require(out, "fsdp_gather_param", "out");
    u.gather_param(param_index, out, numel);
  });
}

fsdp_status_t fsdp_gather_grad(fsdp_unit_t* unit, size_t param_index, float* out, size_t numel) {
  return guard([&] {
    Unit& u = live_unit(unit, "fsdp_gather_grad");
    require(out, "fsdp_gather_grad", "out");
    u.gather_grad(param_index, out, numel);
  });
}

fsdp_status_t fsdp_shard_info(fsdp_unit_t* unit, float** ptr, size_t* offset, size_t* numel) {
  return guard([&] {
    Unit& u = live_unit(unit, "fsdp_shard_info");
    require(ptr, "fsdp_shard_info", "ptr");
    require(offset, "fsdp_shard_info", "offset");
    require(numel, "fsdp_shard_info", "numel");
    u.runtime().wait_step();  // the host may read the shard next: the update in flight writes it
    *ptr = u.master();
    *offset = u.shard_offset();
    *numel = u.shard_numel();
  });
}

fsdp_status_t fsdp_param_flat_range(fsdp_unit_t* unit, size_t param_index, size_t* offset, size_t* numel) {
  return guard([&] {
    Unit& u = live_unit(unit, "fsdp_param_flat_range");
    require(offset, "fsdp_param_flat_range", "offset");
    require(numel, "fsdp_param_flat_range", "numel");
    u.check_param_index(param_index, "fsdp_param_flat_range");
    *offset = u.layout().param_offset(param_index);
    *numel = u.layout().param(param_index).numel;
  });
}

fsdp_status_t fsdp_memory_stats(const fsdp_ctx_t* ctx, fsdp_memory_stats_t* stats) {
  return guard([&] {
    write_versioned(ctx, stats, "fsdp_memory_stats", "fsdp_memory_stats_t", [&](fsdp_memory_stats_t& full) {
      using fsdp::core::MemCategory;
      auto snap = ctx_of(ctx)->memory().snapshot();
      auto cur = [&](MemCategory c) { return snap.current[static_cast<size_t>(c)]; };
      auto peak = [&](MemCategory c) { return snap.peak[static_cast<size_t>(c)]; };
      full.sharded_params_nbytes = cur(MemCategory::kShardedParams);
      full.sharded_grads_nbytes = cur(MemCategory::kShardedGrads);
      full.optimizer_state_nbytes = cur(MemCategory::kOptimizerState);
      full.gathered_params_nbytes = cur(MemCategory::kGatheredParams);
      full.gathered_params_peak_nbytes = peak(MemCategory::kGatheredParams);
      full.unsharded_grads_nbytes = cur(MemCategory::kUnshardedGrads);
      full.unsharded_grads_peak_nbytes = peak(MemCategory::kUnshardedGrads);
      full.total_nbytes = snap.total;
      full.total_peak_nbytes = snap.total_peak;
      using fsdp::device::Pool;
      full.device_nbytes = snap.pool[static_cast<size_t>(Pool::kDevice)];
      full.device_peak_nbytes = snap.pool_peak[static_cast<size_t>(Pool::kDevice)];
      full.host_nbytes = snap.pool[static_cast<size_t>(Pool::kHost)];
      full.host_peak_nbytes = snap.pool_peak[static_cast<size_t>(Pool::kHost)];
      full.free_slots_nbytes = cur(MemCategory::kFreeSlots);
      full.secondary_params_nbytes = cur(MemCategory::kSecondaryParams);
      full.secondary_params_peak_nbytes = peak(MemCategory::kSecondaryParams);
    });
  });
}

fsdp_status_t fsdp_memory_stats_reset_peak(fsdp_ctx_t* ctx) {
  return guard([&] {
    require(ctx, "fsdp_memory_stats_reset_peak", "ctx");
    ctx_of(ctx)->check_live("fsdp_memory_stats_reset_peak");
    ctx_of(ctx)->memory().reset_peak();
  });
}

fsdp_status_t fsdp_comm_stats(const fsdp_ctx_t* ctx, fsdp_comm_stats_t* stats) {
  return guard([&] {
    write_versioned(ctx, stats, "fsdp_comm_stats", "fsdp_comm_stats_t", [&](fsdp_comm_stats_t& full) {
      using fsdp::comm::Collective;
      const fsdp::comm::CommCounters& c = ctx_of(ctx)->comm_counters();
      auto calls = [&](Collective k) { return c.calls[static_cast<size_t>(k)].load(std::memory_order_relaxed); };
      auto bytes = [&](Collective k) { return c.nbytes[static_cast<size_t>(k)].load(std::memory_order_relaxed); };
      full.all_gather_calls = calls(Collective::kAllGather);
      full.all_gather_nbytes = bytes(Collective::kAllGather);
      full.reduce_scatter_calls = calls(Collective::kReduceScatter);
      full.reduce_scatter_nbytes = bytes(Collective::kReduceScatter);
      full.all_reduce_calls = calls(Collective::kAllReduce);
      full.all_reduce_nbytes = bytes(Collective::kAllReduce);
      full.broadcast_calls = calls(Collective::kBroadcast);
      full.broadcast_nbytes = bytes(Collective::kBroadcast);
      full.control_calls = calls(Collective::kControl);
      full.host_waits = ctx_of(ctx)->runtime().host_waits.load(std::memory_order_relaxed);
      full.all_to_all_calls = calls(Collective::kAllToAll);
      full.all_to_all_nbytes = bytes(Collective::kAllToAll);
      using fsdp::comm::CommGroup;
      auto group = [&](CommGroup g) { return c.group_nbytes[static_cast<size_t>(g)].load(std::memory_order_relaxed); };
      full.world_group_nbytes = group(CommGroup::kWorld);
      full.shard_group_nbytes = group(CommGroup::kShard);
      full.replica_group_nbytes = group(CommGroup::kReplica);
      full.secondary_group_nbytes = group(CommGroup::kSecondary);
    });
  });
}

fsdp_status_t fsdp_comm_stats_reset(fsdp_ctx_t* ctx) {
  return guard([&] {
    require(ctx, "fsdp_comm_stats_reset", "ctx");
    ctx_of(ctx)->check_live("fsdp_comm_stats_reset");
    ctx_of(ctx)->comm_counters().reset();
    ctx_of(ctx)->runtime().host_waits.store(0, std::memory_order_relaxed);
  });
}

fsdp_status_t fsdp_trace_begin(fsdp_ctx_t* ctx) {
  return guard([&] {
    require(ctx, "fsdp_trace_begin", "ctx");
    ctx_of(ctx)->check_live("fsdp_trace_begin");
    ctx_of(ctx)->trace().begin();
  });
}

fsdp_status_t fsdp_trace_write(fsdp_ctx_t* ctx, const char* path) {
  return guard([&] {
    require(ctx, "fsdp_trace_write", "ctx");
    require(path, "fsdp_trace_write", "path");
    ctx_of(ctx)->check_live("fsdp_trace_write");
    if (!ctx_of(ctx)->trace().enabled()) {
      fail(FSDP_ERR_INVALID_STATE, "fsdp_trace_write: no trace is being recorded; call fsdp_trace_begin first");
    }
    ctx_of(ctx)->trace().write(path, ctx_of(ctx)->rank());
  });
}

}  // extern "C"
