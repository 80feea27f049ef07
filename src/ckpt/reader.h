// src/ckpt/reader.h - CheckpointReader: a checkpoint directory opened for
// reading, sharded or full, behind one question: "what are elements [a, b) of
// this param (or of its optimizer state)?". Resharding is answered by it: a
// rank fills its new shard by asking for the param ranges the shard covers,
// and only the byte ranges of the source files that hold them are read.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "../base/layout.h"
#include "meta.h"

namespace fsdp::ckpt {

class CheckpointReader {
 public:
  // Reads and checks the metadata. FSDP_ERR_CORRUPT if it is missing or bad.
  explicit CheckpointReader(std::string dir);
  const Meta& meta() const { return meta_; }
  const std::string& dir() const { return dir_; }

  // Elements [a, b) of param `p` of unit `u`: `kind` is "param" or one of the
  // optimizer's state names. Verifies the checksums of every chunk it reads.
  void read_param(size_t u, size_t p, const std::string& kind, uint64_t a, uint64_t b, float* out);
  // Shard `shard` of unit `u` as `layout` lays it out (which may differ from
  // the checkpoint's: another world size or alignment); padding is zero.
  // `layout` must have the unit's params (checked by the caller).
  void read_shard(size_t u, const std::string& kind, const FlatLayout& layout, int shard, float* out);
  // Every file read whole, every checksum checked; the damage found, one
  // line each ("" if none). Throws what is not damage (FSDP_ERR_IO).
  std::string verify_all();

 private:
  const Reader& file(const std::string& name);

  static constexpr size_t kMaxOpenFiles = 32;
  std::string dir_;
  Meta meta_;
  std::map<std::string, std::unique_ptr<Reader>> open_;
};

// Writes `m` as the directory's metadata file and its CRC-32 file, fsync'ed.
void write_meta(const std::string& dir, const Meta& m);

}  // namespace fsdp::ckpt
