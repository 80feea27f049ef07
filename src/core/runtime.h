// src/core/runtime.h - Runtime: what every unit of one context shares (options,
// device, communicator, memory accounting) and the rank's place in the
// sharding. Owned by the Context; units hold a reference.
#pragma once

#include <algorithm>
#include <atomic>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "../base/error.h"
#include "../base/host_waits.h"
#include "../comm/communicator.h"
#include "../device/device.h"
#include "config.h"
#include "memory.h"
#include "trace.h"

namespace fsdp::core {

class Scheduler;
class SlotPool;
using device::EventPtr;

struct Runtime {
  explicit Runtime(const Options& o) : opts(o) {}
  Options opts;
  // The compute device (gathered params, the grads the host writes) and the
  // device that holds the shards and optimizer state: the same one, or the
  // host with offload=cpu.
  device::Device* dev = nullptr;
  device::Device* state_dev = nullptr;
  // Synchronous collectives (they run on the comm stream and wait): over the
  // world, and over this rank's shard group (the world unless HYBRID_SHARD).
  comm::Communicator* comm = nullptr;
  comm::Communicator* shard_sync = nullptr;
  // The communicators themselves, for tasks that run on the comm stream.
  comm::Communicator* world_comm = nullptr;
  comm::Communicator* shard_comm = nullptr;
  comm::Communicator* replica_comm = nullptr;  // HYBRID_SHARD with more than one replica; else null
  // The quantized reduction's hierarchy (reduce_hierarchy, on the comm
  // stream as the shard group's): the shard group's ranks of this rank's
  // group, and those of every group at this rank's index in it; null when
  // the reduction is one all-to-all.
  comm::Communicator* reduce_local_comm = nullptr;
  comm::Communicator* reduce_cross_comm = nullptr;
  MemoryTracker mem;
  Trace trace;
  device::Stream* stream = nullptr;  // the comm stream: reductions, the step's norm, every synchronous collective
  // The params' all-gathers run on a stream of their own, over a
  // communicator of their own (the shard group's, split off), so that a
  // prefetched gather never queues behind a reduction (FSDP2's streams).
  device::Stream* gather_stream = nullptr;
  comm::Communicator* gather_comm = nullptr;
  // secondary_shard: the secondary group's communicator (run on the gather
  // stream, as the gathers), its size and this rank's index in it; null
  // when off or where nothing is gathered.
  comm::Communicator* secondary_comm = nullptr;
  int secondary_size = 1;
  int secondary_index = 0;
  // offload=cpu: host -> device copies of param shards before their gathers,
  // device -> host copies of reduced grad shards (and their accumulation).
  device::Stream* copy_in = nullptr;
  device::Stream* copy_out = nullptr;
  // offload=cpu: the host's own work on what copy_out brought (the reduced
  // grads added into the host grad shard), after the copy's event: on a GPU
  // a copy completes after its task returns, so the host must wait for it.
  device::Stream* host_work = nullptr;
  Scheduler* sched = nullptr;
  // Gathered params (param_dtype) and the grads the host writes (param_dtype),
  // on the compute device.
  SlotPool* gather_slots = nullptr;
  SlotPool* grad_slots = nullptr;
  // The step on the device (Optimizer): the event after which the last
  // fsdp_step's update is done (null before the first), and each unit's sum
  // of squares, a double in the state device's memory at unit_sq[index],
  // written by the pass that last accumulated into its grad shard.
  EventPtr step_done;
  double* unit_sq = nullptr;
  // Host-blocking waits of this context's calls (fsdp_comm_stats): every
  // time a call blocked the calling thread on a stream's or an event's work,
  // counted by the devices' waits (base/host_waits.h).
  mutable std::atomic<uint64_t> host_waits{0};
  // Blocks the host until the last step's update is done (a call that reads
  // or rewrites what it writes: the shards, the optimizer state, the step's
  // scalars); at once when none is queued.
  // After a CUDA graph captured a step, the graph's runs are the host's
  // to launch (on the stream the capture began on): a read waits for all
  // that stream queued.
  void wait_step() const;
  // CUDA graphs (docs/gpu.md, "CUDA graphs"): the capture the engine's
  // streams joined last (0: none), and the host's stream it began on.
  uint64_t capture_joined = 0;
  device::Stream* graph_origin = nullptr;
  // Called by every transition and fsdp_step with the host's stream `s`:
  // where `s` is capturing a CUDA graph that the engine has not joined, the
  // engine's streams join it (they wait for an event of `s`), so that what
  // they queue is captured too; refused where the step cannot be captured
  // (offload=cpu, optimizer=host) or where they still run work queued
  // before the capture.
  void join_capture(device::Stream& s, const char* call);
  // A capture the engine joined is still open (only the calls a graph can
  // hold are allowed then: check_live).
  bool in_capture() const;
  // Steps queued so far, and the stream that last waited for the newest.
  uint64_t step_seq = 0;
  const device::Stream* step_waiter = nullptr;
  uint64_t step_waiter_seq = 0;
  // Makes `s` start its next work after the last step's update: a host
  // stream that reads the shards in place (nothing gathered) or writes the
  // grad shard itself, once per stream and step.
  void order_after_step(device::Stream& s) {
    if (!step_done || (step_waiter == &s && step_waiter_seq == step_seq)) return;
    s.wait(step_done);
    step_waiter = &s;
    step_waiter_seq = step_seq;
  }
  // Grad reductions queued on the comm stream, oldest first. A backward pass
  // lets at most one run behind the unit being computed, which bounds the
  // unsharded grads to two units while keeping the overlap.
  std::deque<EventPtr> reductions_in_flight;
  // The host's streams that run later than the calls (not the CPU's NULL
  // stream) seen so far: fsdp_ctx_async_error reports their failures.
  std::vector<device::Stream*> async_callers;
  int rank = 0;
  int world = 1;
  // The ranks a unit is sharded over: the world (FULL_SHARD, SHARD_GRAD_OP),
  // the shard group (HYBRID_SHARD*), or a world of one (NO_SHARD: one flat
  // layout code path serves all), and this rank's place among them.
  int shard_size = 1;
  int shard_index = 0;
  bool grad_sync = true;
  bool finalized = false;
  // optimizer=host: between fsdp_step_begin and fsdp_step_end, where only
  // the calls of the host's update are allowed (check_live).
  bool host_step_open = false;

  bool sharded() const { return opts.sharding != Sharding::kNoShard; }
  bool offload() const { return opts.offload_cpu; }
  // Units whose full params are a separate buffer on the compute device,
  // made by a gather (sharded over more than one rank) or a host -> device
  // copy (offload=cpu). Otherwise the shard is the full params (NO_SHARD, or a
  // shard group of one) and the host reads it in place: no gather, no copy.
  bool gathers() const { return (sharded() && shard_size > 1) || offload(); }
  // A world of one: grads need no reduction, only to reach the grad shard.
  bool alone() const { return world == 1; }
  int shard_world() const { return shard_size; }
  int shard_rank() const { return shard_index; }
  std::string where() const { return "rank " + std::to_string(rank); }
  // The device stream for the API's `stream` argument of `call`.
  device::Stream& caller_stream(void* native, const char* call) {
    device::Stream& s = dev->caller_stream(native, call);
    if (!s.synchronous() && std::find(async_callers.begin(), async_callers.end(), &s) == async_callers.end()) {
      async_callers.push_back(&s);
    }
    return s;
  }
  // Throws INVALID_STATE naming `call` once the context is finalized.
  void check_live(const char* call) const {
    base::host_wait_counter() = &host_waits;  // the call's waits count for this context (api's guard() lets go)
    if (finalized) {
      fail(FSDP_ERR_INVALID_STATE,
           std::string(call) + " (" + where() + "): the context was finalized; only fsdp_ctx_destroy is allowed");
    }
    if (host_step_open) check_in_host_step(call);
    if (capture_joined != 0) check_in_capture(call);
  }
  // During a CUDA graph capture that the engine joined: the brackets, the
  // pointers they hand out, fsdp_step and what only reads the host's own
  // counters; anything else waits on the host or writes outside the graph,
  // and is FSDP_ERR_INVALID_STATE naming `call`.
  void check_in_capture(const char* call) const;
  // Between fsdp_step_begin and fsdp_step_end: the shards are the host's to
  // update, and what would read or change them (a pass, a save, a gather) is
  // FSDP_ERR_INVALID_STATE naming `call`.
  static bool allowed_in_host_step(const std::string& call) {
    for (const char* ok : {"fsdp_step_end", "fsdp_shard_tensors", "fsdp_shard_info", "fsdp_param_flat_range", "fsdp_ctx_step",
                           "fsdp_last_grad_norm", "fsdp_memory_stats", "fsdp_comm_stats", "fsdp_unit_trainable", "fsdp_param_trainable"}) {
      if (call == ok) return true;
    }
    return false;
  }
  void check_in_host_step(const char* call) const {
    if (allowed_in_host_step(call)) return;
    fail(FSDP_ERR_INVALID_STATE, std::string(call) + " (" + where() +
                                     "): between fsdp_step_begin and fsdp_step_end the shards are the host's to "
                                     "update; call fsdp_step_end first");
  }
};

}  // namespace fsdp::core
