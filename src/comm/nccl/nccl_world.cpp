// src/comm/nccl/nccl_world.cpp - how the ranks of an nccl world find each
// other (see nccl_comm.h): the NCCL unique id made on rank 0 reaches every
// rank through the host (comm_id), TCP at MASTER_ADDR:MASTER_PORT
// (torchrun's variables) or MPI (mpirun), and the communicator then forms
// without blocking, bounded by timeout_s.
#include <cstdlib>
#include <thread>

#include "../../base/error.h"
#include "../../base/spin.h"
#include "../../base/text.h"
#include "../launch.h"
#include "../slurm.h"
#include "../tcp_exchange.h"
#include "nccl_check.h"
#include "nccl_comm.h"
#ifdef FSDP_HAVE_MPI
#include "../mpi/mpi_comm.h"
#endif

namespace fsdp::comm {
namespace {

using Clock = std::chrono::steady_clock;

const char* env(const char* name) {
  return std::getenv(name);  // NOLINT(concurrency-mt-unsafe): read at context creation
}

int env_int(const char* name, int lo, int fallback) {
  const char* v = env(name);
  if (v == nullptr) return fallback;
  long n = 0;
  if (!base::parse_long(v, &n) || n < lo || n > (1L << 30)) {
    fail(FSDP_ERR_INVALID_ARGUMENT, std::string("environment variable ") + name + "=" + base::quote(v) +
                                        " is not an integer >= " + std::to_string(lo));
  }
  return static_cast<int>(n);
}

// torchrun's variables (also set by other launchers that follow it).
struct TorchrunEnv {
  int rank = -1;
  int world = -1;
  int local_world = -1;
  std::string addr;
  int port = -1;
  bool present() const { return rank >= 0 && world >= 1; }
};

TorchrunEnv read_torchrun_env() {
  TorchrunEnv e;
  e.rank = env_int("RANK", 0, -1);
  e.world = env_int("WORLD_SIZE", 1, -1);
  if ((e.rank < 0) != (e.world < 0) || (e.present() && e.rank >= e.world)) {
    fail(FSDP_ERR_INVALID_ARGUMENT, "launcher variables disagree: RANK=" + std::to_string(e.rank) + ", WORLD_SIZE=" +
                                        std::to_string(e.world) + "; both must be set, with RANK below WORLD_SIZE");
  }
  e.local_world = env_int("LOCAL_WORLD_SIZE", 1, -1);
  if (const char* a = env("MASTER_ADDR")) e.addr = a;
  e.port = env_int("MASTER_PORT", 0, -1);
  return e;
}

std::string to_hex(const void* p, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    auto b = static_cast<const unsigned char*>(p)[i];
    s += digits[b >> 4];
    s += digits[b & 15];
  }
  return s;
}

ncclUniqueId from_hex(const std::string& hex) {
  ncclUniqueId id{};
  if (hex.size() != 2 * sizeof id.internal) {
    fail(FSDP_ERR_INVALID_ARGUMENT, "comm_id has " + std::to_string(hex.size()) + " characters, not " +
                                        std::to_string(2 * sizeof id.internal) + ": pass fsdp_comm_id_create()'s text");
  }
  for (size_t i = 0; i < sizeof id.internal; ++i) {
    unsigned v = 0;
    for (int k = 0; k < 2; ++k) {
      char c = hex[2 * i + static_cast<size_t>(k)];
      int d = c >= '0' && c <= '9'   ? c - '0'
              : c >= 'a' && c <= 'f' ? c - 'a' + 10
              : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                     : -1;
      if (d < 0) fail(FSDP_ERR_INVALID_ARGUMENT, "comm_id is not hexadecimal: pass fsdp_comm_id_create()'s text");
      v = v * 16 + static_cast<unsigned>(d);
    }
    id.internal[i] = static_cast<char>(v);
  }
  return id;
}

ncclUniqueId new_id() {
  ncclUniqueId id{};
  nccl_check(nccl().GetUniqueId(&id), "ncclGetUniqueId");
  return id;
}

// Forms the communicator without blocking; a rank that does not join within
// timeout_s fails it instead of hanging.
ncclComm_t init(const ncclUniqueId& id, int rank, int world, int ordinal, double timeout_s) {
  cuda_check(cudaSetDevice(ordinal), "cudaSetDevice(" + std::to_string(ordinal) + ")");
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t r = nccl().CommInitRankConfig(&comm, world, id, rank, &config);
  auto deadline = base::deadline_after(timeout_s);
  while (r == ncclInProgress && comm != nullptr) {
    if (timeout_s > 0 && Clock::now() > deadline) {
      nccl().CommAbort(comm);
      fail(FSDP_ERR_TIMEOUT,
           "fsdp_ctx_create: rank " + std::to_string(rank) + " of " + std::to_string(world) +
               ": the NCCL communicator did not form within timeout_s = " + base::format_double(timeout_s) +
               " s: a rank did not join (it may have failed, or have another id or world size)");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    if (nccl().CommGetAsyncError(comm, &r) != ncclSuccess && r == ncclInProgress) break;
  }
  if (r != ncclSuccess) {
    std::string why = nccl_describe(r, comm);
    if (comm != nullptr) nccl().CommAbort(comm);
    fail(FSDP_ERR_COMM, "fsdp_ctx_create: rank " + std::to_string(rank) + " of " + std::to_string(world) +
                            ": forming the NCCL communicator failed: " + why);
  }
  return comm;
}

void check_rank_arg(int given, int launcher_rank, const char* source) {
  if (given != -1 && given != launcher_rank) {
    fail(FSDP_ERR_INVALID_ARGUMENT, "fsdp_ctx_create: rank " + std::to_string(given) + " was passed, but " + source +
                                        " says this process is rank " + std::to_string(launcher_rank) +
                                        "; pass -1 to take the launcher's rank");
  }
}

}  // namespace

bool launched_as_ranks() {
  TorchrunEnv t = read_torchrun_env();
  if (t.present() && t.world > 1) return true;
  LaunchEnv m = read_launch_env();
  return m.present() && m.world > 1;
}

std::string new_nccl_id_hex() {
  ncclUniqueId id = new_id();
  return to_hex(id.internal, sizeof id.internal);
}

std::unique_ptr<Communicator> make_nccl_world(const Options& opts, int rank) {
  if (opts.cuda_ordinal < 0) {
    fail(FSDP_ERR_INVALID_ARGUMENT, "fsdp_ctx_create: comm=nccl moves GPU memory: it needs device=cuda[:N]");
  }
  // Before any bootstrap: a process without a usable GPU fails at once, and
  // so does every other rank of a job on such machines, instead of waiting
  // for its peers.
  int gpus = 0;
  cudaError_t e = cudaGetDeviceCount(&gpus);
  if (e != cudaSuccess || gpus <= opts.cuda_ordinal) {
    if (e != cudaSuccess) cudaGetLastError();
    fail(FSDP_ERR_UNSUPPORTED, "comm=nccl: no CUDA device can be used by this process for device=cuda:" +
                                   std::to_string(opts.cuda_ordinal) + " (" +
                                   (e != cudaSuccess ? std::string(cudaGetErrorString(e))
                                                     : std::to_string(gpus) + " GPU(s) visible") +
                                   "; check the driver and CUDA_VISIBLE_DEVICES)");
  }
  ncclUniqueId id{};
  int world = 0, local_world = 1;
  if (!opts.nccl_id.empty()) {
    // (c) A host that runs its own processes passed the id it made on one rank.
    id = from_hex(opts.nccl_id);
    world = opts.world_size;
    if (world < 1) {
      fail(FSDP_ERR_INVALID_ARGUMENT, "fsdp_ctx_create: comm_id needs world_size, the number of ranks it joins");
    }
    if (rank < 0 || rank >= world) {
      fail(FSDP_ERR_INVALID_ARGUMENT, "fsdp_ctx_create: with comm_id pass this process's rank, 0.." +
                                          std::to_string(world - 1) + ", not " + std::to_string(rank));
    }
    local_world = env_int("LOCAL_WORLD_SIZE", 1, 1);
  } else if (TorchrunEnv t = read_torchrun_env(); t.present()) {
    // (a) torchrun: rank 0 serves the id at MASTER_ADDR:MASTER_PORT.
    check_rank_arg(rank, t.rank, "RANK");
    rank = t.rank;
    world = t.world;
    local_world = t.local_world > 0 ? t.local_world : 1;
    if (world > 1 && (t.addr.empty() || t.port < 0)) {
      fail(FSDP_ERR_INVALID_ARGUMENT,
           "fsdp_ctx_create: RANK and WORLD_SIZE are set but not MASTER_ADDR and "
           "MASTER_PORT, where rank 0 hands out the NCCL id");
    }
    std::string blob;
    if (rank == 0) {
      id = new_id();
      blob.assign(id.internal, sizeof id.internal);
    }
    blob = tcp_exchange_blob({t.addr, t.port, rank, world, opts.timeout_s}, blob);
    if (blob.size() != sizeof id.internal) fail(FSDP_ERR_COMM, "bootstrap: rank 0 sent an id of the wrong size");
    std::copy(blob.begin(), blob.end(), id.internal);
  } else if (LaunchEnv sl = read_launch_env(); sl.present() && sl.source == "SLURM_*") {
    // (a') srun: as torchrun, at the first host of the step's node list and
    // a port from the job and step ids (slurm.h), no MPI needed.
    check_rank_arg(rank, sl.rank, "SLURM_PROCID");
    rank = sl.rank;
    world = sl.world;
    local_world = sl.local_world > 0 ? sl.local_world : 1;
    std::string host;
    int port = -1;
    slurm_rendezvous(&host, &port);
    std::string blob;
    if (rank == 0) {
      id = new_id();
      blob.assign(id.internal, sizeof id.internal);
    }
    if (world > 1) blob = tcp_exchange_blob({host, port, rank, world, opts.timeout_s}, blob);
    if (blob.size() != sizeof id.internal) fail(FSDP_ERR_COMM, "bootstrap: rank 0 sent an id of the wrong size");
    std::copy(blob.begin(), blob.end(), id.internal);
  } else if (LaunchEnv m = read_launch_env(); m.present()) {
    // (b) mpirun: the id is broadcast over MPI.
    check_rank_arg(rank, m.rank, m.source.c_str());
#ifdef FSDP_HAVE_MPI
    std::unique_ptr<Communicator> mpi = make_mpi_world(opts, m.rank);
    rank = mpi->rank();
    world = mpi->world_size();
    local_world = mpi->local_world_size();
    if (rank == 0) id = new_id();
    mpi->broadcast(id.internal, sizeof id.internal, 0, "the NCCL id");
#else
    fail(FSDP_ERR_UNSUPPORTED,
         "fsdp_ctx_create: comm=nccl under mpirun hands its id over MPI, which this build "
         "does not have; launch with torchrun's variables (MASTER_ADDR, MASTER_PORT) instead");
#endif
  } else if (rank <= 0) {
    // A world of one.
    rank = 0;
    world = 1;
    id = new_id();
  } else {
    fail(FSDP_ERR_INVALID_ARGUMENT,
         "fsdp_ctx_create: comm=nccl does not know its ranks: launch with torchrun "
         "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or mpirun, or pass comm_id "
         "(fsdp_comm_id_create on one rank) and world_size");
  }
  ncclComm_t comm = init(id, rank, world, opts.cuda_ordinal, opts.timeout_s);
  std::vector<int> names(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) names[static_cast<size_t>(r)] = r;
  return std::make_unique<NcclComm>(comm, opts.cuda_ordinal, std::move(names), std::min(local_world, world),
                                    opts.timeout_s);
}

}  // namespace fsdp::comm
