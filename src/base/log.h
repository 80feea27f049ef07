// src/base/log.h - the library's only way to say something outside a return
// status: leveled messages with the rank, to stderr (FSDP_LOG_LEVEL) or to a
// host-installed callback. Library code never prints otherwise.
#pragma once

#include <string>

#include "fsdp.h"

namespace fsdp::base {

// Logs `message` if `level` is enabled (FSDP_LOG_LEVEL, default warn, or
// fsdp_log_set_level); rank < 0 means "no rank".
void log(fsdp_log_level_t level, int rank, const std::string& message);
void set_log_level(fsdp_log_level_t level);
void set_log_callback(fsdp_log_fn fn, void* user);

}  // namespace fsdp::base
