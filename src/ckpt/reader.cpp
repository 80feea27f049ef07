// src/ckpt/reader.cpp - see reader.h.
#include "reader.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "../base/error.h"
#include "../base/text.h"

namespace fsdp::ckpt {

CheckpointReader::CheckpointReader(std::string dir) : dir_(std::move(dir)) {
  std::string path = join(dir_, kMetaFile);
  if (!path_exists(dir_))
    fail(FSDP_ERR_INVALID_ARGUMENT, "checkpoint directory " + base::quote_path(dir_) + " does not exist");
  if (!is_dir(dir_))
    fail(FSDP_ERR_INVALID_ARGUMENT, base::quote_path(dir_) + " is not a checkpoint directory (it is a file)");
  File f = File::open_read(path);
  uint64_t size = f.size();
  if (size > (uint64_t{1} << 30))
    fail(FSDP_ERR_CORRUPT, "checkpoint metadata " + base::quote_path(path) + " is over 1 GiB");
  std::string text(size, '\0');
  f.pread_exact(0, text.data(), size);
  File c = File::open_read(join(dir_, kMetaCrcFile));
  char hex[10] = {};
  uint64_t n = std::min<uint64_t>(c.size(), 9);
  c.pread_exact(0, hex, n);
  char* end = nullptr;
  unsigned long want = std::strtoul(hex, &end, 16);
  if (!(n == 9 && end == hex + 8 && hex[8] == '\n')) {
    fail(FSDP_ERR_CORRUPT,
         "checkpoint file " + base::quote_path(c.path()) + " does not hold a CRC-32 (8 hex digits and a newline)");
  }
  if (crc32_of(text.data(), text.size()) != want) {
    fail(FSDP_ERR_CORRUPT, "checkpoint metadata " + base::quote_path(path) + " fails its checksum (" + kMetaCrcFile +
                               "): it was changed or damaged");
  }
  meta_ = parse_meta(path, text);
}

const Reader& CheckpointReader::file(const std::string& name) {
  auto it = open_.find(name);
  if (it != open_.end()) return *it->second;
  // Bounded open files: a small world reading a checkpoint of thousands of
  // shards (or verify_all) closes what it read before opening more.
  if (open_.size() >= kMaxOpenFiles) open_.clear();
  auto r = std::make_unique<Reader>(join(dir_, name), &meta_.file(name), meta_.chunk_bytes);
  // Every tensor must have the size the layout gives it, so that no read can
  // pass its end.
  for (size_t u = 0; u < meta_.units.size(); ++u) {
    const UnitMeta& um = meta_.units[u];
    for (const std::string& k : tensor_kinds(meta_.optimizer, um)) {
      if (meta_.sharded()) {
        const TensorInfo& t = r->tensor(shard_tensor(u, k));
        const uint64_t n = k == "param" ? um.shard_numel(meta_.shard_world) : um.state_shard_numel(meta_.shard_world);
        if (t.nbytes() != n * 4) {
          fail(FSDP_ERR_CORRUPT, "checkpoint file " + base::quote_path(r->path()) + ": tensor " + base::quote(t.name) +
                                     " has " + std::to_string(t.nbytes()) + " bytes, the layout needs " +
                                     std::to_string(n * 4));
        }
        continue;
      }
      if (name != full_file(k)) continue;
      for (const ParamMeta& p : um.params) {
        if (k != "param" && !p.trainable) continue;  // frozen: no state
        const TensorInfo& t = r->tensor(full_tensor(p.name, k));
        if (t.nbytes() != p.numel * 4 || t.shape != p.shape) {
          fail(FSDP_ERR_CORRUPT, "checkpoint file " + base::quote_path(r->path()) + ": tensor " + base::quote(t.name) +
                                     " does not have the shape the checkpoint metadata gives it");
        }
      }
    }
  }
  return *open_.emplace(name, std::move(r)).first->second;
}

void CheckpointReader::read_param(size_t u, size_t p, const std::string& kind, uint64_t a, uint64_t b, float* out) {
  const ParamMeta& pm = meta_.units.at(u).params.at(p);
  if (a > b || b > pm.numel) fail(FSDP_ERR_INTERNAL, "checkpoint read outside param " + base::quote(pm.name));
  const UnitMeta& um = meta_.units[u];
  if (kind != "param" && (!um.trainable || !pm.trainable)) {
    std::memset(out, 0, (b - a) * sizeof(float));  // frozen when saved: no state, which is fresh state
    return;
  }
  if (!meta_.sharded()) {
    file(full_file(kind)).read(full_tensor(pm.name, kind), a * 4, (b - a) * 4, out);
    return;
  }
  // The param lies in one block: its pieces are runs of that block's slices.
  const uint64_t w = static_cast<uint64_t>(meta_.shard_world);
  const uint64_t slice = pm.trainable ? um.trainable_block() / w : (um.padded_numel - um.trainable_block()) / w;
  const uint64_t block_begin = pm.trainable ? 0 : um.trainable_block();
  std::string tensor = shard_tensor(u, kind);
  while (a < b) {
    uint64_t pos = pm.offset + a;
    int s = 0;
    uint64_t within = 0;
    um.locate(pos, meta_.shard_world, &s, &within);
    uint64_t k = std::min(b - a, slice - (pos - block_begin) % slice);
    file(shard_file(s, meta_.shard_world)).read(tensor, within * 4, k * 4, out);
    out += k;
    a += k;
  }
}

void CheckpointReader::read_shard(size_t u, const std::string& kind, const FlatLayout& layout, int shard, float* out) {
  std::vector<ParamRef> same(layout.n_params());
  for (size_t i = 0; i < same.size(); ++i) same[i] = {u, i};
  read_shard(same, kind, layout, shard, out);
}

void CheckpointReader::read_shard(const std::vector<ParamRef>& sources, const std::string& kind,
                                  const FlatLayout& layout, int shard, float* out) {
  // The param's shard, or the state's: the trainable block's slice alone.
  const size_t end = kind == "param" ? layout.shard_numel() : layout.trainable_shard_numel();
  size_t pos = 0;  // everything before it is filled
  for (const ShardSegment& seg : layout.shard_segments(shard)) {
    if (seg.shard_begin >= end) break;  // segments come in shard order
    std::memset(out + pos, 0, (seg.shard_begin - pos) * sizeof(float));
    const ParamRef& src = sources.at(seg.param_index);
    if (!src.none()) read_param(src.unit, src.param, kind, seg.param_begin, seg.param_begin + seg.numel, out + seg.shard_begin);
    pos = seg.shard_begin + seg.numel;
  }
  std::memset(out + pos, 0, (end - pos) * sizeof(float));
}

std::string CheckpointReader::verify_all() {
  std::string problems;
  for (const FileRecord& f : meta_.files) {
    try {
      problems += file(f.name).verify_all();
    } catch (const Error& e) {
      // Damage is reported file by file; an I/O failure is not damage.
      if (e.status() != FSDP_ERR_CORRUPT) throw;
      problems += std::string(e.what()) + "\n";
    }
  }
  return problems;
}

void write_meta(const std::string& dir, const Meta& m) {
  std::string text = to_json(m);
  File f = File::create(join(dir, kMetaFile));
  f.write_all(text.data(), text.size());
  f.sync();
  f.close();
  char crc[16];
  std::snprintf(crc, sizeof crc, "%08x\n", crc32_of(text.data(), text.size()));
  File c = File::create(join(dir, kMetaCrcFile));
  c.write_all(crc, 9);
  c.sync();
  c.close();
  after_file_written();
}

}  // namespace fsdp::ckpt
