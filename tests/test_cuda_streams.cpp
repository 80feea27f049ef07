// The CUDA device's streams and events against what the engine asks of
// them, its memory pool, the nccl communicator at a world of one, and what
// the review of the GPU path found (docs/gpu.md). Linked into test_cuda
// with test_cuda.cpp (the kernels). Skips, saying so, where no GPU can be
// used.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/error.h"
#include "device/cpu/cpu_device.h"
#include "device/cuda/cuda_device.h"
#include "gpu_presence.h"
#include "kernels/cast.h"
#include "kernels/cuda/launch.h"
#ifdef FSDP_HAVE_NCCL
#include "comm/nccl/nccl_comm.h"
#include "comm/nccl/nccl_lib.h"
#include "core/device_plane.h"
#endif

#include "cuda_test_util.h"

using fsdp::DType;
using fsdp::device::AdamArgs;
using fsdp::device::CpuDevice;
using fsdp::device::EventPtr;
using fsdp::device::Pool;
using fsdp::device::SgdArgs;
using fsdp::device::Stream;
using fsdp::device::StreamHooks;
using fsdp::device::cuda::CudaDevice;
using fsdp::device::cuda::CudaStream;
using namespace fsdp_test::cuda;

// Heap allocations made by this thread while counting (global operator new
// replaced for the test binary): what a steady-state submit must not do.
namespace {
thread_local bool counting_allocations = false;
thread_local long allocations = 0;
}  // namespace
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"  // malloc'd by the operator new below
void* operator new(size_t n) {
  if (counting_allocations) ++allocations;
  void* p = std::malloc(n == 0 ? 1 : n);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
void* operator new[](size_t n) { return operator new(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop

// ---- streams and events ---------------------------------------------------

// What the local communicator's DataPlane asks of the device: which memory is
// the GPU's, and marks that order one stream after another's work.
TEST(CudaStreams, DeviceOnlyMemoryAndMarksOrderAnotherStream) {
  SKIP_WITHOUT_GPU();
  CudaDevice gpu(0);
  const size_t n = size_t(1) << 26;
  DeviceArray a(gpu, nullptr, n * sizeof(float)), b(gpu, nullptr, n * sizeof(float));
  std::vector<float> host(4);
  void* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, 64), cudaSuccess);
  EXPECT_TRUE(gpu.device_only(a.ptr));
  EXPECT_TRUE(gpu.device_only(a.as<float>() + 100)) << "inside a block";
  EXPECT_FALSE(gpu.device_only(host.data()));
  EXPECT_FALSE(gpu.device_only(pinned)) << "pinned host memory is the host's";
  EXPECT_FALSE(gpu.device_only(nullptr));
  cudaFreeHost(pinned);
  gpu.zero(a.ptr, a.nbytes);
  std::vector<float> ones(n, 1.0f);
  DeviceArray src = upload(gpu, ones);
  auto producer = gpu.create_stream("producer", 0, StreamHooks{});
  auto consumer = gpu.create_stream("consumer", 1, StreamHooks{});
  EventPtr mark;
  producer->submit("write a", [&] {
    for (int k = 0; k < 8; ++k) gpu.accumulate(a.as<float>(), src.ptr, DType::kFp32, 1.0f, n, nullptr);
    mark = gpu.mark();
  });
  EventPtr copied = consumer->submit("copy a to b after the mark", [&] {
    gpu.wait_mark(mark);
    gpu.copy(b.ptr, a.ptr, a.nbytes);
  });
  copied->wait(60);
  std::vector<float> got = b.read<float>();
  EXPECT_EQ(got.front(), 8.0f);
  EXPECT_EQ(got.back(), 8.0f);
}

TEST(CudaStreams, OperationsInATaskAreQueuedOnItsStreamAndOrderedByEvents) {
  SKIP_WITHOUT_GPU();
  CudaDevice gpu(0);
  auto producer = gpu.create_stream("producer", 0, StreamHooks{});
  auto consumer = gpu.create_stream("consumer", 1, StreamHooks{});
  const size_t n = size_t(1) << 26;  // long enough that the consumer would overtake an unordered producer
  DeviceArray a(gpu, nullptr, n * sizeof(float)), b(gpu, nullptr, n * sizeof(float));
  gpu.zero(a.ptr, a.nbytes);
  std::vector<float> ones(n, 1.0f);
  DeviceArray src = upload(gpu, ones);
  CudaStream* seen = nullptr;
  EventPtr written = producer->submit("write a", [&] {
    seen = CudaStream::current();
    for (int k = 0; k < 8; ++k) gpu.accumulate(a.as<float>(), src.ptr, DType::kFp32, 1.0f, n, nullptr);
  });
  EXPECT_EQ(seen, producer.get()) << "the task runs with its stream current";
  EXPECT_EQ(CudaStream::current(), nullptr);
  consumer->wait(written);
  EventPtr copied = consumer->submit("copy a to b", [&] { gpu.copy(b.ptr, a.ptr, a.nbytes); });
  copied->wait(60);
  EXPECT_TRUE(written->done());
  std::vector<float> got = b.read<float>();
  EXPECT_EQ(got.front(), 8.0f);
  EXPECT_EQ(got.back(), 8.0f);
}

TEST(CudaStreams, AFailedTaskFailsItsEventTheStreamAndTheWorkThatWaitsForIt) {
  SKIP_WITHOUT_GPU();
  CudaDevice gpu(0);
  auto s1 = gpu.create_stream("one", 0, StreamHooks{});
  auto s2 = gpu.create_stream("two", 0, StreamHooks{});
  EventPtr bad = s1->submit("a failing task", [] { fsdp::fail(FSDP_ERR_COMM, "the collective failed"); });
  EXPECT_TRUE(bad->done());
  EXPECT_EQ(bad->status(), FSDP_ERR_COMM);
  EXPECT_EQ(s1->failure(), FSDP_ERR_COMM);
  s2->wait(bad);
  bool ran = false;
  EventPtr after = s2->submit("work after it", [&] { ran = true; });
  EXPECT_FALSE(ran);
  EXPECT_EQ(after->status(), FSDP_ERR_COMM);
  EXPECT_EQ(s2->failure(), FSDP_ERR_COMM) << "a failed wait sticks to the waiting stream, as on the CPU";
  expect_error(FSDP_ERR_COMM, "the collective failed", [&] { s1->synchronize(10); });
}

TEST(CudaStreams, TheHostsStreamIsWrappedOncePerHandle) {
  SKIP_WITHOUT_GPU();
  CudaDevice gpu(0);
  cudaStream_t mine = nullptr;
  ASSERT_EQ(cudaStreamCreate(&mine), cudaSuccess);
  Stream& wrapped = gpu.caller_stream(mine, "fsdp_forward_begin");
  EXPECT_EQ(&wrapped, &gpu.caller_stream(mine, "fsdp_forward_end")) << "one wrapper per handle";
  EXPECT_EQ(static_cast<CudaStream&>(wrapped).native(), mine);
  Stream& legacy = gpu.caller_stream(nullptr, "fsdp_step");
  EXPECT_EQ(static_cast<CudaStream&>(legacy).native(), nullptr);
  ASSERT_EQ(cudaStreamDestroy(mine), cudaSuccess);
}

// (A pointer that is no stream at all cannot be tested: CUDA may dereference it.)
TEST(CudaStreams, AStreamOfAnotherGpuIsRefused) {
  if (CudaDevice::count() < 2) GTEST_SKIP() << "needs 2 GPUs, " << CudaDevice::count() << " here: GPU test not run";
  CudaDevice gpu(0);
  cudaStream_t other = nullptr;
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  ASSERT_EQ(cudaStreamCreate(&other), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);  // the tests after this one run on device 0
  expect_error(FSDP_ERR_INVALID_ARGUMENT, "belongs to cuda:1",
               [&] { gpu.caller_stream(other, "fsdp_backward_begin"); });
  ASSERT_EQ(cudaStreamDestroy(other), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

TEST(CudaDeviceErrors, AnOrdinalOutOfRangeIsRefusedNamingTheCount) {
  SKIP_WITHOUT_GPU();
  expect_error(FSDP_ERR_INVALID_ARGUMENT, "CUDA device(s)", [] { CudaDevice bad(CudaDevice::count()); });
}

TEST(CudaDeviceErrors, WithoutAGpuTheDeviceIsUnsupportedWithAReason) {
  if (CudaDevice::count() > 0) GTEST_SKIP() << "a GPU is present: this checks the machines without one";
  expect_error(FSDP_ERR_UNSUPPORTED, "no CUDA device", [] { CudaDevice none(0); });
}

// ---- what the review of the GPU path found (docs/gpu.md) -------------------

namespace {

// Runs this test binary again with `filter` and the variable `flag` set:
// for what poisons the process's CUDA context. Returns its exit code.
int run_self(const std::string& filter, const std::string& flag) {
  std::vector<std::string> env_s = {flag};
  for (char** e = environ; *e != nullptr; ++e) env_s.emplace_back(*e);
  std::vector<char*> env;
  for (std::string& e : env_s) env.push_back(e.data());
  env.push_back(nullptr);
  std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  std::string arg = "--gtest_filter=" + filter;
  char* argv[] = {self.data(), arg.data(), nullptr};
  pid_t pid = 0;
  if (posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv, env.data()) != 0) return -1;
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Holds `s` for `ms` milliseconds (a host function that sleeps): work queued
// after it starts that much later.
void CUDART_CB sleep_ms(void* ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(reinterpret_cast<intptr_t>(ms)));
}
void queue_host_sleep(cudaStream_t s, int ms) {
  ASSERT_EQ(cudaLaunchHostFunc(s, sleep_ms, reinterpret_cast<void*>(static_cast<intptr_t>(ms))), cudaSuccess);
}

// Queues `passes` memory-bound passes on `s` (n floats of `acc` += `src`):
// GPU work for other work to overtake.
void queue_busy_work(float* acc, void* src, size_t n, int passes, cudaStream_t s) {
  for (int k = 0; k < passes; ++k) {
    ASSERT_EQ(fsdp::kernels::cuda::accumulate(acc, src, FSDP_DTYPE_FP32, 1.0f, n, false, s), cudaSuccess);
  }
}

}  // namespace

// Review P4: libfsdp's memory is a pool of its own; the device's default pool
// (what cudaMallocAsync uses in torch, CuPy, JAX or the host) keeps its
// release threshold and holds none of libfsdp's blocks.
TEST(CudaMemory, ComesFromAPoolOfItsOwnAndLeavesTheDefaultPoolAsItWas) {
  SKIP_WITHOUT_GPU();
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaMemPool_t def = nullptr;
  ASSERT_EQ(cudaDeviceGetDefaultMemPool(&def, 0), cudaSuccess);
  uint64_t threshold_before = 0, used_before = 0;
  ASSERT_EQ(cudaMemPoolGetAttribute(def, cudaMemPoolAttrReleaseThreshold, &threshold_before), cudaSuccess);
  ASSERT_EQ(cudaMemPoolGetAttribute(def, cudaMemPoolAttrUsedMemCurrent, &used_before), cudaSuccess);
  CudaDevice gpu(0);
  const size_t nbytes = size_t(64) << 20;
  void* p = gpu.alloc(nbytes);
  uint64_t threshold = 0, used = 0, ours = 0;
  ASSERT_EQ(cudaMemPoolGetAttribute(def, cudaMemPoolAttrReleaseThreshold, &threshold), cudaSuccess);
  ASSERT_EQ(cudaMemPoolGetAttribute(def, cudaMemPoolAttrUsedMemCurrent, &used), cudaSuccess);
  ASSERT_EQ(cudaMemPoolGetAttribute(gpu.mem_pool(), cudaMemPoolAttrUsedMemCurrent, &ours), cudaSuccess);
  EXPECT_EQ(threshold, threshold_before) << "libfsdp changed the default pool's release threshold";
  EXPECT_EQ(used, used_before) << "libfsdp's block came from the default pool";
  EXPECT_GE(ours, nbytes) << "libfsdp's block is not in its own pool";
  gpu.free(p);
}

// Review 14 (in part): an allocation outside a task (queued on the device's
// own stream, which the host then synchronizes) does not reuse a block whose
// free on another stream is still queued by making the device's stream wait
// for that stream: here that stream is held for half a second.
TEST(CudaMemory, AnAllocationOutsideATaskDoesNotWaitForAnotherStreamsFree) {
  SKIP_WITHOUT_GPU();
  CudaDevice gpu(0);
  auto s = gpu.create_stream("comm", 1, StreamHooks{});
  const size_t nbytes = size_t(64) << 20;
  s->submit("a block used and freed behind half a second of other work", [&] {
    void* p = gpu.alloc(nbytes);
    queue_host_sleep(CudaStream::current()->native(), 500);
    gpu.zero(p, nbytes);
    gpu.free(p);  // in the order of this stream: after the sleep
  });
  auto t0 = std::chrono::steady_clock::now();
  void* q = gpu.alloc(nbytes);
  auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(took, std::chrono::milliseconds(250)) << "the allocation waited for the other stream's work";
  s->synchronize(60);
  gpu.free(q);
}

// Review 3 and 17: the multi-tensor optimizer's span table, made inside a
// task as the optimizer makes it, is uploaded on that task's stream (so the
// kernel after it reads it in order), used, and freed after its last launch,
// all without waiting for other streams. The legacy default stream, which the
// engine's non-blocking streams do not wait for, is held for half a second
// first, and is still held when the task has built, used and dropped its
// table: a pageable cudaMemcpy on the legacy stream, or the device-wide wait
// of a cudaFree, would have waited for it.
// The first launch of each kernel in a process does not wait for other
// streams: CudaDevice loads libfsdp's kernels when it is made. Under CUDA's
// lazy loading (the default), a kernel loaded at its first launch may wait
// for the whole context; on the first H100 run the span-table test below
// saw its first launch wait for the legacy default stream. Each ctest runs
// in a process of its own, so these launches are the process's first.
TEST(CudaKernels, AFirstLaunchWaitsForNoOtherStream) {
  SKIP_WITHOUT_GPU();
  CudaDevice gpu(0);
  const size_t n = 4099;
  DeviceArray a = upload(gpu, random_floats(n, 41)), b = upload(gpu, random_floats(n, 42));
  DeviceArray flag(gpu, nullptr, sizeof(int)), sum(gpu, nullptr, sizeof(double)),
      scratch(gpu, nullptr, fsdp::kernels::cuda::sum_squares_scratch_nbytes(n)), bf16(gpu, nullptr, n * 2);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  queue_host_sleep(nullptr, 500);
  cudaEvent_t legacy_done = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&legacy_done, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(legacy_done, nullptr), cudaSuccess);
  namespace kc = fsdp::kernels::cuda;
  ASSERT_EQ(kc::cast(bf16.ptr, FSDP_DTYPE_BF16, a.ptr, FSDP_DTYPE_FP32, n, false, s), cudaSuccess);
  ASSERT_EQ(kc::accumulate(a.as<float>(), b.ptr, FSDP_DTYPE_FP32, 0.5f, n, false, s), cudaSuccess);
  ASSERT_EQ(kc::sum_squares(a.as<float>(), n, sum.as<double>(), scratch.ptr, s), cudaSuccess);
  ASSERT_EQ(kc::flag_non_finite(a.as<float>(), n, flag.as<int>(), s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  const bool legacy_busy = cudaEventQuery(legacy_done) == cudaErrorNotReady;
  EXPECT_TRUE(legacy_busy) << "a first launch on a non-blocking stream waited for the legacy default stream";
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  cudaEventDestroy(legacy_done);
  cudaStreamDestroy(s);
}

TEST(CudaKernels, ASpanTableIsUploadedUsedAndFreedInTheOrderOfItsStream) {
  SKIP_WITHOUT_GPU();
  CudaDevice gpu(0);
  CpuDevice cpu(1, Pool::kDevice);
  const size_t chunk = fsdp::kernels::cuda::kSpanChunk;
  const std::vector<size_t> sizes = {7, chunk + 3, 1, 3 * chunk + 129, 256};
  size_t total = 0;
  for (size_t n : sizes) total += n + 16;
  std::vector<float> p = random_floats(total, 31), g = random_floats(total, 32, 3.0f),
                     m = random_floats(total, 33, 1e-2f), v = random_floats(total, 34, 1e-2f);
  for (float& x : v) x = std::abs(x);
  std::vector<uint8_t> out_host(total * 2, 0xab);
  std::vector<float> cp = p, cg = g, cm = m, cv = v;
  std::vector<uint8_t> cout = out_host;
  DeviceArray dp = upload(gpu, p), dg = upload(gpu, g), dm = upload(gpu, m), dv = upload(gpu, v),
              dout(gpu, out_host.data(), out_host.size());
  std::vector<fsdp::device::ShardSpan> cspans, gspans;
  size_t at = 0;
  for (size_t k = 0; k < sizes.size(); ++k) {
    float wd = k % 2 == 0 ? 0.1f : 0.0f;
    cspans.push_back(
        {cp.data() + at, cg.data() + at, cm.data() + at, cv.data() + at, cout.data() + at * 2, sizes[k], wd, 0});
    gspans.push_back({dp.as<float>() + at, dg.as<float>() + at, dm.as<float>() + at, dv.as<float>() + at,
                      dout.as<uint8_t>() + at * 2, sizes[k], wd, 0});
    at += sizes[k] + 16;
  }
  queue_host_sleep(nullptr, 500);
  cudaEvent_t legacy_done = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&legacy_done, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(legacy_done, nullptr), cudaSuccess);
  auto s = gpu.create_stream("comm", 1, StreamHooks{});
  const std::vector<fsdp::kernels::StepGroup> groups = {{0, 1.0f, 0.9f, 0.999f}};
  fsdp::kernels::StepState st{};
  st.lr = 1e-3;
  st.t = 3;
  st.grad_scale = 0.75f;
  fsdp::kernels::StepRule rule{};
  rule.eps = 1e-8f;
  rule.decoupled = 1;
  DeviceArray dst(gpu, &st, sizeof st);
  EventPtr done = s->submit("optimizer step", [&] {
    std::unique_ptr<fsdp::device::SpanTable> table = gpu.make_span_table(gspans, groups);
    gpu.adam_spans(*table, rule, dst.as<fsdp::kernels::StepState>(), DType::kBf16, true);
  });  // the table went inside the task, as a rebuilt one does
  const bool legacy_busy = cudaEventQuery(legacy_done) == cudaErrorNotReady;
  done->wait(60);
  EXPECT_TRUE(legacy_busy) << "building, using or freeing the span table waited for the legacy default stream";
  auto ctable = cpu.make_span_table(cspans, groups);
  cpu.adam_spans(*ctable, rule, &st, DType::kBf16, true);
  expect_same_pass(cp, cg, cm, cv, cout, dp, dg, dm, dv, dout);
  ASSERT_EQ(cudaEventSynchronize(legacy_done), cudaSuccess);
  cudaEventDestroy(legacy_done);
}

// Review 9: the device is made current at every call, not remembered per
// thread, so a host that switched the thread to another GPU in between does
// not send libfsdp's work there.
TEST(CudaStreams, EachCallMakesItsGpuCurrentAfterTheHostSwitchedToAnotherGpu) {
  if (CudaDevice::count() < 2) GTEST_SKIP() << "needs 2 GPUs, " << CudaDevice::count() << " here: GPU test not run";
  CudaDevice gpu(0);
  void* a = gpu.alloc(256);
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);  // the host's own work on its other GPU
  gpu.zero(a, 256);
  int current = -1;
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  EXPECT_EQ(current, 0) << "libfsdp's call ran with the host's device current";
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  void* b = gpu.alloc(256);
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, b), cudaSuccess);
  EXPECT_EQ(attr.device, 0);
  gpu.free(a);
  gpu.free(b);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

// Review 11: destroy is local. A stream of the engine's own that goes with
// work still queued (a collective that may wait for a rank that is gone)
// calls its abort hook, as the CPU's worker stream does; an idle one does not.
TEST(CudaStreams, DestroyingAStreamWithQueuedWorkAbortsWhatItMayWaitFor) {
  SKIP_WITHOUT_GPU();
  CudaDevice gpu(0);
  const size_t n = size_t(1) << 27;
  DeviceArray acc(gpu, nullptr, n * 4), ones(gpu, nullptr, n * 4);
  gpu.zero(acc.ptr, acc.nbytes);
  gpu.zero(ones.ptr, ones.nbytes);
  std::atomic<int> aborts{0};
  StreamHooks hooks{nullptr, [&](const std::string&) { ++aborts; }, 0};
  {
    auto s = gpu.create_stream("comm", 1, hooks);
    s->submit("long work",
              [&] { queue_busy_work(acc.as<float>(), ones.ptr, n, 200, CudaStream::current()->native()); });
  }
  EXPECT_EQ(aborts.load(), 1) << "a stream destroyed with work queued did not call its abort hook";
  {
    auto s = gpu.create_stream("comm", 1, hooks);
    s->submit("short work", [&] { gpu.zero(acc.ptr, 64); })->wait(60);
  }
  EXPECT_EQ(aborts.load(), 1) << "an idle stream called its abort hook";
}

// Review 12: a fault on the GPU (here an illegal address) reaches the
// stream's failure(), which fsdp_ctx_async_error reports, without any wait
// for an event. The fault poisons the CUDA context of the process, so the
// check runs in a child (GpuFaultChild, which skips when run alone).
TEST(CudaStreams, AFaultOnTheGpuReachesTheStreamsFailureWithoutAWait) {
  SKIP_WITHOUT_GPU();
  EXPECT_EQ(run_self("GpuFaultChild.*", "FSDP_TEST_GPU_FAULT_CHILD=1"), 0) << "the child failed (its output is above)";
}

TEST(GpuFaultChild, AKernelFaultIsTheStreamsFailure) {
  if (std::getenv("FSDP_TEST_GPU_FAULT_CHILD") == nullptr) {  // NOLINT(concurrency-mt-unsafe)
    GTEST_SKIP() << "runs only as a process of CudaStreams.AFaultOnTheGpuReachesTheStreamsFailureWithoutAWait";
  }
  CudaDevice gpu(0);
  auto s = gpu.create_stream("comm", 1, StreamHooks{});
  void* nowhere = reinterpret_cast<void*>(uintptr_t(1) << 44);  // 16 TiB: no allocation there
  s->submit("a cast through a pointer to nowhere",
            [&] { gpu.cast(nowhere, DType::kFp32, nowhere, DType::kBf16, size_t(1) << 20); });
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (s->failure() == FSDP_OK && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(s->failure(), FSDP_ERR_INTERNAL) << "the fault never reached failure()";
}

// Review 15: queueing a task, waiting for its event on another stream and
// recording there allocate nothing once warm (pooled CUDA events and event
// objects, labels made once), and a CUDA event goes back to the pool when its
// event object goes.
TEST(CudaStreams, SubmitWaitAndRecordAllocateNothingOnceWarm) {
  SKIP_WITHOUT_GPU();
  CudaDevice gpu(0);
  auto a = gpu.create_stream("comm", 1, StreamHooks{});
  auto b = gpu.create_stream("copy_in", 0, StreamHooks{});
  DeviceArray x(gpu, nullptr, 4096);
  const fsdp::device::Label label = fsdp::device::make_label("zero x");
  auto round = [&] {
    EventPtr ev = a->submit(label, [&] { gpu.zero(x.ptr, x.nbytes); });
    b->wait(ev);
    b->record()->wait(60);
  };
  for (int i = 0; i < 100; ++i) round();  // the pools now hold what a round needs
  allocations = 0;
  counting_allocations = true;
  for (int i = 0; i < 1000; ++i) round();
  counting_allocations = false;
  EXPECT_EQ(allocations, 0) << "heap allocations in 1000 rounds of submit, wait and record";
  cudaEvent_t first = nullptr;
  {
    EventPtr e = a->record();
    first = static_cast<fsdp::device::cuda::CudaEvent&>(*e).native();
  }
  EventPtr again = a->record();
  EXPECT_EQ(static_cast<fsdp::device::cuda::CudaEvent&>(*again).native(), first) << "the CUDA event was not reused";
}

#ifdef FSDP_HAVE_NCCL
// ---- the nccl communicator at a world of one (review findings 4-7, 13) -----

namespace {

// comm=nccl at a world of one on GPU 0, moving the GPU's memory itself, and
// a comm stream to run its collectives on.
struct NcclWorld {
  CudaDevice dev{0};
  std::unique_ptr<fsdp::comm::Communicator> comm;
  std::unique_ptr<Stream> stream;
  explicit NcclWorld(double timeout_s) {
    fsdp::comm::Options o;
    o.kind = fsdp::comm::CommKind::kNccl;
    o.cuda_ordinal = 0;
    o.timeout_s = timeout_s;
    comm = fsdp::comm::make_nccl_world(o, 0);
    comm->attach_data_plane(fsdp::core::make_device_plane(dev));
    stream = dev.create_stream("comm", 1, StreamHooks{});
  }
};

}  // namespace

// Review 6: the collectives go to a blocking NCCL communicator, which queues
// them on the stream and returns ncclSuccess; a non-blocking one launches
// each from a new host thread and returns ncclInProgress.
TEST(CudaNccl, CollectivesAreQueuedByNcclWithoutAThreadOfTheirOwn) {
  SKIP_WITHOUT_GPU();
  NcclWorld w(60);
  auto& nc = dynamic_cast<fsdp::comm::NcclComm&>(*w.comm);
  DeviceArray a(w.dev, nullptr, 4096), b(w.dev, nullptr, 4096);
  cudaStream_t s = static_cast<CudaStream&>(*w.stream).native();
  ncclResult_t r = fsdp::comm::nccl().AllGather(a.ptr, b.ptr, 4096, ncclUint8, nc.native(), s);
  EXPECT_EQ(r, ncclSuccess) << fsdp::comm::nccl().GetErrorString(r);
  while (r == ncclInProgress) fsdp::comm::nccl().CommGetAsyncError(nc.native(), &r);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  // libfsdp's own collectives on it, on the comm stream.
  w.stream->submit("all_gather", [&] { w.comm->all_gather(a.ptr, b.ptr, 4096, "the test's all-gather"); })->wait(60);
  double x = 2.0;
  w.comm->all_reduce_f64(&x, 1, fsdp::comm::RedOp::kSum, "the test's all-reduce");
  EXPECT_EQ(x, 2.0);
  EXPECT_EQ(w.comm->failure(), FSDP_OK);
}

// Review 4: a collective over host memory whose communicator is aborted while
// the host waits for it fails, rather than returning whatever its buffer
// held: the wait polls (the result comes through pinned memory), and the
// communicator's failure is checked once the stream has run.
TEST(CudaNccl, AnAbortWhileAHostCollectiveWaitsFailsItInsteadOfReturningItsBuffer) {
  SKIP_WITHOUT_GPU();
  NcclWorld w(60);
  fsdp_status_t got = FSDP_OK;
  std::thread aborter;
  w.stream->submit("a host-memory all-reduce behind half a second of other work", [&] {
    queue_host_sleep(CudaStream::current()->native(), 500);
    aborter = std::thread([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      w.comm->abort("the test aborts it");
    });
    double x = 1.0;
    try {
      w.comm->all_reduce_f64(&x, 1, fsdp::comm::RedOp::kSum, "the test's all-reduce");
    } catch (const fsdp::Error& e) {
      got = e.status();
    }
  });
  aborter.join();
  EXPECT_EQ(got, FSDP_ERR_COMM) << "the all-reduce returned a result after its communicator was aborted";
}

// Review 13: the watchdog times a collective from when its stream reaches
// it, not from when it was queued: one queued behind 2 s of other work with
// timeout_s = 1 completes without a timeout.
TEST(CudaNccl, ATimeoutCountsFromWhenTheStreamReachesTheCollective) {
  SKIP_WITHOUT_GPU();
  NcclWorld w(1.0);
  DeviceArray a(w.dev, nullptr, 1 << 20), b(w.dev, nullptr, 1 << 20);
  EventPtr done = w.stream->submit("an all-gather behind 2 s of other work", [&] {
    queue_host_sleep(CudaStream::current()->native(), 2000);
    w.comm->all_gather(a.ptr, b.ptr, 1 << 20, "the test's all-gather");
  });
  done->wait(60);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the watchdog's next look
  EXPECT_EQ(w.comm->failure(), FSDP_OK) << "the collective timed out before its stream had reached it";
  // And one that does run too long, from the start, still times out.
  // (At a world of one nothing waits for a peer: not tested here.)
}

// Review 5: after an abort, with collectives still in flight, the watchdog
// drains them with event queries only, every later call fails with the
// abort's reason, and the communicator goes without another NCCL call. (A
// use of the freed communicator would show as nothing or as a crash: this
// runs the path.)
TEST(CudaNccl, AnAbortedCommunicatorFailsEveryCallAndGoesQuietly) {
  SKIP_WITHOUT_GPU();
  NcclWorld w(60);
  DeviceArray a(w.dev, nullptr, 1 << 20), b(w.dev, nullptr, 1 << 20);
  w.stream->submit("collectives behind 300 ms of other work", [&] {
    queue_host_sleep(CudaStream::current()->native(), 300);
    for (int k = 0; k < 4; ++k) w.comm->all_gather(a.ptr, b.ptr, 1 << 20, "the test's all-gather");
  });
  w.comm->abort("the test aborts it");
  EXPECT_EQ(w.comm->failure(), FSDP_ERR_COMM);
  expect_error(FSDP_ERR_COMM, "the test aborts it", [&] { w.comm->all_gather(a.ptr, b.ptr, 1 << 20, "after"); });
  expect_error(FSDP_ERR_COMM, "the test aborts it", [&] { w.comm->barrier("after"); });
  expect_error(FSDP_ERR_COMM, "the test aborts it", [&] { w.comm->split(0, 0, "after"); });
  static_cast<CudaStream&>(*w.stream).synchronize(60);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the watchdog drains
  w.comm.reset();
}
#endif  // FSDP_HAVE_NCCL
