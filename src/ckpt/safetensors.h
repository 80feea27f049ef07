// src/ckpt/safetensors.h - the safetensors file format (an 8-byte little-endian
// header length, a JSON header naming each tensor's dtype, shape and byte range,
// then the raw little-endian data), with CRC-32 checksums per tensor and per
// fixed-size chunk of it, so that a reader of part of a tensor can check what
// it read. The writer streams: data goes to disk as it is produced.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "io.h"

namespace fsdp::ckpt {

struct TensorInfo {
  std::string name;
  std::string dtype;  // "F32", "BF16", ... (safetensors spelling)
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte range inside the data section
  uint64_t end = 0;
  uint64_t nbytes() const { return end - begin; }
};

struct Header {
  uint64_t json_bytes = 0;          // N: the header's length, after the 8-byte prefix
  std::vector<TensorInfo> tensors;  // in data order
  std::map<std::string, std::string> metadata;
  uint64_t data_start() const { return 8 + json_bytes; }
  const TensorInfo* find(const std::string& name) const;
};

// Element size of a safetensors dtype; 0 for an unknown one.
size_t dtype_bytes(const std::string& dtype);
// Largest header accepted (the reference implementation's limit).
constexpr uint64_t kMaxHeaderBytes = 100u << 20;

// Parses a header's JSON (`n` bytes). Checks everything the format promises,
// as strictly as the reference reader: JSON that starts with '{' (no byte
// order mark), holds no NUL byte and repeats no key (trailing spaces, the
// format's padding, are fine); known dtypes, shapes matching byte ranges,
// ranges that tile the data section in order with no gap or overlap, and
// (when file_size != 0) a data section that ends exactly at the end of the
// file. Throws FSDP_ERR_CORRUPT naming `file` (as a `kind`: "checkpoint
// file") and the tensor.
Header parse_header(const std::string& file, const char* json, size_t n, uint64_t file_size,
                    const char* kind = "checkpoint file");

// Checksums of one tensor's bytes: the whole, and each chunk of chunk_bytes
// (the last one shorter).
struct TensorSums {
  uint32_t crc32 = 0;
  std::vector<uint32_t> chunks;
};

// What a checkpoint's metadata records about one file it wrote.
struct FileRecord {
  std::string name;  // relative to the checkpoint directory
  uint64_t size = 0;
  uint64_t header_bytes = 0;  // 8 + N
  uint32_t header_crc32 = 0;  // over those header_bytes
  std::map<std::string, TensorSums> tensors;
};

uint32_t crc32_of(const void* data, size_t n, uint32_t crc = 0);

// Writes one safetensors file (fp32 tensors unless an entry says BF16): the header at once, then the tensors'
// bytes in order as write() receives them.
class Writer {
 public:
  struct Entry {
    std::string name;
    std::vector<int64_t> shape;
    std::string dtype = "F32";  // "F32" or "BF16": write() then takes that dtype's bytes
  };
  Writer(const std::string& path, const std::string& record_name, std::vector<Entry> entries,
         const std::map<std::string, std::string>& metadata, uint64_t chunk_bytes);
  // The next `n` bytes of data, which may span tensors.
  void write(const void* data, size_t n);
  // Checks that every tensor was written, fsyncs and closes.
  FileRecord finish();

 private:
  void put(const char* p, size_t n);
  void flush();
  void checksum(const char* p, size_t n);

  File file_;
  FileRecord rec_;
  std::vector<Entry> entries_;
  std::vector<uint64_t> sizes_;
  uint64_t chunk_bytes_;
  size_t cur_ = 0;       // tensor being written
  uint64_t in_cur_ = 0;  // bytes of it written
  uint32_t chunk_crc_ = 0;
  std::vector<char> buf_;
  size_t buf_used_ = 0;
};

// One safetensors file opened for reading, its header parsed. With `expect`
// the header and size are checked against the metadata's record, and every
// read() verifies the chunks it touches. Its errors call the file a `kind`
// ("checkpoint file", "pretrained weights file").
class Reader {
 public:
  Reader(const std::string& path, const FileRecord* expect, uint64_t chunk_bytes,
         const char* kind = "checkpoint file");
  const Header& header() const { return header_; }
  const std::string& path() const { return file_.path(); }
  // The tensor, or FSDP_ERR_CORRUPT naming the file and tensor.
  const TensorInfo& tensor(const std::string& name) const;
  // Bytes [offset, offset + n) of tensor `name`.
  void read(const std::string& name, uint64_t offset, uint64_t n, void* out) const;
  // Reads every tensor whole and checks both kinds of checksum; returns the
  // problems found ("" if none).
  std::string verify_all() const;

 private:
  void check_chunk(const TensorInfo& t, uint64_t chunk, const char* data, uint64_t n) const;

  File file_;
  Header header_;
  const FileRecord* expect_;
  uint64_t chunk_bytes_;
  const char* kind_;
};

}  // namespace fsdp::ckpt
