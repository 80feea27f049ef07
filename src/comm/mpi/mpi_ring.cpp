// src/comm/mpi/mpi_ring.cpp - MpiComm's point-to-point algorithms (see
// mpi_comm.h): the ring exchange and the ring reduce-scatter and all-gather
// built on it, and the pairwise all-to-all; all in pieces MPI's int counts
// can carry. They run inside a collective (after its check-in); a peer that
// stalls is a timeout naming it (wait_data).
#include <algorithm>
#include <cstring>

#include "../reduce.h"
#include "mpi_comm.h"
#include "mpi_env.h"

namespace fsdp::comm {

void MpiComm::ring_exchange(const void* send, size_t send_nbytes, void* recv, size_t recv_nbytes) {
  int next = (rank_ + 1) % world_;
  int prev = (rank_ + world_ - 1) % world_;
  std::vector<MPI_Request> reqs;
  {
    auto guard = mpi::lock();
    for (size_t off = 0; off < recv_nbytes; off += kMaxPiece) {
      reqs.push_back(MPI_REQUEST_NULL);
      MPI_Irecv(static_cast<char*>(recv) + off, as_count(std::min(kMaxPiece, recv_nbytes - off)), MPI_BYTE, prev,
                kTagData, comm_, &reqs.back());
    }
    for (size_t off = 0; off < send_nbytes; off += kMaxPiece) {
      reqs.push_back(MPI_REQUEST_NULL);
      MPI_Isend(static_cast<const char*>(send) + off, as_count(std::min(kMaxPiece, send_nbytes - off)), MPI_BYTE, next,
                kTagData, comm_, &reqs.back());
    }
  }
  wait_data(reqs, prev);
}

void MpiComm::ring_reduce_scatter(const void* send, void* out, const std::vector<size_t>& first, DType dtype,
                                  float scale, bool clear) {
  const size_t es = dtype_size(dtype);
  const auto len = [&](int c) { return first[static_cast<size_t>(c) + 1] - first[static_cast<size_t>(c)]; };
  const auto own = [&](int c) { return static_cast<const char*>(send) + first[static_cast<size_t>(c)] * es; };
  size_t max_len = 0;
  for (int c = 0; c < world_; ++c) max_len = std::max(max_len, len(c));
  char* partial = scratch(0, max_len * es);
  char* incoming = scratch(1, max_len * es);
  // Step k sends the partial sum of chunk (r-1-k) and receives that of chunk
  // (r-2-k), adding this rank's part; after world-1 steps chunk r is complete.
  int c_send = (rank_ + world_ - 1) % world_;
  for (int k = 0; k < world_ - 1; ++k) {
    int c_recv = (rank_ + 2 * world_ - 2 - k) % world_;
    ring_exchange(k == 0 ? own(c_send) : partial, len(c_send) * es, incoming, len(c_recv) * es);
    if (clear && k == 0) std::memset(const_cast<char*>(own(c_send)), 0, len(c_send) * es);  // sent: MPI is done with it
    const void* ins[2] = {incoming, own(c_recv)};
    bool last = k == world_ - 2;
    // The output may be this rank's own input (all_reduce in place): only
    // write there when it does not overlap what is read.
    bool direct = last && (static_cast<const char*>(out) + len(c_recv) * es <= own(c_recv) ||
                           static_cast<const char*>(out) >= own(c_recv) + len(c_recv) * es);
    reduce_sum(direct ? out : partial, ins, 2, len(c_recv), dtype, last ? scale : 1.0f);
    if (clear) std::memset(const_cast<char*>(own(c_recv)), 0, len(c_recv) * es);  // just read, still in cache
    if (last && !direct) std::memcpy(out, partial, len(c_recv) * es);
    c_send = c_recv;
  }
}

void MpiComm::ring_all_gather(void* buf, const std::vector<size_t>& first) {
  char* b = static_cast<char*>(buf);
  for (int k = 0; k < world_ - 1; ++k) {
    size_t c_send = static_cast<size_t>((rank_ + world_ - k) % world_);
    size_t c_recv = static_cast<size_t>((rank_ + 2 * world_ - k - 1) % world_);
    ring_exchange(b + first[c_send], first[c_send + 1] - first[c_send], b + first[c_recv],
                  first[c_recv + 1] - first[c_recv]);
  }
}

void MpiComm::pairwise_all_to_all(const void* send, void* recv, size_t nbytes) {
  const size_t mine = static_cast<size_t>(rank_) * nbytes;
  std::memcpy(static_cast<char*>(recv) + mine, static_cast<const char*>(send) + mine, nbytes);
  std::vector<MPI_Request> reqs;
  std::vector<int> peers;  // each request's
  {
    auto guard = mpi::lock();
    for (int k = 1; k < world_; ++k) {
      const int to = (rank_ + k) % world_, from = (rank_ + world_ - k) % world_;
      for (size_t off = 0; off < nbytes; off += kMaxPiece) {
        const int piece = as_count(std::min(kMaxPiece, nbytes - off));
        reqs.push_back(MPI_REQUEST_NULL);
        peers.push_back(from);
        MPI_Irecv(static_cast<char*>(recv) + static_cast<size_t>(from) * nbytes + off, piece, MPI_BYTE, from, kTagData,
                  comm_, &reqs.back());
        reqs.push_back(MPI_REQUEST_NULL);
        peers.push_back(to);
        MPI_Isend(static_cast<const char*>(send) + static_cast<size_t>(to) * nbytes + off, piece, MPI_BYTE, to,
                  kTagData, comm_, &reqs.back());
      }
    }
  }
  wait_data(reqs, (rank_ + world_ - 1) % world_, &peers);
}

}  // namespace fsdp::comm
