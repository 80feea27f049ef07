// A program run by mpirun (through tests/run_mpi_fault.py) to prove that a bad
// launch or a failing rank ends in an error on the other ranks, never a hang.
// Each rank prints one line "rank R: STATUS: message" and exits 3 when it got
// the error the scenario expects, 1 otherwise.
//   early_exit   the last rank returns from main after registering; the others
//                must fail their next collective with FSDP_ERR_TIMEOUT naming it
//   mismatch     the last rank gathers another unit than the others: every
//                rank fails with FSDP_ERR_MISMATCH, without waiting for a timeout
//   wrong_rank   every rank passes a rank argument that is not its own
//   exit_before_create  the last rank exits with status 0 before
//                fsdp_ctx_create (before MPI is initialised); the others
//                must fail fsdp_ctx_create with FSDP_ERR_TIMEOUT
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "fsdp.h"

namespace {

int report(int rank, fsdp_status_t got, fsdp_status_t expected) {
  std::printf("rank %d: %s: %s\n", rank, fsdp_status_name(got), got == FSDP_OK ? "" : fsdp_last_error());
  std::fflush(stdout);
  // mpirun ends the whole job when the first rank exits with an error; give
  // the other ranks' reports time to reach it first.
  std::this_thread::sleep_for(std::chrono::seconds(2));
  return got == expected ? 3 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: mpi_fault early_exit|mismatch|wrong_rank\n");
    return 2;
  }
  const std::string scenario = argv[1];
  const char* env_rank = std::getenv("OMPI_COMM_WORLD_RANK");
  const char* env_size = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (env_rank == nullptr || env_size == nullptr) {
    std::fprintf(stderr, "mpi_fault: run me under mpirun\n");
    return 2;
  }
  const int me = std::atoi(env_rank), world = std::atoi(env_size);

  if (scenario == "exit_before_create" && me == world - 1) {
    std::printf("rank %d: exiting before fsdp_ctx_create\n", me);
    return 0;
  }
  fsdp_config_t* cfg = nullptr;
  fsdp_config_create(&cfg);
  fsdp_config_set(cfg, "comm", "mpi");
  // exit_before_create: 5 s, so that an end by mpirun (within about 2 s) and
  // one by libfsdp's timeout are told apart by the time (run_mpi_fault.py).
  fsdp_config_set(cfg, "timeout_s", scenario == "exit_before_create" ? "5" : "2");
  fsdp_ctx_t* ctx = nullptr;
  fsdp_status_t st = fsdp_ctx_create(cfg, nullptr, scenario == "wrong_rank" ? (me + 1) % world : -1, &ctx);
  fsdp_config_destroy(cfg);
  if (scenario == "wrong_rank") return report(me, st, FSDP_ERR_INVALID_ARGUMENT);
  if (scenario == "exit_before_create") return report(me, st, FSDP_ERR_TIMEOUT);
  if (st != FSDP_OK) {
    report(me, st, FSDP_OK);
    return 1;
  }

  const char* names[] = {"w"};
  const int32_t ndims[] = {1};
  const int64_t dims[] = {1000};
  fsdp_unit_t* a = nullptr;
  fsdp_unit_t* b = nullptr;
  if (fsdp_unit_register(ctx, "a", 1, names, ndims, dims, &a) != FSDP_OK ||
      fsdp_unit_register(ctx, "b", 1, names, ndims, dims, &b) != FSDP_OK) {
    return report(me, FSDP_ERR_INTERNAL, FSDP_OK);
  }
  const bool odd = me == world - 1;
  if (scenario == "early_exit") {
    if (odd) {
      fsdp_ctx_destroy(ctx);
      std::printf("rank %d: exiting early\n", me);
      return 0;
    }
    st = fsdp_forward_begin(a, nullptr);
    int rc = report(me, st, FSDP_ERR_TIMEOUT);
    fsdp_ctx_destroy(ctx);
    return rc;
  }
  if (scenario == "mismatch") {
    st = fsdp_forward_begin(odd ? b : a, nullptr);
    int rc = report(me, st, FSDP_ERR_MISMATCH);
    fsdp_ctx_destroy(ctx);
    return rc;
  }
  std::fprintf(stderr, "mpi_fault: unknown scenario '%s'\n", scenario.c_str());
  return 2;
}
