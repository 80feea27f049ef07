// src/core/error.h - the one exception type of the library: a status plus a
// sentence. Thrown inside, turned into fsdp_status_t + fsdp_last_error() at the
// C boundary (src/api/).
#pragma once

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

}  // namespace fsdp
