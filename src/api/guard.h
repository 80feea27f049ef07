// src/api/guard.h - the C boundary: every public function runs its body inside
// guard(), which turns exceptions into a status and fsdp_last_error(), so no
// C++ exception ever crosses into the host language.
#pragma once

#include <new>
#include <string>

#include "../core/error.h"
#include "fsdp.h"

namespace fsdp::api {

void set_last_error(const std::string& message);

template <typename F>
fsdp_status_t guard(F&& body) noexcept {
  try {
    body();
    return FSDP_OK;
  } catch (const Error& e) {
    set_last_error(e.what());
    return e.status();
  } catch (const std::bad_alloc&) {
    set_last_error("out of host memory");
    return FSDP_ERR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    set_last_error(std::string("internal error (please report): ") + e.what());
    return FSDP_ERR_INTERNAL;
  } catch (...) {
    set_last_error("internal error (please report): unknown exception");
    return FSDP_ERR_INTERNAL;
  }
}

// Throws INVALID_ARGUMENT "<call>: <what> is NULL" when `p` is null.
inline void require(const void* p, const char* call, const char* what) {
  if (p == nullptr) fail(FSDP_ERR_INVALID_ARGUMENT, std::string(call) + ": " + what + " is NULL");
}

// CPU contexts have no streams; a non-NULL stream means the host believes it
// is talking to a CUDA context.
inline void require_cpu_stream(const void* stream, const char* call) {
  if (stream != nullptr) {
    fail(FSDP_ERR_INVALID_ARGUMENT,
         std::string(call) + ": stream must be NULL on the cpu device (it is a cudaStream_t only on cuda)");
  }
}

}  // namespace fsdp::api
