// src/core/consensus.cpp - see consensus.h.
#include "consensus.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <vector>

#include "../base/error.h"
#include "../base/text.h"

namespace fsdp::core {
namespace {

// Two quoted lines (base::quote: at most 200 input bytes each, 4 output bytes
// per escaped byte) and the words around them.
constexpr size_t kMsgBytes = 2048;

std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string line;
  while (std::getline(ss, line)) out.push_back(line);
  return out;
}

std::string first_difference(const std::string& root, const std::string& mine, int rank) {
  auto a = lines(root);
  auto b = lines(mine);
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    std::string x = i < a.size() ? a[i] : "(nothing)";
    std::string y = i < b.size() ? b[i] : "(nothing)";
    if (x != y)
      return "rank 0 has " + base::quote(x) + " where rank " + std::to_string(rank) + " has " + base::quote(y);
  }
  return "";
}

}  // namespace

std::vector<std::string> gather_strings(comm::Communicator& comm, const std::string& mine, const std::string& what) {
  size_t world = static_cast<size_t>(comm.world_size());
  if (world == 1) return {mine};
  std::vector<uint64_t> lens(world);
  uint64_t len = mine.size();
  comm.all_gather(&len, lens.data(), sizeof len, what + " (lengths)");
  uint64_t longest = 1;
  for (uint64_t l : lens) longest = std::max(longest, l);
  std::string padded = mine;
  padded.resize(longest, '\0');
  std::string all(longest * world, '\0');
  comm.all_gather(padded.data(), all.data(), longest, what + " (strings)");
  std::vector<std::string> out(world);
  for (size_t r = 0; r < world; ++r) out[r] = all.substr(r * longest, lens[r]);
  return out;
}

void check_outcomes(comm::Communicator& comm, const std::string& what, fsdp_status_t status,
                    const std::string& message) {
  std::string mine = status == FSDP_OK ? std::string() : std::to_string(static_cast<int>(status)) + " " + message;
  std::vector<std::string> all = gather_strings(comm, mine, what);
  if (status != FSDP_OK) fail(status, message);
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    size_t sp = all[r].find(' ');
    auto st = static_cast<fsdp_status_t>(std::stoi(all[r].substr(0, sp)));
    fail(st, what + " failed on rank " + std::to_string(r) + ": " + all[r].substr(sp + 1));
  }
}

void agree(comm::Communicator& comm, const std::string& what, const std::string& text) {
  if (comm.world_size() == 1) return;
  uint64_t len = text.size();
  comm.broadcast(&len, sizeof len, 0, what + " (length)");
  std::string root = comm.rank() == 0 ? text : std::string(len, '\0');
  comm.broadcast(root.data(), len, 0, what + " (text)");
  std::string diff = text == root ? "" : first_difference(root, text, comm.rank());

  std::vector<char> mine(kMsgBytes, '\0');
  std::memcpy(mine.data(), diff.data(), std::min(diff.size(), kMsgBytes - 1));
  std::vector<char> all(kMsgBytes * static_cast<size_t>(comm.world_size()));
  comm.all_gather(mine.data(), all.data(), kMsgBytes, what + " (differences)");
  for (int r = 0; r < comm.world_size(); ++r) {
    const char* msg = all.data() + static_cast<size_t>(r) * kMsgBytes;
    if (msg[0] != '\0') {
      fail(FSDP_ERR_MISMATCH, what + ": ranks disagree (seen from rank " + std::to_string(comm.rank()) +
                                  "): " + std::string(msg, strnlen(msg, kMsgBytes)));
    }
  }
}

}  // namespace fsdp::core
