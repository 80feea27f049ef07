// src/core/unit_gather.cpp - a unit's params gathered and given back: the
// all-gather of its shard into a gathered slot (from the param_dtype copy, a
// cast stage, an offloaded shard's copy on the device, or the fp32 master
// packed for gather_dtype's quantized gather), the caller's stream made to
// wait for it, and the slot's release after its last reader (debug_poison's
// fill first). The state machine is unit.cpp's; see unit.h.
#include <algorithm>

#include "../base/error.h"
#include "../base/text.h"
#include "scheduler.h"
#include "slots.h"
#include "unit.h"

namespace fsdp::core {

void Unit::issue_gather(bool prefetch) {
  if (!can_gather())
    fail(FSDP_ERR_INTERNAL, "issue_gather on unit " + base::quote(name_) + " in state " + unit_state_name(state_));
  if (secondary_ready_) {
    issue_secondary_gather(prefetch);
    return;
  }
  // secondary_shard: the gather task also keeps this rank's secondary slice,
  // which the unit's next gather (backward's) reads instead of the shards.
  const bool keep = rt_.secondary_comm != nullptr;
  secondary_ready_ = keep;
  size_t es = dtype_size(rt_.opts.param_dtype);
  // The stream that writes the slot waits for its last reader (offload alone:
  // the copy stream). Gathers run on a stream and over a communicator of
  // their own, so that one never queues behind a reduction.
  bool copy_only = rt_.offload() && rt_.shard_world() == 1;
  device::Stream* gather = rt_.gather_stream;
  gathered_ = rt_.gather_slots->acquire(layout_.padded_numel(), copy_only ? *rt_.copy_in : *gather,
                                        /*zeroed=*/false);
  // Quantized gathers (gather_dtype) start from the fp32 master; the others
  // from the param_dtype copy where one is kept.
  const bool quantized = quantized_gathers_ && !copy_only;
  const void* src = lowp_.empty() || quantized ? master_.data() : lowp_.data();
  void* dst = gathered_.data();
  size_t nbytes = shard_numel() * es;
  Unit* self = this;  // tasks reach the unit's constants and stages through it (the streams stop before units go)
  if (rt_.trace.enabled()) {
    rt_.trace.add(std::string(prefetch ? "prefetch " : "issue ") + gather_label_, 'i', Track::kCaller);
  }
  comm::Communicator* shard = rt_.gather_comm;
  if (rt_.offload()) {
    // The host shard goes to the device first, on the copy stream, so that the
    // copy overlaps compute as the gather does. A world of one (NO_SHARD)
    // needs no collective: the copy lands in the full buffer itself.
    // Otherwise it lands in offload_stage_, taken by the copy task and freed
    // by the gather task (each stream-ordered on its own stream); the next
    // copy of this unit waits for this gather, which is done with the stage.
    // Quantized, the stage holds the fp32 master, which the gather task
    // packs on the device (stream-ordered, as every copy of the state is).
    bool alone = rt_.shard_world() == 1;
    if (quantized) nbytes = shard_numel() * sizeof(float);
    rt_.copy_in->wait(last_gather_);
    EventPtr copied = rt_.copy_in->submit(tasks_.copy_in, [self, alone, quantized, dst, src, nbytes] {
      Runtime& rt = self->rt_;
      void* to = dst;
      if (!alone) {
        self->offload_stage_ = Buffer(rt.dev, &rt.mem, MemCategory::kScratch,
                                      quantized ? DType::kFp32 : rt.opts.param_dtype, self->shard_numel(),
                                      /*zeroed=*/false);
        to = self->offload_stage_.data();
      }
      rt.dev->copy_from_host(to, src, nbytes);
    });
    if (alone) {
      gather_event_ = copied;
    } else {
      gather->wait(copied);
      gather_event_ = gather->submit(tasks_.gather, [self, shard, dst, quantized, keep] {
        void* stage = self->offload_stage_.data();
        if (quantized) {
          self->pack_and_gather(*shard, static_cast<const float*>(stage), dst);
        } else {
          self->gather_blocks(*shard, stage, dst, dtype_size(self->rt_.opts.param_dtype), false, self->gather_label_);
        }
        if (keep) self->store_secondary(dst);
        if (self->rt_.opts.debug_poison) self->rt_.dev->fill_nan(stage, self->offload_stage_.nbytes());
        self->offload_stage_.reset();
      });
    }
    last_gather_ = gather_event_;
    set_state(UnitState::kGathering);
    trace_memory();
    return;
  }
  if (quantized) {
    // The master's slices packed into a stage on the gather stream, just
    // before the collective reads it (as the cast stage below).
    gather_event_ = gather->submit(tasks_.gather, [self, shard, src, dst, keep] {
      self->pack_and_gather(*shard, static_cast<const float*>(src), dst);
      if (keep) self->store_secondary(dst);
    });
    set_state(UnitState::kGathering);
    trace_memory();
    return;
  }
  if (lowp_.empty() && rt_.opts.param_dtype != DType::kFp32) {
    // keep_param_dtype_shard=0: the fp32 master is cast into a transient
    // param_dtype stage on the comm stream, just before the collective reads
    // it. The stage is taken inside the task: stream-ordered on the comm
    // stream, nothing for the host to allocate or keep alive.
    const float* master = master_.as<float>();
    gather_event_ = gather->submit(tasks_.gather_cast, [shard, master, dst, self, keep] {
      Runtime& rt = self->rt_;
      DType dt = rt.opts.param_dtype;
      size_t n = self->shard_numel();
      Buffer stage(rt.dev, &rt.mem, MemCategory::kScratch, dt, n, /*zeroed=*/false);
      rt.dev->cast(stage.data(), dt, master, DType::kFp32, n);
      self->gather_blocks(*shard, stage.data(), dst, dtype_size(dt), false, self->gather_label_);
      if (rt.opts.debug_poison) rt.dev->fill_nan(stage.data(), stage.nbytes());
      if (keep) self->store_secondary(dst);
    });
    set_state(UnitState::kGathering);
    trace_memory();
    return;
  }
  gather_event_ = gather->submit(tasks_.gather, [shard, src, dst, es, self, keep] {
    self->gather_blocks(*shard, src, dst, es, false, self->gather_label_);
    if (keep) self->store_secondary(dst);
  });
  set_state(UnitState::kGathering);
  trace_memory();
}

void Unit::store_secondary(const void* full) {
  const DType dt = rt_.opts.param_dtype;
  const size_t n = layout_.padded_numel() / static_cast<size_t>(rt_.secondary_size);
  secondary_ = Buffer(rt_.dev, &rt_.mem, MemCategory::kSecondaryParams, dt, n, /*zeroed=*/false);
  rt_.dev->copy(secondary_.data(),
                static_cast<const char*>(full) + static_cast<size_t>(rt_.secondary_index) * n * dtype_size(dt),
                n * dtype_size(dt));
}

void Unit::issue_secondary_gather(bool prefetch) {
  // The secondary group's slices, in its rank order, are the full buffer:
  // slice j is elements [j * n, (j + 1) * n) of it. On the gather stream,
  // after the gather task that kept this rank's slice.
  device::Stream* gather = rt_.gather_stream;
  gathered_ = rt_.gather_slots->acquire(layout_.padded_numel(), *gather, /*zeroed=*/false);
  void* dst = gathered_.data();
  Unit* self = this;
  if (rt_.trace.enabled()) {
    rt_.trace.add(std::string(prefetch ? "prefetch " : "issue ") + secondary_label_, 'i', Track::kCaller);
  }
  gather_event_ = gather->submit(tasks_.gather_secondary, [self, dst] {
    Runtime& rt = self->rt_;
    rt.secondary_comm->all_gather(self->secondary_.data(), dst, self->secondary_.nbytes(), self->secondary_label_);
    if (rt.opts.debug_poison) rt.dev->fill_nan(self->secondary_.data(), self->secondary_.nbytes());
    self->secondary_.reset();  // stream-ordered: after the collective read it
  });
  if (rt_.offload()) last_gather_ = gather_event_;
  secondary_ready_ = false;
  set_state(UnitState::kGathering);
  trace_memory();
}

void Unit::pack_and_gather(comm::Communicator& c, const float* master, void* dst) const {
  // Per block: this rank's slice of the master packed, the ranks' packed
  // slices gathered in rank order, then unpacked into the block's place in
  // the full buffer (where gather_blocks lays the param_dtype slices).
  const size_t w = static_cast<size_t>(layout_.shard_world()), block = rt_.opts.gather_block;
  const DType dt = rt_.opts.param_dtype;
  const kernels::QType qt = rt_.opts.gather_qtype;
  size_t most = 0;
  for (const ShardRange& r : block_slices_) most = std::max(most, kernels::quant_packed_bytes(r.numel, block));
  const size_t words = (most + sizeof(float) - 1) / sizeof(float);
  Buffer mine(rt_.dev, &rt_.mem, MemCategory::kScratch, DType::kFp32, words, /*zeroed=*/false);
  Buffer all(rt_.dev, &rt_.mem, MemCategory::kScratch, DType::kFp32, words * w, /*zeroed=*/false);
  size_t flat = 0;
  for (const ShardRange& r : block_slices_) {
    const size_t bytes = kernels::quant_packed_bytes(r.numel, block);
    rt_.dev->quantize(mine.data(), master + r.shard_begin, DType::kFp32, r.numel, block, qt);
    c.all_gather(mine.data(), all.data(), bytes, gather_label_);
    rt_.dev->dequantize(static_cast<char*>(dst) + flat * dtype_size(dt), dt, all.data(), w, r.numel, block, qt);
    flat += r.numel * w;
  }
  if (rt_.opts.debug_poison) {
    rt_.dev->fill_nan(mine.data(), mine.nbytes());
    rt_.dev->fill_nan(all.data(), all.nbytes());
  }
}

void Unit::gather_blocks(comm::Communicator& c, const void* src, void* dst, size_t es, bool trainable_block,
                         const std::string& label) const {
  // Block b's slices are at the same shard offset on every rank; gathered,
  // they are the block, which starts where the blocks before it end.
  size_t flat = 0;
  for (const ShardRange& r : block_slices_) {
    if (trainable_block && r.shard_begin >= layout_.trainable_shard_numel()) break;  // the frozen block
    c.all_gather(static_cast<const char*>(src) + r.shard_begin * es, static_cast<char*>(dst) + flat * es, r.numel * es,
                 label);
    flat += r.numel * static_cast<size_t>(layout_.shard_world());
  }
}

void Unit::wait_gathered(device::Stream& s) {
  if (!rt_.gathers()) {  // the shard is the full params: read in place after the last update
    rt_.order_after_step(s);
    return;
  }
  try {
    // On a synchronous stream the wait is what the comm stream failed to hide.
    TraceScope wait(rt_.trace, "wait all_gather of unit ", unit_tag());
    s.wait(gather_event_);
  } catch (...) {
    rt_.gather_slots->release(std::move(gathered_), nullptr, false);  // the failed gather is over
    gather_event_.reset();
    set_state(UnitState::kSharded);
    throw;
  }
}

EventPtr Unit::poisoned_after(const EventPtr& after) {
  if (!rt_.opts.debug_poison || gathered_.empty()) return after;
  // On the comm stream, after the last read: the next gather into the slot
  // (which waits for the returned event) comes after the fill.
  static const device::Label kPoison = device::make_label("debug_poison: fill freed gathered params with NaN");
  device::Device* dev = rt_.dev;
  void* p = gathered_.data();
  size_t n = gathered_.nbytes();
  // On the comm stream (debug only): a collective queued after it there
  // (fsdp_metrics_reduce) finds the fill done.
  rt_.stream->wait(after);
  return rt_.stream->submit(kPoison, [dev, p, n] { dev->fill_nan(p, n); });
}

void Unit::free_gathered(const EventPtr& read) {
  gather_event_.reset();
  slot_read_.reset();
  EventPtr free_after = poisoned_after(read);
  free_after = poisoned_after(free_after);
  rt_.gather_slots->release(std::move(gathered_), free_after, false);  // reused once the host has read it
  set_state(UnitState::kSharded);
  trace_memory();
  rt_.sched->on_freed();
}

void Unit::drop_stale_gathered(device::Stream* order_after) {
  if (secondary_ready_) {  // the kept slice is stale too: freed after the gather task that wrote it
    secondary_ready_ = false;
    Unit* self = this;
    rt_.gather_stream->submit(tasks_.drop_secondary, [self] { self->secondary_.reset(); });
  }
  if (!rt_.gathers() || state_ == UnitState::kSharded) return;
  EventPtr ev = std::move(gather_event_);
  // Free once the gather is over and, when the caller's stream read the slot
  // since (kept after forward), once it is done reading: that read came after
  // the gather on its stream.
  EventPtr free_after = slot_read_ ? std::move(slot_read_) : ev;
  slot_read_.reset();
  free_after = poisoned_after(free_after);
  rt_.gather_slots->release(std::move(gathered_), free_after, false);
  set_state(UnitState::kSharded);
  trace_memory();
  rt_.sched->on_freed();
  if (!ev) return;
  if (order_after != nullptr) {
    order_after->wait(ev);  // a failed gather fails what it runs next, and sticks to the gather stream
    return;
  }
  TraceScope wait(rt_.trace, "wait all_gather of unit ", unit_tag());
  ev->wait(rt_.opts.timeout_s);  // throws if the gather failed
}

}  // namespace fsdp::core
