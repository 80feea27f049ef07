// src/comm/options.h - what a communicator is told at creation: its kind, its
// timeout and the MPI algorithm. Core fills it from its config (core/config.h);
// a communicator never sees the engine's options.
#pragma once

namespace fsdp::comm {

enum class CommKind { kAuto, kLocal, kMpi };
enum class MpiAlgorithm { kAuto, kRing, kNative };

struct Options {
  CommKind kind = CommKind::kAuto;  // auto: mpi when launched by mpirun (and built in), else local
  double timeout_s = 300.0;         // a collective that waits longer fails with FSDP_ERR_TIMEOUT
  MpiAlgorithm mpi_algorithm = MpiAlgorithm::kAuto;
};

}  // namespace fsdp::comm
