// src/core/runtime.h - Runtime: what every unit of one context shares (options,
// device, communicator, memory accounting) and the rank's place in the
// sharding. Owned by the Context; units hold a reference.
#pragma once

#include <string>

#include "../comm/communicator.h"
#include "../device/device.h"
#include "config.h"
#include "error.h"
#include "memory.h"

namespace fsdp::core {

struct Runtime {
  Options opts;
  device::Device* dev = nullptr;
  comm::Communicator* comm = nullptr;
  MemoryTracker mem;
  int rank = 0;
  int world = 1;
  bool grad_sync = true;
  bool finalized = false;

  bool sharded() const { return opts.sharding != Sharding::kNoShard; }
  // NO_SHARD is a flat layout over a world of one, so one code path serves all.
  int shard_world() const { return sharded() ? world : 1; }
  int shard_rank() const { return sharded() ? rank : 0; }
  std::string where() const { return "rank " + std::to_string(rank); }
  // Throws INVALID_STATE naming `call` once the context is finalized.
  void check_live(const char* call) const {
    if (finalized) {
      fail(FSDP_ERR_INVALID_STATE,
           std::string(call) + " (" + where() + "): the context was finalized; only fsdp_ctx_destroy is allowed");
    }
  }
};

}  // namespace fsdp::core
