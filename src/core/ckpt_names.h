// src/core/ckpt_names.h - how the checkpoint code of src/core lists params in
// its messages and load reports (fsdp_load, fsdp_load_pretrained).
#pragma once

#include <string>
#include <vector>

#include "../base/text.h"

namespace fsdp::core {

// "a, b and c" of up to 8 names, then "and N more".
inline std::string name_list(const std::vector<std::string>& names) {
  constexpr size_t kShown = 8;
  std::string out;
  for (size_t i = 0; i < names.size() && i < kShown; ++i) {
    if (i > 0) out += (i + 1 == names.size() && names.size() <= kShown) ? " and " : ", ";
    out += base::quote(names[i]);
  }
  if (names.size() > kShown) out += " and " + std::to_string(names.size() - kShown) + " more";
  return out;
}

// fsdp_load_report's text: a "missing: NAME" line per registered param not
// loaded, then an "unexpected: NAME" line per one not registered.
inline std::string report_lines(const std::vector<std::string>& missing, const std::vector<std::string>& unexpected) {
  std::string out;
  for (const auto& n : missing) out += "missing: " + n + "\n";
  for (const auto& n : unexpected) out += "unexpected: " + n + "\n";
  return out;
}


}  // namespace fsdp::core
