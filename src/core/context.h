// src/core/context.h - Context: one rank's view of one training job. Ties the
// options, the device, the communicator, the units and the optimizer together,
// and enforces the context-wide rules (finalize, step order).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "../base/error.h"
#include "../ckpt/files.h"
#include "../comm/communicator.h"
#include "../comm/counting.h"
#include "optimizer.h"
#include "runtime.h"
#include "scheduler.h"
#include "slots.h"
#include "sync_comm.h"
#include "unit.h"

namespace fsdp::ckpt {
struct ParamRef;  // ckpt/reader.h
}  // namespace fsdp::ckpt

namespace fsdp::core {

struct AsyncSave;  // async_save.h

class Context {
 public:
  // Collective over `world`: checks that all ranks use the same options and,
  // for HYBRID_SHARD, splits the world into shard and replica groups.
  Context(const Options& opts, std::unique_ptr<comm::Communicator> world);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int rank() const { return rt_.rank; }
  int world_size() const { return rt_.world; }
  const Options& options() const { return rt_.opts; }
  fsdp_status_t async_error() const;

  void check_live(const char* call) const { rt_.check_live(call); }

  // Collective. `problem` is this rank's reason its arguments are invalid ("" if
  // none): the call still joins the other ranks so that they fail too.
  // `frozen` (empty: none frozen): the params registered frozen (Unit).
  // fsdp_clip_grad_norm: the grads' global norm, and the coming fsdp_step
  // clips them with torch's rule (Optimizer::grad_norm, set_clip).
  double clip_grad_norm(device::Stream& caller, double max_norm);
  Unit& register_unit(const std::string& name, std::vector<ParamSpec> params, std::string problem,
                      std::vector<bool> frozen = {});
  // Orders itself after `caller`'s work (the host's compute stream).
  void step(device::Stream& caller);
  // optimizer=host: fsdp_step_begin (all of step() but the update; returns
  // false for a skipped step, else true with the grads' factor) and
  // fsdp_step_end (after the host's update on `caller`).
  bool step_begin(device::Stream& caller, float* grad_scale);
  void step_end(device::Stream& caller);
  // Collective: freezes (false) or unfreezes `unit` between steps (no unit in
  // use, no grads accumulated since the last step), the same on every rank.
  void set_trainable(Unit& unit, bool trainable);
  // fsdp_param_set_trainable: the same checks, then the unit laid out again.
  void set_param_trainable(Unit& unit, size_t param_index, bool trainable);
  // Collective, between steps: sets `options` (lr_scale, weight_decay, beta1,
  // beta2) on every registered param whose name matches the glob `pattern`;
  // returns how many matched (none is FSDP_ERR_INVALID_ARGUMENT).
  size_t set_param_group(const std::string& pattern, const char* options);
  // Unit `unit`'s i-th optimizer state buffer (its shard), null while frozen.
  float* optimizer_state(const Unit& unit, size_t i) { return optimizer_.state_for_load(unit.index(), i); }
  bool owns(const Unit& unit) const { return unit.index() < units_.size() && units_[unit.index()].get() == &unit; }
  // The device stream for the API's `stream` argument of `call`.
  device::Stream& caller_stream(void* native, const char* call) { return rt_.caller_stream(native, call); }
  device::Device& device() { return *dev_; }
  // For white-box tests: the engine's streams, options and rank.
  const Runtime& runtime() const { return rt_; }
  void set_grad_sync(bool enabled) { rt_.grad_sync = enabled; }
  void set_lr(double lr);
  double last_grad_norm() const;
  uint64_t step_count() const { return static_cast<uint64_t>(optimizer_.step_count()); }
  // Collective: fsdp_metrics_reduce.
  // `op` is an fsdp_reduce_op_t's value, checked here.
  void metrics_reduce(double* values, size_t count, int op);
  // The loss scale as the last step left it (waits for that step), and
  // where the steps keep it (fsdp_loss_scale_device).
  const LossScaler& loss_scaler() const { return optimizer_.loss_scaler(); }
  const double* loss_scale_device() { return optimizer_.loss_scale_device(); }
  void finalize();
  // Checkpoints (checkpoint.cpp). Collective. kind is "sharded" or "full".
  void save(const std::string& dir, const std::string& kind);
  // Collective. All or nothing: on any rank's failure no rank changes.
  // strict=false: the params the checkpoint lacks keep their values and
  // state, the ones it has that are not registered are ignored; what was
  // left out is in load_report() (after every load that succeeded).
  // With a `label` (what its collectives and errors are called), each rank
  // loads its own directory (fsdp_restore's snapshot, one per rank).
  void load(const std::string& dir, bool strict = true, const std::string& label = "");
  // checkpoint_async.cpp. Collective: fsdp_save_async (a sharded save from
  // a copy of the state, written in the background). Local: fsdp_save_wait
  // (throws the background save's error, once).
  void save_async(const std::string& dir);
  void save_wait();
  // Collective: fsdp_snapshot, and fsdp_restore (returns what it restored:
  // an fsdp_restore_source_t).
  void snapshot(const std::string& path);
  int restore(const std::string& path, const std::string& checkpoint_dir);
  const std::string& load_report() const { return load_report_; }
  // fsdp_load_pretrained: params from safetensors files written by anything
  // (by name through `options`: ckpt/pretrained.h), optimizer state fresh.
  void load_pretrained(const std::string& path, const char* options);
  // fsdp_export: the params, consolidated, as safetensors files another
  // program loads (the names and layouts through the same options, reversed).
  void export_weights(const std::string& dir, const char* options);
  MemoryTracker& memory() { return rt_.mem; }
  Trace& trace() { return rt_.trace; }
  const MemoryTracker& memory() const { return rt_.mem; }
  // What this rank's collectives moved (fsdp_comm_stats): its world, shard
  // and replica communicators count into these.
  comm::CommCounters& comm_counters() { return *comm_counters_; }
  const comm::CommCounters& comm_counters() const { return *comm_counters_; }

 private:
  void check_no_unit_in_use(const char* call) const;
  // A collective call checked on each rank: every rank agrees on `text`
  // (which carries this rank's refusal, if any), so that a rank whose call is
  // refused still joins and the others fail too (FSDP_ERR_MISMATCH) instead
  // of waiting or going on alone; then a rank with a `refusal` ("" for none)
  // fails with `status` and it.
  void agree_or_refuse(const std::string& what, const std::string& text, fsdp_status_t status,
                       const std::string& refusal);
  // What a step does before its update: no unit in use, no_sync's grads
  // reduced, the caller's stream and every reduction done.
  void settle_for_step(device::Stream& caller, device::Stream& run, const char* call);
  // Where a step's norm, verdict and update run: the caller's stream alone
  // (a world of one: nothing leaves it), the host's work stream with
  // offload=cpu (the state is the host's), else the comm stream, after the
  // reductions it runs.
  device::Stream& step_stream(device::Stream& caller);
  // Throws the first failure of work queued earlier (a stream's, with its
  // message, or a communicator's), without waiting: fsdp_step queues its
  // work after that work and would otherwise train on its results.
  void check_failures(const char* call) const;
  // Why freezing or unfreezing is refused now ("" when it is not): a unit in
  // use, or grads since the last fsdp_step.
  std::string between_steps_problem() const;
  bool host_update_ = false;  // fsdp_step_begin's verdict, for fsdp_step_end
  // The first step's check that each gather_dtype_exclude pattern matches a
  // registered unit: a misspelt one would leave every gather quantized.
  void check_gather_exclusions(const char* call);
  bool exclusions_checked_ = false;
  // Waits (on the host) for queued gathers, reductions and the last step,
  // and drops gathered params that an update would make stale: the units'
  // state before a call that reads or rewrites the shards, or finalize.
  void settle_units();
  // Shard and replica groups (HYBRID_SHARD) and the rank's place in them.
  void setup_groups();
  // secondary_shard: checks the option against the strategy and splits the
  // shard group into secondary groups (after setup_groups).
  void setup_secondary();
  // reduce_hierarchy: splits the shard group into the quantized reduction's
  // groups (runs of consecutive ranks: a host) and across them.
  void setup_reduce_hierarchy();
  // Whether the gathers get a stream and a communicator of their own (gather_stream).
  bool gathers_apart();
  // Fails every collective of this context's communicators (never waits).
  void abort_comms(const std::string& reason);
  // checkpoint.cpp: the metadata of this context's state, and the files this
  // rank writes into the staging directory.
  ckpt::Meta checkpoint_meta(const std::string& kind) const;
  // The shard file's contents in writing order: each unit's master shard,
  // then its optimizer states' slices (state-device memory).
  struct StateSegment {
    const void* data;
    size_t nbytes;
  };
  std::vector<StateSegment> shard_segments() const;
  // Writes this rank's shard file (of its shard_rank) from `segs`, memory of
  // `dev` (the host's when null).
  ckpt::FileRecord write_shard_file(const std::string& staged, const ckpt::Meta& meta,
                                    const std::vector<StateSegment>& segs, device::Device* dev);
  // A save's collective start (rank 0 readies the staging directory; returns
  // it) and end (every rank's outcome of writing, the file records, rank 0's
  // metadata and commit, over `comm`; on failure the staging directory goes).
  std::string prepare_save(comm::Communicator& comm, const std::string& dir, const std::string& what,
                           const char* call) const;
  void finish_save(comm::Communicator& comm, const std::string& what, const std::string& dir, ckpt::Meta meta,
                   const Outcome& wrote, const std::vector<ckpt::FileRecord>& mine) const;
  // Waits for a background save (fsdp_save_async); throws its error if no
  // call reported it yet. Checkpoint calls run this first.
  void settle_async(const char* call);
  std::vector<ckpt::FileRecord> write_full_files(const std::string& staged, const ckpt::Meta& meta,
                                                 ckpt::FullEntries entries);
  // Where each registered param comes from in a checkpoint: the same units in
  // the same order, or else by name (any grouping and order; names unique on
  // both sides); FSDP_ERR_INVALID_ARGUMENT naming every param missing from
  // it, every param it has that is not registered, and every shape that differs.
  // Non-strict: params missing from it get ParamRef::kNone, and `left_out`
  // receives the report ("missing: <name>" / "unexpected: <name>" lines).
  std::vector<std::vector<ckpt::ParamRef>> match_checkpoint(const ckpt::Meta& meta, const std::string& file,
                                                            bool strict, std::string* left_out) const;

  // A load's refusal while no_sync grads wait unreduced; what a load left
  // out, kept for load_report() and logged on rank 0.
  void check_no_pending_grads(const char* call) const;
  void set_load_report(const std::string& what, std::string left_out);
  std::string load_report_;  // what the last load left out (load_report())
  std::string snapshot_run_;  // the run id of this context's snapshots (fsdp_snapshot, fsdp_restore)
  Runtime rt_;
  std::unique_ptr<device::Device> dev_;
  std::unique_ptr<device::Device> host_;  // offload=cpu only
  std::shared_ptr<comm::CommCounters> comm_counters_ = std::make_shared<comm::CommCounters>();
  std::unique_ptr<comm::Communicator> world_;  // a CountingComm over fsdp_ctx_create's
  std::unique_ptr<comm::Communicator> shard_;    // HYBRID_SHARD only
  std::unique_ptr<comm::Communicator> replica_;  // HYBRID_SHARD only
  // The params' all-gathers, over the shard group (sharded over more than one rank).
  std::unique_ptr<comm::Communicator> gather_comm_;
  std::unique_ptr<comm::Communicator> secondary_;  // secondary_shard only
  std::unique_ptr<comm::Communicator> reduce_local_, reduce_cross_;  // reduce_hierarchy where it groups
  // After the devices (their slots free through them), before the units and
  // the streams (whose tasks use the slots), so that they go after those.
  std::unique_ptr<SlotPool> gather_slots_;
  std::unique_ptr<SlotPool> grad_slots_;
  std::vector<std::unique_ptr<Unit>> units_;
  Optimizer optimizer_;
  Scheduler scheduler_;
  // Declared after what their tasks use so that they stop first; the comm
  // stream stops before the copy streams, whose tasks may wait for it.
  std::unique_ptr<device::Stream> copy_in_;
  std::unique_ptr<device::Stream> copy_out_;
  std::unique_ptr<device::Stream> host_work_;  // waits for copy_out_: stops before it
  std::unique_ptr<device::Stream> stream_;
  std::unique_ptr<device::Stream> gather_stream_;  // with gather_comm_
  std::unique_ptr<SyncComm> sync_world_;
  std::unique_ptr<SyncComm> sync_shard_;
  // Last: destroyed first, it waits for its background save (which uses the
  // state above only through its own copy and communicator).
  std::unique_ptr<AsyncSave> async_;
};

}  // namespace fsdp::core
