// src/comm/launch.h - which communicator a context gets: what a launcher
// (mpirun, MPICH's hydra) told this process through its environment, and the
// choice between the in-process `local` communicator and `mpi`.
#pragma once

#include <memory>
#include <string>

#include "communicator.h"
#include "local/local_group.h"
#include "options.h"

namespace fsdp::comm {

// Rank, world and host-local place of this process as its launcher set them;
// `source` names the variables ("OMPI_COMM_WORLD_*"), empty when none is set.
struct LaunchEnv {
  std::string source;
  int rank = -1;
  int world = -1;
  int local_rank = -1;   // -1 when the launcher does not say
  int local_world = -1;  // -1 when the launcher does not say
  bool present() const { return !source.empty(); }
};

// Reads OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE} (Open MPI),
// PMI_RANK/PMI_SIZE with MPI_LOCALRANKID/MPI_LOCALNRANKS (MPICH), or an srun
// task's SLURM_* variables (slurm.h), in that order. Throws INVALID_ARGUMENT
// naming the variable when a value is malformed.
LaunchEnv read_launch_env();

// The world communicator for a new context. `group` (may be null) and `rank`
// are fsdp_ctx_create's arguments: a local group and a rank in it, or, for
// mpi and nccl, null and -1 (or the launcher's rank, which is then checked;
// with a host-passed comm_id, this process's rank). comm=auto on a GPU takes
// nccl when a launcher started several processes.
std::unique_ptr<Communicator> make_world_comm(const Options& opts, std::shared_ptr<LocalGroup> group, bool group_given,
                                              int rank);

// A new id for comm=nccl ranks that a host connects itself (fsdp_comm_id_create):
// NCCL's unique id as hex text. UNSUPPORTED in a build without NCCL.
std::string new_comm_id();

// Whether this build has the mpi communicator; the nccl one.
bool have_mpi();
bool have_nccl();

}  // namespace fsdp::comm
