// src/comm/tcp_exchange.h - the torchrun-style bootstrap: rank 0 hands a small
// blob (NCCL's unique id) to every other rank over TCP at MASTER_ADDR:
// MASTER_PORT, before any communicator exists. Plain sockets with a deadline
// on every step, so that a rank that never comes, an address that does not
// resolve and ranks that disagree on the world size all fail with a sentence
// naming what is missing, never a hang. Each peer sends a hello (magic,
// version, rank, world) and rank 0 answers with the blob or with the reason
// it refuses; a connection that does not speak the protocol is closed and
// the wait goes on.
#pragma once

#include <string>

namespace fsdp::comm {

struct TcpExchange {
  std::string host;  // MASTER_ADDR: a name or a numeric IPv4/IPv6 address
  int port = 0;      // MASTER_PORT, 1..65535
  int rank = 0;
  int world = 1;
  double timeout_s = 300;  // the whole exchange, from the call
};

// Rank 0: serves `blob` until every rank 1..world-1 has it, and returns it.
// Other ranks: connect (retrying while rank 0 is not listening yet), fetch
// and return the blob (`blob` is ignored). Throws INVALID_ARGUMENT for a bad
// host, port, rank or world; TIMEOUT naming the ranks that did not connect
// (rank 0) or the address that did not answer (the others); MISMATCH when
// ranks disagree on the world size or two claim one rank; COMM when the
// exchange breaks off.
std::string tcp_exchange_blob(const TcpExchange& x, const std::string& blob);

}  // namespace fsdp::comm
