// src/ckpt/safetensors.cpp - see safetensors.h.
#include "safetensors.h"

#include <libdeflate.h>
#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

#include "../base/error.h"
#include "../base/text.h"
#include "strict_json.h"

namespace fsdp::ckpt {
namespace {

using nlohmann::json;

[[noreturn]] void corrupt(const char* kind, const std::string& file, const std::string& msg) {
  fail(FSDP_ERR_CORRUPT, std::string(kind) + " " + base::quote_path(file) + ": " + msg);
}

constexpr size_t kWriteBuffer = 4u << 20;

uint64_t load_u64_le(const unsigned char* b) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | b[i];
  return v;
}

void store_u64_le(unsigned char* b, uint64_t v) {
  for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
}

bool as_u64(const json& j, uint64_t* out) {
  if (j.is_number_unsigned()) {
    *out = j.get<uint64_t>();
    return true;
  }
  if (j.is_number_integer() && j.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(j.get<int64_t>());
    return true;
  }
  return false;
}

}  // namespace

const TensorInfo* Header::find(const std::string& name) const {
  for (const TensorInfo& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

size_t dtype_bytes(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL" || d == "F8_E4M3" || d == "F8_E5M2") return 1;
  return 0;
}

uint32_t crc32_of(const void* data, size_t n, uint32_t crc) {
  // The same CRC-32 as zlib's crc32() (and Python's zlib.crc32), computed with
  // carry-less multiplication where the CPU has it.
  return libdeflate_crc32(crc, data, n);
}

Header parse_header(const std::string& file, const char* text, size_t n, uint64_t file_size, const char* kind) {
  auto corrupt = [&](const std::string& msg) { ckpt::corrupt(kind, file, msg); };
  // As strict as the reference reader, so that no file loads here that it
  // refuses: nlohmann stops quietly at a NUL (NUL padding would pass for
  // spaces), skips a byte order mark, and keeps the last of repeated keys.
  if (const void* nul = std::memchr(text, '\0', n)) {
    uint64_t at = static_cast<uint64_t>(static_cast<const char*>(nul) - text);
    corrupt("its safetensors header has a NUL byte at header offset " + std::to_string(at) + " (file byte " +
            std::to_string(8 + at) + "); JSON allows none, and the format pads with spaces");
  }
  if (n >= 3 && std::memcmp(text, "\xEF\xBB\xBF", 3) == 0) {
    corrupt("its safetensors header starts with a UTF-8 byte order mark; it must start with '{'");
  }
  if (n == 0 || text[0] != '{') corrupt("its safetensors header does not start with '{'");
  StrictJson parsed = parse_strict_json(text, text + n);
  json& j = parsed.value;
  if (j.is_discarded()) corrupt("its safetensors header is not valid JSON");
  if (!j.is_object()) corrupt("its safetensors header is not a JSON object");
  if (const std::vector<std::string>& d = parsed.duplicate; !d.empty()) {
    if (d.size() == 1) {
      corrupt(d[0] == "__metadata__" ? std::string("its safetensors header has __metadata__ twice")
                                     : "its safetensors header names tensor " + base::quote(d[0]) + " twice");
    }
    corrupt("its safetensors header has key " + base::quote(d.back()) + " twice in the object of " +
            base::quote(d[d.size() - 2]));
  }
  Header h;
  h.json_bytes = n;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) corrupt("__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) corrupt("__metadata__ value " + base::quote(m.key()) + " is not a string");
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    std::string where = "tensor " + base::quote(name);
    if (!v.is_object()) corrupt(where + " is not described by an object");
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto off = v.find("data_offsets");
    if (dt == v.end() || !dt->is_string()) corrupt(where + " has no dtype string");
    if (sh == v.end() || !sh->is_array()) corrupt(where + " has no shape array");
    if (off == v.end() || !off->is_array() || off->size() != 2) corrupt(where + " has no data_offsets pair");
    TensorInfo t;
    t.name = name;
    t.dtype = dt->get<std::string>();
    size_t es = dtype_bytes(t.dtype);
    if (es == 0) corrupt(where + " has unknown dtype " + base::quote(t.dtype));
    uint64_t nbytes = es;
    for (const json& d : *sh) {
      uint64_t dim = 0;
      if (!as_u64(d, &dim) || dim > (uint64_t{1} << 62)) corrupt(where + " has a bad dimension in its shape");
      if (__builtin_mul_overflow(nbytes, dim, &nbytes)) corrupt(where + " has a shape too large to exist");
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    if (!as_u64((*off)[0], &t.begin) || !as_u64((*off)[1], &t.end) || t.end < t.begin) {
      corrupt(where + " has bad data_offsets");
    }
    if (t.end - t.begin != nbytes) {
      corrupt(where + " has data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + ") of " +
                        std::to_string(t.end - t.begin) + " bytes, but its dtype and shape need " +
                        std::to_string(nbytes));
    }
    h.tensors.push_back(std::move(t));
  }
  std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t pos = 0;
  for (const TensorInfo& t : h.tensors) {
    if (t.begin != pos) {
      corrupt("tensor " + base::quote(t.name) + " starts at data byte " + std::to_string(t.begin) +
                        ", expected " + std::to_string(pos) +
                        " (tensors must tile the data section without gaps or overlaps)");
    }
    pos = t.end;
  }
  if (file_size != 0 && h.data_start() + pos < file_size) {
    corrupt("its tensors end at byte " + std::to_string(h.data_start() + pos) + " but the file has " +
            std::to_string(file_size) + " bytes (padded, or not what its header describes)");
  }
  if (file_size != 0 && h.data_start() + pos > file_size) {
    // Truncated: name the first tensor that does not fit, and how many after it.
    auto past = std::find_if(h.tensors.begin(), h.tensors.end(),
                             [&](const TensorInfo& t) { return h.data_start() + t.end > file_size; });
    std::string which;
    if (past != h.tensors.end()) {
      auto after = h.tensors.end() - past - 1;
      which = ", but tensor " + base::quote(past->name) + " ends at byte " + std::to_string(h.data_start() + past->end) +
              (after > 0 ? " (and " + std::to_string(after) + " tensor(s) after it lie past the end too)" : "");
    }
    corrupt("truncated: it has " + std::to_string(file_size) + " bytes" + which + "; its header needs " +
            std::to_string(h.data_start() + pos));
  }
  return h;
}

Writer::Writer(const std::string& path, const std::string& record_name, std::vector<Entry> entries,
               const std::map<std::string, std::string>& metadata, uint64_t chunk_bytes)
    : entries_(std::move(entries)), chunk_bytes_(chunk_bytes) {
  nlohmann::ordered_json h;
  if (!metadata.empty()) h["__metadata__"] = metadata;
  uint64_t pos = 0;
  for (const Entry& e : entries_) {
    uint64_t n = dtype_bytes(e.dtype);
    if (n == 0) fail(FSDP_ERR_INTERNAL, "safetensors writer: unknown dtype " + base::quote(e.dtype));
    for (int64_t d : e.shape) n *= static_cast<uint64_t>(d);
    h[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {pos, pos + n}}};
    sizes_.push_back(n);
    pos += n;
    rec_.tensors[e.name] = TensorSums{};
  }
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  std::string head(8, '\0');
  store_u64_le(reinterpret_cast<unsigned char*>(head.data()), text.size());
  head += text;
  rec_.name = record_name;
  rec_.header_bytes = head.size();
  rec_.header_crc32 = crc32_of(head.data(), head.size());
  rec_.size = head.size() + pos;
  file_ = File::create(path);
  buf_.resize(kWriteBuffer);
  put(head.data(), head.size());
}

void Writer::checksum(const char* p, size_t n) {
  while (n > 0) {
    while (cur_ < entries_.size() && in_cur_ == sizes_[cur_]) {
      ++cur_;
      in_cur_ = 0;
    }
    if (cur_ == entries_.size()) fail(FSDP_ERR_INTERNAL, "checkpoint writer: more data than the header declares");
    TensorSums& sums = rec_.tensors[entries_[cur_].name];
    uint64_t in_chunk = in_cur_ % chunk_bytes_;
    uint64_t chunk_len = std::min(chunk_bytes_, sizes_[cur_] - (in_cur_ - in_chunk));
    size_t k = static_cast<size_t>(std::min<uint64_t>(n, chunk_len - in_chunk));
    chunk_crc_ = crc32_of(p, k, chunk_crc_);
    in_cur_ += k;
    p += k;
    n -= k;
    if (in_chunk + k == chunk_len) {
      sums.chunks.push_back(chunk_crc_);
      sums.crc32 = static_cast<uint32_t>(::crc32_combine(sums.crc32, chunk_crc_, static_cast<z_off_t>(chunk_len)));
      chunk_crc_ = 0;
    }
  }
}

void Writer::write(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  checksum(p, n);
  put(p, n);
}

void Writer::put(const char* p, size_t n) {
  if (buf_used_ + n > buf_.size()) flush();
  if (n >= buf_.size()) {
    file_.write_all(p, n);
    return;
  }
  std::memcpy(buf_.data() + buf_used_, p, n);
  buf_used_ += n;
}

void Writer::flush() {
  if (buf_used_ > 0) file_.write_all(buf_.data(), buf_used_);
  buf_used_ = 0;
}

FileRecord Writer::finish() {
  while (cur_ < entries_.size() && in_cur_ == sizes_[cur_]) {
    ++cur_;
    in_cur_ = 0;
  }
  if (cur_ != entries_.size()) {
    fail(FSDP_ERR_INTERNAL, "checkpoint writer: tensor " + base::quote(entries_[cur_].name) + " of " +
                                base::quote_path(file_.path()) + " was not completely written");
  }
  flush();
  file_.sync();
  file_.close();
  after_file_written();
  return rec_;
}

Reader::Reader(const std::string& path, const FileRecord* expect, uint64_t chunk_bytes, const char* kind)
    : file_(File::open_read(path)), expect_(expect), chunk_bytes_(chunk_bytes), kind_(kind) {
  auto corrupt = [&](const std::string& file, const std::string& msg) { ckpt::corrupt(kind_, file, msg); };
  uint64_t size = file_.size();
  if (expect_ != nullptr && size != expect_->size) {
    corrupt(path, "it has " + std::to_string(size) + " bytes, the checkpoint metadata says " +
                      std::to_string(expect_->size) + " (truncated or replaced)");
  }
  if (size < 8) corrupt(path, "it has " + std::to_string(size) + " bytes, too few for a safetensors header");
  unsigned char len[8];
  file_.pread_exact(0, len, 8);
  uint64_t n = load_u64_le(len);
  if (n > kMaxHeaderBytes || n > size - 8) {
    corrupt(path, "its safetensors header length " + std::to_string(n) + " does not fit in the file of " +
                      std::to_string(size) + " bytes");
  }
  std::vector<char> head(8 + n);
  std::memcpy(head.data(), len, 8);
  file_.pread_exact(8, head.data() + 8, n);
  if (expect_ != nullptr &&
      (8 + n != expect_->header_bytes || crc32_of(head.data(), head.size()) != expect_->header_crc32)) {
    corrupt(path, "its safetensors header fails its checksum");
  }
  header_ = parse_header(path, head.data() + 8, n, size, kind_);
  if (expect_ == nullptr) return;
  for (const auto& [name, sums] : expect_->tensors) {
    const TensorInfo& t = tensor(name);
    uint64_t chunks = (t.nbytes() + chunk_bytes_ - 1) / chunk_bytes_;
    if (t.dtype != "F32" || sums.chunks.size() != chunks) {
      corrupt(path,
              "tensor " + base::quote(name) + " does not match the checkpoint metadata (dtype or checksum count)");
    }
  }
  if (header_.tensors.size() != expect_->tensors.size()) {
    corrupt(path, "it holds " + std::to_string(header_.tensors.size()) + " tensors, the checkpoint metadata lists " +
                      std::to_string(expect_->tensors.size()));
  }
}

const TensorInfo& Reader::tensor(const std::string& name) const {
  const TensorInfo* t = header_.find(name);
  if (t == nullptr) corrupt(kind_, path(), "tensor " + base::quote(name) + " is missing");
  return *t;
}

void Reader::check_chunk(const TensorInfo& t, uint64_t chunk, const char* data, uint64_t n) const {
  if (crc32_of(data, n) != expect_->tensors.at(t.name).chunks[chunk]) {
    uint64_t b = chunk * chunk_bytes_;
    corrupt(kind_, path(), "tensor " + base::quote(t.name) + " fails its checksum in bytes [" + std::to_string(b) + ", " +
                        std::to_string(b + n) + ")");
  }
}

void Reader::read(const std::string& name, uint64_t offset, uint64_t n, void* out) const {
  const TensorInfo& t = tensor(name);
  if (offset > t.nbytes() || n > t.nbytes() - offset) {
    fail(FSDP_ERR_INTERNAL,
         "checkpoint read past the end of tensor " + base::quote(name) + " in " + base::quote_path(path()));
  }
  if (n == 0) return;
  uint64_t base = header_.data_start() + t.begin;
  char* dst = static_cast<char*>(out);
  if (expect_ == nullptr) {
    file_.pread_exact(base + offset, dst, n);
    return;
  }
  // Whole chunks are read in place and checked there; the partial chunks at
  // either end go through a scratch buffer.
  std::vector<char> scratch;
  const uint64_t c = chunk_bytes_;
  for (uint64_t k = offset / c; k * c < offset + n; ++k) {
    uint64_t cb = k * c;
    uint64_t ce = std::min(cb + c, t.nbytes());
    uint64_t wb = std::max(cb, offset);
    uint64_t we = std::min(ce, offset + n);
    if (wb == cb && we == ce) {
      file_.pread_exact(base + cb, dst + (cb - offset), ce - cb);
      check_chunk(t, k, dst + (cb - offset), ce - cb);
    } else {
      scratch.resize(ce - cb);
      file_.pread_exact(base + cb, scratch.data(), ce - cb);
      check_chunk(t, k, scratch.data(), ce - cb);
      std::memcpy(dst + (wb - offset), scratch.data() + (wb - cb), we - wb);
    }
  }
}

std::string Reader::verify_all() const {
  std::string problems;
  if (expect_ == nullptr) return problems;
  std::vector<char> buf(chunk_bytes_);
  for (const TensorInfo& t : header_.tensors) {
    const TensorSums& sums = expect_->tensors.at(t.name);
    uint32_t whole = 0;
    bool chunk_ok = true;
    for (uint64_t k = 0; k * chunk_bytes_ < t.nbytes(); ++k) {
      uint64_t len = std::min(chunk_bytes_, t.nbytes() - k * chunk_bytes_);
      file_.pread_exact(header_.data_start() + t.begin + k * chunk_bytes_, buf.data(), len);
      uint32_t crc = crc32_of(buf.data(), len);
      if (crc != sums.chunks[k] && chunk_ok) {
        problems += "checkpoint file " + base::quote_path(path()) + ": tensor " + base::quote(t.name) +
                    " fails its checksum in bytes [" + std::to_string(k * chunk_bytes_) + ", " +
                    std::to_string(k * chunk_bytes_ + len) + ")\n";
        chunk_ok = false;
      }
      whole = static_cast<uint32_t>(::crc32_combine(whole, crc, static_cast<z_off_t>(len)));
    }
    if (chunk_ok && whole != sums.crc32) {
      problems += "checkpoint file " + base::quote_path(path()) + ": tensor " + base::quote(t.name) +
                  " fails its whole-tensor checksum\n";
    }
  }
  return problems;
}

}  // namespace fsdp::ckpt
