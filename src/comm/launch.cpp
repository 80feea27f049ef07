// src/comm/launch.cpp - see launch.h.
#include "launch.h"

#include <cstdlib>

#include "../base/error.h"
#include "../base/log.h"
#include "../base/text.h"
#include "local/local_comm.h"
#include "slurm.h"
#ifdef FSDP_HAVE_MPI
#include "mpi/mpi_comm.h"
#endif
#ifdef FSDP_HAVE_NCCL
#include "nccl/nccl_comm.h"
#endif

namespace fsdp::comm {
namespace {

// The value of `name` as an int >= lo, or `fallback` when unset.
int env_int(const char* name, int lo, int fallback) {
  const char* v = std::getenv(name);  // NOLINT(concurrency-mt-unsafe): read before any rank thread starts
  if (v == nullptr) return fallback;
  long n = 0;
  if (!base::parse_long(v, &n) || n < lo || n > (1L << 30)) {
    fail(FSDP_ERR_INVALID_ARGUMENT, std::string("environment variable ") + name + "=" + base::quote(v) +
                                        " is not an integer >= " + std::to_string(lo) +
                                        "; it is set by the launcher (mpirun): do not set it by hand");
  }
  return static_cast<int>(n);
}

LaunchEnv read_vars(const char* source, const char* rank, const char* size, const char* local_rank,
                    const char* local_size) {
  LaunchEnv e;
  e.rank = env_int(rank, 0, -1);
  e.world = env_int(size, 1, -1);
  if (e.rank < 0 && e.world < 0) return e;
  if (e.rank < 0 || e.world < 0 || e.rank >= e.world) {
    fail(FSDP_ERR_INVALID_ARGUMENT, std::string("launcher variables disagree: ") + rank + "=" + std::to_string(e.rank) +
                                        ", " + size + "=" + std::to_string(e.world) +
                                        "; both must be set, with the rank below the size");
  }
  e.source = source;
  e.local_rank = env_int(local_rank, 0, -1);
  e.local_world = env_int(local_size, 1, -1);
  return e;
}

}  // namespace

LaunchEnv read_launch_env() {
  LaunchEnv e = read_vars("OMPI_COMM_WORLD_*", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                          "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE");
  if (e.present()) return e;
  e = read_vars("PMI_RANK/PMI_SIZE", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS");
  if (e.present()) return e;
  return read_slurm_env();  // srun (--mpi=pmix|pmi2 or none)
}

std::string new_comm_id() {
#ifdef FSDP_HAVE_NCCL
  return new_nccl_id_hex();
#else
  fail(FSDP_ERR_UNSUPPORTED,
       "fsdp_comm_id_create: the id is NCCL's, and this library has no NCCL communicator (see fsdp_build_info())");
#endif
}

bool have_mpi() {
#ifdef FSDP_HAVE_MPI
  return true;
#else
  return false;
#endif
}

bool have_nccl() {
#ifdef FSDP_HAVE_NCCL
  return true;
#else
  return false;
#endif
}

std::unique_ptr<Communicator> make_world_comm(const Options& opts, std::shared_ptr<LocalGroup> group, bool group_given,
                                              int rank) {
  CommKind kind = opts.kind;
  if (opts.world_size != 0 && opts.nccl_id.empty()) {
    fail(FSDP_ERR_INVALID_ARGUMENT,
         "fsdp_ctx_create: world_size goes with comm_id (a host-passed NCCL id); the "
         "local communicator's world is its group's, mpi's and torchrun's the launcher's");
  }
  if (!opts.nccl_id.empty()) {
    if (kind != CommKind::kAuto && kind != CommKind::kNccl) {
      fail(FSDP_ERR_INVALID_ARGUMENT, "fsdp_ctx_create: comm_id is an NCCL id: it goes with comm=nccl (or auto)");
    }
    kind = CommKind::kNccl;
  }
  // On a GPU, processes a launcher started (torchrun, mpirun) talk over NCCL.
  if (kind == CommKind::kAuto && opts.cuda_ordinal >= 0 && !group_given && have_nccl()) {
#ifdef FSDP_HAVE_NCCL
    if (launched_as_ranks()) kind = CommKind::kNccl;
#endif
  }
  if (kind == CommKind::kNccl) {
    if (group_given) {
      fail(FSDP_ERR_INVALID_ARGUMENT,
           "fsdp_ctx_create: comm=nccl ranks are processes: pass group NULL (and rank -1, "
           "or with comm_id this process's rank)");
    }
#ifdef FSDP_HAVE_NCCL
    return make_nccl_world(opts, rank);
#else
    fail(FSDP_ERR_UNSUPPORTED, "fsdp_ctx_create: comm=nccl is not built into this library (see fsdp_build_info())");
#endif
  }
  if (kind == CommKind::kAuto) {
    LaunchEnv env = group_given ? LaunchEnv{} : read_launch_env();
    if (env.present() && env.world > 1) {
      if (!have_mpi()) {
        fail(FSDP_ERR_UNSUPPORTED, "fsdp_ctx_create: this process was launched as rank " + std::to_string(env.rank) +
                                       " of " + std::to_string(env.world) + " (" + env.source +
                                       "), but this libfsdp was built without MPI, so every process would train "
                                       "alone; rebuild with MPI installed (FSDP_WITH_MPI), or set comm=local to "
                                       "run independent single-rank jobs on purpose");
      }
      kind = CommKind::kMpi;
      if (env.source == "SLURM_*" && env.rank == 0) {
        base::log(FSDP_LOG_INFO, 0,
                  "launched by srun: rank 0 of " + std::to_string(env.world) + " tasks (SLURM_PROCID, " +
                      "SLURM_STEP_NUM_TASKS), " + std::to_string(env.local_world) +
                      " on this node (SLURM_STEP_TASKS_PER_NODE); comm=auto takes mpi (srun --mpi=pmix|pmi2)");
      }
    } else {
      kind = CommKind::kLocal;
    }
  }
  if (kind == CommKind::kMpi) {
    if (group_given) {
      fail(FSDP_ERR_INVALID_ARGUMENT,
           "fsdp_ctx_create: comm=mpi takes its ranks from the launcher; pass group NULL and rank -1");
    }
#ifdef FSDP_HAVE_MPI
    return make_mpi_world(opts, rank);
#else
    fail(FSDP_ERR_UNSUPPORTED, "fsdp_ctx_create: comm=mpi is not built into this library");
#endif
  }
  if (!group_given && rank == -1) rank = 0;  // "the launcher's rank": a world of one has rank 0
  if (rank < 0 || rank >= group->world_size()) {
    fail(FSDP_ERR_INVALID_ARGUMENT, "fsdp_ctx_create: rank " + std::to_string(rank) +
                                        " is outside the group's world of " + std::to_string(group->world_size()) +
                                        (group_given ? "" : " (group NULL means a world of one)"));
  }
  return std::make_unique<LocalComm>(std::move(group), rank, opts.timeout_s);
}

}  // namespace fsdp::comm
