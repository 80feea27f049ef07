// tools/fsdp-ckpt/convert.cpp - the writing subcommands: consolidate (any
// checkpoint -> full) and reshard (any checkpoint -> N shard files), both
// streaming and crash-safe (staging directory, metadata, atomic commit).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "args.h"
#include "base/error.h"
#include "base/layout.h"
#include "ckpt/files.h"
#include "ckpt/io.h"
#include "ckpt/reader.h"

namespace fsdp_ckpt {
namespace {

namespace ckpt = fsdp::ckpt;
namespace fs = std::filesystem;
using fsdp::fail;

// Elements read per call: large enough to amortise, small enough that a huge
// param does not need a buffer of its size.
constexpr uint64_t kMaxBufferElems = uint64_t{4} << 20;

fs::path resolved(const std::string& p) {
  std::string s = p;
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  std::error_code ec;
  fs::path abs = fs::absolute(s, ec);
  fs::path r;
  if (!ec) r = fs::weakly_canonical(abs, ec);
  if (ec) fail(FSDP_ERR_IO, "cannot resolve path '" + p + "': " + ec.message());
  return r.lexically_normal();
}

// True when `inner` is `outer` or lies inside it.
bool within(const fs::path& inner, const fs::path& outer) {
  auto o = outer.begin();
  auto i = inner.begin();
  for (; o != outer.end(); ++o, ++i) {
    if (o->empty()) continue;  // a trailing separator
    if (i == inner.end() || *i != *o) return false;
  }
  return true;
}

// Refuses a destination that would destroy the source or something that is
// not a checkpoint: commit_dir replaces what DST holds.
void check_destination(const std::string& src, const std::string& dst) {
  fs::path s = resolved(src);
  fs::path d = resolved(dst);
  if (within(d, s)) throw UsageError("DST '" + dst + "' is SRC '" + src + "' or inside it");
  if (within(s, d)) throw UsageError("DST '" + dst + "' contains SRC '" + src + "'");
  ckpt::check_replaceable(dst, "fsdp-ckpt");
}

// The hidden sibling directory where DST is assembled; removed unless
// committed.
class Staging {
 public:
  explicit Staging(const std::string& dst) : dst_(dst), dir_(ckpt::staging_dir(dst)) {
    std::string note = ckpt::prepare_staging(dst, "fsdp-ckpt");
    if (!note.empty()) std::fprintf(stderr, "fsdp-ckpt: warning: %s\n", note.c_str());
  }
  ~Staging() {
    if (done_) return;
    std::string warning = ckpt::remove_failed_staging(dir_);
    if (!warning.empty()) std::fprintf(stderr, "fsdp-ckpt: warning: %s\n", warning.c_str());
  }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  const std::string& dir() const { return dir_; }
  // Metadata last, then the atomic rename: DST is the old or the new
  // checkpoint at every instant.
  void commit(const ckpt::Meta& m) {
    ckpt::write_meta(dir_, m);
    std::string warning = ckpt::commit_dir(dir_, dst_);  // on failure the partial checkpoint goes, as in fsdp_save
    done_ = true;
    if (!warning.empty())
      std::fprintf(stderr, "fsdp-ckpt: warning: '%s' was written, but %s\n", dst_.c_str(), warning.c_str());
  }

 private:
  std::string dst_;
  std::string dir_;
  bool done_ = false;
};

// Streams elements of one param (or one of its optimizer states) from the
// source into the writer, through `buf`.
void copy_param(ckpt::CheckpointReader& r, size_t u, size_t p, const std::string& kind, std::vector<float>& buf,
                ckpt::Writer& w) {
  uint64_t n = r.meta().units[u].params[p].numel;
  for (uint64_t a = 0; a < n; a += buf.size()) {
    uint64_t b = std::min<uint64_t>(n, a + buf.size());
    r.read_param(u, p, kind, a, b, buf.data());
    w.write(buf.data(), static_cast<size_t>(b - a) * sizeof(float));
  }
}

}  // namespace

int run_consolidate(const Args& a) {
  const std::string& src = a.pos[0];
  const std::string& dst = a.pos[1];
  check_destination(src, dst);
  ckpt::CheckpointReader r(src);
  const ckpt::Meta& in = r.meta();
  const std::vector<std::string>& states = in.optimizer.state;

  ckpt::Meta out = in;
  out.kind = "full";
  out.shard_world = 1;
  for (ckpt::UnitMeta& u : out.units) u.trainable_numel = -1;  // no flat layout in a full checkpoint
  out.library = ckpt::library_name();
  out.files.clear();
  // Before the destination is touched: the param names must suit a full checkpoint.
  ckpt::FullEntries entries = ckpt::full_entries(out, "cannot consolidate '" + src + "'");
  const size_t n_params = entries.model.size();
  uint64_t largest = 1;
  for (const ckpt::UnitMeta& u : in.units) {
    for (const ckpt::ParamMeta& p : u.params) largest = std::max(largest, p.numel);
  }

  Staging staging(dst);
  // In the entries' order, as Context::write_full_files writes them.
  ckpt::FullWriters w = ckpt::create_full_files(staging.dir(), out, std::move(entries));
  std::vector<float> buf(static_cast<size_t>(std::min(largest, kMaxBufferElems)));
  for (size_t u = 0; u < in.units.size(); ++u) {
    size_t n = in.units[u].params.size();
    for (size_t p = 0; p < n; ++p) copy_param(r, u, p, "param", buf, *w.model);
    if (!in.units[u].trainable) continue;  // a frozen unit has no optimizer state
    for (const std::string& s : states) {
      for (size_t p = 0; p < n; ++p) {
        if (in.units[u].params[p].trainable) copy_param(r, u, p, s, buf, *w.optimizer);  // a frozen param: none
      }
    }
  }
  out.files.push_back(w.model->finish());
  if (w.optimizer) out.files.push_back(w.optimizer->finish());
  staging.commit(out);
  std::printf("consolidated %s (%s, shard world %d) into %s: %zu units, %zu params\n", src.c_str(), in.kind.c_str(),
              in.shard_world, dst.c_str(), in.units.size(), n_params);
  return 0;
}

int run_reshard(const Args& a) {
  if (!a.has("--world")) throw UsageError("reshard needs --world N");
  int world = parse_world("--world", a.opts.at("--world"));
  const std::string& src = a.pos[0];
  const std::string& dst = a.pos[1];
  check_destination(src, dst);
  ckpt::CheckpointReader r(src);
  const ckpt::Meta& in = r.meta();

  ckpt::Meta out = in;
  out.kind = "sharded";
  out.world_size = world;
  out.shard_world = world;
  out.sharding = "FULL_SHARD";  // the layout written below, whatever the source's strategy
  out.library = ckpt::library_name();
  out.files.clear();
  // Each unit laid out as an N-rank job with the source's alignment lays it out.
  std::vector<fsdp::FlatLayout> layouts;
  size_t largest = 1;
  for (ckpt::UnitMeta& u : out.units) {
    std::vector<fsdp::ParamSpec> specs;
    std::vector<bool> frozen;  // params frozen inside the unit keep their block
    for (const ckpt::ParamMeta& p : u.params) {
      specs.push_back({p.name, p.shape, static_cast<size_t>(p.numel)});
      frozen.push_back(!p.trainable);
    }
    layouts.emplace_back(std::move(specs), static_cast<size_t>(in.align_elems), world, frozen);
    const fsdp::FlatLayout& lay = layouts.back();
    u.padded_numel = lay.padded_numel();
    u.trainable_numel = lay.has_frozen() ? static_cast<int64_t>(lay.trainable_padded_numel()) : -1;
    for (size_t i = 0; i < u.params.size(); ++i) u.params[i].offset = lay.param_offset(i);
    largest = std::max(largest, lay.shard_numel());
  }

  Staging staging(dst);
  std::vector<float> buf(largest);
  for (int s = 0; s < world; ++s) {
    // As Context::write_shard_file writes it.
    std::unique_ptr<ckpt::Writer> w = ckpt::create_shard_file(staging.dir(), out, s);
    for (size_t u = 0; u < layouts.size(); ++u) {
      for (const std::string& k : ckpt::tensor_kinds(in.optimizer, in.units[u])) {  // a frozen unit: params only
        r.read_shard(u, k, layouts[u], s, buf.data());
        const size_t n = k == "param" ? layouts[u].shard_numel() : layouts[u].trainable_shard_numel();
        w->write(buf.data(), n * sizeof(float));
      }
    }
    out.files.push_back(w->finish());
  }
  staging.commit(out);
  std::printf("resharded %s (%s, shard world %d) into %s: %d shard files\n", src.c_str(), in.kind.c_str(),
              in.shard_world, dst.c_str(), world);
  return 0;
}

}  // namespace fsdp_ckpt
