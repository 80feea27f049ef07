// src/core/consensus.h - agree(): checks that every rank describes something
// (its config, a unit registration) the same way as rank 0, so that a mismatch
// fails on every rank with a message naming the first difference, never a hang
// or silent corruption.
#pragma once

#include <string>
#include <vector>

#include "../comm/communicator.h"

namespace fsdp::core {

// Collective. `text` is line-oriented. Throws Error(FSDP_ERR_MISMATCH) on every
// rank if any rank's text differs from rank 0's.
void agree(comm::Communicator& comm, const std::string& what, const std::string& text);

// Collective. Every rank's string, in rank order.
std::vector<std::string> gather_strings(comm::Communicator& comm, const std::string& mine, const std::string& what);

// Collective. Each rank passes how its part of `what` went (FSDP_OK and "", or
// a status and its message); if any failed, every rank throws the first
// failed rank's error (the others' messages say which rank it was), so that
// all ranks return the same status and none goes on alone.
void check_outcomes(comm::Communicator& comm, const std::string& what, fsdp_status_t status,
                    const std::string& message);

}  // namespace fsdp::core
