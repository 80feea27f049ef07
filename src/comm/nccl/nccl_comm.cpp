// src/comm/nccl/nccl_comm.cpp - see nccl_comm.h.
#include "nccl_comm.h"

#include <algorithm>

#include "../../base/error.h"
#include "../../base/spin.h"
#include "../../base/text.h"
#include "../split.h"
#include "nccl_check.h"

namespace fsdp::comm {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kWatchEvery{5};

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

}  // namespace

NcclComm::NcclComm(ncclComm_t comm, int ordinal, std::vector<int> world_ranks, int local_world, double timeout_s)
    : comm_(comm),
      ordinal_(ordinal),
      world_ranks_(std::move(world_ranks)),
      local_world_(local_world),
      timeout_s_(timeout_s) {
  int r = 0;
  nccl_check(nccl().CommUserRank(comm_, &r), "ncclCommUserRank");
  rank_ = r;
  cuda_check(cudaSetDevice(ordinal_), "cudaSetDevice");
  cuda_check(cudaStreamCreateWithFlags(&own_, cudaStreamNonBlocking), "creating the nccl communicator's stream");
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
  if (aborted_.load()) {
    // ncclCommAbort released it.
  } else if (failure_.load() != FSDP_OK) {
    nccl().CommAbort(comm_);  // a failed communicator cannot finalize: its peers may be gone
  } else {
    // Local, as every destroy: queued work finishes on the device first.
    cudaStreamSynchronize(own_);
    nccl().CommDestroy(comm_);
  }
  for (InFlight& f : in_flight_) cudaEventDestroy(f.done);
  if (scratch_ != nullptr) cudaFree(scratch_);
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

void NcclComm::abort(const std::string& reason) {
  fail_with(FSDP_ERR_COMM, "aborted: " + reason);
  if (!aborted_.exchange(true)) nccl().CommAbort(comm_);  // also wakes NCCL kernels waiting for peers
}

std::string NcclComm::begin(const char* kind, const std::string& label) {
  if (failure_.load() != FSDP_OK) throw_failure();
  cuda_check(cudaSetDevice(ordinal_), "cudaSetDevice");
  return label + " (" + kind + ", collective #" + std::to_string(++seq_) + ")";
}

void NcclComm::queued(ncclResult_t r, const std::string& what, cudaStream_t s) {
  // Non-blocking: the call may still be getting its work onto the stream.
  auto deadline = base::deadline_after(timeout_s_);
  while (r == ncclInProgress) {
    if (Clock::now() > deadline) {
      abort(what + " was not queued within timeout_s = " + base::format_double(timeout_s_) + " s");
      throw_failure();
    }
    std::this_thread::yield();
    if (nccl().CommGetAsyncError(comm_, &r) != ncclSuccess) break;
  }
  if (r != ncclSuccess) {
    fail_with(FSDP_ERR_COMM, what + " failed: " + nccl_describe(r, comm_));
    throw_failure();
  }
  cudaEvent_t done = nullptr;
  cuda_check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  cudaError_t e = cudaEventRecord(done, s);
  if (e != cudaSuccess) {
    cudaEventDestroy(done);
    cuda_check(e, "recording " + what);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_.push_back({done, what, Clock::now()});
  }
  cv_.notify_all();
}

void NcclComm::watch() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, kWatchEvery, [this] { return stop_ || !in_flight_.empty(); });
    if (stop_) break;
    // The oldest collective first: NCCL runs them in order.
    while (!in_flight_.empty()) {
      InFlight& f = in_flight_.front();
      cudaSetDevice(ordinal_);
      cudaError_t q = cudaEventQuery(f.done);
      if (q == cudaErrorNotReady) {
        double waited = std::chrono::duration<double>(Clock::now() - f.queued).count();
        ncclResult_t async = ncclSuccess;
        nccl().CommGetAsyncError(comm_, &async);
        std::string reason;
        fsdp_status_t status = FSDP_OK;
        if (async != ncclSuccess && async != ncclInProgress) {
          status = FSDP_ERR_COMM;
          reason = f.what + " failed in NCCL: " + nccl_describe(async, comm_);
        } else if (timeout_s_ > 0 && waited > timeout_s_) {
          status = FSDP_ERR_TIMEOUT;
          reason = f.what + " did not complete within timeout_s = " + base::format_double(timeout_s_) +
                   " s (a rank may have failed or stopped calling collectives); the NCCL communicator was aborted";
        }
        if (status != FSDP_OK) {
          lock.unlock();
          fail_with(status, reason);
          if (!aborted_.exchange(true)) nccl().CommAbort(comm_);
          lock.lock();
        }
        break;
      }
      if (q != cudaSuccess) {
        std::string what = f.what;
        lock.unlock();
        fail_with(FSDP_ERR_COMM, what + " failed on the GPU: " + std::string(cudaGetErrorString(q)));
        lock.lock();
      }
      cudaEventDestroy(f.done);
      in_flight_.pop_front();
    }
  }
}

void* NcclComm::scratch(size_t nbytes) {
  if (nbytes > scratch_nbytes_) {
    if (scratch_ != nullptr) {
      cuda_check(cudaStreamSynchronize(stream()), "waiting for the staging buffer");
      cudaFree(scratch_);
      scratch_ = nullptr;
      scratch_nbytes_ = 0;
    }
    cuda_check(cudaMalloc(&scratch_, nbytes), "cudaMalloc (nccl staging buffer)");
    scratch_nbytes_ = nbytes;
  }
  return scratch_;
}

void NcclComm::staged(const void* in, void* out, size_t in_nbytes, size_t out_nbytes, const std::string& what,
                      const std::function<ncclResult_t(const void*, void*, cudaStream_t)>& body) {
  cudaStream_t s = stream();
  char* buf = static_cast<char*>(scratch(in_nbytes + out_nbytes + 16));
  char* dev_out = buf + (in_nbytes + 15) / 16 * 16;
  cuda_check(cudaMemcpyAsync(buf, in, in_nbytes, cudaMemcpyHostToDevice, s), "staging " + what);
  queued(body(buf, dev_out, s), what, s);
  cuda_check(cudaMemcpyAsync(out, dev_out, out_nbytes, cudaMemcpyDeviceToHost, s), "staging " + what);
  // The host reads the result now: wait for it, bounded, and give up (the
  // watchdog aborts) rather than hang.
  auto deadline = base::deadline_after(timeout_s_);
  for (;;) {
    cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) cuda_check(e, what);
    if (failure_.load() != FSDP_OK) throw_failure();
    if (timeout_s_ > 0 && Clock::now() > deadline) {
      fail_with(FSDP_ERR_TIMEOUT, what + " did not complete within timeout_s = " + base::format_double(timeout_s_) +
                                      " s; the NCCL communicator was aborted");
      if (!aborted_.exchange(true)) nccl().CommAbort(comm_);
      throw_failure();
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void NcclComm::all_gather(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) {
  std::string what = begin("all_gather", label);
  if (plane_ != nullptr && plane_->owns(recv)) {
    cudaStream_t s = stream();
    queued(nccl().AllGather(send, recv, nbytes_per_rank, ncclUint8, comm_, s), what, s);
    return;
  }
  staged(send, recv, nbytes_per_rank, nbytes_per_rank * world_ranks_.size(), what,
         [&](const void* in, void* out, cudaStream_t s) {
           return nccl().AllGather(in, out, nbytes_per_rank, ncclUint8, comm_, s);
         });
}

void NcclComm::reduce_scatter(const void* send, void* recv, size_t numel_per_rank, DType dtype, RedOp op,
                              const std::string& label) {
  std::string what = begin("reduce_scatter", label);
  cudaStream_t s = stream();
  queued(nccl().ReduceScatter(send, recv, numel_per_rank, nccl_type(dtype), nccl_op(op), comm_, s), what, s);
}

void NcclComm::reduce_scatter_clear(void* send, void* recv, size_t numel_per_rank, DType dtype, RedOp op,
                                    const std::string& label) {
  reduce_scatter(send, recv, numel_per_rank, dtype, op, label);
  size_t nbytes = numel_per_rank * world_ranks_.size() * dtype_size(dtype);
  cuda_check(cudaMemsetAsync(send, 0, nbytes, stream()), "clearing the grads after " + label);
}

void NcclComm::all_reduce(const void* send, void* recv, size_t numel, DType dtype, RedOp op, const std::string& label) {
  std::string what = begin("all_reduce", label);
  cudaStream_t s = stream();
  queued(nccl().AllReduce(send, recv, numel, nccl_type(dtype), nccl_op(op), comm_, s), what, s);
}

void NcclComm::all_reduce_f64(double* values, size_t n, RedOp op, const std::string& label) {
  std::string what = begin("all_reduce_f64", label);
  staged(values, values, n * sizeof(double), n * sizeof(double), what, [&](const void* in, void* out, cudaStream_t s) {
    return nccl().AllReduce(in, out, n, ncclFloat64, nccl_op(op), comm_, s);
  });
}

void NcclComm::broadcast(void* buf, size_t nbytes, int root, const std::string& label) {
  std::string what = begin("broadcast", label);
  if (plane_ != nullptr && plane_->owns(buf)) {
    cudaStream_t s = stream();
    queued(nccl().Broadcast(buf, buf, nbytes, ncclUint8, root, comm_, s), what, s);
    return;
  }
  staged(buf, buf, nbytes, nbytes, what, [&](const void* in, void* out, cudaStream_t s) {
    return nccl().Broadcast(in, out, nbytes, ncclUint8, root, comm_, s);
  });
}

void NcclComm::barrier(const std::string& label) {
  double one = 1.0;
  all_reduce_f64(&one, 1, RedOp::kSum, label + " (barrier)");
}

std::unique_ptr<Communicator> NcclComm::split(int color, int key, const std::string& label) {
  std::string what = begin("split", label);
  // The members' world ranks, for messages: every rank's (color, key).
  int64_t mine[2] = {color, key};
  std::vector<int64_t> all(2 * world_ranks_.size());
  all_gather(mine, all.data(), sizeof mine, label + " (members)");
  std::vector<int> members = split_members(all, color);
  std::vector<int> names;
  for (int m : members) names.push_back(world_ranks_[static_cast<size_t>(m)]);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t child = nullptr;
  ncclResult_t r = nccl().CommSplit(comm_, color, key, &child, &config);
  auto deadline = base::deadline_after(timeout_s_);
  while (r == ncclInProgress && child != nullptr) {
    if (Clock::now() > deadline) {
      nccl().CommAbort(child);
      abort(what + " did not complete within timeout_s = " + base::format_double(timeout_s_) + " s");
      throw_failure();
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    if (nccl().CommGetAsyncError(child, &r) != ncclSuccess) break;
  }
  if (r != ncclSuccess) {
    fail_with(FSDP_ERR_COMM, what + " failed: " + nccl_describe(r, comm_));
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
