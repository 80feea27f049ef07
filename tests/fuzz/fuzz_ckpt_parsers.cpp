// libFuzzer target over everything libfsdp parses from a checkpoint before it
// trusts it: the metadata JSON (parse_meta) and a safetensors file's header
// (the length prefix, then parse_header), and the file records ranks exchange
// while saving. Any input must give a result or an fsdp::Error, never a crash,
// a hang, a sanitizer report or another exception type.
#include <cstddef>
#include <cstdint>
#include <string>

#include "base/error.h"
#include "ckpt/meta.h"
#include "ckpt/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char* text = reinterpret_cast<const char*>(data);
  try {
    fsdp::ckpt::Meta m = fsdp::ckpt::parse_meta("fuzz.json", std::string(text, size));
    // What parses must write back to the same thing.
    fsdp::ckpt::Meta again = fsdp::ckpt::parse_meta("fuzz.json", fsdp::ckpt::to_json(m));
    if (fsdp::ckpt::to_json(again) != fsdp::ckpt::to_json(m)) __builtin_trap();
  } catch (const fsdp::Error&) {
  }
  try {
    fsdp::ckpt::files_from_json(std::string(text, size));
  } catch (const fsdp::Error&) {
  }
  if (size >= 8) {
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | data[i];
    if (n <= size - 8) {
      try {
        fsdp::ckpt::parse_header("fuzz.safetensors", text + 8, static_cast<size_t>(n), size);
      } catch (const fsdp::Error&) {
      }
    }
  }
  return 0;
}
