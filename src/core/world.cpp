// src/core/world.cpp - see world.h.
#include "world.h"

#include "../base/error.h"
#include "../comm/launch.h"
#include "../comm/local/local_group.h"

namespace fsdp::core {

std::shared_ptr<comm::LocalGroup> make_local_group(int world_size) {
  return std::make_shared<comm::LocalGroup>(world_size);
}

void abort_local_group(comm::LocalGroup& group, const std::string& reason) {
  group.abort(FSDP_ERR_COMM, "the local group was aborted by the application: " + reason, true);
}

std::string new_comm_id() { return comm::new_comm_id(); }

void launcher_env(int* rank, int* world, int* local_rank, int* local_world) {
  const comm::LaunchEnv e = comm::read_launch_env();
  *rank = e.rank;
  *world = e.world;
  *local_rank = e.present() ? e.local_rank : -1;
  *local_world = e.present() ? e.local_world : -1;
}

std::unique_ptr<comm::Communicator> make_world(const Options& opts, std::shared_ptr<comm::LocalGroup> group, int rank) {
  bool given = group != nullptr;
  if (!given) group = make_local_group(1);
  return comm::make_world_comm(opts.comm_options(), std::move(group), given, rank);
}

}  // namespace fsdp::core
