// src/core/sync_comm.h - SyncComm: a Communicator whose every call runs on the
// context's comm stream (a device::Stream) and waits for it there. Every
// collective of a context goes through that one stream, synchronous ones too,
// so all of them leave in program order, which is what keeps the ranks
// matched.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "../comm/communicator.h"
#include "../device/stream.h"
#include "fsdp.h"

namespace fsdp::core {

// A Communicator whose every call runs synchronously on the comm stream, so
// that it leaves in program order with the asynchronous ones. Alone (a world
// of one) nothing needs ordering against other ranks: calls run on the caller.
class SyncComm final : public comm::Communicator {
 public:
  SyncComm(device::Stream& stream, comm::Communicator& inner)
      : stream_(stream), inner_(inner), alone_(inner.world_size() == 1) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  void all_gather(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) override;
  void reduce_scatter(const void* send, void* recv, size_t numel_per_rank, DType dtype, comm::RedOp op,
                      const std::string& label) override;
  void reduce_scatter_clear(void* send, void* recv, size_t numel_per_rank, DType dtype, comm::RedOp op,
                            const std::string& label) override;
  void all_to_all(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) override;
  void all_reduce(const void* send, void* recv, size_t numel, DType dtype, comm::RedOp op,
                  const std::string& label) override;
  void all_reduce_f64(double* values, size_t n, comm::RedOp op, const std::string& label) override;
  void sum_f64(const double* send, double* recv, size_t n, const std::string& label) override;
  void broadcast(void* buf, size_t nbytes, int root, const std::string& label) override;
  void barrier(const std::string& label) override;
  // The new communicator is the inner kind: use it on the stream or wrap it.
  std::unique_ptr<comm::Communicator> split(int color, int key, const std::string& label) override;
  int local_world_size() const override { return inner_.local_world_size(); }
  fsdp_status_t failure() const override { return inner_.failure(); }
  void abort(const std::string& reason) override { inner_.abort(reason); }
  // The gathers' communicator and stream (core/context.cpp): each call first
  // meets the other ranks there too, with a barrier of its label queued
  // after the gathers issued before it. The gathers run apart from the other
  // collectives (a communicator of their own), so a rank whose host made
  // this call where another issued a gather would otherwise wait for it
  // until timeout_s; with the fence both fail at once, naming both calls.
  void set_fence(device::Stream* stream, comm::Communicator* comm) {
    fence_stream_ = stream;
    fence_ = comm;
  }

 private:
  template <typename Fn>
  void run(const std::string& label, const Fn& fn);
  // The stream task's name for `label`, made the first time it is seen: the
  // step's collectives ("grad norm", ...) name their tasks without allocating.
  const device::Label& task_label(const std::string& label);

  std::map<std::string, device::Label, std::less<>> labels_;  // used on the API's thread only
  device::Stream& stream_;
  comm::Communicator& inner_;
  bool alone_;
  device::Stream* fence_stream_ = nullptr;
  comm::Communicator* fence_ = nullptr;
};

}  // namespace fsdp::core
