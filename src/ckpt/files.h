// src/ckpt/files.h - a checkpoint's data files as fsdp_save and fsdp-ckpt both
// write them: which tensors each holds, in which order, with which safetensors
// metadata. One definition, so that the tool's output stays byte-identical to
// the library's.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "meta.h"

namespace fsdp::ckpt {

// Shard file `shard` of the sharded checkpoint `m`, created in `dir`: unit by
// unit, tensor_kinds(m.optimizer) of [shard_numel] each.
std::unique_ptr<Writer> create_shard_file(const std::string& dir, const Meta& m, int shard);

// The tensors of a full checkpoint: model.safetensors holds every param under
// its name and shape, optimizer.safetensors (none if the optimizer keeps no
// state) "<param>.<state>", unit by unit and within a unit one state at a
// time. A full checkpoint names tensors by param name, so a name used twice or
// reserved by safetensors is FSDP_ERR_INVALID_ARGUMENT, its message starting
// with `what`.
struct FullEntries {
  std::vector<Writer::Entry> model;
  std::vector<Writer::Entry> optimizer;
};
FullEntries full_entries(const Meta& m, const std::string& what);

// The writers of those files, created in `dir` (`optimizer` null when the
// optimizer keeps no state).
struct FullWriters {
  std::unique_ptr<Writer> model;
  std::unique_ptr<Writer> optimizer;
};
FullWriters create_full_files(const std::string& dir, const Meta& m, FullEntries entries);

}  // namespace fsdp::ckpt
