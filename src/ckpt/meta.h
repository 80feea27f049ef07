// src/ckpt/meta.h - a checkpoint's metadata file (fsdp_checkpoint.json): what
// was saved (sharded or full), by which job (world size, sharding), every
// unit's flat layout, the optimizer and loss-scaler state, and a record of each
// file with its checksums. Parsing checks every field, so that a damaged file
// is refused with FSDP_ERR_CORRUPT naming what is wrong, never trusted.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "safetensors.h"

namespace fsdp::ckpt {

constexpr const char* kMetaFile = "fsdp_checkpoint.json";
// The metadata's own CRC-32: 8 lowercase hex digits and a newline. Without it
// a flipped digit in a field that stays in range (the step, the learning
// rate) would go unnoticed.
constexpr const char* kMetaCrcFile = "fsdp_checkpoint.json.crc32";
constexpr const char* kFormatName = "libfsdp-checkpoint";
constexpr int kFormatVersion = 1;
constexpr uint64_t kDefaultChunkBytes = 1u << 20;

struct ParamMeta {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t numel = 0;
  uint64_t offset = 0;  // in the unit's flat buffer (sharded checkpoints)
  double weight_decay = 0.0;
  // Its param group (fsdp_set_param_group), recorded only where set: the
  // lr scale (1: none) and Adam's betas (-1: the optimizer's).
  double lr_scale = 1.0;
  double beta1 = -1.0, beta2 = -1.0;
  // Frozen inside a trainable unit (fsdp_param_set_trainable): laid out in
  // the unit's frozen block, no optimizer state. Written only when false.
  bool trainable = true;
  // The step at which this param's state was fresh, where it differs from
  // its unit's (unfrozen on its own). Written when >= 0.
  int64_t state_fresh_at = -1;
};

struct UnitMeta {
  std::string name;
  uint64_t padded_numel = 0;  // flat buffer length, a multiple of shard_world
  std::vector<ParamMeta> params;
  // A frozen unit has no optimizer state: its files hold only its params.
  // "trainable" is written only when false.
  bool trainable = true;
  // The optimizer step at which its state was fresh (zeros): unfrozen then;
  // its updates are optimizer.step - state_fresh_at. Written when not 0.
  int64_t state_fresh_at = 0;
  // The trainable block's length: the front of the flat buffer, a multiple
  // of shard_world; the rest is the frozen block (FlatLayout). Written only
  // when it is not padded_numel (-1 here: padded_numel, one block).
  int64_t trainable_numel = -1;
  uint64_t shard_numel(int shard_world) const { return padded_numel / static_cast<uint64_t>(shard_world); }
  uint64_t trainable_block() const {
    return trainable_numel < 0 ? padded_numel : static_cast<uint64_t>(trainable_numel);
  }
  // The optimizer state tensors' length: each shard's slice of the trainable block.
  uint64_t state_shard_numel(int shard_world) const { return trainable_block() / static_cast<uint64_t>(shard_world); }
  // Which shard holds flat element `pos` (sharded), and where in its tensors.
  void locate(uint64_t pos, int shard_world, int* shard, uint64_t* within) const;
};

struct OptimizerMeta {
  std::string kind;  // "adamw", "adam", "sgd"
  // Per-element state tensors: {"exp_avg", "exp_avg_sq"}, {"momentum"} or {}.
  std::vector<std::string> state;
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0, momentum = 0;
  bool nesterov = false;
  int64_t step = 0;
  double last_grad_norm = 0;
};

struct ScalerMeta {
  double scale = 1.0;
  int64_t clean_steps = 0;
  uint64_t skipped_steps = 0;
};

struct Meta {
  std::string kind;  // "sharded" or "full"
  std::string library;
  int world_size = 1;
  std::string sharding;
  // Sharded: the number of shard files and of flat shards per unit. Full: 1.
  int shard_world = 1;
  uint64_t align_elems = 1;
  uint64_t chunk_bytes = kDefaultChunkBytes;
  OptimizerMeta optimizer;
  ScalerMeta scaler;
  std::vector<UnitMeta> units;
  std::vector<FileRecord> files;

  bool sharded() const { return kind == "sharded"; }
  const FileRecord& file(const std::string& name) const;
};

// Tensor names. Sharded files hold "units.<u>.param" of shape [shard_numel]
// and "units.<u>.<state>" of [state_shard_numel] (the trainable block's slice); model.safetensors holds each param under its own
// name and shape, optimizer.safetensors "<param>.<state>".
std::string shard_tensor(size_t unit, const std::string& kind);
std::string shard_file(int shard, int shard_world);
constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
// The kinds of tensor kept per unit (sharded) or per param (full): "param",
// then each optimizer state.
std::vector<std::string> tensor_kinds(const OptimizerMeta& o);
// The kinds the files hold for unit `u`: all of them, or "param" alone for a
// frozen unit (it has no optimizer state).
std::vector<std::string> tensor_kinds(const OptimizerMeta& o, const UnitMeta& u);
// A full checkpoint's tensors of one param: a frozen param's are its values alone.
std::vector<std::string> tensor_kinds(const OptimizerMeta& o, const UnitMeta& u, const ParamMeta& p);
// Full checkpoints: the file that holds a param's `kind`, and its tensor name.
const char* full_file(const std::string& kind);
std::string full_tensor(const std::string& param, const std::string& kind);
// The "library" field this build writes: "libfsdp MAJOR.MINOR.PATCH".
std::string library_name();

// "[3, 4]": a shape as messages and fsdp-ckpt print it.
std::string shape_string(const std::vector<int64_t>& shape);

std::string to_json(const Meta& m);
// The file records alone, as ranks send them to the rank that writes the
// metadata.
std::string files_to_json(const std::vector<FileRecord>& files);
std::vector<FileRecord> files_from_json(const std::string& text);
// Throws FSDP_ERR_CORRUPT naming `file` and the field.
Meta parse_meta(const std::string& file, const std::string& text);

}  // namespace fsdp::ckpt
