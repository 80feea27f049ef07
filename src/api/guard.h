// src/api/guard.h - the C boundary: every public function runs its body inside
// guard(), which turns exceptions into a status and fsdp_last_error(), so no
// C++ exception ever crosses into the host language.
#pragma once

#include <string>
#include <utility>

#include "../base/error.h"
#include "../base/host_waits.h"
#include "fsdp.h"

namespace fsdp::api {

void set_last_error(const std::string& message);

template <typename F>
fsdp_status_t guard(F&& body) noexcept {
  Outcome o = capture(std::forward<F>(body));
  base::host_wait_counter() = nullptr;  // set by the call's check_live for its context
  if (!o.ok()) set_last_error(o.message);
  return o.status;
}

// Throws INVALID_ARGUMENT "<call>: <what> is NULL" when `p` is null.
inline void require(const void* p, const char* call, const char* what) {
  if (p == nullptr) fail(FSDP_ERR_INVALID_ARGUMENT, std::string(call) + ": " + what + " is NULL");
}

}  // namespace fsdp::api
