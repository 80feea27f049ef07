// src/core/consensus.h - agree(): checks that every rank describes something
// (its config, a unit registration) the same way as rank 0, so that a mismatch
// fails on every rank with a message naming the first difference, never a hang
// or silent corruption.
#pragma once

#include <string>

#include "../comm/communicator.h"

namespace fsdp::core {

// Collective. `text` is line-oriented. Throws Error(FSDP_ERR_MISMATCH) on every
// rank if any rank's text differs from rank 0's.
void agree(comm::Communicator& comm, const std::string& what, const std::string& text);

}  // namespace fsdp::core
