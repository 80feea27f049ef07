// src/comm/counting.cpp - see counting.h.
#include "counting.h"

namespace fsdp::comm {

void CountingComm::all_gather(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) {
  inner_->all_gather(send, recv, nbytes_per_rank, label);
  counters_->add(Collective::kAllGather, uint64_t(nbytes_per_rank) * uint64_t(world_size()), group_);
}

void CountingComm::reduce_scatter(const void* send, void* recv, size_t numel_per_rank, DType dtype, RedOp op,
                                  const std::string& label) {
  inner_->reduce_scatter(send, recv, numel_per_rank, dtype, op, label);
  counters_->add(Collective::kReduceScatter, uint64_t(numel_per_rank) * dtype_size(dtype) * uint64_t(world_size()),
                 group_);
}

void CountingComm::reduce_scatter_clear(void* send, void* recv, size_t numel_per_rank, DType dtype, RedOp op,
                                        const std::string& label) {
  inner_->reduce_scatter_clear(send, recv, numel_per_rank, dtype, op, label);
  counters_->add(Collective::kReduceScatter, uint64_t(numel_per_rank) * dtype_size(dtype) * uint64_t(world_size()),
                 group_);
}

void CountingComm::all_to_all(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) {
  inner_->all_to_all(send, recv, nbytes_per_rank, label);
  counters_->add(Collective::kAllToAll, uint64_t(nbytes_per_rank) * uint64_t(world_size()), group_);
}

void CountingComm::all_reduce(const void* send, void* recv, size_t numel, DType dtype, RedOp op,
                              const std::string& label) {
  inner_->all_reduce(send, recv, numel, dtype, op, label);
  counters_->add(Collective::kAllReduce, uint64_t(numel) * dtype_size(dtype), group_);
}

void CountingComm::all_reduce_f64(double* values, size_t n, RedOp op, const std::string& label) {
  inner_->all_reduce_f64(values, n, op, label);
  counters_->add(Collective::kControl, 0, group_);
}

void CountingComm::sum_f64(const double* send, double* recv, size_t n, const std::string& label) {
  inner_->sum_f64(send, recv, n, label);
  counters_->add(Collective::kControl, 0, group_);
}

void CountingComm::broadcast(void* buf, size_t nbytes, int root, const std::string& label) {
  inner_->broadcast(buf, nbytes, root, label);
  counters_->add(Collective::kBroadcast, nbytes, group_);
}

void CountingComm::barrier(const std::string& label) {
  inner_->barrier(label);
  counters_->add(Collective::kControl, 0, group_);
}

std::unique_ptr<Communicator> CountingComm::split(int color, int key, const std::string& label) {
  return std::make_unique<CountingComm>(inner_->split(color, key, label), counters_, group_);
}

}  // namespace fsdp::comm
