// src/device/cuda/cuda_device.cpp - see cuda_device.h.
#include "cuda_device.h"

#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <string>

#include "../../../kernels/cuda/launch.h"
#include "../../base/log.h"
#include "../../base/pool.h"
#include "cuda_check.h"

namespace fsdp::device::cuda {
namespace {

namespace k = fsdp::kernels::cuda;

constexpr size_t kPinnedPerBlock = 512;  // doubles per pinned block

fsdp_dtype_t code(DType t) { return static_cast<fsdp_dtype_t>(t); }

struct HostResult {
  CudaDevice* dev;
  double* pinned;
  double* dst;
};

}  // namespace

// libfsdp's own stream-ordered pool on one GPU: freed blocks stay cached for
// the next allocation (a release threshold of "never"), as the engine frees
// and allocates the same sizes every step; the device's default pool, which
// other libraries in the process use, is left as it is. Shared by the
// contexts on one GPU (thread-ranks reuse each other's freed blocks) and
// destroyed with the last of them, which returns its memory to the driver.
class MemPool {
 public:
  explicit MemPool(int ordinal) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = ordinal;
    check(cudaMemPoolCreate(&pool_, &props), "cudaMemPoolCreate");
    uint64_t keep = std::numeric_limits<uint64_t>::max();
    cudaError_t e = cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep);
    // A block freed on another stream is reused once its free has run, never
    // by making the allocating stream wait for that stream: an allocation
    // outside a task (on the device's own stream, which the host then
    // synchronizes) would otherwise wait for the comm stream's collectives.
    int no = 0;
    if (e == cudaSuccess) e = cudaMemPoolSetAttribute(pool_, cudaMemPoolReuseAllowInternalDependencies, &no);
    if (e != cudaSuccess) {
      cudaMemPoolDestroy(pool_);
      check(e, "setting the memory pool's attributes");
    }
  }
  // Blocks still allocated are released by CUDA once they are freed.
  ~MemPool() { cudaMemPoolDestroy(pool_); }
  MemPool(const MemPool&) = delete;
  MemPool& operator=(const MemPool&) = delete;
  cudaMemPool_t get() const { return pool_; }

  // The pool of GPU `ordinal`, made when no device of it has one.
  static std::shared_ptr<MemPool> of(int ordinal) {
    static auto* mu = new std::mutex;  // never destroyed: devices may go during static destruction
    static auto* pools = new std::map<int, std::weak_ptr<MemPool>>;
    std::lock_guard<std::mutex> lock(*mu);  // no host callback takes it
    std::weak_ptr<MemPool>& slot = (*pools)[ordinal];
    std::shared_ptr<MemPool> p = slot.lock();
    if (!p) {
      p = std::make_shared<MemPool>(ordinal);
      slot = p;
    }
    return p;
  }

 private:
  cudaMemPool_t pool_ = nullptr;
};

namespace {

// A SpanTable with its device copy: the spans, and the chunk table of the
// multi-tensor launches, in one block of the pool. The upload is queued on
// the stream the table is made on, from host copies the table keeps (the
// spans, and the chunks), so it is ordered before the launches queued after
// it there; `last_` marks the upload and then each launch, so that a launch
// on another stream waits for the upload, and the table is freed only after
// its last launch.
class CudaSpanTable final : public SpanTable {
 public:
  CudaSpanTable(int ordinal, std::vector<ShardSpan> spans, cudaMemPool_t pool, cudaStream_t s, cudaStream_t idle)
      : SpanTable(std::move(spans)), ordinal_(ordinal), idle_(idle) {
    const std::vector<ShardSpan>& sp = this->spans();
    chunks_host_ = k::span_chunks(sp.data(), sp.size());
    has_out_ = !sp.empty() && sp.front().out != nullptr;
    momentum_ = !sp.empty() && sp.front().state1 != nullptr;
    for (const ShardSpan& x : sp) {
      if ((x.out != nullptr) != has_out_ || (x.state1 != nullptr) != momentum_) {
        fail(FSDP_ERR_INTERNAL, "cuda device: a span table whose spans differ in having a params copy or state");
      }
    }
    check(cudaEventCreateWithFlags(&last_, cudaEventDisableTiming), "cudaEventCreateWithFlags (span table)");
    const size_t spans_nbytes = (sp.size() * sizeof(ShardSpan) + 255) / 256 * 256;
    const size_t chunks_nbytes = chunks_host_.size() * sizeof(k::SpanChunk);
    if (spans_nbytes + chunks_nbytes > 0) {
      void* block = nullptr;
      cudaError_t e = cudaMallocFromPoolAsync(&block, spans_nbytes + chunks_nbytes, pool, s);
      if (e != cudaSuccess) {
        cudaGetLastError();
        cudaEventDestroy(last_);
        fail_cuda(e, "cudaMallocFromPoolAsync (span table)");
      }
      block_ = block;
      spans_ = static_cast<ShardSpan*>(block);
      chunks_ = reinterpret_cast<k::SpanChunk*>(static_cast<char*>(block) + spans_nbytes);
      e = cudaMemcpyAsync(spans_, sp.data(), sp.size() * sizeof(ShardSpan), cudaMemcpyHostToDevice, s);
      if (e == cudaSuccess) e = cudaMemcpyAsync(chunks_, chunks_host_.data(), chunks_nbytes, cudaMemcpyHostToDevice, s);
      if (e != cudaSuccess) {
        cudaStreamSynchronize(s);  // the copies may have begun: they read the host copies that go with this
        cudaFreeAsync(block_, s);
        cudaEventDestroy(last_);
        fail_cuda(e, "uploading the span table");
      }
    }
    cudaError_t e = cudaEventRecord(last_, s);
    if (e != cudaSuccess) {
      cudaStreamSynchronize(s);
      if (block_ != nullptr) cudaFreeAsync(block_, s);
      cudaEventDestroy(last_);
      fail_cuda(e, "recording the span table's upload");
    }
  }
  // Waits for the table's own last use (an event: the upload and every launch
  // recorded it; in the engine the step has already waited for its launch),
  // not for the device, then frees in stream order and lets the host copies go.
  ~CudaSpanTable() override {
    if (!try_bind(ordinal_)) return;
    cudaEventSynchronize(last_);
    if (block_ != nullptr) {
      CudaStream* cur = CudaStream::current();
      cudaFreeAsync(block_, cur != nullptr ? cur->native() : idle_);
    }
    cudaEventDestroy(last_);
  }
  CudaSpanTable(const CudaSpanTable&) = delete;
  CudaSpanTable& operator=(const CudaSpanTable&) = delete;

  // Around a launch on `s`: after the upload and the launches before it.
  void before_launch(cudaStream_t s) const { check(cudaStreamWaitEvent(s, last_, 0), "waiting for the span table"); }
  void after_launch(cudaStream_t s) const { check(cudaEventRecord(last_, s), "recording a span table launch"); }

  const ShardSpan* spans_dev() const { return spans_; }
  const k::SpanChunk* chunks() const { return chunks_; }
  size_t n_chunks() const { return chunks_host_.size(); }
  bool has_out() const { return has_out_; }
  bool momentum() const { return momentum_; }

 private:
  int ordinal_;
  cudaStream_t idle_;  // the device's own stream: frees outside tasks go there
  std::vector<k::SpanChunk> chunks_host_;
  cudaEvent_t last_ = nullptr;
  void* block_ = nullptr;
  ShardSpan* spans_ = nullptr;
  k::SpanChunk* chunks_ = nullptr;
  bool has_out_ = false;
  bool momentum_ = false;
};

// The callback's argument, from a pool of blocks (no heap allocation per
// reduction once warm).
HostResult* new_host_result(const HostResult& r) {
  HostResult* p = base::PoolAllocator<HostResult>().allocate(1);
  return new (p) HostResult(r);
}

void CUDART_CB write_host_result(void* arg) {  // no CUDA calls allowed here
  auto* r = static_cast<HostResult*>(arg);
  *r->dst = *r->pinned;
  r->dev->give_pinned(r->pinned);
  r->~HostResult();
  base::PoolAllocator<HostResult>().deallocate(r, 1);
}

void* pinned_alloc(size_t nbytes) {
  void* p = nullptr;
  if (cudaHostAlloc(&p, nbytes == 0 ? 1 : nbytes, cudaHostAllocPortable) != cudaSuccess) {
    cudaGetLastError();  // out of pinned memory is not sticky: the caller reports it
    return nullptr;
  }
  return p;  // page-aligned
}

void pinned_free(void* p) { cudaFreeHost(p); }

// libfsdp's kernels loaded into the device's context once per process, when
// its first CudaDevice is made (k::load_kernels says why). Kernels built
// without this GPU's architecture are refused here, by name, rather than at
// a first launch in the middle of a step.
void load_kernels_once(int ordinal) {
  static std::mutex mu;
  static std::set<int> loaded;
  std::lock_guard<std::mutex> lock(mu);
  if (loaded.count(ordinal) != 0) return;
  const char* what = "";
  cudaError_t e = k::load_kernels(&what);
  if (e == cudaSuccess) {
    loaded.insert(ordinal);
    return;
  }
  cudaGetLastError();  // not sticky: clear it
  if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidDeviceFunction) {
    cudaDeviceProp prop{};
    std::string arch = cudaGetDeviceProperties(&prop, ordinal) == cudaSuccess
                           ? "sm_" + std::to_string(prop.major) + std::to_string(prop.minor)
                           : "this GPU's architecture";
    fail(FSDP_ERR_UNSUPPORTED, "device=cuda:" + std::to_string(ordinal) + ": libfsdp's kernels were not built for " +
                                   arch + " (" + describe(e) +
                                   "); build it with CMAKE_CUDA_ARCHITECTURES naming that architecture");
  }
  loaded.insert(ordinal);  // said once: every kernel still loads at its first launch
  base::log(FSDP_LOG_WARN, -1,
            "device=cuda:" + std::to_string(ordinal) + ": loading libfsdp's kernels up front failed at " + what + " (" +
                describe(e) + "); each loads at its first launch instead, which may wait for all work queued on the GPU");
}

}  // namespace

HostMemory CudaDevice::host_memory() const { return {pinned_alloc, pinned_free}; }

int CudaDevice::count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

CudaDevice::CudaDevice(int ordinal) : ordinal_(ordinal) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    fail(FSDP_ERR_UNSUPPORTED, "device=cuda: no CUDA device can be used by this process (" +
                                   (e != cudaSuccess ? describe(e) : std::string("cudaGetDeviceCount found none")) +
                                   "; check the driver and CUDA_VISIBLE_DEVICES)");
  }
  if (ordinal < 0 || ordinal >= n) {
    fail(FSDP_ERR_INVALID_ARGUMENT, "device=cuda:" + std::to_string(ordinal) + ": this process sees " +
                                        std::to_string(n) + " CUDA device(s), numbered 0.." + std::to_string(n - 1));
  }
  bind(ordinal_);
  load_kernels_once(ordinal_);
  pool_ = MemPool::of(ordinal_);
  ops_ = std::make_unique<CudaStream>(ordinal_, "device operations", 0, StreamHooks{});
}

CudaDevice::~CudaDevice() {
  if (try_bind(ordinal_)) cudaDeviceSynchronize();
  callers_.clear();
  ops_.reset();
  pool_.reset();
  for (void* b : pinned_blocks_) cudaFreeHost(b);
}

cudaMemPool_t CudaDevice::mem_pool() const { return pool_->get(); }

std::unique_ptr<Stream> CudaDevice::create_stream(std::string name, int priority, StreamHooks hooks) {
  return std::make_unique<CudaStream>(ordinal_, std::move(name), priority, std::move(hooks));
}

Stream& CudaDevice::caller_stream(void* native, const char* call) {
  auto s = static_cast<cudaStream_t>(native);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = callers_.find(s);
    if (it != callers_.end()) return *it->second;
  }
  // A handle seen for the first time: checked and wrapped without the lock
  // (no CUDA call under it); a thread that wrapped it meanwhile wins.
  if (s != nullptr) {
    int dev = -1;
    cudaError_t e = cudaStreamGetDevice(s, &dev);
    if (e != cudaSuccess || dev != ordinal_) {
      fail(FSDP_ERR_INVALID_ARGUMENT,
           std::string(call) + ": stream is not a cudaStream_t of cuda:" + std::to_string(ordinal_) +
               (e != cudaSuccess ? " (" + describe(e) + ")" : " (it belongs to cuda:" + std::to_string(dev) + ")"));
    }
  }
  auto wrapped = std::make_unique<CudaStream>(ordinal_, s, s == nullptr ? "default" : "host");
  std::lock_guard<std::mutex> lock(mu_);
  return *callers_.emplace(s, std::move(wrapped)).first->second;
}

cudaStream_t CudaDevice::target() const {
  CudaStream* cur = CudaStream::current();
  return cur != nullptr ? cur->native() : ops_->native();
}

void CudaDevice::issued(cudaError_t e, const char* what) {
  check(e, what);
  if (CudaStream::current() == nullptr) check(cudaStreamSynchronize(ops_->native()), what);
}

void* CudaDevice::alloc(size_t nbytes) {
  bind(ordinal_);
  void* p = nullptr;
  cudaError_t e = cudaMallocFromPoolAsync(&p, nbytes == 0 ? 1 : nbytes, pool_->get(), target());
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // not sticky: clear it
    fail(FSDP_ERR_OUT_OF_MEMORY,
         "cuda device: could not allocate " + std::to_string(nbytes) + " bytes on cuda:" + std::to_string(ordinal_));
  }
  issued(e, "cudaMallocFromPoolAsync");
  return p;
}

void CudaDevice::free(void* ptr) noexcept {
  if (ptr == nullptr) return;
  if (!try_bind(ordinal_)) return;
  if (CudaStream* cur = CudaStream::current()) {
    cudaFreeAsync(ptr, cur->native());  // after the work queued on that stream
    return;
  }
  // Outside a task the block may still be read by any stream's queued work:
  // wait for the device (the engine frees its hot-path buffers inside tasks
  // or through slots, not here).
  cudaDeviceSynchronize();
  cudaFreeAsync(ptr, ops_->native());
  cudaStreamSynchronize(ops_->native());
}

void* CudaDevice::alloc_zeroed(size_t nbytes) {
  void* p = alloc(nbytes);
  zero(p, nbytes);
  return p;
}

void CudaDevice::zero(void* ptr, size_t nbytes) {
  bind(ordinal_);
  issued(cudaMemsetAsync(ptr, 0, nbytes, target()), "cudaMemsetAsync");
}

void CudaDevice::fill_nan(void* ptr, size_t nbytes) {
  bind(ordinal_);
  issued(cudaMemsetAsync(ptr, 0xFF, nbytes, target()), "cudaMemsetAsync");
}

void CudaDevice::copy(void* dst, const void* src, size_t nbytes) {
  bind(ordinal_);
  issued(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, target()), "cudaMemcpyAsync (device to device)");
}

void CudaDevice::copy_from_host(void* dst, const void* host_src, size_t nbytes) {
  bind(ordinal_);
  issued(cudaMemcpyAsync(dst, host_src, nbytes, cudaMemcpyHostToDevice, target()), "cudaMemcpyAsync (host to device)");
}

void CudaDevice::copy_to_host(void* host_dst, const void* src, size_t nbytes) {
  bind(ordinal_);
  issued(cudaMemcpyAsync(host_dst, src, nbytes, cudaMemcpyDeviceToHost, target()), "cudaMemcpyAsync (device to host)");
}

void CudaDevice::cast(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t numel) {
  bind(ordinal_);
  issued(k::cast(dst, code(dst_dtype), const_cast<void*>(src), code(src_dtype), numel, false, target()), "cast");
}

void CudaDevice::cast_clear(void* dst, DType dst_dtype, void* src, DType src_dtype, size_t numel) {
  bind(ordinal_);
  issued(k::cast(dst, code(dst_dtype), src, code(src_dtype), numel, true, target()), "cast_clear");
}

double* CudaDevice::take_pinned() {
  {
    std::lock_guard<std::mutex> lock(pinned_mu_);
    if (!pinned_free_.empty()) {
      double* p = pinned_free_.back();
      pinned_free_.pop_back();
      return p;
    }
  }
  // A new block, allocated without the lock: the host callbacks that hand
  // scalars back take it, and CUDA forbids a wait on them from a CUDA call.
  void* block = nullptr;
  check(cudaMallocHost(&block, kPinnedPerBlock * sizeof(double)), "cudaMallocHost (result scalars)");
  std::lock_guard<std::mutex> lock(pinned_mu_);
  pinned_blocks_.push_back(block);
  pinned_free_.reserve(pinned_blocks_.size() * kPinnedPerBlock);  // give_pinned never grows it
  for (size_t i = 1; i < kPinnedPerBlock; ++i) pinned_free_.push_back(static_cast<double*>(block) + i);
  return static_cast<double*>(block);
}

void CudaDevice::give_pinned(double* p) {
  std::lock_guard<std::mutex> lock(pinned_mu_);
  pinned_free_.push_back(p);
}

void CudaDevice::queue_squares_to_host(const float* x, size_t numel, double* host_dst, cudaStream_t s) {
  // The result and the reduction's scratch in one block of the pool.
  const size_t scratch_nbytes = k::sum_squares_scratch_nbytes(numel);
  void* block = nullptr;
  check(cudaMallocFromPoolAsync(&block, 256 + scratch_nbytes, pool_->get(), s), "cudaMallocFromPoolAsync (norm)");
  auto* sq = static_cast<double*>(block);
  check(k::sum_squares(x, numel, sq, static_cast<char*>(block) + 256, s), "sum of squares");
  double* pinned = take_pinned();
  check(cudaMemcpyAsync(pinned, sq, sizeof(double), cudaMemcpyDeviceToHost, s), "copying a result to the host");
  check(cudaFreeAsync(block, s), "cudaFreeAsync (norm)");
  check(cudaLaunchHostFunc(s, write_host_result, new_host_result({this, pinned, host_dst})), "cudaLaunchHostFunc");
}

void CudaDevice::accumulate_pass(float* acc, void* src, DType src_dtype, float scale, size_t numel, bool clear,
                                 double* acc_sq) {
  bind(ordinal_);
  cudaStream_t s = target();
  check(k::accumulate(acc, src, code(src_dtype), scale, numel, clear, s), "accumulate");
  if (acc_sq != nullptr) queue_squares_to_host(acc, numel, acc_sq, s);  // of the sums, as the CPU's pass
  issued(cudaSuccess, "accumulate");
}

void CudaDevice::accumulate(float* acc, const void* src, DType src_dtype, float scale, size_t numel, double* acc_sq) {
  accumulate_pass(acc, const_cast<void*>(src), src_dtype, scale, numel, false, acc_sq);
}

void CudaDevice::accumulate_clear(float* acc, void* src, DType src_dtype, float scale, size_t numel, double* acc_sq) {
  accumulate_pass(acc, src, src_dtype, scale, numel, true, acc_sq);
}

void CudaDevice::adam(const AdamArgs& a) {
  bind(ordinal_);
  cudaStream_t s = target();
  if (a.grad_sq != nullptr) {  // the raw grads' squares, before the pass clears them
    queue_squares_to_host(a.grads, a.numel, a.grad_sq, s);
  }
  issued(k::adam(a.op, a.params, a.grads, a.exp_avg, a.exp_avg_sq, a.out, code(a.out_dtype), a.numel, a.zero_grads, s),
         "adam");
}

void CudaDevice::sgd(const SgdArgs& a) {
  bind(ordinal_);
  cudaStream_t s = target();
  if (a.grad_sq != nullptr) queue_squares_to_host(a.grads, a.numel, a.grad_sq, s);
  issued(k::sgd(a.op, a.params, a.grads, a.momentum_buf, a.out, code(a.out_dtype), a.numel, a.zero_grads, s), "sgd");
}

double CudaDevice::sum_squares(const float* x, size_t numel) {
  bind(ordinal_);
  cudaStream_t s = target();
  double v = 0.0;
  queue_squares_to_host(x, numel, &v, s);
  check(cudaStreamSynchronize(s), "sum of squares");  // the host callback has written v
  return v;
}

void CudaDevice::reduce_sum(void* out, void* const* ins, size_t n_ins, size_t numel, DType dtype, float scale,
                            bool clear) {
  if (n_ins > k::kMaxReduceInputs) {
    fail(FSDP_ERR_UNSUPPORTED, "cuda device: a reduction over " + std::to_string(n_ins) +
                                   " ranks sharing one GPU; at most " + std::to_string(k::kMaxReduceInputs) +
                                   " ranks can share a GPU");
  }
  bind(ordinal_);
  issued(k::reduce_sum(out, ins, n_ins, code(dtype), numel, scale, clear, target()), "reduce_sum");
}

std::unique_ptr<SpanTable> CudaDevice::make_span_table(std::vector<ShardSpan> spans) {
  bind(ordinal_);
  auto table = std::make_unique<CudaSpanTable>(ordinal_, std::move(spans), pool_->get(), target(), ops_->native());
  issued(cudaSuccess, "uploading the span table");
  return table;
}

void CudaDevice::adam_spans(const SpanTable& table, const kernels::AdamOp& op, float lr, bool decoupled,
                            DType out_dtype, bool zero_grads) {
  const auto& t = dynamic_cast<const CudaSpanTable&>(table);
  bind(ordinal_);
  cudaStream_t s = target();
  t.before_launch(s);
  check(k::adam_spans(t.spans_dev(), t.chunks(), t.n_chunks(), op, lr, decoupled, t.has_out(), code(out_dtype),
                      zero_grads, s),
        "adam (multi-tensor)");
  t.after_launch(s);
  issued(cudaSuccess, "adam (multi-tensor)");
}

void CudaDevice::sgd_spans(const SpanTable& table, const kernels::SgdOp& op, DType out_dtype, bool zero_grads) {
  const auto& t = dynamic_cast<const CudaSpanTable&>(table);
  bind(ordinal_);
  cudaStream_t s = target();
  t.before_launch(s);
  check(k::sgd_spans(t.spans_dev(), t.chunks(), t.n_chunks(), op, t.momentum(), t.has_out(), code(out_dtype),
                     zero_grads, s),
        "sgd (multi-tensor)");
  t.after_launch(s);
  issued(cudaSuccess, "sgd (multi-tensor)");
}

bool CudaDevice::device_only(const void* ptr) const {
  if (ptr == nullptr) return false;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, ptr) != cudaSuccess) {
    cudaGetLastError();  // not sticky: an unknown pointer is the host's
    return false;
  }
  return a.type == cudaMemoryTypeDevice;
}

EventPtr CudaDevice::mark() {
  bind(ordinal_);
  CudaStream* cur = CudaStream::current();
  return cur != nullptr ? cur->record() : ops_->record();
}

void CudaDevice::wait_mark(const EventPtr& ev) {
  if (!ev) return;
  if (CudaStream* cur = CudaStream::current()) {
    cur->wait(ev);
    return;
  }
  ev->wait(0);  // outside a task the next operation is synchronous anyway
}

}  // namespace fsdp::device::cuda
