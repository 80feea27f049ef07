// src/core/sync_comm.cpp - see sync_comm.h.
#include "sync_comm.h"

namespace fsdp::core {

const device::Label& SyncComm::task_label(const std::string& label) {
  auto it = labels_.find(label);
  if (it == labels_.end()) it = labels_.emplace(label, device::make_label(label)).first;
  return it->second;
}

template <typename Fn>
void SyncComm::run(const std::string& label, const Fn& fn) {
  if (alone_) {
    fn();
    return;
  }
  const device::Label& name = task_label(label);
  if (fence_ != nullptr) {
    comm::Communicator* fence = fence_;
    fence_stream_->submit(name, [fence, &label] { fence->barrier(label); })->wait(0);
  }
  stream_.submit(name, [&fn] { fn(); })->wait(0);  // the collective bounds itself (timeout_s)
}

void SyncComm::all_gather(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) {
  run(label, [&] { inner_.all_gather(send, recv, nbytes_per_rank, label); });
}
void SyncComm::reduce_scatter(const void* send, void* recv, size_t numel_per_rank, DType dtype, comm::RedOp op,
                              const std::string& label) {
  run(label, [&] { inner_.reduce_scatter(send, recv, numel_per_rank, dtype, op, label); });
}
void SyncComm::reduce_scatter_clear(void* send, void* recv, size_t numel_per_rank, DType dtype, comm::RedOp op,
                                    const std::string& label) {
  run(label, [&] { inner_.reduce_scatter_clear(send, recv, numel_per_rank, dtype, op, label); });
}
void SyncComm::all_to_all(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) {
  run(label, [&] { inner_.all_to_all(send, recv, nbytes_per_rank, label); });
}
void SyncComm::all_reduce(const void* send, void* recv, size_t numel, DType dtype, comm::RedOp op,
                          const std::string& label) {
  run(label, [&] { inner_.all_reduce(send, recv, numel, dtype, op, label); });
}
void SyncComm::all_reduce_f64(double* values, size_t n, comm::RedOp op, const std::string& label) {
  run(label, [&] { inner_.all_reduce_f64(values, n, op, label); });
}
void SyncComm::sum_f64(const double* send, double* recv, size_t n, const std::string& label) {
  run(label, [&] { inner_.sum_f64(send, recv, n, label); });
}
void SyncComm::broadcast(void* buf, size_t nbytes, int root, const std::string& label) {
  run(label, [&] { inner_.broadcast(buf, nbytes, root, label); });
}
void SyncComm::barrier(const std::string& label) {
  run(label, [&] { inner_.barrier(label); });
}
std::unique_ptr<comm::Communicator> SyncComm::split(int color, int key, const std::string& label) {
  std::unique_ptr<comm::Communicator> out;
  run(label, [&] { out = inner_.split(color, key, label); });
  return out;
}

}  // namespace fsdp::core
