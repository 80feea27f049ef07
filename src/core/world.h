// src/core/world.h - how the C API reaches the communicators: through core,
// which builds a group of in-process ranks and the world communicator of a new
// context from the context's options. The API sees the group only as a handle.
#pragma once

#include <memory>
#include <string>

#include "config.h"

namespace fsdp::comm {
class Communicator;
class LocalGroup;
}  // namespace fsdp::comm

namespace fsdp::core {

// A group of `world_size` in-process ranks (fsdp_local_group_create).
std::shared_ptr<comm::LocalGroup> make_local_group(int world_size);
// Fails every rank's pending and future collectives in `group` (fsdp_local_group_abort).
void abort_local_group(comm::LocalGroup& group, const std::string& reason);
// A new id for comm=nccl ranks that a host connects itself
// (fsdp_comm_id_create): hex text. UNSUPPORTED in a build without NCCL.
std::string new_comm_id();
// fsdp_launcher: rank, world, local rank and local world a launcher gave
// this process (-1 where none).
void launcher_env(int* rank, int* world, int* local_rank, int* local_world);
// The world communicator for fsdp_ctx_create's arguments: `group` (null for a
// world of one, or comm=mpi) and `rank`.
std::unique_ptr<comm::Communicator> make_world(const Options& opts, std::shared_ptr<comm::LocalGroup> group, int rank);

}  // namespace fsdp::core
