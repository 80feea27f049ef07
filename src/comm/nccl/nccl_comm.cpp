// src/comm/nccl/nccl_comm.cpp - see nccl_comm.h.
#include "nccl_comm.h"

#include <algorithm>
#include <cstring>

#include "../../base/error.h"
#include "../../base/spin.h"
#include "../../base/text.h"
#include "../split.h"
#include "nccl_check.h"

namespace fsdp::comm {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kWatchEvery{5};
constexpr std::chrono::milliseconds kIdleWatchEvery{50};

ncclRedOp_t nccl_op(RedOp op) {
  switch (op) {
    case RedOp::kSum:
      return ncclSum;
    case RedOp::kAvg:
      return ncclAvg;  // NCCL averages in the collective itself: no pass of our own
    case RedOp::kMax:
      return ncclMax;
    case RedOp::kMin:
      return ncclMin;
  }
  return ncclSum;
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kFp32:
      return ncclFloat32;
    case DType::kBf16:
      return ncclBfloat16;
    case DType::kFp16:
      return ncclFloat16;
  }
  return ncclFloat32;
}

int64_t now_ns() {
  int64_t t = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
  return t == 0 ? 1 : t;  // 0 means "no call"
}

// A formation call of the non-blocking `parent`: a split into `*child`
// (null for another kind of call). Polls until it is complete, until
// `deadline` (then ncclInProgress is returned). NCCL 2.28 (seen on an H100
// and an H200) returns ncclSuccess from a split of a non-blocking
// communicator at once, the parent's state reads ncclSuccess, and the child
// appears in *child some milliseconds later, written by NCCL's own thread:
// so the split is complete once the child is there and neither it nor the
// parent is in progress. An error of either ends the wait.
ncclResult_t settle_formation(ncclResult_t r, ncclComm_t parent, ncclComm_t* child, Clock::time_point deadline,
                              double timeout_s) {
  for (;;) {
    if (r != ncclSuccess && r != ncclInProgress) return r;
    ncclComm_t c = child != nullptr ? __atomic_load_n(child, __ATOMIC_ACQUIRE) : nullptr;
    ncclResult_t a = ncclSuccess, b = ncclSuccess;
    if (nccl().CommGetAsyncError(parent, &a) != ncclSuccess) return ncclInternalError;
    if (c != nullptr && nccl().CommGetAsyncError(c, &b) != ncclSuccess) return ncclInternalError;
    if (a != ncclSuccess && a != ncclInProgress) return a;
    if (b != ncclSuccess && b != ncclInProgress) return b;
    if (a == ncclSuccess && b == ncclSuccess && (child == nullptr || c != nullptr)) return ncclSuccess;
    if (timeout_s > 0 && Clock::now() > deadline) return ncclInProgress;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    r = ncclInProgress;
  }
}

// Splits the non-blocking `parent` (bounded by timeout_s). The child's slot
// is on the heap: a split that has not finished by the deadline may still
// write it, so then the slot is left to it (a pointer's worth, once, on a
// failing rank) rather than freed under NCCL's thread.
ncclResult_t split_bounded(ncclComm_t parent, int color, int key, ncclConfig_t* config, double timeout_s,
                           ncclComm_t* out) {
  auto* slot = new ncclComm_t(nullptr);
  auto deadline = base::deadline_after(timeout_s);
  ncclResult_t r = nccl().CommSplit(parent, color, key, slot, config);
  r = settle_formation(r, parent, slot, deadline, timeout_s);
  if (r == ncclInProgress) return r;  // NOLINT(clang-analyzer-cplusplus.NewDeleteLeaks): see above
  *out = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
  delete slot;
  return r;
}

}  // namespace

NcclComm::Call::Call(NcclComm& c, bool watched) : c_(c), lock_(c.comm_mu_), watched_(watched) {
  if (c_.aborted_) {
    lock_.unlock();
    c_.throw_failure();
  }
  if (watched_) c_.call_since_ns_.store(now_ns());
}

NcclComm::Call::~Call() {
  if (watched_) c_.call_since_ns_.store(0);
  lock_.unlock();
  c_.abort_if_requested();  // asked for while this call was inside NCCL
}

NcclComm::NcclComm(ncclComm_t formed, int ordinal, std::vector<int> world_ranks, int local_world, double timeout_s)
    : ctrl_(formed),
      ordinal_(ordinal),
      world_ranks_(std::move(world_ranks)),
      local_world_(local_world),
      timeout_s_(timeout_s) {
  // What was formed goes (aborted: peers may be gone) if this does not finish.
  auto give_up = [&](fsdp_status_t status, const std::string& message) {
    if (comm_ != nullptr) nccl().CommAbort(comm_);
    nccl().CommAbort(ctrl_);
    if (own_ != nullptr) cudaStreamDestroy(own_);
    fail(status, message);
  };
  cudaError_t e = cudaSetDevice(ordinal_);
  if (e != cudaSuccess)
    give_up(FSDP_ERR_COMM, std::string("nccl communicator: cudaSetDevice failed: ") + cudaGetErrorString(e));
  int r = 0;
  ncclResult_t res = nccl().CommUserRank(ctrl_, &r);
  if (res != ncclSuccess) give_up(FSDP_ERR_COMM, "nccl: ncclCommUserRank failed: " + nccl_describe(res, nullptr));
  rank_ = r;
  // The blocking data communicator: one NCCL group of the same ranks in the
  // same order, formed by a split of the non-blocking one (bounded).
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  res = split_bounded(ctrl_, 0, rank_, &config, timeout_s_, &comm_);
  const std::string who =
      "rank " + std::to_string(world_ranks_[static_cast<size_t>(rank_)]) + " of " + std::to_string(world_ranks_.size());
  if (res == ncclInProgress) {
    give_up(FSDP_ERR_TIMEOUT, "nccl communicator (" + who + "): forming its blocking data communicator did not " +
                                  "complete within timeout_s = " + base::format_double(timeout_s_) +
                                  " s: a rank did not take part (it may have failed)");
  }
  if (res != ncclSuccess) {
    give_up(FSDP_ERR_COMM, "nccl communicator (" + who +
                               "): forming its blocking data communicator failed: " + nccl_describe(res, nullptr));
  }
  e = cudaStreamCreateWithFlags(&own_, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&staged_done_, cudaEventDisableTiming);
  if (e != cudaSuccess) {
    give_up(FSDP_ERR_COMM, std::string("nccl communicator: creating its stream failed: ") + cudaGetErrorString(e));
  }
  watchdog_ = std::thread([this] { watch(); });
}

NcclComm::~NcclComm() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  watchdog_.join();
  cudaSetDevice(ordinal_);
  {
    std::lock_guard<std::mutex> lock(comm_mu_);
    if (aborted_) {
      // ncclCommAbort released them.
    } else if (failure_.load() != FSDP_OK) {
      nccl().CommAbort(comm_);  // a failed communicator cannot finalize: its peers may be gone
      nccl().CommAbort(ctrl_);
    } else {
      // Local, as every destroy: queued work finishes on the device first.
      cudaStreamSynchronize(own_);
      nccl().CommDestroy(comm_);
      nccl().CommDestroy(ctrl_);
    }
    aborted_ = true;
  }
  for (size_t i = 0; i < in_flight_.size(); ++i) {  // legal while pending: CUDA releases them once they complete
    cudaEventDestroy(in_flight_[i].start);
    cudaEventDestroy(in_flight_[i].done);
  }
  for (cudaEvent_t ev : events_) cudaEventDestroy(ev);
  if (staged_pending_) cudaEventSynchronize(staged_done_);  // its copies use the staging memory
  cudaEventDestroy(staged_done_);
  if (scratch_ != nullptr) cudaFree(scratch_);
  if (pinned_ != nullptr) cudaFreeHost(pinned_);
  cudaStreamDestroy(own_);
}

bool NcclComm::attach_data_plane(std::shared_ptr<DataPlane> plane) {
  plane_ = std::move(plane);
  return true;
}

cudaStream_t NcclComm::stream() const {
  void* s = plane_ != nullptr ? plane_->native_stream() : nullptr;
  return s != nullptr ? static_cast<cudaStream_t>(s) : own_;
}

void NcclComm::fail_with(fsdp_status_t status, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  fsdp_status_t ok = FSDP_OK;
  if (failure_.compare_exchange_strong(ok, status)) reason_ = reason;
}

void NcclComm::throw_failure() {
  std::lock_guard<std::mutex> lock(mu_);
  fail(failure_.load(),
       "nccl communicator (rank " + std::to_string(world_ranks_[static_cast<size_t>(rank_)]) + "): " + reason_);
}

void NcclComm::abort_locked() {
  if (aborted_) return;
  aborted_ = true;
  abort_requested_.store(false);
  cudaSetDevice(ordinal_);
  // Also wakes NCCL kernels waiting for peers; both communicators are freed.
  nccl().CommAbort(comm_);
  nccl().CommAbort(ctrl_);
}

void NcclComm::request_abort() {
  abort_requested_.store(true);
  abort_if_requested();
}

void NcclComm::abort_if_requested() {
  if (!abort_requested_.load()) return;
  // Whoever holds comm_mu_ now checks again when it lets go.
  std::unique_lock<std::mutex> lock(comm_mu_, std::try_to_lock);
  if (lock.owns_lock() && abort_requested_.exchange(false)) abort_locked();
}

void NcclComm::abort(const std::string& reason) {
  fail_with(FSDP_ERR_COMM, "aborted: " + reason);
  request_abort();
}

std::string NcclComm::describe(const char* kind, const std::string& label, uint64_t seq) {
  return label + " (" + kind + ", collective #" + std::to_string(seq) + ")";
}

uint64_t NcclComm::begin() {
  if (failure_.load() != FSDP_OK) throw_failure();
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess || current != ordinal_) {
    cuda_check(cudaSetDevice(ordinal_), "cudaSetDevice");
  }
  return ++seq_;
}

cudaEvent_t NcclComm::take_event() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!events_.empty()) {
      cudaEvent_t ev = events_.back();
      events_.pop_back();
      return ev;
    }
  }
  cudaEvent_t ev = nullptr;
  cuda_check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  std::lock_guard<std::mutex> lock(mu_);
  if (events_.capacity() < ++events_made_) events_.reserve(2 * events_made_);  // give_event never allocates
  return ev;
}

void NcclComm::give_event(cudaEvent_t ev) {
  std::lock_guard<std::mutex> lock(mu_);
  events_.push_back(ev);
}

template <typename Fn>
void NcclComm::collective(const char* kind, const std::string& label, uint64_t seq, cudaStream_t s, Fn&& call) {
  // Into a CUDA graph capture, the collective runs when the graph is
  // launched, and an event recorded in a capture cannot be queried: it is
  // queued unwatched (a graph's collective that hangs is the host's to time
  // out, docs/gpu.md).
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const bool watched = !(cudaStreamIsCapturing(s, &capture) == cudaSuccess && capture != cudaStreamCaptureStatusNone);
  InFlight f;
  if (watched) {
    f.start = take_event();
    f.done = take_event();
  }
  f.kind = kind;
  f.seq = seq;
  ncclResult_t r = ncclSuccess;
  cudaError_t e = watched ? cudaEventRecord(f.start, s) : cudaSuccess;
  auto give_back = [&] {
    if (!watched) return;
    give_event(f.start);
    give_event(f.done);
  };
  try {
    if (e == cudaSuccess) {
      Call guard(*this);
      r = call(comm_, s);
      if (r == ncclInProgress) {  // not from a blocking communicator; waited out all the same
        auto deadline = base::deadline_after(timeout_s_);
        while (r == ncclInProgress && (timeout_s_ <= 0 || Clock::now() < deadline)) {
          std::this_thread::yield();
          if (nccl().CommGetAsyncError(comm_, &r) != ncclSuccess) break;
        }
      }
      if (r == ncclSuccess && watched) e = cudaEventRecord(f.done, s);
    }
  } catch (...) {
    give_back();
    throw;
  }
  if (r != ncclSuccess || e != cudaSuccess) {
    give_back();
    if (r != ncclSuccess) {
      fail_with(FSDP_ERR_COMM, describe(kind, label, seq) +
                                   (r == ncclInProgress ? " was not queued within timeout_s" : " failed: ") +
                                   (r == ncclInProgress ? std::string() : nccl_describe(r, nullptr)));
      if (r == ncclInProgress) request_abort();
      throw_failure();
    }
    cuda_check(e, "queueing " + describe(kind, label, seq));
  }
  if (!watched) return;
  size_t n = std::min(label.size(), sizeof f.label - 4);
  std::memcpy(f.label, label.data(), n);
  if (n < label.size()) std::memcpy(f.label + n, "...", 3);
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_.push_back(std::move(f));
  }
  cv_.notify_all();
}

void NcclComm::watch() {
  cudaSetDevice(ordinal_);
  // Its queries are of events outside every CUDA graph capture (collectives
  // queued into one are not watched): in the default capture mode they would
  // fail, and invalidate a capture the host has open on another thread.
  cudaStreamCaptureMode relaxed = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&relaxed);
  const auto timeout = std::chrono::duration<double>(timeout_s_);
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    bool busy = !in_flight_.empty() || call_since_ns_.load() != 0;
    cv_.wait_for(lock, busy ? kWatchEvery : kIdleWatchEvery, [this] { return stop_; });
    if (stop_) break;
    abort_if_requested();  // one asked for while comm_mu_ was held is not lost
    // A call that stays inside NCCL: a blocking collective that connects to
    // a peer the first time it needs it, and the peer does not come. It
    // cannot be aborted under the caller (NCCL frees the communicator); the
    // failure is reported now and the abort made as the call returns.
    int64_t since = call_since_ns_.load();
    if (since != 0 && timeout_s_ > 0 && failure_.load() == FSDP_OK &&
        std::chrono::nanoseconds(now_ns() - since) > timeout) {
      lock.unlock();
      fail_with(FSDP_ERR_TIMEOUT,
                "an NCCL call has not returned within timeout_s = " + base::format_double(timeout_s_) +
                    " s: it waits for a rank that does not come (NCCL connects to a peer when a "
                    "collective first needs it); the communicator is aborted when the call returns");
      request_abort();
      lock.lock();
    }
    // The oldest collective first: NCCL runs them in order.
    while (!in_flight_.empty()) {
      InFlight& f = in_flight_.front();
      cudaError_t q = cudaEventQuery(f.done);
      if (q == cudaErrorNotReady) {
        // After a failure only events are queried: the communicators may be
        // gone, and the aborted collectives quit on their own.
        if (failure_.load() != FSDP_OK) break;
        if (!f.seen_started && cudaEventQuery(f.start) == cudaSuccess) {
          f.seen_started = true;
          f.started = Clock::now();
        }
        ncclResult_t async = ncclSuccess;
        {
          std::unique_lock<std::mutex> call(comm_mu_, std::try_to_lock);  // never waits for a call in progress
          if (call.owns_lock() && !aborted_) nccl().CommGetAsyncError(comm_, &async);
        }
        abort_if_requested();
        std::string reason;
        fsdp_status_t status = FSDP_OK;
        if (async != ncclSuccess && async != ncclInProgress) {
          status = FSDP_ERR_COMM;
          reason = describe(f.kind, f.label, f.seq) + " failed in NCCL: " + nccl_describe(async, nullptr);
        } else if (timeout_s_ > 0 && f.seen_started && Clock::now() - f.started > timeout) {
          status = FSDP_ERR_TIMEOUT;
          reason = describe(f.kind, f.label, f.seq) +
                   " did not complete within timeout_s = " + base::format_double(timeout_s_) +
                   " s of the stream reaching it (a rank may have failed or stopped calling collectives); the NCCL "
                   "communicator was aborted";
        }
        if (status != FSDP_OK) {
          lock.unlock();
          fail_with(status, reason);
          request_abort();
          lock.lock();
        }
        break;
      }
      if (q != cudaSuccess) {
        std::string what = describe(f.kind, f.label, f.seq);
        lock.unlock();
        fail_with(FSDP_ERR_COMM, what + " failed on the GPU: " + std::string(cudaGetErrorString(q)));
        lock.lock();
      }
      // The front may have moved while the lock was down: only the watchdog pops.
      InFlight& done = in_flight_.front();
      events_.push_back(done.start);
      events_.push_back(done.done);
      in_flight_.pop_front();
    }
  }
}

void NcclComm::ensure_staging(size_t nbytes) {
  if (nbytes <= staging_nbytes_) return;
  if (staged_pending_) cuda_check(cudaEventSynchronize(staged_done_), "waiting for the staging buffers");
  if (scratch_ != nullptr) cudaFree(scratch_);
  if (pinned_ != nullptr) cudaFreeHost(pinned_);
  scratch_ = nullptr;
  pinned_ = nullptr;
  staging_nbytes_ = 0;
  size_t n = std::max<size_t>(nbytes, 4096);
  cuda_check(cudaMalloc(&scratch_, n), "cudaMalloc (nccl staging buffer)");
  cuda_check(cudaHostAlloc(&pinned_, n, cudaHostAllocPortable), "cudaHostAlloc (nccl staging buffer)");
  staging_nbytes_ = n;
}

template <typename Fn>
void NcclComm::staged(const void* in, void* out, size_t in_nbytes, size_t out_nbytes, const char* kind,
                      const std::string& label, uint64_t seq, Fn&& body) {
  cudaStream_t s = stream();
  const size_t out_at = (in_nbytes + 255) / 256 * 256;
  ensure_staging(out_at + out_nbytes);
  char* host = static_cast<char*>(pinned_);
  char* dev = static_cast<char*>(scratch_);
  if (in_nbytes > 0) std::memcpy(host, in, in_nbytes);
  cudaError_t e = cudaMemcpyAsync(dev, host, in_nbytes, cudaMemcpyHostToDevice, s);
  if (e != cudaSuccess) cuda_check(e, "staging " + describe(kind, label, seq));
  collective(kind, label, seq, s, [&](ncclComm_t c, cudaStream_t st) { return body(dev, dev + out_at, c, st); });
  // Into pinned memory: the copy is asynchronous, so the wait below polls
  // (a copy into pageable memory would hold the host until the collective ends).
  e = cudaMemcpyAsync(host + out_at, dev + out_at, out_nbytes, cudaMemcpyDeviceToHost, s);
  if (e == cudaSuccess) e = cudaEventRecord(staged_done_, s);
  if (e != cudaSuccess) cuda_check(e, "staging " + describe(kind, label, seq));
  staged_pending_ = true;
  // The host reads the result now: wait for it, bounded, and give up (the
  // communicator is aborted) rather than hang.
  auto deadline = base::deadline_after(timeout_s_);
  for (;;) {
    e = cudaEventQuery(staged_done_);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) cuda_check(e, describe(kind, label, seq));
    if (failure_.load() != FSDP_OK) throw_failure();
    if (timeout_s_ > 0 && Clock::now() > deadline) {
      fail_with(FSDP_ERR_TIMEOUT, describe(kind, label, seq) + " did not complete within timeout_s = " +
                                      base::format_double(timeout_s_) + " s; the NCCL communicator was aborted");
      request_abort();
      throw_failure();
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  staged_pending_ = false;
  // An aborted collective completes too, with whatever its buffer held.
  if (failure_.load() != FSDP_OK) throw_failure();
  if (out_nbytes > 0) std::memcpy(out, host + out_at, out_nbytes);
}

void NcclComm::all_gather(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) {
  uint64_t seq = begin();
  if (plane_ != nullptr && plane_->owns(recv)) {
    collective("all_gather", label, seq, stream(), [&](ncclComm_t c, cudaStream_t s) {
      return nccl().AllGather(send, recv, nbytes_per_rank, ncclUint8, c, s);
    });
    return;
  }
  staged(send, recv, nbytes_per_rank, nbytes_per_rank * world_ranks_.size(), "all_gather", label, seq,
         [&](const void* in, void* out, ncclComm_t c, cudaStream_t s) {
           return nccl().AllGather(in, out, nbytes_per_rank, ncclUint8, c, s);
         });
}

void NcclComm::all_to_all(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) {
  uint64_t seq = begin();
  const size_t world = world_ranks_.size();
  // One send and one receive per peer, grouped into one operation.
  auto exchange = [&](const void* in, void* out, ncclComm_t c, cudaStream_t s) {
    ncclResult_t r = nccl().GroupStart();
    for (size_t p = 0; p < world && r == ncclSuccess; ++p) {
      r = nccl().Send(static_cast<const char*>(in) + p * nbytes_per_rank, nbytes_per_rank, ncclUint8,
                      static_cast<int>(p), c, s);
      if (r == ncclSuccess) {
        r = nccl().Recv(static_cast<char*>(out) + p * nbytes_per_rank, nbytes_per_rank, ncclUint8, static_cast<int>(p),
                        c, s);
      }
    }
    ncclResult_t end = nccl().GroupEnd();
    return r != ncclSuccess ? r : end;
  };
  if (plane_ != nullptr && plane_->owns(recv)) {
    collective("all_to_all", label, seq, stream(),
               [&](ncclComm_t c, cudaStream_t s) { return exchange(send, recv, c, s); });
    return;
  }
  staged(send, recv, nbytes_per_rank * world, nbytes_per_rank * world, "all_to_all", label, seq, exchange);
}

void NcclComm::reduce_scatter(const void* send, void* recv, size_t numel_per_rank, DType dtype, RedOp op,
                              const std::string& label) {
  uint64_t seq = begin();
  collective("reduce_scatter", label, seq, stream(), [&](ncclComm_t c, cudaStream_t s) {
    return nccl().ReduceScatter(send, recv, numel_per_rank, nccl_type(dtype), nccl_op(op), c, s);
  });
}

void NcclComm::reduce_scatter_clear(void* send, void* recv, size_t numel_per_rank, DType dtype, RedOp op,
                                    const std::string& label) {
  reduce_scatter(send, recv, numel_per_rank, dtype, op, label);
  size_t nbytes = numel_per_rank * world_ranks_.size() * dtype_size(dtype);
  cudaError_t e = cudaMemsetAsync(send, 0, nbytes, stream());
  if (e != cudaSuccess) cuda_check(e, "clearing the grads after " + label);
}

void NcclComm::all_reduce(const void* send, void* recv, size_t numel, DType dtype, RedOp op, const std::string& label) {
  uint64_t seq = begin();
  collective("all_reduce", label, seq, stream(), [&](ncclComm_t c, cudaStream_t s) {
    return nccl().AllReduce(send, recv, numel, nccl_type(dtype), nccl_op(op), c, s);
  });
}

void NcclComm::sum_f64(const double* send, double* recv, size_t n, const std::string& label) {
  if (plane_ == nullptr || !plane_->owns(recv)) {
    Communicator::sum_f64(send, recv, n, label);  // host memory: staged, as all_reduce_f64
    return;
  }
  // Device memory: queued on the stream, no host wait (NCCL's order of the
  // sum, the same bits on every rank).
  uint64_t seq = begin();
  collective("sum_f64", label, seq, stream(), [&](ncclComm_t c, cudaStream_t s) {
    return nccl().AllReduce(send, recv, n, ncclFloat64, ncclSum, c, s);
  });
}

void NcclComm::all_reduce_f64(double* values, size_t n, RedOp op, const std::string& label) {
  uint64_t seq = begin();
  staged(values, values, n * sizeof(double), n * sizeof(double), "all_reduce_f64", label, seq,
         [&](const void* in, void* out, ncclComm_t c, cudaStream_t s) {
           return nccl().AllReduce(in, out, n, ncclFloat64, nccl_op(op), c, s);
         });
}

void NcclComm::broadcast(void* buf, size_t nbytes, int root, const std::string& label) {
  uint64_t seq = begin();
  if (plane_ != nullptr && plane_->owns(buf)) {
    collective("broadcast", label, seq, stream(),
               [&](ncclComm_t c, cudaStream_t s) { return nccl().Broadcast(buf, buf, nbytes, ncclUint8, root, c, s); });
    return;
  }
  staged(buf, buf, nbytes, nbytes, "broadcast", label, seq,
         [&](const void* in, void* out, ncclComm_t c, cudaStream_t s) {
           return nccl().Broadcast(in, out, nbytes, ncclUint8, root, c, s);
         });
}

void NcclComm::barrier(const std::string& label) {
  double one = 1.0;
  all_reduce_f64(&one, 1, RedOp::kSum, label + " (barrier)");
}

std::unique_ptr<Communicator> NcclComm::split(int color, int key, const std::string& label) {
  uint64_t seq = begin();
  const std::string what = describe("split", label, seq);
  // The members' world ranks, for messages: every rank's (color, key).
  int64_t mine[2] = {color, key};
  std::vector<int64_t> all(2 * world_ranks_.size());
  all_gather(mine, all.data(), sizeof mine, label + " (members)");
  std::vector<int> members = split_members(all, color);
  std::vector<int> names;
  for (int m : members) names.push_back(world_ranks_[static_cast<size_t>(m)]);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // a formation communicator, as the world's
  ncclComm_t child = nullptr;
  ncclResult_t r = ncclSuccess;
  {
    Call guard(*this, /*watched=*/false);  // bounded here
    r = split_bounded(ctrl_, color, key, &config, timeout_s_, &child);
    if (r != ncclSuccess && child != nullptr) nccl().CommAbort(child);
  }
  if (r == ncclInProgress) {
    fail_with(FSDP_ERR_TIMEOUT,
              what + " did not complete within timeout_s = " + base::format_double(timeout_s_) + " s");
    request_abort();
    throw_failure();
  }
  if (r != ncclSuccess) {
    fail_with(FSDP_ERR_COMM, what + " failed: " + nccl_describe(r, nullptr));
    throw_failure();
  }
  // The ranks of one host stay together in a split (shard groups are runs
  // of consecutive ranks): at most this host's share.
  int local = std::min<int>(local_world_, static_cast<int>(names.size()));
  auto out = std::make_unique<NcclComm>(child, ordinal_, std::move(names), local, timeout_s_);
  out->attach_data_plane(plane_);
  return out;
}

}  // namespace fsdp::comm
