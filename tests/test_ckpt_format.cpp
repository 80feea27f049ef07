// White-box tests of the checkpoint format layer (src/ckpt): partial reads
// check exactly the chunks they touch, a reshard reads only the source files
// that overlap the new shard, and the safetensors header parser refuses
// ranges that do not tile the data section.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "base/error.h"
#include "ckpt/io.h"
#include "ckpt/meta.h"
#include "ckpt/reader.h"
#include "ckpt/safetensors.h"

namespace {

using namespace fsdp::ckpt;

std::string temp_dir() {
  std::string t = (std::filesystem::temp_directory_path() / "fsdp_ckpt_fmt_XXXXXX").string();
  return mkdtemp(t.data());
}

TEST(CheckpointFormat, PartialReadsAreExactAndCheckOnlyTheChunksTheyTouch) {
  std::string dir = temp_dir();
  const uint64_t chunk = 1024;  // 256 floats
  std::vector<float> a(1000), b(77);
  std::iota(a.begin(), a.end(), 0.f);
  std::iota(b.begin(), b.end(), 5000.f);
  Writer w(dir + "/t.safetensors", "t.safetensors", {{"a", {1000}}, {"b", {7, 11}}}, {{"k", "v"}}, chunk);
  w.write(a.data(), 10);  // pieces that cross chunk and tensor boundaries
  w.write(reinterpret_cast<char*>(a.data()) + 10, a.size() * 4 - 10);
  w.write(b.data(), b.size() * 4);
  FileRecord rec = w.finish();
  ASSERT_EQ(rec.tensors.at("a").chunks.size(), 4u);  // 4000 B in 1024 B chunks
  ASSERT_EQ(rec.tensors.at("a").crc32, crc32_of(a.data(), a.size() * 4));
  ASSERT_EQ(rec.tensors.at("b").crc32, crc32_of(b.data(), b.size() * 4));
  {
    Reader r(dir + "/t.safetensors", &rec, chunk);
    EXPECT_EQ(r.header().metadata.at("k"), "v");
    for (uint64_t lo : {0, 1, 255, 256, 300, 999})
      for (uint64_t n : {1, 2, 256, 700}) {
        if (lo + n > 1000) continue;
        std::vector<float> got(n);
        r.read("a", lo * 4, n * 4, got.data());
        EXPECT_EQ(0, std::memcmp(got.data(), a.data() + lo, n * 4)) << lo << "+" << n;
      }
  }
  // Damage chunk 2 of "a" (floats 512..767): reads of other chunks still
  // succeed, any read touching it fails naming the tensor and bytes.
  std::string path = dir + "/t.safetensors";
  uint64_t data0 = rec.header_bytes;
  {
    std::FILE* f = std::fopen(path.c_str(), "r+b");
    std::fseek(f, long(data0 + 600 * 4), SEEK_SET);
    std::fputc(0x55, f);
    std::fclose(f);
  }
  Reader r(path, &rec, chunk);
  std::vector<float> got(256);
  EXPECT_NO_THROW(r.read("a", 0, 256 * 4, got.data()));
  EXPECT_NO_THROW(r.read("a", 768 * 4, 232 * 4, got.data()));
  try {
    r.read("a", 700 * 4, 4, got.data());
    ADD_FAILURE() << "a damaged chunk was read without error";
  } catch (const fsdp::Error& e) {
    EXPECT_EQ(e.status(), FSDP_ERR_CORRUPT);
    EXPECT_NE(std::string(e.what()).find("tensor 'a' fails its checksum in bytes [2048, 3072)"), std::string::npos)
        << e.what();
  }
  // The same through a read of exactly that chunk (checked in place) and one
  // spanning it whole.
  for (auto [lo, n] : {std::pair<uint64_t, uint64_t>{512, 256}, {300, 600}}) {
    std::vector<float> buf(n);
    try {
      r.read("a", lo * 4, n * 4, buf.data());
      ADD_FAILURE() << "a damaged chunk was read without error: floats " << lo << "+" << n;
    } catch (const fsdp::Error& e) {
      EXPECT_NE(std::string(e.what()).find("[2048, 3072)"), std::string::npos) << e.what();
    }
  }
  EXPECT_NE(r.verify_all().find("tensor 'a'"), std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST(CheckpointFormat, HeaderRangesMustTileTheDataSection) {
  auto parse = [](const std::string& j, uint64_t file_size) {
    return parse_header("f", j.data(), j.size(), file_size);
  };
  const std::string ok =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[],"data_offsets":[8,10]}})";
  EXPECT_EQ(parse(ok, 8 + ok.size() + 10).tensors.size(), 2u);
  EXPECT_THROW(parse(ok, 8 + ok.size() + 11), fsdp::Error);  // trailing bytes
  const std::string gap = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  EXPECT_THROW(parse(gap, 0), fsdp::Error);
  const std::string overlap =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  EXPECT_THROW(parse(overlap, 0), fsdp::Error);
  const std::string wrong_size = R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})";
  EXPECT_THROW(parse(wrong_size, 0), fsdp::Error);
  const std::string dtype = R"({"a":{"dtype":"F31","shape":[2],"data_offsets":[0,8]}})";
  EXPECT_THROW(parse(dtype, 0), fsdp::Error);
}

// A sharded checkpoint of one unit at shard_world 4; loading it at world 4
// reads only the file of the rank's own shard: the other three may be gone.
TEST(CheckpointFormat, ReshardReadsOnlyTheOverlappingSourceFiles) {
  std::string dir = temp_dir();
  fsdp::FlatLayout lay({{"w", {10, 10}, 100}, {"b", {5}, 5}}, 4, 4);
  std::vector<float> flat(lay.padded_numel(), 0.f);
  for (size_t i = 0; i < 100; ++i) flat[lay.param_offset(0) + i] = float(i);
  for (size_t i = 0; i < 5; ++i) flat[lay.param_offset(1) + i] = 100.f + float(i);
  Meta m;
  m.kind = "sharded";
  m.library = "test";
  m.world_size = 4;
  m.sharding = "FULL_SHARD";
  m.shard_world = 4;
  m.align_elems = 4;
  m.optimizer.kind = "sgd";
  m.units.push_back(
      {"u", lay.padded_numel(), {{"w", {10, 10}, 100, lay.param_offset(0), 0}, {"b", {5}, 5, lay.param_offset(1), 0}}});
  const size_t n = lay.shard_numel();
  for (int s = 0; s < 4; ++s) {
    Writer w(dir + "/" + shard_file(s, 4), shard_file(s, 4), {{shard_tensor(0, "param"), {int64_t(n)}}}, {},
             m.chunk_bytes);
    w.write(flat.data() + size_t(s) * n, n * 4);
    m.files.push_back(w.finish());
  }
  write_meta(dir, m);
  for (int s : {1, 2, 3}) std::filesystem::remove(dir + "/" + shard_file(s, 4));
  CheckpointReader r(dir);
  std::vector<float> got(n);
  r.read_shard(0, "param", lay, 0, got.data());
  EXPECT_EQ(0, std::memcmp(got.data(), flat.data(), n * 4));
  // World 1 needs every file: the first missing one is named.
  fsdp::FlatLayout one({{"w", {10, 10}, 100}, {"b", {5}, 5}}, 16, 1);
  std::vector<float> all(one.shard_numel());
  try {
    r.read_shard(0, "param", one, 0, all.data());
    ADD_FAILURE() << "read a missing file";
  } catch (const fsdp::Error& e) {
    EXPECT_EQ(e.status(), FSDP_ERR_CORRUPT);
    EXPECT_NE(std::string(e.what()).find(shard_file(1, 4)), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

}  // namespace

// Every refusal of a metadata document names the field it is about (its path,
// "optimizer.lr", "units[0].params[1].shape"), never just "the document":
// each leaf of real metadata is replaced in turn by values of the wrong type
// or range.
TEST(CheckpointFormat, EveryMetadataErrorNamesTheFieldPath) {
  for (const char* name : {"meta_sharded_adamw.json", "meta_full_adamw.json", "meta_sharded_sgd.json"}) {
    SCOPED_TRACE(name);
    std::ifstream in(std::string(FSDP_FUZZ_CORPUS) + "/" + name);
    std::stringstream ss;
    ss << in.rdbuf();
    const nlohmann::json doc = nlohmann::json::parse(ss.str());
    ASSERT_NO_THROW(parse_meta(name, doc.dump())) << "the seed must be valid";
    const nlohmann::json flat = doc.flatten();
    size_t refused = 0;
    for (const auto& leaf : flat.items()) {
      for (const nlohmann::json& bad : {nlohmann::json(0), nlohmann::json(-1), nlohmann::json("x"), nlohmann::json(),
                                        nlohmann::json(1e300), nlohmann::json(true)}) {
        nlohmann::json edited = flat;
        edited[leaf.key()] = bad;
        std::string text = edited.unflatten().dump();
        try {
          parse_meta(name, text);
        } catch (const fsdp::Error& e) {
          ++refused;
          const std::string msg = e.what();
          EXPECT_EQ(e.status(), FSDP_ERR_CORRUPT) << msg;
          EXPECT_EQ(msg.find(": the document "), std::string::npos)
              << leaf.key() << " = " << bad.dump() << " is refused without naming a field: " << msg;
        }
      }
    }
    EXPECT_GT(refused, flat.size()) << "too few edits were refused for the test to mean anything";
  }
}
