// src/core/runtime.cpp - Runtime's part in CUDA graph captures (see runtime.h):
// the engine's streams join the host's capture, and what a graph cannot hold
// is refused while it is open.
#include "runtime.h"

#include <cstring>

namespace fsdp::core {

void Runtime::wait_step() const {
  if (graph_origin != nullptr) {
    // The graph's runs that the host launched are queued on its stream: all of
    // them are done once what that stream queued so far is.
    graph_origin->synchronize(opts.timeout_s);
    return;
  }
  if (step_done) step_done->wait(opts.timeout_s);
}

bool Runtime::in_capture() const { return capture_joined != 0 && stream->capture_id() == capture_joined; }

void Runtime::join_capture(device::Stream& s, const char* call) {
  const uint64_t id = s.capture_id();
  if (id == 0 || id == capture_joined) return;
  const std::string who = std::string(call) + " (" + where() + "): the host's stream is capturing a CUDA graph, but ";
  if (offload()) {
    fail(FSDP_ERR_UNSUPPORTED, who + "offload=cpu runs the optimizer and the copies around it on the host's threads, "
                                     "which a graph cannot hold; run offloaded steps without capturing them");
  }
  if (opts.optimizer == OptimizerKind::kHost) {
    fail(FSDP_ERR_UNSUPPORTED, who + "optimizer=host updates the shards from the host between fsdp_step_begin and "
                                     "fsdp_step_end, which a graph cannot hold; use fsdp_step's optimizer to capture");
  }
  if (world_comm != nullptr && !world_comm->capturable()) {
    fail(FSDP_ERR_UNSUPPORTED, who + "ranks that are threads sharing one GPU (the local communicator at a world of " +
                                     std::to_string(world) +
                                     ") cannot be captured yet: their capture into one graph did not pass its test "
                                     "on a GPU (docs/gpu.md, 'GPU runs'); capture at a world of one or with "
                                     "comm=nccl, or run these steps eagerly");
  }
  device::Stream* engine[] = {stream, gather_stream, copy_in, copy_out};
  for (device::Stream* e : engine) {
    // Work an engine stream queued before the capture cannot be waited for
    // inside it: it must be done (the warm-up steps are, once the host
    // synchronized before capturing).
    if (e != nullptr && e->capture_id() == 0 && !e->record()->done()) {
      fail(FSDP_ERR_INVALID_STATE, who + "work libfsdp queued before it still runs on the GPU; synchronize "
                                         "(cudaDeviceSynchronize) before cudaStreamBeginCapture");
    }
  }
  // The fork: the engine's streams wait for an event of the capturing
  // stream, so that they are part of the capture; they join back into it
  // through the events it waits for (the gathers, the step).
  EventPtr fork = s.record();
  for (device::Stream* e : engine) {
    if (e != nullptr) e->wait(fork);
  }
  capture_joined = id;
  graph_origin = &s;
}

void Runtime::check_in_capture(const char* call) const {
  if (!in_capture()) return;
  for (const char* ok : {"fsdp_forward_begin", "fsdp_forward_end", "fsdp_backward_begin", "fsdp_backward_end",
                         "fsdp_param_ptr", "fsdp_grad_ptr", "fsdp_step", "fsdp_set_grad_sync", "fsdp_ctx_rank",
                         "fsdp_ctx_world_size", "fsdp_ctx_param_dtype", "fsdp_memory_stats", "fsdp_comm_stats",
                         "fsdp_unit_trainable", "fsdp_param_trainable", "fsdp_param_flat_range",
                         "fsdp_loss_scale_device"}) {
    if (std::strcmp(call, ok) == 0) return;
  }
  fail(FSDP_ERR_INVALID_STATE,
       std::string(call) + " (" + where() +
           "): a CUDA graph is being captured on this context's streams: only the brackets, their pointers and "
           "fsdp_step can be captured (a graph runs them when launched); call it after cudaStreamEndCapture");
}

}  // namespace fsdp::core
