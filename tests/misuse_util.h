// The helpers the misuse tests share (test_misuse.cpp: one process's calls,
// options and launcher variables; test_misuse_ranks.cpp: what ranks do to
// each other: registrations, call order, missing and aborting ranks).
#pragma once

#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "rank_runner.h"

namespace fsdp_test::misuse {

using Call = std::pair<const char*, std::function<fsdp_status_t()>>;

inline const std::vector<ParamSpec> kParams = {{"w", {4, 3}}, {"b", {4}}};

// A context with one registered unit (`params`, by default kParams): by
// default a world of one (group NULL).
struct Single {
  CtxPtr ctx;
  fsdp_unit_t* unit = nullptr;
};

inline void make_single(Single& s, const std::map<std::string, std::string>& opts = {},
                        fsdp_local_group_t* group = nullptr, int rank = 0,
                        const std::vector<ParamSpec>& params = kParams) {
  ConfigPtr cfg = make_config(opts);
  ASSERT_TRUE(cfg);
  fsdp_ctx_t* raw = nullptr;
  ASSERT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
  s.ctx.reset(raw);
  ASSERT_OK(register_unit(raw, "u", params, &s.unit));
}

inline std::string get_option(const fsdp_config_t* cfg, const char* key) {
  char buf[512] = {0};
  size_t len = 0;
  EXPECT_OK(fsdp_config_get(cfg, key, buf, sizeof buf, &len));
  EXPECT_EQ(len, std::strlen(buf)) << key;
  return buf;
}

inline bool contains(const std::string& hay, const std::string& needle) {
  return hay.find(needle) != std::string::npos;
}

inline bool have_cuda() { return contains(fsdp_build_info(), "cuda"); }
inline bool have_nccl() { return contains(fsdp_build_info(), "nccl"); }

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace fsdp_test::misuse
