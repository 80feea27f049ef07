// src/ckpt/pretrained.h - pretrained weights that any program wrote in the
// safetensors format (Hugging Face's save_pretrained, safetensors' save_file):
// where the files are, and how their tensor names become the host's param
// names (fsdp_load_pretrained's options).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::ckpt {

// The files of pretrained weights at `path`: the file itself; in a
// directory, the files that model.safetensors.index.json's weight_map names
// (each once, in name order), else model.safetensors. FSDP_ERR_IO for what is
// missing, FSDP_ERR_CORRUPT for an index that is not one (no weight_map
// object, a key twice, a file name with a '/' or a NUL), naming the file.
std::vector<std::string> pretrained_files(const std::string& path);

// fsdp_load_pretrained's options: "key=value" items separated by ';' or
// newlines. A file's tensor name T becomes the host's name by, in order:
// strip_prefix (T without it, where T starts with it), add_prefix, then the
// first rename rule FROM:TO whose FROM matches the whole name, where "{i}" in
// FROM stands for a number that replaces "{i}" in TO. transpose: globs ('*'
// any run of characters, '?' one) on the host's names of 2-D params stored
// transposed (GPT-2's Conv1D). strict: 1 (default) or 0.
struct PretrainedOptions {
  std::string strip_prefix;
  std::string add_prefix;
  std::vector<std::pair<std::string, std::string>> rename;
  std::vector<std::string> transpose;
  bool strict = true;
  // fsdp_export only: the files' dtype ("F32" or "BF16": dtype=fp32|bf16)
  // and the size past which they are split (max_shard_bytes; 0: one file).
  std::string dtype = "F32";
  uint64_t max_shard_bytes = 0;
};
// FSDP_ERR_INVALID_ARGUMENT naming the item it cannot take (`call` in the
// message; the export keys only where `for_export`). NULL: defaults.
PretrainedOptions parse_pretrained_options(const char* text, const char* call = "fsdp_load_pretrained",
                                           bool for_export = false);
std::string host_name(const PretrainedOptions& o, const std::string& tensor);
// The reverse, for an export: the file's name of the host's param `host`
// (the first rename rule whose TO matches, then without add_prefix, then
// with strip_prefix), so that the same options load what they exported.
std::string file_name(const PretrainedOptions& o, const std::string& host);
bool glob_match(const std::string& pattern, const std::string& name);

}  // namespace fsdp::ckpt
