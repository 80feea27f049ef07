// src/core/unit.h - Unit: one group of params gathered and freed together. Owns
// the unit's flat shards and full buffers and is the only place its state
// changes, through transitions that check the call order.
//
//   SHARDED --issue_gather (prefetch or *_begin)--> GATHERING --wait--> GATHERED
//   SHARDED|GATHERING|GATHERED --forward_begin--> FORWARD --forward_end--> SHARDED (FULL_SHARD)
//                                                                   \-> GATHERED (SHARD_GRAD_OP, NO_SHARD)
//   SHARDED|GATHERING|GATHERED --backward_begin--> BACKWARD --backward_end--> SHARDED
//                                                               (GATHERED for NO_SHARD)
// Gathers run on the gather stream and grad reductions on the comm stream
// (each with a communicator of its own); the unit keeps the
// events and waits only where it needs the result. Where there is nothing to
// communicate (Runtime::gathers() false: the shard is the full params;
// Runtime::alone(): a world of one) no collective, copy or comm-stream task
// runs: the host reads the shard in place and, when the grad shard is fp32 and
// still zero, adds its grads straight into it.
#pragma once

#include <limits>
#include <string>
#include <vector>

#include "../base/layout.h"
#include "../device/stream.h"
#include "config.h"
#include "memory.h"
#include "runtime.h"

namespace fsdp::core {

enum class UnitState { kSharded, kGathering, kGathered, kForward, kBackward };
const char* unit_state_name(UnitState s);

class Unit {
 public:
  // `frozen` (empty: none): params frozen from the start, laid out in the
  // frozen block with no grads or state ever allocated for them; all of
  // them frozen makes the unit frozen (fsdp_unit_register_trainable).
  Unit(Runtime& rt, size_t index, std::string name, std::vector<ParamSpec> params, std::vector<bool> frozen = {});

  const std::string& name() const { return name_; }
  const Runtime& runtime() const { return rt_; }
  device::Stream& caller_stream(void* native, const char* call) { return rt_.caller_stream(native, call); }
  size_t index() const { return index_; }
  const FlatLayout& layout() const { return layout_; }
  UnitState state() const { return state_; }
  bool in_use() const { return state_ == UnitState::kForward || state_ == UnitState::kBackward; }
  // Full grads accumulated with grad sync off, not yet reduced.
  bool grads_pending() const { return grads_pending_; }
  // Holds grads for the coming step: pending, reduced (or being reduced)
  // into the grad shard, or written there by the host.
  bool holds_grads() const { return grads_pending_ || !sgrad_zero_; }
  // Holds, or is gathering, full params that a later step frees (sharded strategies).
  bool holds_gathered() const { return rt_.gathers() && state_ != UnitState::kSharded; }
  bool can_gather() const { return rt_.gathers() && state_ == UnitState::kSharded; }
  // Starts the all-gather on the comm stream, after the host -> device copy
  // of the shard with offload=cpu (SHARDED -> GATHERING).
  void issue_gather(bool prefetch);

  void set_values(size_t param_index, const float* values, size_t numel);
  // A frozen unit (not trainable) keeps no grad shard and no optimizer
  // state, hands out no grads and reduces nothing; its backward bracket
  // still gathers the params for the input grads. The Context checks the
  // call (no unit in use, nothing pending, the same on every rank); this
  // frees or allocates (zeroed) the grad shard.
  bool trainable() const { return trainable_; }
  // FSDP_ERR_INVALID_ARGUMENT naming `call` unless the unit has param `param_index`.
  void check_param_index(size_t param_index, const char* call) const;
  void set_trainable(bool trainable);
  // A param frozen inside the unit (fsdp_param_set_trainable) lies in the
  // layout's frozen block: no grads, no state, no bytes in a reduction.
  bool param_trainable(size_t param_index) const { return !layout_.frozen(param_index); }
  // Grads exist for this unit: trainable, with a trainable param in it.
  bool has_grads() const { return trainable_ && layout_.trainable_padded_numel() > 0; }
  // The whole flat fp32 buffer whose shard is `shard` (this unit's layout:
  // the master, or with `trainable_block` a state or the grads, which cover
  // the trainable block alone), gathered over the shard group into host
  // memory. Collective.
  std::vector<float> gather_to_host(const float* shard, bool trainable_block, const char* call);
  // The same into a scratch buffer on the compute device (more than one rank
  // in the shard group; an offloaded shard is staged there first).
  Buffer gather_on_device(const float* shard, bool trainable_block, const char* call);
  // Lays the unit out again with `frozen` params (the Context checked the
  // call): the master moves to the new layout (gathered through the host,
  // one unit's full params), the param_dtype copy follows, the grad shard
  // restarts from zero at its new length. The caller moves the optimizer
  // state (Optimizer::relayout).
  void relayout(const std::vector<bool>& frozen);
  // The quantized all-gather (gather_dtype) of this rank's fp32 master shard
  // `master` (on the compute device) into the full param_dtype buffer `dst`:
  // per block, its slice packed (kernels/quant.h), the ranks' packed slices
  // gathered, and unpacked where gather_blocks would put the values.
  void pack_and_gather(comm::Communicator& c, const float* master, void* dst) const;
  // secondary_shard: keeps this rank's slice of the gathered `full` params
  // (a gather task's last step), and the gather from those slices.
  void store_secondary(const void* full);
  void issue_secondary_gather(bool prefetch);
  // The all-gather of `src` (this rank's shard, `es` bytes per element, on
  // the compute device) into the flat buffer `dst`: one collective per block
  // (only the trainable block's with `trainable_block`).
  void gather_blocks(comm::Communicator& c, const void* src, void* dst, size_t es, bool trainable_block,
                     const std::string& label) const;
  void set_weight_decay(size_t param_index, double weight_decay);
  // A checkpoint is read into the fp32 master shard in place: the shard,
  // once the caller's stream no longer reads it (the unit holds no gathered
  // params: the caller dropped them); then master_loaded() makes the
  // param_dtype copy follow and restarts the sharded grads from zero.
  float* master_for_load();
  void master_loaded();
  double weight_decay(size_t param_index) const { return weight_decay_[param_index]; }
  // A param group's hyperparameters (fsdp_set_param_group): the lr scale,
  // and Adam's betas where set (NaN: the context's).
  struct Hyper {
    double lr_scale = 1.0;
    double beta1 = std::numeric_limits<double>::quiet_NaN();
    double beta2 = std::numeric_limits<double>::quiet_NaN();
  };
  const Hyper& hyper(size_t param_index) const { return hyper_[param_index]; }
  // What `g` gives, for param `param_index` (checked by the caller).
  void set_group(size_t param_index, const ParamGroupOptions& g);

  // The transitions order the engine's work after the caller's stream `s`
  // (the host's compute) through events: *_begin makes `s` wait for the
  // gather, *_end records the event after which the gathered params may be
  // freed and the grads reduced. On the CPU's NULL stream these waits block
  // the calling thread; on any other stream they block nothing.
  void forward_begin(device::Stream& s);
  void forward_end(device::Stream& s);
  void backward_begin(device::Stream& s);
  void backward_end(device::Stream& s);
  void* param_ptr(size_t param_index);
  void* grad_ptr(size_t param_index);
  // Adds `src` (numel elements of src_dtype in memory the unit's device
  // reads) into the param's grad on `s`, after the work queued there so far:
  // what a host's add through grad_ptr computes (kernels::AddOp).
  void grad_accumulate(size_t param_index, const void* src, DType src_dtype, size_t numel, device::Stream& s);
  void gather_param(size_t param_index, float* out, size_t numel);
  // The reduced fp32 grad of one param as the grad shards hold it after
  // backward (before fsdp_step unscales and clips it). Collective like
  // gather_param; refused while grads wait unreduced (no_sync).
  void gather_grad(size_t param_index, float* out, size_t numel);

  // For fsdp_step: reduce grads left pending by no_sync, wait for queued
  // reductions, and drop gathered params that the update will make stale.
  void reduce_pending_grads(device::Stream& s);
  void wait_reductions();
  // Drops gathered params that an update or new values would make stale;
  // the host waits for their gather (it reads the shard) unless
  // `order_after` is given, whose work then starts after it instead.
  void drop_stale_gathered(device::Stream* order_after = nullptr);
  // The optimizer's queued step zeroes the grad shard (and its sum of
  // squares, at Runtime::unit_sq[index]): the next backward pass may add
  // into it directly again.
  void grads_cleared() {
    sgrad_zero_ = true;
    grad_sq_known_ = true;
  }
  // The same where the grads were zeroed here, between steps (a load, a
  // relayout, a freeze): the sum of squares is zeroed too, now.
  void grads_reset();
  // Whether a pass of ours wrote the grad shard's sum of squares
  // (Runtime::unit_sq[index]) as it accumulated into the shard: false when
  // the host wrote the shard itself, and the step sums it.
  bool grad_sq_known() const { return grad_sq_known_; }
  // The host's last *_end of this unit on a stream that runs later than the
  // calls (null on a synchronous stream), and that stream.
  const EventPtr& host_use() const { return host_use_; }
  const device::Stream* host_use_stream() const { return host_use_stream_; }

  // The rank's shards, for the optimizer and fsdp_shard_info: the master
  // (shard_numel) is the rank's slice of the trainable block, then of the
  // frozen block; the grads and the optimizer state cover the first
  // (trainable_shard_numel). shard_offset: where the first slice starts in
  // the flat buffer.
  size_t shard_numel() const { return layout_.shard_numel(); }
  size_t trainable_shard_numel() const { return layout_.trainable_shard_numel(); }
  size_t shard_offset() const { return layout_.shard_ranges(rt_.shard_rank()).front().flat_begin; }
  float* master() const { return master_.as<float>(); }
  float* sharded_grad() const { return sgrad_.as<float>(); }  // null while frozen
  // The param_dtype copy of the shard (null when param_dtype is fp32). These
  // shards live on the state device: the host with offload=cpu.
  void* lowp_shard() const { return lowp_.data(); }
  const std::vector<ShardSegment>& segments() const { return segments_; }

 private:
  // FSDP_ERR_INVALID_STATE naming `call` when the unit is frozen.
  void refuse_frozen(const char* call) const;
  // FSDP_ERR_INVALID_STATE naming `call` when param `param_index` is frozen.
  void refuse_frozen_param(size_t param_index, const char* call) const;
  // The param's place in the grads being written, after grad_ptr's checks
  // (in backward, trainable), as `call`.
  void* grad_at(size_t param_index, const char* call);
  // gather_param's and gather_grad's argument and state checks.
  void check_gather_out(size_t param_index, size_t numel, const char* call) const;
  // Copies param `param_index`'s range of the flat fp32 state whose shard is
  // `shard` (the master, or with `grads` the grads: the trainable block's
  // slice; state device) into the host's `out`.
  void gather_shard(const float* shard, bool grads, size_t param_index, float* out, size_t numel, const char* call);
  // The task labels (with byte counts) of the current layout.
  void make_task_labels();
  [[noreturn]] void bad_state(const char* call, const char* expected) const;
  void* full_params() const;
  // `s` waits for the gather (GATHERING|GATHERED -> in use); a synchronous
  // stream that sees it fail leaves the unit SHARDED.
  void wait_gathered(device::Stream& s);
  // Frees the gathered params once `read` completes (null: now): the event
  // after the caller's stream's last read, so that the block is not reused
  // while that stream may still read it.
  void free_gathered(const EventPtr& read);
  // With debug_poison: queues the NaN fill of gathered_ after `after` and
  // returns its event (the slot's new release event); else `after`.
  EventPtr poisoned_after(const EventPtr& after);
  // At *_end: the event after what the caller's stream `s` queued so far (its
  // use of this unit's buffers), kept in host_use_; null on a synchronous stream.
  EventPtr note_host_use(device::Stream& s);
  // Blocks the host until the caller's stream's last use of this unit is
  // done: before the shard that stream reads in place is rewritten.
  void wait_host_use();
  // The reduction of the grads that the caller's stream `s` wrote, after
  // `written` (null: recorded on `s` now).
  EventPtr submit_reduction(device::Stream& s, EventPtr written);
  // offload=cpu: `work` on the host's data that the copy of event `copied`
  // brought, on the host work stream; returns its event.
  EventPtr on_host_after(const EventPtr& copied, device::Stream::Task work);
  // World of one: the grads reach the grad shard on the caller's stream `s`,
  // no comm task; returns the event of that work (null when done already).
  EventPtr accumulate_alone(device::Stream& s);
  // The comm-stream task of a reduction of the grads in `grads`.
  void reduce_task(void* grads);
  // The quantized reduce-scatter (reduce_dtype=int8|fp8_e4m3) of the
  // trainable block of `grads` over `c`: each rank's part for every rank
  // packed (kernels/quant.h), the parts exchanged by an all-to-all, and this
  // rank's received parts dequantized and summed in rank order in fp32
  // (scaled by 1/world for an average). Returns the fp32 shard (scratch).
  Buffer reduce_scatter_quantized(comm::Communicator& c, const void* grads, comm::RedOp op) const;
  // The same over reduce_hierarchy's groups (ZeRO++'s qgZ): an all-to-all
  // inside this rank's group moves to each member the parts of the shards
  // at its index in every group, each summed there over the group in fp32;
  // those partial sums, packed once more, go by an all-to-all across the
  // groups to their shards' ranks, which sum them in group order. What
  // leaves a group is one part per group instead of one per rank.
  Buffer reduce_scatter_hierarchical(const void* grads, comm::RedOp op) const;
  // HYBRID's all-reduce of that fp32 shard (n values) across the replicas
  // over `c`, quantized too: the shard cut into one part per replica, packed,
  // exchanged by an all-to-all and summed as above (each replica its part),
  // then each part packed once more and all-gathered, every replica
  // dequantizing the same bytes into `shard` (so the replicas stay equal).
  void all_reduce_quantized(comm::Communicator& c, float* shard, size_t n, comm::RedOp op) const;
  // Elements of the reduced grads: the shard, or the padded params (NO_SHARD).
  size_t reduced_numel() const;
  // Whether this backward may hand out the grad shard itself as the grad buffer.
  bool can_write_shard_grads() const;
  void set_state(UnitState s);
  void trace_memory();
  std::string label(const char* what) const;
  const std::string& unit_tag() const { return tag_; }  // 'name' (#index)
  // Where the passes that accumulate into the grad shard write its sum of
  // squares (the state device's memory).
  double* grad_sq_slot() const { return rt_.unit_sq + index_; }

  Runtime& rt_;
  size_t index_;
  std::string name_;
  std::string tag_;  // unit_tag(): quoted once, as messages and every collective's label use it
  FlatLayout layout_;
  std::vector<ShardSegment> segments_;
  // The blocks' slices (as every rank's shard holds them): what the gathers
  // move, kept so that a transition allocates nothing.
  std::vector<ShardRange> block_slices_;
  std::vector<double> weight_decay_;
  std::vector<Hyper> hyper_;
  UnitState state_ = UnitState::kSharded;
  bool trainable_ = true;
  bool quantized_gathers_ = false;  // gather_dtype quantizes this unit's gathers (gather_dtype_exclude)
  bool grads_pending_ = false;
  bool sgrad_zero_ = true;       // the grad shard holds zeros (since the last step or load)
  bool grads_in_shard_ = false;  // this backward's grads are the grad shard itself (alone, fp32)
  bool grad_sq_known_ = true;    // the pass that accumulates into the grad shard writes its sum of squares
  // The collectives' labels, and the names of the tasks this unit queues,
  // built once: a transition builds no string.
  std::string gather_label_, reduce_label_, replica_label_, secondary_label_;
  struct TaskLabels {
    device::Label gather, gather_cast, copy_in, copy_out_grads, reduce, copy_out_reduced, host_accumulate, accumulate,
        add_grad, gather_secondary, drop_secondary;
  } tasks_;
  EventPtr gather_event_;  // the gathered params are complete (while gathered)
  EventPtr reduce_event_;  // the last reduction queued for this unit
  EventPtr host_use_;      // the caller's stream's last *_end of this unit (async streams)
  const device::Stream* host_use_stream_ = nullptr;  // that stream
  EventPtr slot_read_;     // kept after forward: the caller's stream's read of gathered_

  Buffer master_;    // fp32 [shard], state device
  Buffer lowp_;      // param_dtype [shard], state device, only when param_dtype != fp32
  Buffer sgrad_;     // fp32 [shard], state device
  Buffer gathered_;  // param_dtype [padded], compute device, while gathered (when rt_.gathers())
  Buffer ugrad_;     // param_dtype [padded], compute device, during backward / while pending (unless grads_in_shard_)
  // offload=cpu: a reduction's result on the compute device (reduced_, or the
  // grad slot itself at reduced_data_) and its copy on the host (on_host_),
  // each used by one stage of the reduction's tasks at a time (submit_reduction).
  Buffer reduced_;
  const void* reduced_data_ = nullptr;
  Buffer on_host_;
  // offload=cpu, gathered: the shard copied to the device for the gather
  // (taken by the copy task, freed by the gather task), and the event of the
  // unit's last gather, which the next copy waits for.
  Buffer offload_stage_;
  EventPtr last_gather_;
  // secondary_shard: this rank's slice of the full params (padded /
  // secondary group size values of param_dtype, compute device), kept by a
  // gather task for the unit's next gather (backward's), which reads the
  // secondary group's slices and frees it. Touched by gather-stream tasks
  // only. secondary_ready_ (host): the last gather issued keeps one, which
  // the next gather uses; a change of the params (the step, set_values,
  // loads, relayout) drops it (drop_stale_gathered).
  Buffer secondary_;
  bool secondary_ready_ = false;
};

}  // namespace fsdp::core
