// The host's compute in tests, on the NULL stream or late: a test writes its
// compute (what reads params and writes grads) as Host::run calls and passes
// Host::stream() to every libfsdp call. Normally the compute runs at once on
// the calling thread, as a CPU framework's does. With the environment
// variable FSDP_TEST_LATE_HOST_US=N (the ".late" copies of the CTests), it is
// queued on a CPU host stream whose tasks start N us late, so every libfsdp
// call returns before the compute it must be ordered with has run, as on a
// GPU: only the events libfsdp records and waits for keep its gathers,
// reductions, frees, set_values and loads in order with that compute. Every
// suite that uses this helper runs whole in both modes (tests/CMakeLists.txt).
// White-box: making a host stream needs the CPU device (link fsdp_internal).
#ifndef FSDP_TESTS_HOST_STREAM_H
#define FSDP_TESTS_HOST_STREAM_H

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <utility>

#include "../src/core/context.h"
#include "../src/device/cpu/cpu_device.h"
#include "fsdp.h"

namespace fsdp_test {

// The late host stream's delay from the environment, in us (0: not late).
inline int late_host_us() {
  const char* v = std::getenv("FSDP_TEST_LATE_HOST_US");
  return v == nullptr ? 0 : std::atoi(v);
}

// Skips the calling test in the late mode, saying why (a test that has no
// host compute to make late, or whose point needs the NULL stream).
#define FSDP_SKIP_WHEN_LATE(why)                                                  \
  do {                                                                            \
    if (::fsdp_test::late_host_us() > 0) GTEST_SKIP() << "not run late: " << why; \
  } while (0)

class Host {
 public:
  Host() = default;
  // For the context `ctx`; `delay_us` < 0 takes the environment's.
  explicit Host(fsdp_ctx_t* ctx, int delay_us = -1) { attach(ctx, delay_us); }
  ~Host() { drain(); }
  Host(const Host&) = delete;
  Host& operator=(const Host&) = delete;

  void attach(fsdp_ctx_t* ctx, int delay_us = -1) {
    drain();
    stream_ = nullptr;
    int us = delay_us < 0 ? late_host_us() : delay_us;
    if (us <= 0 || ctx == nullptr) return;
    auto* dev = dynamic_cast<fsdp::device::CpuDevice*>(&reinterpret_cast<fsdp::core::Context*>(ctx)->device());
    if (dev == nullptr) return;  // not the CPU device: the NULL stream
    stream_ = dev->create_host_stream(std::chrono::microseconds(us));
  }
  bool late() const { return stream_ != nullptr; }
  // The API's stream argument: NULL, or the late host stream.
  void* stream() const { return stream_; }
  // The compute: now, or queued on the late stream (its captures must stay
  // valid until it runs: capture by value, or sync() before they go).
  template <typename F>
  void run(F&& f) {
    if (stream_ == nullptr) {
      f();
    } else {
      static const fsdp::device::Label kName = fsdp::device::make_label("host compute");
      stream_->submit(kName, std::forward<F>(f));
    }
  }
  // Waits until the queued compute has run (before the host thread reads what
  // it computed); the late stream's failure, if any, fails the test.
  void sync() {
    if (stream_ == nullptr) return;
    try {
      stream_->synchronize(0);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "the late host stream failed: " << e.what();
    }
  }

 private:
  void drain() {
    if (stream_ == nullptr) return;
    try {
      stream_->synchronize(0);
    } catch (...) {  // reported by the call that waited on it
    }
  }
  fsdp::device::Stream* stream_ = nullptr;
};

}  // namespace fsdp_test

#endif  // FSDP_TESTS_HOST_STREAM_H
