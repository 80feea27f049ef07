// src/ckpt/files.cpp - see files.h.
#include "files.h"

#include <map>

#include "../base/error.h"
#include "../base/text.h"
#include "io.h"

namespace fsdp::ckpt {

std::unique_ptr<Writer> create_shard_file(const std::string& dir, const Meta& m, int shard) {
  std::vector<Writer::Entry> entries;
  for (size_t u = 0; u < m.units.size(); ++u) {
    for (const std::string& k : tensor_kinds(m.optimizer, m.units[u])) {
      const uint64_t n = k == "param" ? m.units[u].shard_numel(m.shard_world) : m.units[u].state_shard_numel(m.shard_world);
      entries.push_back({shard_tensor(u, k), {static_cast<int64_t>(n)}});
    }
  }
  std::string name = shard_file(shard, m.shard_world);
  return std::make_unique<Writer>(
      join(dir, name), name, std::move(entries),
      std::map<std::string, std::string>{
          {"format", kFormatName}, {"shard", std::to_string(shard)}, {"shard_world", std::to_string(m.shard_world)}},
      m.chunk_bytes);
}

FullEntries full_entries(const Meta& m, const std::string& what) {
  FullEntries e;
  std::map<std::string, std::string> unit_of;  // param name -> its unit
  for (const UnitMeta& u : m.units) {
    for (const ParamMeta& p : u.params) {
      auto [it, fresh] = unit_of.emplace(p.name, u.name);
      if (!fresh || p.name == "__metadata__") {
        fail(FSDP_ERR_INVALID_ARGUMENT,
             what + ": param name " + base::quote(p.name) + " " +
                 (fresh ? "(unit " + base::quote(u.name) + ") is reserved by safetensors"
                        : "is used twice (units " + base::quote(it->second) + " and " + base::quote(u.name) + ")") +
                 "; a full checkpoint names tensors by param name, so they must be unique (e.g. "
                 "'layers.3.weight'); a sharded checkpoint has no such limit");
      }
      e.model.push_back({p.name, p.shape});
    }
    if (!u.trainable) continue;  // no optimizer state
    for (const std::string& s : m.optimizer.state) {
      for (const ParamMeta& p : u.params) {
        if (p.trainable) e.optimizer.push_back({full_tensor(p.name, s), p.shape});  // a frozen param: none
      }
    }
  }
  return e;
}

FullWriters create_full_files(const std::string& dir, const Meta& m, FullEntries entries) {
  // "format": "pt" is the mark Hugging Face's libraries check for.
  std::map<std::string, std::string> md = {{"format", "pt"}, {"written_by", m.library}};
  FullWriters w;
  w.model = std::make_unique<Writer>(join(dir, kModelFile), kModelFile, std::move(entries.model), md, m.chunk_bytes);
  if (!m.optimizer.state.empty()) {
    w.optimizer = std::make_unique<Writer>(join(dir, kOptimizerFile), kOptimizerFile, std::move(entries.optimizer), md,
                                           m.chunk_bytes);
  }
  return w;
}

}  // namespace fsdp::ckpt
