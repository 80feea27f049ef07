// src/base/error.h - the one exception type of the library: a status plus a
// sentence. Thrown inside, turned into fsdp_status_t + fsdp_last_error() at the
// C boundary (src/api/).
#pragma once

#include <new>
#include <stdexcept>
#include <string>

#include "fsdp.h"

namespace fsdp {

class Error : public std::runtime_error {
 public:
  Error(fsdp_status_t status, const std::string& message) : std::runtime_error(message), status_(status) {}
  fsdp_status_t status() const { return status_; }

 private:
  fsdp_status_t status_;
};

[[noreturn]] inline void fail(fsdp_status_t status, const std::string& message) { throw Error(status, message); }

// How a piece of work ended: FSDP_OK, or the status and sentence it failed with.
struct Outcome {
  fsdp_status_t status = FSDP_OK;
  std::string message;
  bool ok() const { return status == FSDP_OK; }
};

// Runs `body` and turns whatever it throws into an Outcome: the C boundary
// (api/guard.h) and the phases of collective work that every rank must report
// before any rank may fail (core/checkpoint.cpp) share this one mapping.
template <typename F>
Outcome capture(F&& body) noexcept {
  try {
    body();
    return {};
  } catch (const Error& e) {
    return {e.status(), e.what()};
  } catch (const std::bad_alloc&) {
    return {FSDP_ERR_OUT_OF_MEMORY, "out of host memory"};
  } catch (const std::exception& e) {
    return {FSDP_ERR_INTERNAL, std::string("internal error (please report): ") + e.what()};
  } catch (...) {
    return {FSDP_ERR_INTERNAL, "internal error (please report): unknown exception"};
  }
}

}  // namespace fsdp
