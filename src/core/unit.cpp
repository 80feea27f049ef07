// src/core/unit.cpp - the unit state machine and its grad reductions (see unit.h;
// the gathers are unit_gather.cpp's, what the host reads and writes unit_host.cpp's).
#include "unit.h"

#include <fnmatch.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "../base/error.h"
#include "../base/text.h"
#include "scheduler.h"
#include "slots.h"

namespace fsdp::core {
namespace {

// sgrad += grads, the grads rounded to reduce_dtype first when that is
// narrower than param_dtype (as a reduction in reduce_dtype would): what a
// world of one does in place of the collective. With `clear` the same pass
// leaves the grads reading as zeros.
void accumulate_rounded(Runtime& rt, float* sgrad, void* grads, DType pd, DType rd, size_t n, double* sq, bool clear) {
  device::Device& dev = *rt.state_dev;
  if (rd == pd || rd == DType::kFp32) {  // widening to fp32 is exact: accumulate from the grads as they are
    clear ? dev.accumulate_clear(sgrad, grads, pd, 1.0f, n, sq) : dev.accumulate(sgrad, grads, pd, 1.0f, n, sq);
    return;
  }
  Buffer rounded(rt.state_dev, &rt.mem, MemCategory::kScratch, rd, n, /*zeroed=*/false);
  clear ? dev.cast_clear(rounded.data(), rd, grads, pd, n) : dev.cast(rounded.data(), rd, grads, pd, n);
  dev.accumulate(sgrad, rounded.data(), rd, 1.0f, n, sq);
}

}  // namespace

const char* unit_state_name(UnitState s) {
  switch (s) {
    case UnitState::kSharded:
      return "sharded";
    case UnitState::kGathering:
      return "gathering";
    case UnitState::kGathered:
      return "gathered (idle)";
    case UnitState::kForward:
      return "in forward";
    case UnitState::kBackward:
      return "in backward";
  }
  return "?";
}

Unit::Unit(Runtime& rt, size_t index, std::string name, std::vector<ParamSpec> params, std::vector<bool> frozen)
    : rt_(rt),
      index_(index),
      name_(std::move(name)),
      tag_(base::quote(name_) + " (#" + std::to_string(index_) + ")"),
      layout_(std::move(params), rt.opts.align_bytes / sizeof(float), rt.shard_world(), frozen),
      trainable_(frozen.empty() || std::find(frozen.begin(), frozen.end(), false) != frozen.end()),
      quantized_gathers_(rt.opts.quantizes_gathers_of(name_)) {
  segments_ = layout_.shard_segments(rt_.shard_rank());
  block_slices_ = layout_.shard_ranges(0);
  for (size_t i = 0; i < layout_.n_params(); ++i) {
    double wd = rt_.opts.weight_decay;
    for (const std::string& pat : rt_.opts.no_weight_decay) {
      if (fnmatch(pat.c_str(), layout_.param(i).name.c_str(), 0) == 0) wd = 0.0;
    }
    weight_decay_.push_back(wd);
  }
  hyper_.resize(layout_.n_params());
  size_t s = layout_.shard_numel();
  master_ = Buffer(rt_.state_dev, &rt_.mem, MemCategory::kShardedParams, DType::kFp32, s);
  // Without gathers the param_dtype copy is the full params the host reads.
  if (rt_.opts.param_dtype != DType::kFp32 && (rt_.opts.keeps_param_dtype_shard() || !rt_.gathers())) {
    lowp_ = Buffer(rt_.state_dev, &rt_.mem, MemCategory::kShardedParams, rt_.opts.param_dtype, s);
  }
  if (trainable_) {
    sgrad_ = Buffer(rt_.state_dev, &rt_.mem, MemCategory::kShardedGrads, DType::kFp32, layout_.trainable_shard_numel());
  }
  if (!rt_.gathers()) state_ = UnitState::kGathered;  // the shard is the full params
  gather_label_ = label("all_gather");
  reduce_label_ = label(!rt_.sharded()              ? "all_reduce"
                        : rt_.opts.reduce_quantized ? "all_to_all (quantized reduce_scatter)"
                                                    : "reduce_scatter");
  replica_label_ = reduce_label_ + " (across replicas)";
  secondary_label_ = label("all_gather (secondary group)");
  make_task_labels();
}

void Unit::make_task_labels() {
  size_t s = layout_.shard_numel();
  size_t pes = dtype_size(rt_.opts.param_dtype), res = dtype_size(rt_.opts.reduce_dtype());
  size_t padded = layout_.trainable_padded_numel();  // what a reduction moves
  std::string gathered_bytes = " " + std::to_string(s * pes * static_cast<size_t>(rt_.shard_world())) + " B";
  size_t reduced = rt_.sharded() ? layout_.trainable_shard_numel() : padded;
  size_t reduce_bytes = padded * res;
  if (rt_.sharded() && rt_.opts.reduce_quantized) {
    reduce_bytes = kernels::quant_packed_bytes(reduced, rt_.opts.reduce_block) * static_cast<size_t>(rt_.shard_world());
  }
  tasks_.gather = device::make_label(gather_label_ + gathered_bytes);
  tasks_.gather_cast = device::make_label(gather_label_ + " (cast from fp32)" + gathered_bytes);
  tasks_.copy_in = device::make_label(label("host to device copy") + " " + std::to_string(s * pes) + " B");
  tasks_.copy_out_grads = device::make_label(label("device to host copy") + " " + std::to_string(padded * pes) + " B");
  tasks_.reduce = device::make_label(reduce_label_ + " " + std::to_string(reduce_bytes) + " B");
  tasks_.copy_out_reduced =
      device::make_label(label("device to host copy") + " " + std::to_string(reduced * res) + " B");
  tasks_.host_accumulate = device::make_label(label("accumulate on the host"));
  tasks_.accumulate = device::make_label(label("accumulate grads"));
  tasks_.add_grad = device::make_label(label("fsdp_grad_accumulate"));
  tasks_.gather_secondary = device::make_label(secondary_label_ + gathered_bytes);
  tasks_.drop_secondary = device::make_label(label("free the secondary slice"));
}

void Unit::set_state(UnitState s) {
  bool was = state_ != UnitState::kSharded;
  bool now = s != UnitState::kSharded;
  state_ = s;
  if (rt_.gathers() && was != now) rt_.sched->count_gathered(now);
}

std::string Unit::label(const char* what) const { return std::string(what) + " of unit " + unit_tag(); }

void Unit::check_param_index(size_t param_index, const char* call) const {
  if (param_index >= layout_.n_params()) {
    fail(FSDP_ERR_INVALID_ARGUMENT, std::string(call) + ": unit " + base::quote(name_) + " has " +
                                        std::to_string(layout_.n_params()) + " params; index " +
                                        std::to_string(param_index) + " is out of range");
  }
}

void Unit::bad_state(const char* call, const char* expected) const {
  fail(FSDP_ERR_INVALID_STATE, std::string(call) + " on unit " + base::quote(name_) + " (" + rt_.where() +
                                   "): expected " + expected + ", but the unit is " + unit_state_name(state_));
}

void* Unit::full_params() const {
  if (rt_.gathers()) return gathered_.data();
  return lowp_.empty() ? master_.data() : lowp_.data();
}

void Unit::grads_reset() {
  grads_cleared();
  if (rt_.unit_sq != nullptr) rt_.state_dev->zero(grad_sq_slot(), sizeof(double));
}

void Unit::set_weight_decay(size_t param_index, double weight_decay) {
  check_param_index(param_index, "fsdp_param_set_weight_decay");
  check_weight_decay(weight_decay, "fsdp_param_set_weight_decay");
  weight_decay_[param_index] = weight_decay;
}

void Unit::set_group(size_t param_index, const ParamGroupOptions& g) {
  Hyper& h = hyper_.at(param_index);
  if (!std::isnan(g.lr_scale)) h.lr_scale = g.lr_scale;
  if (!std::isnan(g.weight_decay)) weight_decay_[param_index] = g.weight_decay;
  if (!std::isnan(g.beta1)) h.beta1 = g.beta1;
  if (!std::isnan(g.beta2)) h.beta2 = g.beta2;
}

void Unit::trace_memory() {
  if (!rt_.trace.enabled()) return;
  auto snap = rt_.mem.snapshot();
  rt_.trace.add("memory", 'C', Track::kCaller,
                "\"gathered_params\": " + std::to_string(snap.current[size_t(MemCategory::kGatheredParams)]) +
                    ", \"unsharded_grads\": " + std::to_string(snap.current[size_t(MemCategory::kUnshardedGrads)]) +
                    ", \"total\": " + std::to_string(snap.total));
}

void Unit::forward_begin(device::Stream& s) {
  TraceScope scope(rt_.trace, "forward_begin ", name_);
  rt_.join_capture(s, "fsdp_forward_begin");
  if (in_use()) bad_state("fsdp_forward_begin", "the unit outside forward and backward");
  if (state_ == UnitState::kSharded) issue_gather(/*prefetch=*/false);
  rt_.sched->before_forward(*this);
  wait_gathered(s);
  set_state(UnitState::kForward);
}

void Unit::forward_end(device::Stream& s) {
  TraceScope scope(rt_.trace, "forward_end ", name_);
  rt_.join_capture(s, "fsdp_forward_end");
  if (state_ != UnitState::kForward) bad_state("fsdp_forward_end", "the unit in forward (after fsdp_forward_begin)");
  EventPtr read = note_host_use(s);
  // The buffer goes once the caller's stream is done reading it.
  if (rt_.gathers() && rt_.opts.reshard_after_forward()) {
    free_gathered(read);
  } else {
    slot_read_ = read;                // a drop before backward releases the slot after this read
    set_state(UnitState::kGathered);  // kept for backward (or the shard itself)
  }
}

void Unit::backward_begin(device::Stream& s) {
  TraceScope scope(rt_.trace, "backward_begin ", name_);
  rt_.join_capture(s, "fsdp_backward_begin");
  if (in_use()) bad_state("fsdp_backward_begin", "the unit outside forward and backward");
  if (state_ == UnitState::kSharded) issue_gather(/*prefetch=*/false);
  rt_.sched->before_backward(*this);
  wait_gathered(s);
  // At most one reduction runs behind the unit being computed: the host's
  // stream waits for older ones (a stream wait; on the CPU's NULL stream,
  // which is the calling thread, a wait of that thread), which bounds how far
  // the host's compute runs ahead of the reductions.
  auto& queued = rt_.reductions_in_flight;
  while (!queued.empty() && (queued.size() > 1 || queued.front()->done())) {
    if (queued.size() > 1) {
      TraceScope wait(rt_.trace, "wait earlier reduction");
      s.wait(queued.front());
    }
    queued.pop_front();
  }
  if (has_grads() && !grads_pending_) {
    // Alone with fp32 grads and a zero grad shard, the shard itself is the
    // grad buffer: nothing to allocate, zero, reduce or copy.
    grads_in_shard_ = can_write_shard_grads();
    if (grads_in_shard_) {
      sgrad_zero_ = false;
      grad_sq_known_ = false;  // no pass of ours sees these grads before the step
    } else {
      ugrad_ = rt_.grad_slots->acquire(layout_.trainable_padded_numel(), s, /*zeroed=*/true);
    }
  }
  set_state(UnitState::kBackward);
  trace_memory();
}

bool Unit::can_write_shard_grads() const {
  return rt_.alone() && !rt_.offload() && sgrad_zero_ && rt_.opts.param_dtype == DType::kFp32 &&
         rt_.opts.reduce_dtype() == DType::kFp32 && layout_.trainable_padded_numel() == trainable_shard_numel();
}

void Unit::backward_end(device::Stream& s) {
  TraceScope scope(rt_.trace, "backward_end ", name_);
  rt_.join_capture(s, "fsdp_backward_end");
  if (state_ != UnitState::kBackward) {
    bad_state("fsdp_backward_end", "the unit in backward (after fsdp_backward_begin)");
  }
  EventPtr used = note_host_use(s);
  if (!has_grads()) {
    // Frozen: no grads to reduce.
  } else if (rt_.grad_sync) {
    reduce_event_ = submit_reduction(s, used);
    // Alone, the accumulation runs on the caller's stream: waiting for it in
    // a later backward_begin would hold the host back behind its own compute.
    bool on_caller = rt_.alone() && !rt_.offload();
    if (reduce_event_ && !on_caller) rt_.reductions_in_flight.push_back(reduce_event_);
  } else {
    grads_pending_ = true;  // reduced by a later backward_end or fsdp_step, after the caller's stream
  }
  if (rt_.gathers()) {
    free_gathered(used);
  } else {
    set_state(UnitState::kGathered);
  }
  rt_.sched->after_backward(*this);
}

EventPtr Unit::note_host_use(device::Stream& s) {
  if (s.synchronous()) return nullptr;  // the host is done with what it read
  host_use_ = s.record();
  host_use_stream_ = &s;
  return host_use_;
}

void Unit::wait_host_use() {
  if (!host_use_) return;
  EventPtr ev = std::move(host_use_);
  TraceScope wait(rt_.trace, "wait for the caller's stream's use of unit ", unit_tag());
  ev->wait(rt_.opts.timeout_s);
}

EventPtr Unit::submit_reduction(device::Stream& s, EventPtr written) {
  grads_pending_ = false;
  if (grads_in_shard_) {  // the host wrote into the grad shard itself
    grads_in_shard_ = false;
    return nullptr;
  }
  sgrad_zero_ = false;
  // Every accumulation into the grad shard below leaves its sum of squares in
  // grad_sq_slot(): the step's norm then needs no pass of its own.
  grad_sq_known_ = true;
  if (rt_.alone() && !rt_.offload()) return accumulate_alone(s);
  // Whatever reads the grads below starts after the caller's stream wrote them.
  if (!written) written = s.record();
  // The tasks read the grad slot through `grads`; the slot goes back to the
  // pool with the event of the last task that reads it. The sharded grad is
  // touched only by such tasks (in FIFO order) and by fsdp_step after it
  // waited for them. Tasks reach the unit's constants (sizes, labels) through
  // `self`: the streams stop before the units go.
  void* grads = ugrad_.data();
  Unit* self = this;
  if (rt_.alone()) {
    // offload=cpu alone: no collective, only the device -> host copy and the
    // accumulation on the host. A copy cannot clear the grads: the slot is
    // zeroed when taken again.
    rt_.copy_out->wait(written);
    rt_.copy_out->wait(reduce_event_);  // the unit's last reduction is done with on_host_
    EventPtr copied = rt_.copy_out->submit(tasks_.copy_out_grads, [self, grads] {
      Runtime& rt = self->rt_;
      size_t padded = self->layout_.trainable_padded_numel();
      DType pd = rt.opts.param_dtype;
      self->on_host_ = Buffer(rt.state_dev, &rt.mem, MemCategory::kScratch, pd, padded, /*zeroed=*/false);
      rt.dev->copy_to_host(self->on_host_.data(), grads, padded * dtype_size(pd));
    });
    rt_.grad_slots->release(std::move(ugrad_), copied, /*zero=*/false);
    return on_host_after(copied, [self] {
      Runtime& rt = self->rt_;
      accumulate_rounded(rt, self->sharded_grad(), self->on_host_.data(), rt.opts.param_dtype, rt.opts.reduce_dtype(),
                         self->layout_.trainable_padded_numel(), self->grad_sq_slot(), /*clear=*/false);
      self->on_host_.reset();
    });
  }
  DType pd = rt_.opts.param_dtype;
  DType rd = rt_.opts.reduce_dtype();
  bool offload = rt_.offload();
  // Each path clears the grads in a pass that reads them anyway (the cast to
  // reduce_dtype, the reduce-scatter or the accumulation into the grad
  // shard), so that the slot reads as zeros again and the next backward takes
  // it as it is; only a device -> host copy of the grads themselves
  // (offload=cpu, NO_SHARD, no cast) cannot, and the slot is zeroed when
  // taken again.
  // The quantized reduction only reads them (a slot zeroed when taken again).
  bool clears = !(offload && !rt_.sharded() && rd == pd) && !(rt_.sharded() && rt_.opts.reduce_quantized);
  // With offload=cpu the reduced grad leaves the comm task in reduced_ (a
  // scratch buffer, or the grad slot itself) and a copy-stream task brings it
  // to the host grad shard; otherwise the comm task accumulates it on the
  // device. reduced_ and on_host_ are the unit's: its reductions run in FIFO
  // order on the comm stream, then on copy_out, then on host_work; the next
  // reduction of the unit (a unit used twice per step) starts after the last
  // is done with them.
  rt_.stream->wait(written);
  if (offload) rt_.stream->wait(reduce_event_);
  EventPtr ev = rt_.stream->submit(tasks_.reduce, [self, grads] { self->reduce_task(grads); });
  if (!offload) {
    rt_.grad_slots->release(std::move(ugrad_), ev, clears);
    return ev;
  }
  rt_.copy_out->wait(ev);
  EventPtr copied = rt_.copy_out->submit(tasks_.copy_out_reduced, [self] {
    Runtime& rt = self->rt_;
    DType dt = rt.opts.reduce_dtype();
    size_t n = self->reduced_numel();
    self->on_host_ = Buffer(rt.state_dev, &rt.mem, MemCategory::kScratch, dt, n, /*zeroed=*/false);
    rt.dev->copy_to_host(self->on_host_.data(), self->reduced_data_, n * dtype_size(dt));
    self->reduced_.reset();  // stream-ordered: after the copy
  });
  rt_.grad_slots->release(std::move(ugrad_), copied, clears);
  return on_host_after(copied, [self] {
    Runtime& rt = self->rt_;
    rt.state_dev->accumulate(self->sharded_grad(), self->on_host_.data(), rt.opts.reduce_dtype(), 1.0f,
                             self->reduced_numel(), self->grad_sq_slot());
    self->on_host_.reset();
  });
}

size_t Unit::reduced_numel() const {
  return rt_.sharded() ? trainable_shard_numel() : layout_.trainable_padded_numel();
}

void Unit::reduce_task(void* grads) {
  Runtime& rt = rt_;
  DType pd = rt.opts.param_dtype;
  DType rd = rt.opts.reduce_dtype();
  // The trainable block alone: the front of the grads' flat buffer.
  size_t padded = layout_.trainable_padded_numel();
  size_t shard = trainable_shard_numel();
  auto op = rt.opts.reduce_op == ReduceOp::kAvg ? comm::RedOp::kAvg : comm::RedOp::kSum;
  const bool quantized = rt.sharded() && rt.opts.reduce_quantized;  // packs from the grads as they are
  Buffer converted;
  void* src = grads;
  if (rd != pd && !quantized) {
    converted = Buffer(rt.dev, &rt.mem, MemCategory::kScratch, rd, padded, /*zeroed=*/false);
    rt.dev->cast_clear(converted.data(), rd, grads, pd, padded);
    src = converted.data();
  }
  Buffer out;
  void* out_data = src;  // NO_SHARD: the all-reduce runs in place
  if (quantized) {
    out = reduce_scatter_quantized(*rt.shard_comm, grads, op);
    out_data = out.data();
    if (rt.replica_comm != nullptr) all_reduce_quantized(*rt.replica_comm, out.as<float>(), shard, op);
  } else if (rt.sharded()) {
    out = Buffer(rt.dev, &rt.mem, MemCategory::kScratch, rd, shard, /*zeroed=*/false);
    out_data = out.data();
    if (rd != pd) {
      rt.shard_comm->reduce_scatter(src, out_data, shard, rd, op, reduce_label_);
    } else {
      rt.shard_comm->reduce_scatter_clear(src, out_data, shard, rd, op, reduce_label_);
    }
    // HYBRID_SHARD: the same shard of every replica, averaged (or summed) too.
    if (rt.replica_comm != nullptr) rt.replica_comm->all_reduce(out_data, out_data, shard, rd, op, replica_label_);
  } else {
    rt.world_comm->all_reduce(src, src, padded, rd, op, reduce_label_);
    out = std::move(converted);  // empty when the grads themselves were reduced
  }
  size_t n_reduced = reduced_numel();
  if (rt.offload()) {
    reduced_ = std::move(out);
    reduced_data_ = out_data;
  } else if (!rt.sharded() && rd == pd) {  // out_data is the grads themselves
    rt.dev->accumulate_clear(sharded_grad(), out_data, rd, 1.0f, n_reduced, grad_sq_slot());
  } else {
    rt.dev->accumulate(sharded_grad(), out_data, rd, 1.0f, n_reduced, grad_sq_slot());
  }
}

Buffer Unit::reduce_scatter_quantized(comm::Communicator& c, const void* grads, comm::RedOp op) const {
  if (rt_.reduce_local_comm != nullptr) return reduce_scatter_hierarchical(grads, op);
  const size_t w = static_cast<size_t>(c.world_size()), n = trainable_shard_numel(), block = rt_.opts.reduce_block;
  const kernels::QType qt = rt_.opts.reduce_qtype;
  const DType pd = rt_.opts.param_dtype;
  const size_t part = kernels::quant_packed_bytes(n, block);  // a multiple of 4 bytes
  const size_t words = part / sizeof(float) * w;
  Buffer send(rt_.dev, &rt_.mem, MemCategory::kScratch, DType::kFp32, words, /*zeroed=*/false);
  Buffer recv(rt_.dev, &rt_.mem, MemCategory::kScratch, DType::kFp32, words, /*zeroed=*/false);
  // Part r of the trainable block (rank r's shard) packed for rank r.
  for (size_t r = 0; r < w; ++r) {
    rt_.dev->quantize(static_cast<char*>(send.data()) + r * part,
                      static_cast<const char*>(grads) + r * n * dtype_size(pd), pd, n, block, qt);
  }
  c.all_to_all(send.data(), recv.data(), part, reduce_label_);
  Buffer out(rt_.dev, &rt_.mem, MemCategory::kScratch, DType::kFp32, n, /*zeroed=*/false);
  const float scale = op == comm::RedOp::kAvg ? 1.0f / static_cast<float>(w) : 1.0f;
  rt_.dev->dequantize_sum(out.as<float>(), recv.data(), w, part, n, block, qt, scale);
  if (rt_.opts.debug_poison) {
    rt_.dev->fill_nan(send.data(), send.nbytes());
    rt_.dev->fill_nan(recv.data(), recv.nbytes());
  }
  return out;
}

Buffer Unit::reduce_scatter_hierarchical(const void* grads, comm::RedOp op) const {
  // Shard index s = q * g + l: the l-th rank of group q, groups of g ranks.
  comm::Communicator& local = *rt_.reduce_local_comm;
  comm::Communicator& cross = *rt_.reduce_cross_comm;
  const size_t g = static_cast<size_t>(local.world_size()), groups = static_cast<size_t>(cross.world_size());
  const size_t n = trainable_shard_numel(), block = rt_.opts.reduce_block;
  const kernels::QType qt = rt_.opts.reduce_qtype;
  const DType pd = rt_.opts.param_dtype;
  const size_t part = kernels::quant_packed_bytes(n, block);  // a multiple of 4 bytes
  Buffer send(rt_.dev, &rt_.mem, MemCategory::kScratch, DType::kFp32, part / sizeof(float) * g * groups,
              /*zeroed=*/false);
  Buffer recv(rt_.dev, &rt_.mem, MemCategory::kScratch, DType::kFp32, part / sizeof(float) * g * groups,
              /*zeroed=*/false);
  auto at = [part](Buffer& b, size_t i) { return static_cast<char*>(b.data()) + i * part; };
  // To member j: the parts of shards q * g + j, q = 0, 1, ... (in q order).
  for (size_t j = 0; j < g; ++j) {
    for (size_t q = 0; q < groups; ++q) {
      rt_.dev->quantize(at(send, j * groups + q), static_cast<const char*>(grads) + (q * g + j) * n * dtype_size(pd),
                        pd, n, block, qt);
    }
  }
  local.all_to_all(send.data(), recv.data(), groups * part, reduce_label_);
  // From member j, its part of shard q * g + l at recv[j][q]: group q's sum
  // of this rank's index, over the members in order.
  Buffer partial(rt_.dev, &rt_.mem, MemCategory::kScratch, DType::kFp32, n * groups, /*zeroed=*/false);
  for (size_t q = 0; q < groups; ++q) {
    rt_.dev->dequantize_sum(partial.as<float>() + q * n, at(recv, q), g, groups * part, n, block, qt, 1.0f);
    rt_.dev->quantize(at(send, q), partial.as<float>() + q * n, DType::kFp32, n, block, qt);
  }
  cross.all_to_all(send.data(), recv.data(), part, reduce_label_);
  Buffer out(rt_.dev, &rt_.mem, MemCategory::kScratch, DType::kFp32, n, /*zeroed=*/false);
  const float scale = op == comm::RedOp::kAvg ? 1.0f / static_cast<float>(g * groups) : 1.0f;
  rt_.dev->dequantize_sum(out.as<float>(), recv.data(), groups, part, n, block, qt, scale);
  if (rt_.opts.debug_poison) {
    rt_.dev->fill_nan(send.data(), send.nbytes());
    rt_.dev->fill_nan(recv.data(), recv.nbytes());
    rt_.dev->fill_nan(partial.data(), partial.nbytes());
  }
  return out;
}

void Unit::all_reduce_quantized(comm::Communicator& c, float* shard, size_t n, comm::RedOp op) const {
  const size_t w = static_cast<size_t>(c.world_size()), block = rt_.opts.reduce_block;
  const size_t p = (n + w - 1) / w;  // each replica's part; the last one padded with zeros
  const kernels::QType qt = rt_.opts.reduce_qtype;
  const size_t part = kernels::quant_packed_bytes(p, block);  // a multiple of 4 bytes
  Buffer padded;
  float* x = shard;
  if (p * w != n) {
    padded = Buffer(rt_.dev, &rt_.mem, MemCategory::kScratch, DType::kFp32, p * w, /*zeroed=*/true);
    rt_.dev->copy(padded.data(), shard, n * sizeof(float));
    x = padded.as<float>();
  }
  Buffer send(rt_.dev, &rt_.mem, MemCategory::kScratch, DType::kFp32, part / sizeof(float) * w, /*zeroed=*/false);
  Buffer recv(rt_.dev, &rt_.mem, MemCategory::kScratch, DType::kFp32, part / sizeof(float) * w, /*zeroed=*/false);
  for (size_t r = 0; r < w; ++r) {
    rt_.dev->quantize(static_cast<char*>(send.data()) + r * part, x + r * p, DType::kFp32, p, block, qt);
  }
  c.all_to_all(send.data(), recv.data(), part, replica_label_);
  Buffer sum(rt_.dev, &rt_.mem, MemCategory::kScratch, DType::kFp32, p, /*zeroed=*/false);
  const float scale = op == comm::RedOp::kAvg ? 1.0f / static_cast<float>(w) : 1.0f;
  rt_.dev->dequantize_sum(sum.as<float>(), recv.data(), w, part, p, block, qt, scale);
  rt_.dev->quantize(send.data(), sum.data(), DType::kFp32, p, block, qt);
  c.all_gather(send.data(), recv.data(), part, replica_label_);
  rt_.dev->dequantize(x, DType::kFp32, recv.data(), w, p, block, qt);
  if (x != shard) rt_.dev->copy(shard, x, n * sizeof(float));
  if (rt_.opts.debug_poison) {
    rt_.dev->fill_nan(send.data(), send.nbytes());
    rt_.dev->fill_nan(recv.data(), recv.nbytes());
  }
}

EventPtr Unit::on_host_after(const EventPtr& copied, device::Stream::Task work) {
  rt_.host_work->wait(copied);
  return rt_.host_work->submit(tasks_.host_accumulate, std::move(work));
}

EventPtr Unit::accumulate_alone(device::Stream& s) {
  DType pd = rt_.opts.param_dtype, rd = rt_.opts.reduce_dtype();
  size_t n = layout_.trainable_padded_numel();
  if (s.synchronous()) {
    TraceScope scope(rt_.trace, "accumulate grads of unit ", unit_tag());
    accumulate_rounded(rt_, sharded_grad(), ugrad_.data(), pd, rd, n, grad_sq_slot(), /*clear=*/true);
    rt_.grad_slots->release(std::move(ugrad_), nullptr, /*zero=*/true);
    return nullptr;
  }
  // On the caller's stream, after its compute wrote the grads: fsdp_step
  // waits for the returned event before the optimizer reads the grad shard
  // and the sum of squares.
  Unit* self = this;
  void* grads = ugrad_.data();
  EventPtr done = s.submit(tasks_.accumulate, [self, grads] {
    Runtime& rt = self->rt_;
    accumulate_rounded(rt, self->sharded_grad(), grads, rt.opts.param_dtype, rt.opts.reduce_dtype(),
                       self->layout_.trainable_padded_numel(), self->grad_sq_slot(), /*clear=*/true);
  });
  rt_.grad_slots->release(std::move(ugrad_), done, /*zero=*/true);
  return done;
}

void Unit::reduce_pending_grads(device::Stream& s) {
  if (grads_pending_) reduce_event_ = submit_reduction(s, nullptr);
}

void Unit::wait_reductions() {
  if (!reduce_event_) return;
  EventPtr ev = std::move(reduce_event_);
  TraceScope wait(rt_.trace, "wait reduction of unit ", unit_tag());
  ev->wait(rt_.opts.timeout_s);
}

}  // namespace fsdp::core
