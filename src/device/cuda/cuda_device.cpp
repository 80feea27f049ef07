// src/device/cuda/cuda_device.cpp - see cuda_device.h.
#include "cuda_device.h"

#include <cstdint>
#include <limits>
#include <string>

#include "../../../kernels/cuda/launch.h"
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

// A SpanTable with its device copy: the spans, and the chunk table of the
// multi-tensor launches.
class CudaSpanTable final : public SpanTable {
 public:
  CudaSpanTable(int ordinal, std::vector<ShardSpan> spans) : SpanTable(std::move(spans)) {
    const std::vector<ShardSpan>& sp = this->spans();
    std::vector<k::SpanChunk> chunks = k::span_chunks(sp.data(), sp.size());
    n_chunks_ = chunks.size();
    bind(ordinal);
    has_out_ = !sp.empty() && sp.front().out != nullptr;
    momentum_ = !sp.empty() && sp.front().state1 != nullptr;
    for (const ShardSpan& s : sp) {
      if ((s.out != nullptr) != has_out_ || (s.state1 != nullptr) != momentum_) {
        fail(FSDP_ERR_INTERNAL, "cuda device: a span table whose spans differ in having a params copy or state");
      }
    }
    upload(reinterpret_cast<void**>(&spans_), sp.data(), sp.size() * sizeof(ShardSpan));
    upload(reinterpret_cast<void**>(&chunks_), chunks.data(), chunks.size() * sizeof(k::SpanChunk));
  }
  ~CudaSpanTable() override {
    cudaFree(spans_);  // synchronizes: no launch may still read them
    cudaFree(chunks_);
  }
  CudaSpanTable(const CudaSpanTable&) = delete;
  CudaSpanTable& operator=(const CudaSpanTable&) = delete;

  const ShardSpan* spans_dev() const { return spans_; }
  const k::SpanChunk* chunks() const { return chunks_; }
  size_t n_chunks() const { return n_chunks_; }
  bool has_out() const { return has_out_; }
  bool momentum() const { return momentum_; }

 private:
  static void upload(void** dst, const void* src, size_t nbytes) {
    if (nbytes == 0) return;
    check(cudaMalloc(dst, nbytes), "cudaMalloc (span table)");
    check(cudaMemcpy(*dst, src, nbytes, cudaMemcpyHostToDevice), "uploading the span table");
  }

  ShardSpan* spans_ = nullptr;
  k::SpanChunk* chunks_ = nullptr;
  size_t n_chunks_ = 0;
  bool has_out_ = false;
  bool momentum_ = false;
};

void CUDART_CB write_host_result(void* arg) {  // no CUDA calls allowed here
  auto* r = static_cast<HostResult*>(arg);
  *r->dst = *r->pinned;
  r->dev->give_pinned(r->pinned);
  delete r;
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
  // Freed blocks stay in the pool for the next cudaMallocAsync instead of
  // going back to the driver at each synchronization.
  cudaMemPool_t pool = nullptr;
  check(cudaDeviceGetDefaultMemPool(&pool, ordinal_), "cudaDeviceGetDefaultMemPool");
  uint64_t keep = std::numeric_limits<uint64_t>::max();
  check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), "setting the pool's release threshold");
  ops_ = std::make_unique<CudaStream>(ordinal_, "device operations", 0, StreamHooks{});
}

CudaDevice::~CudaDevice() {
  if (cudaSetDevice(ordinal_) == cudaSuccess) cudaDeviceSynchronize();
  callers_.clear();
  ops_.reset();
  for (void* b : pinned_blocks_) cudaFreeHost(b);
}

std::unique_ptr<Stream> CudaDevice::create_stream(std::string name, int priority, StreamHooks hooks) {
  return std::make_unique<CudaStream>(ordinal_, std::move(name), priority, std::move(hooks));
}

Stream& CudaDevice::caller_stream(void* native, const char* call) {
  auto s = static_cast<cudaStream_t>(native);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = callers_.find(s);
  if (it != callers_.end()) return *it->second;
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
  cudaError_t e = cudaMallocAsync(&p, nbytes == 0 ? 1 : nbytes, target());
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // not sticky: clear it
    fail(FSDP_ERR_OUT_OF_MEMORY,
         "cuda device: could not allocate " + std::to_string(nbytes) + " bytes on cuda:" + std::to_string(ordinal_));
  }
  issued(e, "cudaMallocAsync");
  return p;
}

void CudaDevice::free(void* ptr) noexcept {
  if (ptr == nullptr) return;
  if (cudaSetDevice(ordinal_) != cudaSuccess) return;
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
  std::lock_guard<std::mutex> lock(mu_);
  if (pinned_free_.empty()) {
    void* block = nullptr;
    check(cudaMallocHost(&block, kPinnedPerBlock * sizeof(double)), "cudaMallocHost (result scalars)");
    pinned_blocks_.push_back(block);
    for (size_t i = 0; i < kPinnedPerBlock; ++i) pinned_free_.push_back(static_cast<double*>(block) + i);
  }
  double* p = pinned_free_.back();
  pinned_free_.pop_back();
  return p;
}

void CudaDevice::give_pinned(double* p) {
  std::lock_guard<std::mutex> lock(mu_);
  pinned_free_.push_back(p);
}

void CudaDevice::queue_sum_squares(const float* x, size_t numel, double* out_dev, cudaStream_t s) {
  size_t scratch_nbytes = k::sum_squares_scratch_nbytes(numel);
  void* scratch = nullptr;
  check(cudaMallocAsync(&scratch, scratch_nbytes == 0 ? 1 : scratch_nbytes, s), "cudaMallocAsync (norm scratch)");
  check(k::sum_squares(x, numel, out_dev, scratch, s), "sum of squares");
  check(cudaFreeAsync(scratch, s), "cudaFreeAsync (norm scratch)");
}

void CudaDevice::queue_squares_to_host(const float* x, size_t numel, double* host_dst, cudaStream_t s) {
  double* sq = nullptr;
  check(cudaMallocAsync(reinterpret_cast<void**>(&sq), sizeof(double), s), "cudaMallocAsync (result)");
  queue_sum_squares(x, numel, sq, s);
  double* pinned = take_pinned();
  check(cudaMemcpyAsync(pinned, sq, sizeof(double), cudaMemcpyDeviceToHost, s), "copying a result to the host");
  check(cudaFreeAsync(sq, s), "cudaFreeAsync (result)");
  check(cudaLaunchHostFunc(s, write_host_result, new HostResult{this, pinned, host_dst}), "cudaLaunchHostFunc");
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
  return std::make_unique<CudaSpanTable>(ordinal_, std::move(spans));
}

void CudaDevice::adam_spans(const SpanTable& table, const kernels::AdamOp& op, float lr, bool decoupled,
                            DType out_dtype, bool zero_grads) {
  const auto& t = dynamic_cast<const CudaSpanTable&>(table);
  bind(ordinal_);
  issued(k::adam_spans(t.spans_dev(), t.chunks(), t.n_chunks(), op, lr, decoupled, t.has_out(), code(out_dtype),
                       zero_grads, target()),
         "adam (multi-tensor)");
}

void CudaDevice::sgd_spans(const SpanTable& table, const kernels::SgdOp& op, DType out_dtype, bool zero_grads) {
  const auto& t = dynamic_cast<const CudaSpanTable&>(table);
  bind(ordinal_);
  issued(k::sgd_spans(t.spans_dev(), t.chunks(), t.n_chunks(), op, t.momentum(), t.has_out(), code(out_dtype),
                      zero_grads, target()),
         "sgd (multi-tensor)");
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
