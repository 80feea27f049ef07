// src/core/config_parse.h - how config.cpp reads and writes option values:
// case and space rules, numeric ranges (Range: the check, its message and
// docs/configuration.md state the same bounds), booleans, dtypes, keyword
// choices with their aliases, and what this build has. For config.cpp's
// option table alone.
#pragma once

#include <cctype>
#include <cmath>
#include <string>
#include <vector>

#include "../base/error.h"
#include "../base/text.h"
#include "config.h"

namespace fsdp::core::config_parse {

inline std::string upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}
inline std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}
inline std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t");
  size_t e = s.find_last_not_of(" \t");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

[[noreturn]] inline void bad_value(const std::string& key, const std::string& value, const std::string& valid) {
  fail(FSDP_ERR_INVALID_ARGUMENT,
       "config: " + base::quote(value) + " is not a valid value for " + base::quote(key) + "; valid: " + valid);
}

// The values a numeric option takes: [lo, hi], or [lo, hi) with hi_open.
// The message and docs/configuration.md say it in the same words
// (range_text), so the check, the message and the docs cannot drift apart.
struct Range {
  double lo, hi;
  bool hi_open = false;
  bool holds(double v) const { return v >= lo && (hi_open ? v < hi : v <= hi); }  // false for nan
};

inline std::string range_text(const Range& r) {
  return "[" + base::format_double(r.lo) + ", " + base::format_double(r.hi) + (r.hi_open ? ")" : "]");
}

inline const Range kLrRange{0, 1e9};
inline const Range kWeightDecayRange{0, 1e9};

inline void check_range(double v, Range r, const std::string& what) {
  if (!r.holds(v)) {
    fail(FSDP_ERR_INVALID_ARGUMENT, what + " must be a number in " + range_text(r) + ", not " + base::format_double(v));
  }
}

// Numbers are decimal in the C locale's syntax whatever the host's locale
// ("0.002", "1e-3", "+2"); spaces and tabs around them are ignored; hex,
// inf, nan and a decimal comma are refused.
inline double parse_double(const std::string& key, const std::string& value, Range r,
                           const std::string& what = "a number", const std::string& note = "") {
  double d = 0.0;
  if (!base::parse_double(trim(value), &d) || !std::isfinite(d) || !r.holds(d)) {
    bad_value(key, value, what + " in " + range_text(r) + note);
  }
  return d;
}

inline long parse_int(const std::string& key, const std::string& value, long lo, long hi,
                      const std::string& what = "an integer") {
  long n = 0;
  if (!base::parse_long(trim(value), &n) || n < lo || n > hi) {
    bad_value(key, value, what + " in " + range_text({double(lo), double(hi)}));
  }
  return n;
}

// 1 for a word that means true, 0 for one that means false, else -1.
inline int bool_word(const std::string& value) {
  std::string v = lower(trim(value));
  if (v == "1" || v == "true" || v == "on" || v == "yes") return 1;
  if (v == "0" || v == "false" || v == "off" || v == "no") return 0;
  return -1;
}

inline bool parse_bool(const std::string& key, const std::string& value) {
  int b = bool_word(value);
  if (b < 0) bad_value(key, value, "0, 1, true, false, on, off");
  return b == 1;
}

inline AutoBool parse_auto_bool(const std::string& key, const std::string& value) {
  if (lower(trim(value)) == "auto") return AutoBool::kAuto;
  int b = bool_word(value);
  if (b < 0) bad_value(key, value, "auto, 0, 1, true, false, on, off");
  return b == 1 ? AutoBool::kYes : AutoBool::kNo;
}

inline DType parse_dtype(const std::string& key, const std::string& value) {
  std::string v = lower(trim(value));
  if (v == "fp32" || v == "float32" || v == "f32") return DType::kFp32;
  if (v == "bf16" || v == "bfloat16") return DType::kBf16;
  if (v == "fp16" || v == "float16" || v == "half" || v == "f16") return DType::kFp16;
  bad_value(key, value, "fp32, bf16, fp16 (or float32, bfloat16, float16)");
}

inline std::string fmt(double d) { return base::format_double(d); }

// A keyword option: canonical names (first in each list), aliases, values.
template <typename E>
struct Choice {
  std::vector<const char*> names;  // canonical first, then aliases (lower case)
  E value;
};

template <typename E>
E parse_choice(const char* key, const std::string& v, const std::vector<Choice<E>>& choices) {
  std::string l = lower(trim(v));
  for (const auto& c : choices) {
    for (const char* n : c.names) {
      if (l == lower(n)) return c.value;
    }
  }
  std::string valid;
  for (const auto& c : choices) valid += (valid.empty() ? "" : ", ") + std::string(c.names[0]);
  bad_value(key, v, valid);
}

template <typename E>
inline std::string choice_name(E value, const std::vector<Choice<E>>& choices) {
  for (const auto& c : choices) {
    if (c.value == value) return c.names[0];
  }
  return "?";
}

inline const std::vector<Choice<Sharding>> kShardings = {
    {{"FULL_SHARD", "ZERO3"}, Sharding::kFullShard},
    {{"SHARD_GRAD_OP", "SHARD_GRAD", "ZERO2"}, Sharding::kShardGradOp},
    {{"NO_SHARD", "DDP"}, Sharding::kNoShard},
    {{"HYBRID_SHARD", "HSDP"}, Sharding::kHybridShard},
    {{"HYBRID_SHARD_ZERO2", "_HYBRID_SHARD_ZERO2"}, Sharding::kHybridShardZero2}};
inline const std::vector<Choice<MpiAlgorithm>> kMpiAlgorithms = {
    {{"auto"}, MpiAlgorithm::kAuto}, {{"ring"}, MpiAlgorithm::kRing}, {{"native"}, MpiAlgorithm::kNative}};
#ifdef FSDP_HAVE_CUDA
inline constexpr bool kHaveCuda = true;
#else
inline constexpr bool kHaveCuda = false;
#endif
#ifdef FSDP_HAVE_MPI
inline constexpr bool kHaveMpi = true;
#else
inline constexpr bool kHaveMpi = false;
#endif
#ifdef FSDP_HAVE_NCCL
inline constexpr bool kHaveNccl = true;
#else
inline constexpr bool kHaveNccl = false;
#endif
// Every kind is named (a value this build lacks is refused with a reason).
inline const std::vector<Choice<CommKind>> kComms = {
    {{"auto"}, CommKind::kAuto}, {{"local"}, CommKind::kLocal}, {{"mpi"}, CommKind::kMpi}, {{"nccl"}, CommKind::kNccl}};
inline const std::vector<Choice<ReduceOp>> kReduceOps = {{{"avg", "mean"}, ReduceOp::kAvg}, {{"sum"}, ReduceOp::kSum}};
inline const std::vector<Choice<OptimizerKind>> kOptimizers = {{{"adamw"}, OptimizerKind::kAdamW},
                                                               {{"adam"}, OptimizerKind::kAdam},
                                                               {{"sgd"}, OptimizerKind::kSgd},
                                                               {{"host"}, OptimizerKind::kHost}};
inline const std::vector<Choice<BackwardPrefetch>> kBackwardPrefetch = {
    {{"pre", "backward_pre"}, BackwardPrefetch::kPre},
    {{"post", "backward_post"}, BackwardPrefetch::kPost},
    {{"none", "0", "off"}, BackwardPrefetch::kNone}};

}  // namespace fsdp::core::config_parse
