// src/comm/mpi/mpi_env.cpp - see mpi_env.h.
#include "mpi_env.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <thread>

#include "../../../kernels/cast.h"
#include "../../base/error.h"
#include "../../base/log.h"
#include "../../base/text.h"

namespace fsdp::comm::mpi {
namespace {

std::mutex g_init_mu;
// MPI_Init_thread runs on a thread of its own, so that a rank waiting in it
// for a process of the job that will never initialise (it exited, or hangs
// before fsdp_ctx_create) gives up after timeout_s instead of hanging. Under
// g_init_mu; never destroyed, as that thread may outlive a failed caller.
struct InitState {
  std::condition_variable cv;
  bool started = false;
  bool done = false;
  int rc = MPI_SUCCESS;
  int provided = MPI_THREAD_SINGLE;
};
InitState& init_state() {
  static InitState* s = new InitState;  // NOLINT: leaked on purpose (see above)
  return *s;
}
std::mutex g_call_mu;
bool g_we_initialized = false;
std::atomic<bool> g_serialize{false};
std::atomic<bool> g_failed{false};
std::atomic<double> g_exit_timeout_s{0.0};  // the longest timeout_s of any mpi context
MPI_Op g_bf16_sum = MPI_OP_NULL;
MPI_Op g_fp16_sum = MPI_OP_NULL;

template <typename T>
void sum16(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) kernels::store(b, static_cast<size_t>(i), kernels::load(a, i) + kernels::load(b, i));
}

void at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (!g_failed.load()) {
    // Open MPI 4.1's mpirun can deadlock in its own teardown when one rank is
    // inside MPI_Finalize while another fails, so first wait (bounded) for
    // every rank to reach its exit. A rank that failed ends the job meanwhile.
    MPI_Request req = MPI_REQUEST_NULL;
    MPI_Ibarrier(MPI_COMM_WORLD, &req);
    auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                               std::chrono::duration<double>(2 * g_exit_timeout_s.load() + 5));
    int done = 0;
    while (!done && !g_failed.load() && std::chrono::steady_clock::now() < deadline) {
      MPI_Test(&req, &done, MPI_STATUS_IGNORE);
      if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (!done) {
      base::log(FSDP_LOG_WARN, -1,
                "not every MPI rank reached its exit within the collective timeout; calling MPI_Finalize "
                "anyway, which waits for them");
    }
  }
  if (g_failed.load()) {
    // MPI_Finalize synchronises with every rank, including the one that
    // failed: end the whole job instead, as a failed collective would.
    base::log(FSDP_LOG_WARN, -1,
              "a libfsdp MPI communicator failed: ending the MPI job with MPI_Abort at exit, so that no rank "
              "waits in MPI_Finalize for a rank that failed");
    MPI_Abort(MPI_COMM_WORLD, 1);
    return;
  }
  MPI_Op_free(&g_bf16_sum);
  MPI_Op_free(&g_fp16_sum);
  MPI_Finalize();
}

const char* level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    default:
      return "MPI_THREAD_MULTIPLE";
  }
}

}  // namespace

void ensure_initialized(double timeout_s) {
  std::unique_lock<std::mutex> guard(g_init_mu);
  if (g_bf16_sum != MPI_OP_NULL) return;
  InitState& init = init_state();
  if (!init.started) {
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (finalized) fail(FSDP_ERR_COMM, "fsdp_ctx_create: MPI was already finalized in this process");
    if (initialized) {
      init.started = init.done = true;
      MPI_Query_thread(&init.provided);
    } else {
      init.started = true;
      g_we_initialized = true;
      std::thread([&init] {
        int got = MPI_THREAD_SINGLE;
        int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &got);
        std::lock_guard<std::mutex> lock(g_init_mu);
        init.rc = rc;
        init.provided = got;
        init.done = true;
        init.cv.notify_all();
      }).detach();
    }
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                         std::chrono::duration<double>(timeout_s));
  if (!init.cv.wait_until(guard, deadline, [&init] { return init.done; })) {
    const char* world = std::getenv("OMPI_COMM_WORLD_SIZE");  // NOLINT(concurrency-mt-unsafe): read only
    if (world == nullptr) world = std::getenv("PMI_SIZE");    // NOLINT(concurrency-mt-unsafe)
    fail(FSDP_ERR_TIMEOUT,
         "fsdp_ctx_create: MPI initialisation did not finish within timeout_s (" + base::format_double(timeout_s) +
             " s). MPI_Init waits for every process of the job" +
             (world != nullptr ? " (" + std::string(world) + " processes)" : std::string()) +
             ", so one of them probably exited or hangs before fsdp_ctx_create; MPI cannot say which before it is "
             "initialised (look for a process that ended early in the launcher's output)");
  }
  if (init.rc != MPI_SUCCESS) fail(FSDP_ERR_COMM, "fsdp_ctx_create: MPI_Init_thread failed: " + error_string(init.rc));
  const int provided = init.provided;
  if (provided < MPI_THREAD_SERIALIZED) {
    fail(FSDP_ERR_UNSUPPORTED, std::string("fsdp_ctx_create: MPI runs at ") + level_name(provided) +
                                   ", but libfsdp calls MPI from its comm thread, which needs "
                                   "MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE; initialise MPI with "
                                   "MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) or let libfsdp do it");
  }
  // Below MULTIPLE every libfsdp MPI call takes one process-wide lock; the
  // host program must then not call MPI while libfsdp runs collectives.
  g_serialize = provided < MPI_THREAD_MULTIPLE;
  MPI_Op_create(&sum16<kernels::bf16_t>, 1, &g_bf16_sum);
  MPI_Op_create(&sum16<kernels::fp16_t>, 1, &g_fp16_sum);
  if (g_we_initialized) std::atexit(at_exit);
}

std::unique_lock<std::mutex> lock() {
  return g_serialize.load() ? std::unique_lock<std::mutex>(g_call_mu) : std::unique_lock<std::mutex>();
}

MPI_Datatype datatype(DType dtype) { return dtype == DType::kFp32 ? MPI_FLOAT : MPI_UINT16_T; }

MPI_Op sum_op(DType dtype) {
  switch (dtype) {
    case DType::kBf16:
      return g_bf16_sum;
    case DType::kFp16:
      return g_fp16_sum;
    default:
      return MPI_SUM;
  }
}

void note_failure() { g_failed = true; }

void note_timeout(double timeout_s) {
  double cur = g_exit_timeout_s.load();
  while (timeout_s > cur && !g_exit_timeout_s.compare_exchange_weak(cur, timeout_s)) {
  }
}

std::string error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(buf, static_cast<size_t>(len));
}

}  // namespace fsdp::comm::mpi
