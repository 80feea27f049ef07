// src/comm/options.h - what a communicator is told at creation: its kind, its
// timeout, the MPI algorithm, and for nccl its GPU and a host-passed id. Core
// fills it from its config (core/config.h); a communicator never sees the
// engine's options.
#pragma once

#include <string>

namespace fsdp::comm {

enum class CommKind { kAuto, kLocal, kMpi, kNccl };
enum class MpiAlgorithm { kAuto, kRing, kNative };

struct Options {
  CommKind kind = CommKind::kAuto;  // auto: mpi when launched by mpirun (and built in), else local
  double timeout_s = 300.0;         // a collective that waits longer fails with FSDP_ERR_TIMEOUT
  MpiAlgorithm mpi_algorithm = MpiAlgorithm::kAuto;
  int cuda_ordinal = -1;  // the context's GPU (device=cuda:N); -1 on the CPU
  std::string nccl_id;    // comm_id: an NCCL id a host passes to every rank (hex); empty: a launcher's bootstrap
  int world_size = 0;     // with comm_id: how many ranks join it
};

}  // namespace fsdp::comm
