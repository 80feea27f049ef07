// src/comm/mpi/mpi_env.h - MPI for the whole process: initialised once by the
// first mpi context (unless the host program did it), with the thread level
// the comm stream needs, finalised at exit; the bf16/fp16 sum ops; and the
// lock that serialises MPI calls when MPI gives less than MPI_THREAD_MULTIPLE.
#pragma once

#include <mpi.h>

#include <mutex>
#include <string>

#include "../../base/dtype.h"

namespace fsdp::comm::mpi {

// Initialises MPI if nobody has (MPI_THREAD_MULTIPLE asked) and registers the
// exit handler. Throws Error(COMM) if MPI was finalised already,
// Error(UNSUPPORTED) if its thread level cannot serve a comm thread, or
// Error(TIMEOUT) if MPI_Init_thread has not returned after `timeout_s` (it
// waits for every process of the job; a later call waits for the same
// initialisation again).
void ensure_initialized(double timeout_s);

// Held around every MPI call: a real lock below MPI_THREAD_MULTIPLE, none above.
std::unique_lock<std::mutex> lock();

// MPI_SUM over `dtype` stored as such (bf16/fp16 as 16-bit words with a
// user-defined op that adds in fp32 and rounds once per pair).
MPI_Datatype datatype(DType dtype);
MPI_Op sum_op(DType dtype);

// A communicator of this process failed: at exit MPI_Finalize is skipped, as
// it would wait for the rank that failed; mpirun then ends the job.
void note_failure();
// A context uses this collective timeout: the exit handler waits that long
// (twice, plus a margin) for every rank to reach its exit before finalising.
void note_timeout(double timeout_s);

// "MPI_ERR_TRUNCATE: message truncated" for an MPI error code.
std::string error_string(int code);

}  // namespace fsdp::comm::mpi
