// src/base/host_waits.h - the count of host-blocking waits: every time a
// context's call blocks the calling thread on a stream's or an event's work
// (fsdp_comm_stats' host_waits). The devices' waits note themselves here;
// an API call points the calling thread at its context's counter for the
// call (core's check_live; api's guard() clears it), so that waits on the
// streams' own threads, and a synchronous stream's waits, which are that
// stream's ordering rather than the host's, count nothing. A steady-state
// step pins it at zero (tests/test_host_waits.cpp).
#pragma once

#include <atomic>
#include <cstdint>

namespace fsdp::base {

// The calling thread's counter (null: its waits are not counted).
inline std::atomic<uint64_t>*& host_wait_counter() {
  thread_local std::atomic<uint64_t>* counter = nullptr;
  return counter;
}

// Depth of the scopes in which a wait is a synchronous stream's own.
inline int& stream_wait_depth() {
  thread_local int depth = 0;
  return depth;
}

// Called by each wait that blocks the host (an event's, a device's).
inline void note_host_wait() {
  std::atomic<uint64_t>* c = host_wait_counter();
  if (c != nullptr && stream_wait_depth() == 0) c->fetch_add(1, std::memory_order_relaxed);
}

// For its scope, the waits are those of a synchronous stream (the CPU's NULL
// stream, which is the calling thread itself), not the host's.
class StreamWaitScope {
 public:
  StreamWaitScope() { ++stream_wait_depth(); }
  ~StreamWaitScope() { --stream_wait_depth(); }
  StreamWaitScope(const StreamWaitScope&) = delete;
  StreamWaitScope& operator=(const StreamWaitScope&) = delete;
};

}  // namespace fsdp::base
