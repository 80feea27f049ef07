// src/ckpt/pretrained.cpp - see pretrained.h.
#include "pretrained.h"

#include <cctype>
#include <nlohmann/json.hpp>
#include <set>

#include "../base/error.h"
#include "../base/text.h"
#include "io.h"
#include "strict_json.h"

namespace fsdp::ckpt {

namespace {

constexpr const char* kIndexFile = "model.safetensors.index.json";
constexpr const char* kModelFile = "model.safetensors";

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r");
  size_t e = s.find_last_not_of(" \t\r");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// `name` matched against `pattern` with at most one "{i}" (a number): the
// number ("" for a plain match), or false.
bool match_rule(const std::string& pattern, const std::string& name, std::string* number) {
  size_t at = pattern.find("{i}");
  if (at == std::string::npos) {
    number->clear();
    return name == pattern;
  }
  std::string head = pattern.substr(0, at), tail = pattern.substr(at + 3);
  if (name.size() <= head.size() + tail.size() || name.compare(0, head.size(), head) != 0 ||
      name.compare(name.size() - tail.size(), tail.size(), tail) != 0) {
    return false;
  }
  *number = name.substr(head.size(), name.size() - head.size() - tail.size());
  for (char c : *number) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

std::string fill(std::string pattern, const std::string& number) {
  for (size_t p = pattern.find("{i}"); p != std::string::npos; p = pattern.find("{i}", p + number.size())) {
    pattern.replace(p, 3, number);
  }
  return pattern;
}

}  // namespace

std::vector<std::string> pretrained_files(const std::string& path) {
  if (!path_exists(path)) fail(FSDP_ERR_IO, "pretrained weights " + base::quote_path(path) + " do not exist");
  if (!is_dir(path)) return {path};
  std::string index = join(path, kIndexFile);
  if (!path_exists(index)) {
    std::string model = join(path, kModelFile);
    if (!path_exists(model)) {
      fail(FSDP_ERR_IO, "directory " + base::quote_path(path) + " holds neither " + kModelFile + " nor " + kIndexFile);
    }
    return {model};
  }
  File f = File::open_read(index);
  std::string text(f.size(), '\0');
  f.pread_exact(0, text.data(), text.size());
  StrictJson parsed = parse_strict_json(text.data(), text.data() + text.size());
  nlohmann::json& j = parsed.value;
  if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
    fail(FSDP_ERR_CORRUPT, "pretrained index " + base::quote_path(index) + " is not JSON with a \"weight_map\" object");
  }
  if (const std::vector<std::string>& d = parsed.duplicate; !d.empty()) {
    // Which of two entries wins would be the reader's guess.
    fail(FSDP_ERR_CORRUPT, "pretrained index " + base::quote_path(index) + " has key " + base::quote(d.back()) +
                               " twice" + (d.size() > 1 ? " in the object of " + base::quote(d[d.size() - 2]) : ""));
  }
  std::set<std::string> files;
  for (const auto& [tensor, file] : j["weight_map"].items()) {
    if (!file.is_string() || file.get<std::string>().empty() ||
        file.get<std::string>().find('/') != std::string::npos) {
      fail(FSDP_ERR_CORRUPT, "pretrained index " + base::quote_path(index) + ": tensor " + base::quote(tensor) +
                                 " is not mapped to a file name of the directory");
    }
    if (file.get<std::string>().find('\0') != std::string::npos) {
      // "\u0000" in the JSON: the system would open the name cut short there,
      // another file than the one the index names.
      fail(FSDP_ERR_CORRUPT, "pretrained index " + base::quote_path(index) + ": tensor " + base::quote(tensor) +
                                 " is mapped to a file name with a NUL byte, " + base::quote(file.get<std::string>()));
    }
    files.insert(file.get<std::string>());
  }
  std::vector<std::string> out;
  for (const auto& name : files) {
    std::string p = join(path, name);
    if (!path_exists(p)) {
      fail(FSDP_ERR_IO, "pretrained index " + base::quote_path(index) + " names " + base::quote(name) +
                            ", which is not in the directory");
    }
    out.push_back(p);
  }
  return out;
}

PretrainedOptions parse_pretrained_options(const char* text, const char* call, bool for_export) {
  PretrainedOptions o;
  if (text == nullptr) return o;
  std::string all(text);
  size_t pos = 0;
  while (pos <= all.size()) {
    size_t end = all.find_first_of(";\n", pos);
    if (end == std::string::npos) end = all.size();
    std::string item = trim(all.substr(pos, end - pos));
    pos = end + 1;
    if (item.empty()) continue;
    size_t eq = item.find('=');
    auto bad = [&](const std::string& why) {
      fail(FSDP_ERR_INVALID_ARGUMENT,
           std::string(call) + ": option " + base::quote(item) + " " + why +
               " (keys: strip_prefix, add_prefix, rename=FROM:TO, transpose=GLOB, " +
               (for_export ? "dtype=fp32|bf16, max_shard_bytes=N)" : "strict=0|1)"));
    };
    if (eq == std::string::npos) bad("is not key=value");
    std::string key = trim(item.substr(0, eq)), value = trim(item.substr(eq + 1));
    if (key == "strip_prefix") {
      o.strip_prefix = value;
    } else if (key == "add_prefix") {
      o.add_prefix = value;
    } else if (key == "rename") {
      size_t colon = value.find(':');
      if (colon == std::string::npos || colon == 0 || colon + 1 == value.size()) bad("is not rename=FROM:TO");
      std::string from = value.substr(0, colon), to = value.substr(colon + 1);
      size_t first = from.find("{i}");
      if (first != std::string::npos && from.find("{i}", first + 1) != std::string::npos) bad("has {i} twice in FROM");
      if (first == std::string::npos && to.find("{i}") != std::string::npos) bad("has {i} in TO but not in FROM");
      o.rename.emplace_back(from, to);
    } else if (key == "transpose") {
      if (value.empty()) bad("has no glob");
      o.transpose.push_back(value);
    } else if (for_export && key == "dtype") {
      if (value != "fp32" && value != "bf16") bad("is not dtype=fp32 or dtype=bf16");
      o.dtype = value == "fp32" ? "F32" : "BF16";
    } else if (for_export && key == "max_shard_bytes") {
      if (value.empty() || value.find_first_not_of("0123456789") != std::string::npos || value.size() > 18) {
        bad("is not max_shard_bytes=<bytes>");
      }
      o.max_shard_bytes = std::stoull(value);
    } else if (!for_export && key == "strict") {
      if (value != "0" && value != "1") bad("is not strict=0 or strict=1");
      o.strict = value == "1";
    } else {
      bad("has an unknown key");
    }
  }
  return o;
}

std::string host_name(const PretrainedOptions& o, const std::string& tensor) {
  std::string name = tensor;
  if (!o.strip_prefix.empty() && name.compare(0, o.strip_prefix.size(), o.strip_prefix) == 0) {
    name = name.substr(o.strip_prefix.size());
  }
  name = o.add_prefix + name;
  std::string number;
  for (const auto& [from, to] : o.rename) {
    if (match_rule(from, name, &number)) return fill(to, number);
  }
  return name;
}

std::string file_name(const PretrainedOptions& o, const std::string& host) {
  std::string name = host;
  std::string number;
  for (const auto& [from, to] : o.rename) {
    if (match_rule(to, host, &number)) {
      name = fill(from, number);
      break;
    }
  }
  if (!o.add_prefix.empty() && name.compare(0, o.add_prefix.size(), o.add_prefix) == 0) {
    name = name.substr(o.add_prefix.size());
  }
  return o.strip_prefix + name;
}

bool glob_match(const std::string& pattern, const std::string& name) {
  size_t p = 0, n = 0, star = std::string::npos, mark = 0;
  while (n < name.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == name[n])) {
      ++p;
      ++n;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = n;
    } else if (star != std::string::npos) {
      p = star + 1;
      n = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

}  // namespace fsdp::ckpt
