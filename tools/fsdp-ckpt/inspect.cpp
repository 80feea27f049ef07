// tools/fsdp-ckpt/inspect.cpp - the read-only subcommands: inspect (what a
// checkpoint holds, as text or JSON) and verify (every file and checksum).
#include <cinttypes>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "args.h"
#include "base/text.h"
#include "ckpt/reader.h"

namespace fsdp_ckpt {
namespace {

using fsdp::ckpt::CheckpointReader;
using fsdp::ckpt::Meta;

std::string list_str(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += (s.empty() ? "" : ", ") + x;
  return "[" + s + "]";
}

// The shortest text that reads back as the same double (0.9, not
// 0.90000000000000002), with '.' whatever the locale.
std::string num(double v) { return fsdp::base::format_double(v); }

uint64_t total_bytes(const Meta& m) {
  uint64_t t = 0;
  for (const auto& f : m.files) t += f.size;
  return t;
}

uint64_t unit_numel(const fsdp::ckpt::UnitMeta& u) {
  uint64_t n = 0;
  for (const auto& p : u.params) n += p.numel;
  return n;
}

nlohmann::ordered_json to_summary(const std::string& dir, const Meta& m) {
  using json = nlohmann::ordered_json;
  json j;
  j["dir"] = dir;
  j["kind"] = m.kind;
  j["format"] = fsdp::ckpt::kFormatName;
  j["format_version"] = fsdp::ckpt::kFormatVersion;  // parse_meta accepts no other
  j["library"] = m.library;
  j["world_size"] = m.world_size;
  j["sharding"] = m.sharding;
  j["shard_world"] = m.shard_world;
  j["align_elems"] = m.align_elems;
  j["chunk_bytes"] = m.chunk_bytes;
  j["step"] = m.optimizer.step;
  // The optimizer and loss scaler exactly as the metadata file spells them.
  const json meta = json::parse(fsdp::ckpt::to_json(m));
  j["optimizer"] = meta["optimizer"];
  j["loss_scaler"] = meta["loss_scaler"];
  json units = json::array();
  uint64_t n_params = 0, numel = 0;
  for (const auto& u : m.units) {
    json params = json::array();
    for (const auto& p : u.params) {
      params.push_back({{"name", p.name},
                        {"shape", p.shape},
                        {"dtype", "F32"},
                        {"numel", p.numel},
                        {"offset", p.offset},
                        {"weight_decay", p.weight_decay}});
    }
    n_params += u.params.size();
    numel += unit_numel(u);
    units.push_back({{"name", u.name},
                     {"numel", unit_numel(u)},
                     {"padded_numel", u.padded_numel},
                     {"shard_numel", u.shard_numel(m.shard_world)},
                     {"params", params}});
  }
  j["units"] = units;
  j["n_params"] = n_params;
  j["numel"] = numel;
  json files = json::array();
  for (const auto& f : m.files) files.push_back({{"name", f.name}, {"size", f.size}, {"tensors", f.tensors.size()}});
  j["files"] = files;
  j["total_bytes"] = total_bytes(m);
  return j;
}

void print_text(const std::string& dir, const Meta& m) {
  const auto& o = m.optimizer;
  std::printf("checkpoint   %s\n", dir.c_str());
  std::printf("kind         %s\n", m.kind.c_str());
  std::printf("format       %s version %d\n", fsdp::ckpt::kFormatName, fsdp::ckpt::kFormatVersion);
  std::printf("library      %s\n", m.library.c_str());
  std::printf("world size   %d\n", m.world_size);
  std::printf("sharding     %s\n", m.sharding.c_str());
  std::printf("shard world  %d%s\n", m.shard_world, m.sharded() ? "" : " (full checkpoint)");
  std::printf("align        %" PRIu64 " elements\n", m.align_elems);
  std::printf("checksums    crc32 per tensor and per %" PRIu64 "-byte chunk\n", m.chunk_bytes);
  std::printf("step         %" PRId64 "\n", o.step);
  std::printf("optimizer    %s lr=%s beta1=%s beta2=%s eps=%s weight_decay=%s momentum=%s nesterov=%s\n",
              o.kind.c_str(), num(o.lr).c_str(), num(o.beta1).c_str(), num(o.beta2).c_str(), num(o.eps).c_str(),
              num(o.weight_decay).c_str(), num(o.momentum).c_str(), o.nesterov ? "true" : "false");
  std::printf("             state %s, last grad norm %s\n", list_str(o.state).c_str(), num(o.last_grad_norm).c_str());
  std::printf("loss scale   %s (clean steps %" PRId64 ", skipped steps %" PRIu64 ")\n", num(m.scaler.scale).c_str(),
              m.scaler.clean_steps, m.scaler.skipped_steps);
  uint64_t n_params = 0, numel = 0;
  for (const auto& u : m.units) {
    n_params += u.params.size();
    numel += unit_numel(u);
  }
  std::printf("units        %zu (%" PRIu64 " params, %" PRIu64 " elements)\n", m.units.size(), n_params, numel);
  for (size_t k = 0; k < m.units.size(); ++k) {
    const auto& u = m.units[k];
    std::printf("  unit %zu '%s': %zu params, %" PRIu64 " elements, padded %" PRIu64, k, u.name.c_str(),
                u.params.size(), unit_numel(u), u.padded_numel);
    if (m.sharded()) std::printf(", %" PRIu64 " per shard", u.shard_numel(m.shard_world));
    std::printf("\n");
    for (const auto& p : u.params) {
      std::printf("    %-32s %-16s F32 numel %-10" PRIu64, p.name.c_str(), fsdp::ckpt::shape_string(p.shape).c_str(),
                  p.numel);
      if (m.sharded()) std::printf(" offset %-10" PRIu64, p.offset);
      std::printf(" weight_decay %s\n", num(p.weight_decay).c_str());
    }
  }
  std::printf("files        %zu\n", m.files.size());
  for (const auto& f : m.files) {
    std::printf("  %-40s %14" PRIu64 " bytes, %zu tensors\n", f.name.c_str(), f.size, f.tensors.size());
  }
  std::printf("total        %" PRIu64 " bytes\n", total_bytes(m));
}

}  // namespace

int run_inspect(const Args& a) {
  const std::string& dir = a.pos[0];
  CheckpointReader r(dir);
  if (a.has("--json")) {
    std::printf("%s\n",
                to_summary(dir, r.meta()).dump(1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else {
    print_text(dir, r.meta());
  }
  return 0;
}

int run_verify(const Args& a) {
  const std::string& dir = a.pos[0];
  CheckpointReader r(dir);
  std::string problems = r.verify_all();
  const Meta& m = r.meta();
  if (problems.empty()) {
    size_t tensors = 0;
    for (const auto& f : m.files) tensors += f.tensors.size();
    std::printf("OK: %s: %zu files, %zu tensors, %" PRIu64 " bytes verified\n", dir.c_str(), m.files.size(), tensors,
                total_bytes(m));
    return 0;
  }
  size_t n = 0;
  std::istringstream lines(problems);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty()) continue;
    std::fprintf(stderr, "fsdp-ckpt: %s\n", line.c_str());
    ++n;
  }
  std::fprintf(stderr, "fsdp-ckpt: %s FAILED verification: %zu problem%s\n", dir.c_str(), n, n == 1 ? "" : "s");
  return 1;
}

}  // namespace fsdp_ckpt
