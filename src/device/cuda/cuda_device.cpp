// src/device/cuda/cuda_device.cpp - see cuda_device.h: the memory pool, streams, copies and the
// multi-tensor tables (the element-wise passes are cuda_passes.cpp's).
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
#include "../../base/host_waits.h"
#include "../../base/pool.h"
#include "cuda_check.h"

namespace fsdp::device::cuda {
namespace {

namespace k = fsdp::kernels::cuda;

fsdp_dtype_t code(DType t) { return static_cast<fsdp_dtype_t>(t); }

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

// Whether `s` is capturing into a CUDA graph.
bool capturing(cudaStream_t s) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &status) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}

// Host arrays uploaded into one block of the pool where the next operation
// goes (in a task: on its stream, in order before the launches queued after
// it there; outside: on the device's own stream), from host copies the owner
// keeps until the upload is done; `last_` marks the upload and then each
// launch, so that a launch on another stream waits for the upload, and the
// block is freed only after its last launch. `extra` bytes at the end are
// left for the owner's own use on the device (no upload).
class Uploaded {
 public:
  struct Part {
    const void* host;
    size_t nbytes;
  };
  Uploaded(int ordinal, std::vector<Part> parts, size_t extra, cudaMemPool_t pool, cudaStream_t s, cudaStream_t idle)
      : ordinal_(ordinal), idle_(idle) {
    check(cudaEventCreateWithFlags(&last_, cudaEventDisableTiming), "cudaEventCreateWithFlags (table)");
    size_t total = 0;
    for (const Part& p : parts) {
      at_.push_back(total);
      total += (p.nbytes + 255) / 256 * 256;
    }
    extra_at_ = total;
    total += extra;
    cudaError_t e = cudaSuccess;
    if (total > 0) {
      void* block = nullptr;
      e = cudaMallocFromPoolAsync(&block, total, pool, s);
      if (e != cudaSuccess) {
        cudaGetLastError();
        cudaEventDestroy(last_);
        fail_cuda(e, "cudaMallocFromPoolAsync (table)");
      }
      block_ = static_cast<char*>(block);
      for (size_t i = 0; i < parts.size() && e == cudaSuccess; ++i) {
        if (parts[i].nbytes > 0) {
          e = cudaMemcpyAsync(block_ + at_[i], parts[i].host, parts[i].nbytes, cudaMemcpyHostToDevice, s);
        }
      }
    }
    if (e == cudaSuccess) e = cudaEventRecord(last_, s);
    if (e != cudaSuccess) {
      cudaStreamSynchronize(s);  // the copies may have begun: they read the owner's host copies
      if (block_ != nullptr) cudaFreeAsync(block_, s);
      cudaEventDestroy(last_);
      fail_cuda(e, "uploading a table");
    }
  }
  // Waits for the block's own last use (an event: the upload and every launch
  // recorded it; in the engine the step has already waited for its launch),
  // not for the device, then frees in stream order.
  ~Uploaded() {
    if (!try_bind(ordinal_)) return;
    base::note_host_wait();
    RelaxedCaptureMode outside;  // (last_ is never recorded inside a capture)
    cudaEventSynchronize(last_);
    if (block_ != nullptr) {
      CudaStream* cur = CudaStream::current();
      cudaFreeAsync(block_, cur != nullptr ? cur->native() : idle_);
    }
    cudaEventDestroy(last_);
  }
  Uploaded(const Uploaded&) = delete;
  Uploaded& operator=(const Uploaded&) = delete;

  // Around a launch on `s`: after the upload and the launches before it.
  // Captured into a CUDA graph, the launch neither waits for nor records
  // the event (no dependency crosses a capture): the upload must be done
  // (it is, after the warm-up steps a capture follows), and the table lives
  // as long as a graph may run it (Optimizer keeps a captured step's tables).
  void before_launch(cudaStream_t s) const {
    if (capturing(s)) {
      cudaError_t q = cudaErrorNotReady;
      {
        RelaxedCaptureMode outside;  // the upload was queued before the capture
        q = cudaEventQuery(last_);
      }
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) fail_cuda(q, "a table's upload");
      fail(FSDP_ERR_INVALID_STATE, "cuda device: a table's upload still runs while a CUDA graph is captured that "
                                   "reads it; synchronize (cudaDeviceSynchronize) before cudaStreamBeginCapture");
    }
    check(cudaStreamWaitEvent(s, last_, 0), "waiting for a table");
  }
  void after_launch(cudaStream_t s) const {
    if (!capturing(s)) check(cudaEventRecord(last_, s), "recording a table's launch");
  }
  template <typename T>
  T* part(size_t i) const {
    return block_ == nullptr ? nullptr : reinterpret_cast<T*>(block_ + at_.at(i));
  }
  char* extra() const { return block_ == nullptr ? nullptr : block_ + extra_at_; }

 private:
  int ordinal_;
  cudaStream_t idle_;  // the device's own stream: frees outside tasks go there
  cudaEvent_t last_ = nullptr;
  char* block_ = nullptr;
  std::vector<size_t> at_;
  size_t extra_at_ = 0;
};

// A SpanTable with its device copy: the spans, the groups and the chunk
// table of the multi-tensor launches (host copies kept for the upload).
class CudaSpanTable final : public SpanTable {
 public:
  CudaSpanTable(int ordinal, std::vector<ShardSpan> spans, std::vector<kernels::StepGroup> groups, cudaMemPool_t pool,
                cudaStream_t s, cudaStream_t idle)
      : SpanTable(std::move(spans), std::move(groups)), chunks_host_(k::span_chunks(this->spans().data(), this->spans().size())) {
    const std::vector<ShardSpan>& sp = this->spans();
    has_out_ = !sp.empty() && sp.front().out != nullptr;
    momentum_ = !sp.empty() && sp.front().state1 != nullptr;
    for (const ShardSpan& x : sp) {
      if ((x.out != nullptr) != has_out_ || (x.state1 != nullptr) != momentum_) {
        fail(FSDP_ERR_INTERNAL, "cuda device: a span table whose spans differ in having a params copy or state");
      }
    }
    dev_ = std::make_unique<Uploaded>(ordinal,
                                      std::vector<Uploaded::Part>{{sp.data(), sp.size() * sizeof(ShardSpan)},
                                                                  {this->groups().data(),
                                                                   this->groups().size() * sizeof(kernels::StepGroup)},
                                                                  {chunks_host_.data(),
                                                                   chunks_host_.size() * sizeof(k::SpanChunk)}},
                                      0, pool, s, idle);
  }
  const Uploaded& dev() const { return *dev_; }
  const ShardSpan* spans_dev() const { return dev_->part<ShardSpan>(0); }
  const kernels::StepGroup* groups_dev() const { return dev_->part<kernels::StepGroup>(1); }
  const k::SpanChunk* chunks() const { return dev_->part<k::SpanChunk>(2); }
  size_t n_chunks() const { return chunks_host_.size(); }
  bool has_out() const { return has_out_; }
  bool momentum() const { return momentum_; }

 private:
  std::vector<k::SpanChunk> chunks_host_;
  std::unique_ptr<Uploaded> dev_;
  bool has_out_ = false;
  bool momentum_ = false;
};

// A SquaresTable with its device copy: the entries (each with its own
// scratch for the steps' sums, at the end of the block, kept for the table's
// life) and the chunk table of the one launch that reads the arrays.
class CudaSquaresTable final : public SquaresTable {
 public:
  CudaSquaresTable(int ordinal, std::vector<SquaresSpan> spans, cudaMemPool_t pool, cudaStream_t s, cudaStream_t idle)
      : SquaresTable(std::move(spans)) {
    size_t scratch = 0;
    std::vector<size_t> scratch_at;
    for (const SquaresSpan& x : this->spans()) {
      scratch_at.push_back(scratch);
      scratch += (k::sum_squares_scratch_nbytes(x.numel) + 255) / 256 * 256;
    }
    // The entries name their scratch, which lies after the uploaded parts: two
    // passes (the entries' size does not depend on where the scratch is).
    for (const SquaresSpan& x : this->spans()) entries_.push_back({x.x, x.numel, x.out, nullptr});
    chunks_host_ = k::squares_chunks(entries_.data(), entries_.size());
    const size_t entries_nbytes = (entries_.size() * sizeof(k::SquaresEntry) + 255) / 256 * 256;
    // Upload the chunks first; the entries, which need the block's address,
    // are uploaded into the extra space by a second copy below.
    dev_ = std::make_unique<Uploaded>(ordinal,
                                      std::vector<Uploaded::Part>{{chunks_host_.data(),
                                                                   chunks_host_.size() * sizeof(k::SquaresChunk)}},
                                      entries_nbytes + scratch, pool, s, idle);
    char* entries_dev = dev_->extra();
    char* scratch_base = entries_dev + entries_nbytes;
    for (size_t i = 0; i < entries_.size(); ++i) entries_[i].scratch = scratch_base + scratch_at[i];
    if (!entries_.empty()) {
      check(cudaMemcpyAsync(entries_dev, entries_.data(), entries_.size() * sizeof(k::SquaresEntry),
                            cudaMemcpyHostToDevice, s),
            "uploading the squares table");
      dev_->after_launch(s);
    }
    entries_dev_ = reinterpret_cast<const k::SquaresEntry*>(entries_dev);
  }
  const Uploaded& dev() const { return *dev_; }
  const k::SquaresEntry* entries_dev() const { return entries_dev_; }
  const std::vector<k::SquaresEntry>& entries() const { return entries_; }
  const k::SquaresChunk* chunks() const { return dev_->part<k::SquaresChunk>(0); }
  size_t n_chunks() const { return chunks_host_.size(); }

 private:
  std::vector<k::SquaresEntry> entries_;
  std::vector<k::SquaresChunk> chunks_host_;
  std::unique_ptr<Uploaded> dev_;
  const k::SquaresEntry* entries_dev_ = nullptr;
};

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
  if (CudaStream::current() == nullptr) {
    base::note_host_wait();
    RelaxedCaptureMode outside;  // the device's own stream is never captured
    check(cudaStreamSynchronize(ops_->native()), what);
  }
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
  base::note_host_wait();
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

std::unique_ptr<SquaresTable> CudaDevice::make_squares_table(std::vector<SquaresSpan> spans) {
  bind(ordinal_);
  auto table = std::make_unique<CudaSquaresTable>(ordinal_, std::move(spans), pool_->get(), target(), ops_->native());
  issued(cudaSuccess, "uploading the squares table");
  return table;
}

void CudaDevice::sum_squares_table(const SquaresTable& table) {
  const auto& t = dynamic_cast<const CudaSquaresTable&>(table);
  bind(ordinal_);
  cudaStream_t s = target();
  t.dev().before_launch(s);
  check(k::sum_squares_table(t.entries_dev(), t.chunks(), t.n_chunks(), t.entries().data(), t.entries().size(), s),
        "sums of squares (multi-tensor)");
  t.dev().after_launch(s);
  issued(cudaSuccess, "sums of squares (multi-tensor)");
}

std::unique_ptr<SpanTable> CudaDevice::make_span_table(std::vector<ShardSpan> spans,
                                                       std::vector<kernels::StepGroup> groups) {
  bind(ordinal_);
  auto table = std::make_unique<CudaSpanTable>(ordinal_, std::move(spans), std::move(groups), pool_->get(), target(),
                                               ops_->native());
  issued(cudaSuccess, "uploading the span table");
  return table;
}

void CudaDevice::adam_spans(const SpanTable& table, const kernels::StepRule& rule, const kernels::StepState* st,
                            DType out_dtype, bool zero_grads) {
  const auto& t = dynamic_cast<const CudaSpanTable&>(table);
  bind(ordinal_);
  cudaStream_t s = target();
  t.dev().before_launch(s);
  check(k::adam_spans(t.spans_dev(), t.chunks(), t.n_chunks(), t.groups_dev(), rule, st, t.has_out(), code(out_dtype),
                      zero_grads, s),
        "adam (multi-tensor)");
  t.dev().after_launch(s);
  issued(cudaSuccess, "adam (multi-tensor)");
}

void CudaDevice::sgd_spans(const SpanTable& table, const kernels::StepRule& rule, const kernels::StepState* st,
                           DType out_dtype, bool zero_grads) {
  const auto& t = dynamic_cast<const CudaSpanTable&>(table);
  bind(ordinal_);
  cudaStream_t s = target();
  t.dev().before_launch(s);
  check(k::sgd_spans(t.spans_dev(), t.chunks(), t.n_chunks(), t.groups_dev(), rule, st, t.momentum(), t.has_out(),
                     code(out_dtype), zero_grads, s),
        "sgd (multi-tensor)");
  t.dev().after_launch(s);
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

bool CudaDevice::readable(const void* ptr) const {
  if (ptr == nullptr) return false;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, ptr) != cudaSuccess) {
    cudaGetLastError();  // not sticky: memory CUDA does not know (pageable host memory)
    return false;
  }
  switch (a.type) {
    case cudaMemoryTypeDevice:
      return a.device == ordinal_;
    case cudaMemoryTypeManaged:
      return true;
    case cudaMemoryTypeHost:  // page-locked: readable where it is mapped for the device
      return a.devicePointer == ptr;
    default:
      return false;
  }
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
