// A program run as N processes with torchrun's variables (through
// tests/run_nccl_fault.py) to prove that under comm=nccl a rank that fails or
// stalls ends in an error on the other ranks within timeout_s, never a hang.
// Each reporting rank prints one line "rank R: STATUS: message".
//   exit_before_create  the last rank exits before fsdp_ctx_create: the
//                       others fail fsdp_ctx_create with FSDP_ERR_TIMEOUT
//   stall               the last rank stops after registering (it sleeps
//                       until it is killed): the others' next gather runs
//                       past timeout_s, the watchdog aborts the communicator,
//                       and fsdp_step fails with FSDP_ERR_TIMEOUT naming the
//                       collective
// NCCL is told to connect its peers when the communicator forms
// (NCCL_RUNTIME_CONNECT=0, unless set already): the collectives are blocking
// NCCL calls (docs/gpu.md), and one that connects a peer the first time it
// needs it would wait inside NCCL for the stalled rank, where no timeout
// reaches it; connected up front, the gather is queued and the watchdog
// times it out on the GPU.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "fsdp.h"

namespace {

int report(int rank, fsdp_status_t got) {
  std::printf("rank %d: %s: %s\n", rank, fsdp_status_name(got), got == FSDP_OK ? "" : fsdp_last_error());
  std::fflush(stdout);
  return got == FSDP_OK ? 0 : 3;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: nccl_fault exit_before_create|stall\n");
    return 2;
  }
  const std::string scenario = argv[1];
  const int rank = std::atoi(std::getenv("RANK") != nullptr ? std::getenv("RANK") : "0");
  const int world = std::atoi(std::getenv("WORLD_SIZE") != nullptr ? std::getenv("WORLD_SIZE") : "1");
  const bool last = rank == world - 1;
  if (scenario == "exit_before_create" && last) return 0;
  setenv("NCCL_RUNTIME_CONNECT", "0", /*overwrite=*/0);  // NOLINT(concurrency-mt-unsafe): before any thread
  fsdp_config_t* cfg = nullptr;
  fsdp_config_create(&cfg);
  fsdp_config_set(cfg, "device", "cuda");
  fsdp_config_set(cfg, "comm", "nccl");
  fsdp_config_set(cfg, "timeout_s", "5");
  fsdp_config_from_env(cfg);
  fsdp_ctx_t* ctx = nullptr;
  fsdp_status_t st = fsdp_ctx_create(cfg, nullptr, -1, &ctx);
  fsdp_config_destroy(cfg);
  if (st != FSDP_OK) return report(rank, st);
  const char* names[] = {"w"};
  const int32_t ndims[] = {1};
  const int64_t dims[] = {1 << 20};
  fsdp_unit_t* unit = nullptr;
  st = fsdp_unit_register(ctx, "block", 1, names, ndims, dims, &unit);
  if (st != FSDP_OK) return report(rank, st);
  if (scenario == "stall" && last) {
    std::this_thread::sleep_for(std::chrono::hours(1));  // the runner kills it
    return 0;
  }
  // A step whose gather never completes: the transitions only queue work on
  // the GPU, so the failure reaches the host at the step (or earlier).
  for (int step = 0; step < 3 && st == FSDP_OK; ++step) {
    st = fsdp_forward_begin(unit, nullptr);
    if (st == FSDP_OK) st = fsdp_forward_end(unit, nullptr);
    if (st == FSDP_OK) st = fsdp_backward_begin(unit, nullptr);
    if (st == FSDP_OK) st = fsdp_backward_end(unit, nullptr);
    if (st == FSDP_OK) st = fsdp_step(ctx, nullptr);
  }
  int code = report(rank, st);
  fsdp_ctx_destroy(ctx);
  return code;
}
