// src/ckpt/strict_json.h - JSON parsed the way the reference safetensors
// reader (serde_json) parses it where nlohmann is laxer: a key repeated in
// one object is refused rather than resolved to its last value. A file that
// another reader would refuse or see differently must not load here as
// something else. Private to src/ckpt: nlohmann stays out of its headers.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_set>
#include <vector>

namespace fsdp::ckpt {

struct StrictJson {
  nlohmann::json value;  // discarded when the text is not JSON
  // The first key found twice in one object, after the keys of the objects
  // around it ({"a": {"b": 1, "b": 2}} gives {"a", "b"}); empty if none.
  std::vector<std::string> duplicate;
};

inline StrictJson parse_strict_json(const char* first, const char* last) {
  struct Frame {
    std::unordered_set<std::string> keys;
    std::string last;  // the key whose value is being parsed
  };
  std::vector<Frame> frames;
  StrictJson out;
  // nlohmann offers no duplicate check, but its parser callback sees every
  // key in order between the start and end of its object.
  auto cb = [&](int /*depth*/, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (event == E::object_start) {
      frames.emplace_back();
    } else if (event == E::object_end) {
      if (!frames.empty()) frames.pop_back();
    } else if (event == E::key && !frames.empty()) {
      Frame& f = frames.back();
      f.last = parsed.get<std::string>();
      if (!f.keys.insert(f.last).second && out.duplicate.empty()) {
        for (const Frame& g : frames) out.duplicate.push_back(g.last);
      }
    }
    return true;
  };
  out.value = nlohmann::json::parse(first, last, cb, /*allow_exceptions=*/false);
  return out;
}

}  // namespace fsdp::ckpt
