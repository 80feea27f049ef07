// src/comm/split.h - who joins whom in Communicator::split: the shared rule of
// every communicator, so that they all form the same groups.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace fsdp::comm {

// `all` holds every rank's (color, key), 2 per rank in rank order (what
// split() gathers): the ranks of `color`, ordered by key, ties by rank.
inline std::vector<int> split_members(const std::vector<int64_t>& all, int64_t color) {
  std::vector<int> members;
  for (size_t r = 0; 2 * r < all.size(); ++r) {
    if (all[2 * r] == color) members.push_back(static_cast<int>(r));
  }
  std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
    return all[2 * static_cast<size_t>(a) + 1] < all[2 * static_cast<size_t>(b) + 1];
  });
  return members;
}

}  // namespace fsdp::comm
