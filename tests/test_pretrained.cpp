// fsdp_load_pretrained: params from safetensors files that the test writes
// itself, byte by byte, as another program would (no libfsdp metadata, no
// checksums): F32, BF16 and F16 tensors land as the test's own exact
// conversions; names go through strip_prefix, add_prefix and rename rules;
// transposed 2-D tensors; a Hugging Face index over two files; at worlds 1
// and 3 under FULL_SHARD, SHARD_GRAD_OP and offload, each rank reading its
// shard. Misfits name every offender and change nothing; a truncated file is
// FSDP_ERR_CORRUPT naming it; strict=0 loads what matches and reports the rest.
// Headers and indexes are read as strictly as safetensors' own reader does.
#include <gtest/gtest.h>
#include <malloc.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "rank_runner.h"

using namespace fsdp_test;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("fsdp_pretrained_" + std::to_string(::getpid()) + "_" +
                                        std::to_string(reinterpret_cast<uintptr_t>(this)));
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

// A tensor as a file holds it: its dtype, shape and values (already what the
// dtype can represent: the expected fp32 values).
struct FileTensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::vector<float> values;
};

FileTensor make_tensor(const std::string& name, const std::string& dtype, std::vector<int64_t> shape, uint64_t seed) {
  size_t n = numel_of(shape);
  std::vector<float> v = Rng(seed).uniform_vec(n, -2.f, 2.f);
  if (dtype == "BF16" || dtype == "F16") {
    const fsdp_dtype_t dt = dtype == "BF16" ? FSDP_DTYPE_BF16 : FSDP_DTYPE_FP16;
    for (float& x : v) x = round_to(dt, x);
  }
  return {name, dtype, std::move(shape), std::move(v)};
}

// A safetensors file's parts: the JSON header and the data section.
std::pair<std::string, std::string> safetensors_parts(const std::vector<FileTensor>& tensors) {
  nlohmann::ordered_json head = nlohmann::ordered_json::object();
  head["__metadata__"] = {{"format", "pt"}};
  std::string data;
  for (const FileTensor& t : tensors) {
    const bool f32 = t.dtype == "F32", bf16 = t.dtype == "BF16";
    std::string bytes(t.values.size() * (f32 ? 4 : 2), '\0');
    if (f32 && !bytes.empty()) std::memcpy(&bytes[0], t.values.data(), bytes.size());
    for (size_t i = 0; !f32 && i < t.values.size(); ++i) {
      const uint16_t h = bf16 ? f32_to_bf16(t.values[i]) : f32_to_fp16(t.values[i]);
      std::memcpy(&bytes[2 * i], &h, 2);
    }
    head[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {data.size(), data.size() + bytes.size()}}};
    data += bytes;
  }
  return {head.dump(), data};
}

// A file of these bytes as they are: 8-byte header length, header, data.
void write_raw(const std::string& path, const std::string& header, const std::string& data) {
  uint64_t n = header.size();
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(&n), 8);
  f << header << data;
}

void write_safetensors(const std::string& path, const std::vector<FileTensor>& tensors) {
  auto [header, data] = safetensors_parts(tensors);
  write_raw(path, header, data);
}

// file_tensors() `ts` as Hugging Face shards them, two files in `dir`; the
// index that goes with them is returned, for the test to write.
nlohmann::json write_shards(const std::string& dir, const std::vector<FileTensor>& ts) {
  fs::create_directories(dir);
  write_safetensors(dir + "/model-00001-of-00002.safetensors", {ts[0], ts[2], ts[4]});
  write_safetensors(dir + "/model-00002-of-00002.safetensors", {ts[1], ts[3]});
  nlohmann::json idx = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json::object()}};
  for (size_t k : {0, 2, 4}) idx["weight_map"][ts[k].name] = "model-00001-of-00002.safetensors";
  for (size_t k : {1, 3}) idx["weight_map"][ts[k].name] = "model-00002-of-00002.safetensors";
  return idx;
}

// The host's params: two units, names as the host calls them.
const std::vector<std::vector<ParamSpec>> kUnits = {
    {{"embed.weight", {7, 6}}, {"norm.bias", {6}}},
    {{"blocks.0.qkv.weight", {9, 6}}, {"blocks.0.qkv.bias", {9}}, {"blocks.1.qkv.weight", {9, 6}}}};

// The files' tensors for kUnits, HF-style names and layouts: qkv weights
// stored transposed ([6, 9]), under "transformer." and "h.{i}.attn.c_attn".
std::vector<FileTensor> file_tensors() {
  return {make_tensor("transformer.wte.weight", "F32", {7, 6}, 1),
          make_tensor("transformer.ln_f.bias", "BF16", {6}, 2),
          make_tensor("transformer.h.0.attn.c_attn.weight", "F16", {6, 9}, 3),
          make_tensor("transformer.h.0.attn.c_attn.bias", "BF16", {9}, 4),
          make_tensor("transformer.h.1.attn.c_attn.weight", "F32", {6, 9}, 5)};
}

const char* kOptions =
    "strip_prefix=transformer.;rename=wte.weight:embed.weight;rename=ln_f.bias:norm.bias;"
    "rename=h.{i}.attn.c_attn.weight:blocks.{i}.qkv.weight\nrename=h.{i}.attn.c_attn.bias:blocks.{i}.qkv.bias;"
    "transpose=blocks.*.qkv.weight";

// A 2-D tensor's values transposed: what a host that registers it the other
// way round holds.
std::vector<float> transposed(const FileTensor& t) {
  size_t r = size_t(t.shape[0]), c = size_t(t.shape[1]);
  std::vector<float> out(r * c);
  for (size_t i = 0; i < r; ++i)
    for (size_t j = 0; j < c; ++j) out[j * r + i] = t.values[i * c + j];
  return out;
}

// The params the files should give, in kUnits' order (the transposes undone).
std::vector<std::vector<std::vector<float>>> expected(const std::vector<FileTensor>& ts) {
  return {{ts[0].values, ts[1].values}, {transposed(ts[2]), ts[3].values, transposed(ts[4])}};
}

struct Ctx {
  CtxPtr ctx;
  std::vector<fsdp_unit_t*> units;
};

void open(Ctx& c, const std::map<std::string, std::string>& opts, int rank, fsdp_local_group_t* group,
          const std::vector<std::vector<ParamSpec>>& units = kUnits) {
  ConfigPtr cfg = make_config(opts);
  ASSERT_TRUE(cfg);
  fsdp_ctx_t* raw = nullptr;
  ASSERT_OK(fsdp_ctx_create(cfg.get(), group, group ? rank : -1, &raw));
  c.ctx.reset(raw);
  for (size_t k = 0; k < units.size(); ++k) {
    fsdp_unit_t* u = nullptr;
    ASSERT_OK(register_unit(raw, "u" + std::to_string(k), units[k], &u));
    c.units.push_back(u);
    for (size_t i = 0; i < units[k].size(); ++i) {
      std::vector<float> v(numel_of(units[k][i].shape), 0.5f);
      ASSERT_OK(fsdp_param_set_values(u, i, v.data(), v.size()));
    }
  }
}

std::vector<std::vector<std::vector<float>>> gather(Ctx& c, const std::vector<std::vector<ParamSpec>>& units = kUnits) {
  std::vector<std::vector<std::vector<float>>> out(units.size());
  for (size_t k = 0; k < units.size(); ++k) {
    for (size_t i = 0; i < units[k].size(); ++i) {
      out[k].emplace_back(numel_of(units[k][i].shape));
      EXPECT_OK(fsdp_gather_param(c.units[k], i, out[k].back().data(), out[k].back().size()));
    }
  }
  return out;
}

struct Case {
  int world;
  const char* sharding;
  bool offload;
  bool index;  // two files and a model.safetensors.index.json
};

class Pretrained : public ::testing::TestWithParam<Case> {};

TEST_P(Pretrained, EveryDtypeNameRuleAndTransposeLandsExactly) {
  const Case c = GetParam();
  TempDir tmp;
  const auto ts = file_tensors();
  std::string path;
  if (c.index) {
    const nlohmann::json idx = write_shards(tmp / "hf", ts);
    std::ofstream(tmp / "hf/model.safetensors.index.json") << idx.dump();
    path = tmp / "hf";
  } else {
    path = tmp / "weights.safetensors";
    write_safetensors(path, ts);
  }
  const auto want = expected(ts);
  run_ranks(c.world, [&](int rank, fsdp_local_group_t* group) {
    std::map<std::string, std::string> opts = {{"sharding", c.sharding}};
    if (c.offload) opts["offload"] = "cpu";
    Ctx x;
    open(x, opts, rank, group);
    if (HasFatalFailure()) return;
    ASSERT_OK(fsdp_load_pretrained(x.ctx.get(), path.c_str(), kOptions));
    const auto got = gather(x);
    for (size_t k = 0; k < want.size(); ++k)
      for (size_t i = 0; i < want[k].size(); ++i)
        EXPECT_EQ(got[k][i], want[k][i]) << kUnits[k][i].name << " on rank " << rank;
    uint64_t step = 7;
    EXPECT_OK(fsdp_ctx_step(x.ctx.get(), &step));
    EXPECT_EQ(step, 0u);
    EXPECT_OK(fsdp_ctx_finalize(x.ctx.get()));
  });
}

INSTANTIATE_TEST_SUITE_P(Files, Pretrained,
                         ::testing::Values(Case{1, "FULL_SHARD", false, false}, Case{3, "FULL_SHARD", false, false},
                                           Case{3, "SHARD_GRAD_OP", false, true}, Case{2, "FULL_SHARD", true, true}),
                         [](const auto& i) {
                           return std::string(i.param.sharding) + "_world" + std::to_string(i.param.world) +
                                  (i.param.offload ? "_offload" : "") + (i.param.index ? "_index" : "_file");
                         });

// Misfits are named, all of them, and change nothing; a truncated file is
// corrupt, named; strict=0 loads what matches and reports the rest.
TEST(PretrainedMisuse, MisfitsAreNamedTruncatedFilesRefusedAndNonStrictLoadsWhatMatches) {
  TempDir tmp;
  auto ts = file_tensors();
  const std::string path = tmp / "w.safetensors";
  write_safetensors(path, ts);
  std::string full;
  {
    std::ifstream f(path, std::ios::binary);
    full.assign(std::istreambuf_iterator<char>(f), {});
  }
  std::ofstream(tmp / "cut.safetensors", std::ios::binary) << full.substr(0, full.size() - 10);
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    Ctx x;
    open(x, {{"sharding", "FULL_SHARD"}}, rank, group);
    if (HasFatalFailure()) return;
    const auto before = gather(x);
    // Without the transpose the qkv shapes differ; without the renames the names.
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT,
                  fsdp_load_pretrained(x.ctx.get(), path.c_str(), "strip_prefix=transformer."));
    std::string msg = last_error_str();
    EXPECT_NE(msg.find("registered but in no file: 'embed.weight', 'norm.bias', 'blocks.0.qkv.weight'"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("in the files but not registered: 'h.0.attn.c_attn.bias (transformer.h.0.attn.c_attn.bias)'"),
              std::string::npos)
        << msg;
    std::string no_transpose = kOptions;
    no_transpose = no_transpose.substr(0, no_transpose.find(";transpose"));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_load_pretrained(x.ctx.get(), path.c_str(), no_transpose.c_str()));
    msg = last_error_str();
    EXPECT_NE(msg.find("shapes differ: 'blocks.0.qkv.weight' ([6, 9] in"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'blocks.1.qkv.weight'"), std::string::npos) << msg;
    EXPECT_EQ(msg.rfind("fsdp_load_pretrained: '", 0), 0u) << "named once, then the path: " << msg;
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_load_pretrained(x.ctx.get(), path.c_str(), "colour=blue"));
    EXPECT_NE(last_error_str().find("'colour=blue' has an unknown key"), std::string::npos) << last_error_str();
    EXPECT_STATUS(FSDP_ERR_CORRUPT,
                  fsdp_load_pretrained(x.ctx.get(), (tmp / "cut.safetensors").c_str(), kOptions));
    msg = last_error_str();
    EXPECT_NE(msg.find("pretrained weights file '" + tmp / "cut.safetensors" + "': truncated"), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("tensor 'transformer.h.1.attn.c_attn.weight' ends at byte"), std::string::npos) << msg;
    EXPECT_STATUS(FSDP_ERR_IO, fsdp_load_pretrained(x.ctx.get(), (tmp / "none").c_str(), kOptions));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_load_pretrained(x.ctx.get(), nullptr, kOptions));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_load_pretrained(nullptr, path.c_str(), kOptions));
    EXPECT_EQ(gather(x), before) << "a refused load changed params";
    // Not strict: without the bias rule, blocks.0.qkv.bias keeps its value
    // and the file's bias is reported unexpected.
    std::string partial = std::string(kOptions) + ";strict=0";
    size_t rule = partial.find("\nrename=h.{i}.attn.c_attn.bias:blocks.{i}.qkv.bias");
    partial.erase(rule, std::string("\nrename=h.{i}.attn.c_attn.bias:blocks.{i}.qkv.bias").size());
    ASSERT_OK(fsdp_load_pretrained(x.ctx.get(), path.c_str(), partial.c_str()));
    const auto got = gather(x);
    const auto want = expected(ts);
    EXPECT_EQ(got[0], want[0]);
    EXPECT_EQ(got[1][0], want[1][0]);
    EXPECT_EQ(got[1][1], before[1][1]) << "the param left out changed";
    EXPECT_EQ(got[1][2], want[1][2]);
    size_t n = 0;
    fsdp_load_report(x.ctx.get(), nullptr, 0, &n);
    std::string report(n + 1, '\0');
    ASSERT_OK(fsdp_load_report(x.ctx.get(), report.data(), report.size(), &n));
    report.resize(n);
    EXPECT_EQ(report,
              "missing: blocks.0.qkv.bias\nunexpected: h.0.attn.c_attn.bias (transformer.h.0.attn.c_attn.bias)\n");
    EXPECT_OK(fsdp_ctx_finalize(x.ctx.get()));
  });
}

// A read that fails after the headers were checked (a disk error, injected
// on rank 1 after its first unit): every rank returns FSDP_ERR_IO, the
// message says the params are partly loaded, and loading again mends them.
TEST(PretrainedMisuse, AReadErrorOnOneRankFailsEveryRankSayingSoAndLoadingAgainMendsIt) {
  TempDir tmp;
  const auto ts = file_tensors();
  const std::string path = tmp / "w.safetensors";
  write_safetensors(path, ts);
  const auto want = expected(ts);
  setenv("FSDP_CKPT_FAULT", "read_error_rank=1", 1);
  Meeting failed(2);
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    Ctx x;
    open(x, {{"sharding", "FULL_SHARD"}}, rank, group);
    if (HasFatalFailure()) return;
    fsdp_status_t st = fsdp_load_pretrained(x.ctx.get(), path.c_str(), kOptions);
    std::string msg = last_error_str();
    EXPECT_EQ(st, FSDP_ERR_IO) << msg;
    EXPECT_NE(msg.find("injected by FSDP_CKPT_FAULT"), std::string::npos) << msg;
    EXPECT_NE(msg.find("the params are now partly loaded; load again"), std::string::npos) << msg;
    if (rank == 0) {
      EXPECT_NE(msg.find("failed on rank 1"), std::string::npos) << msg;
    }
    failed.meet(rank, [] { unsetenv("FSDP_CKPT_FAULT"); });  // no rank reads it meanwhile
    ASSERT_OK(fsdp_load_pretrained(x.ctx.get(), path.c_str(), kOptions));
    EXPECT_EQ(gather(x), want);
    EXPECT_OK(fsdp_ctx_finalize(x.ctx.get()));
  });
  unsetenv("FSDP_CKPT_FAULT");
}

// A load that must be refused: FSDP_ERR_CORRUPT on every rank, saying
// `says`, and the params as they were.
void expect_corrupt(const std::string& path, const std::string& says) {
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    Ctx x;
    open(x, {{"sharding", "FULL_SHARD"}}, rank, group);
    if (::testing::Test::HasFatalFailure()) return;
    const auto before = gather(x);
    EXPECT_STATUS(FSDP_ERR_CORRUPT, fsdp_load_pretrained(x.ctx.get(), path.c_str(), kOptions));
    EXPECT_NE(last_error_str().find(says), std::string::npos) << last_error_str();
    EXPECT_EQ(gather(x), before) << "a refused load changed params";
    EXPECT_OK(fsdp_ctx_finalize(x.ctx.get()));
  });
}

// A header the reference reader (safetensors' own, serde_json) refuses, made
// from a well-formed one, and what the refusal says after the file's name.
struct MalformedHeader {
  const char* name;
  std::string (*make)(const std::string& header);
  std::string (*says)(const std::string& header);
};

const MalformedHeader kMalformed[] = {
    {"ByteOrderMark", [](const std::string& h) { return "\xEF\xBB\xBF" + h; },
     [](const std::string&) { return std::string("its safetensors header starts with a UTF-8 byte order mark"); }},
    // nlohmann stops at a NUL as at the end of its input: NUL padding
    // would load as if it were spaces.
    {"NulPadding", [](const std::string& h) { return h + std::string(3, '\0'); },
     [](const std::string& h) {
       return "its safetensors header has a NUL byte at header offset " + std::to_string(h.size()) + " (file byte " +
              std::to_string(8 + h.size()) + ")";
     }},
    // The last tensor's entry again, the same: a parser that keeps either
    // one would load the file.
    {"DuplicateTensorName",
     [](const std::string& h) {
       auto head = nlohmann::ordered_json::parse(h);
       auto last = std::prev(head.end());
       return h.substr(0, h.size() - 1) + "," + nlohmann::json(last.key()).dump() + ":" + last.value().dump() + "}";
     },
     [](const std::string&) {
       return std::string("its safetensors header names tensor 'transformer.h.1.attn.c_attn.weight' twice");
     }},
    {"DuplicateKeyInATensor",
     [](const std::string& h) {
       std::string dtype = R"("dtype":"F32",)";
       return std::string(h).insert(h.find(dtype), dtype);
     },
     [](const std::string&) {
       return std::string("its safetensors header has key 'dtype' twice in the object of 'transformer.wte.weight'");
     }},
};

void PrintTo(const MalformedHeader& m, std::ostream* os) { *os << m.name; }

class PretrainedStrict : public ::testing::TestWithParam<MalformedHeader> {};

TEST_P(PretrainedStrict, AHeaderTheReferenceReaderRefusesIsCorruptNamingTheFileAndChangesNothing) {
  TempDir tmp;
  const auto [header, data] = safetensors_parts(file_tensors());
  const std::string path = tmp / "w.safetensors";
  write_raw(path, GetParam().make(header), data);
  expect_corrupt(path, "pretrained weights file '" + path + "': " + GetParam().says(header));
}

INSTANTIATE_TEST_SUITE_P(Headers, PretrainedStrict, ::testing::ValuesIn(kMalformed),
                         [](const auto& i) { return std::string(i.param.name); });

// Spaces after the header's JSON are the format's padding (writers align the
// data section to 8 bytes with them): the file loads, every value as written.
TEST(PretrainedStrict, SpacesAfterTheHeaderArePaddingAndLoad) {
  TempDir tmp;
  const auto ts = file_tensors();
  const auto [header, data] = safetensors_parts(ts);
  const std::string path = tmp / "w.safetensors";
  write_raw(path, header + std::string(8 + (8 - header.size() % 8) % 8, ' '), data);
  const auto want = expected(ts);
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    Ctx x;
    open(x, {{"sharding", "FULL_SHARD"}}, rank, group);
    if (HasFatalFailure()) return;
    ASSERT_OK(fsdp_load_pretrained(x.ctx.get(), path.c_str(), kOptions));
    EXPECT_EQ(gather(x), want);
    EXPECT_OK(fsdp_ctx_finalize(x.ctx.get()));
  });
}

// "\u0000" in a weight_map file name: cut there, as the system would open
// it, the name is a file of the directory, and the load would go ahead.
TEST(PretrainedStrict, AnIndexNamingAFileWithANulIsCorruptNamingTheIndex) {
  TempDir tmp;
  const auto ts = file_tensors();
  nlohmann::json idx = write_shards(tmp / "hf", ts);
  for (size_t k : {1, 3})
    idx["weight_map"][ts[k].name] = "model-00002-of-00002.safetensors" + std::string(1, '\0') + ".bak";
  std::ofstream(tmp / "hf/model.safetensors.index.json") << idx.dump();
  expect_corrupt(tmp / "hf", "pretrained index '" + tmp / "hf/model.safetensors.index.json" + "': tensor '" +
                                 ts[3].name + "' is mapped to a file name with a NUL byte");
}

// A tensor mapped twice, to the same file: nlohmann alone would keep one.
TEST(PretrainedStrict, AnIndexWithAKeyTwiceIsCorruptNamingIt) {
  TempDir tmp;
  const auto ts = file_tensors();
  std::string text = write_shards(tmp / "hf", ts).dump();  // ends with the weight_map's "}}"
  text.insert(text.size() - 2, ",\"" + ts[0].name + "\":\"model-00001-of-00002.safetensors\"");
  std::ofstream(tmp / "hf/model.safetensors.index.json") << text;
  expect_corrupt(tmp / "hf", "pretrained index '" + tmp / "hf/model.safetensors.index.json" + "' has key '" +
                                 ts[0].name + "' twice in the object of 'weight_map'");
}

// Large enough that what a load holds shows: a transposed param whose shard
// spans many rows of the file (1024 x 4096 stored), one of more host rows
// than a piece (300000 x 1, stored 1 x 300000), and untransposed F32 and BF16.
const std::vector<std::vector<ParamSpec>> kBigUnits = {{{"wide.weight", {4096, 1024}}, {"tall.weight", {300000, 1}}},
                                                       {{"plain.weight", {1000, 1100}}, {"half.weight", {700, 900}}}};

std::vector<FileTensor> big_tensors() {
  return {make_tensor("wide.weight", "F16", {1024, 4096}, 11), make_tensor("tall.weight", "BF16", {1, 300000}, 12),
          make_tensor("plain.weight", "F32", {1000, 1100}, 13), make_tensor("half.weight", "BF16", {700, 900}, 14)};
}
const char* kBigOptions = "transpose=wide.weight;transpose=tall.weight";

std::vector<std::vector<std::vector<float>>> big_expected(const std::vector<FileTensor>& ts) {
  return {{transposed(ts[0]), transposed(ts[1])}, {ts[2].values, ts[3].values}};
}

// fsdp_load_pretrained holds 2 MiB of host memory above the steady state
// (a piece of the file's bytes and a piece of fp32 values), whatever the
// params' sizes, counted in fsdp_memory_stats; and it lands every value.
TEST(PretrainedMemory, ALoadHoldsTwoMiBAboveTheSteadyStateAndLandsEveryValue) {
  TempDir tmp;
  const auto ts = big_tensors();
  const std::string path = tmp / "big.safetensors";
  write_safetensors(path, ts);
  const auto want = big_expected(ts);
  for (int world : {1, 2}) {
    for (const char* offload : {"none", "cpu"}) {
      SCOPED_TRACE("world " + std::to_string(world) + ", offload=" + offload);
      run_ranks(world, [&](int rank, fsdp_local_group_t* group) {
        Ctx x;
        open(x, {{"sharding", "FULL_SHARD"}, {"offload", offload}}, rank, group, kBigUnits);
        if (HasFatalFailure()) return;
        ASSERT_OK(fsdp_load_pretrained(x.ctx.get(), path.c_str(), kBigOptions));  // anything made on first use
        fsdp_memory_stats_t before{}, after{};
        before.struct_size = after.struct_size = sizeof(fsdp_memory_stats_t);
        ASSERT_OK(fsdp_memory_stats(x.ctx.get(), &before));
        ASSERT_OK(fsdp_memory_stats_reset_peak(x.ctx.get()));
        ASSERT_OK(fsdp_load_pretrained(x.ctx.get(), path.c_str(), kBigOptions));
        ASSERT_OK(fsdp_memory_stats(x.ctx.get(), &after));
        EXPECT_EQ(after.total_nbytes, before.total_nbytes);
        EXPECT_EQ(after.total_peak_nbytes - before.total_nbytes, size_t(2) << 20)
            << "the load's peak above the steady state, in bytes";
        const auto got = gather(x, kBigUnits);
        for (size_t k = 0; k < want.size(); ++k)
          for (size_t i = 0; i < want[k].size(); ++i)
            EXPECT_TRUE(got[k][i] == want[k][i]) << kBigUnits[k][i].name << " on rank " << rank;
        EXPECT_OK(fsdp_ctx_finalize(x.ctx.get()));
      });
    }
  }
}

// The same bound seen from outside libfsdp's own accounting: the process's
// peak resident memory during the load (VmHWM, reset through
// /proc/self/clear_refs) grows by no more than the two ranks' 2 MiB each and
// a margin for the allocator and the threads. Holding a transposed param's
// whole run of rows, as a load once did, takes 8 MiB per rank here.
TEST(PretrainedMemory, TheProcessPeakDuringALoadStaysWithinTheBound) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__) || !defined(__GLIBC__)
  GTEST_SKIP() << "resident memory is measured with glibc's malloc and without a sanitizer (its shadow memory "
                  "and quarantine are resident too)";
#else
  auto status_kib = [](const char* key) {
    std::ifstream f("/proc/self/status");
    std::string line;
    while (std::getline(f, line)) {
      if (line.rfind(key, 0) == 0) return std::stol(line.substr(std::strlen(key)));
    }
    return -1L;
  };
  {
    std::ofstream reset("/proc/self/clear_refs");
    if (!(reset << "5" << std::flush) || status_kib("VmHWM:") < 0) {
      GTEST_SKIP() << "this kernel cannot reset the process's peak resident memory (/proc/self/clear_refs)";
    }
  }
  // Large blocks from mmap, returned when freed: glibc's default raises the
  // threshold after a free, and its heap keeps what it frees resident, where
  // a second load's allocations would not show.
  mallopt(M_MMAP_THRESHOLD, 256 << 10);
  TempDir tmp;
  const auto ts = big_tensors();
  const std::string path = tmp / "big.safetensors";
  write_safetensors(path, ts);
  long rss_before = 0, hwm = 0;
  Meeting settled(2), loaded(2);
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    Ctx x;
    open(x, {{"sharding", "FULL_SHARD"}}, rank, group, kBigUnits);
    if (HasFatalFailure()) return;
    ASSERT_OK(fsdp_load_pretrained(x.ctx.get(), path.c_str(), kBigOptions));  // every page of the state touched
    settled.meet(rank, [&] {
      malloc_trim(0);  // what the first load freed goes back to the system
      std::ofstream("/proc/self/clear_refs") << "5";
      rss_before = status_kib("VmRSS:");
    });
    ASSERT_OK(fsdp_load_pretrained(x.ctx.get(), path.c_str(), kBigOptions));
    loaded.meet(rank, [&] { hwm = status_kib("VmHWM:"); });
    EXPECT_OK(fsdp_ctx_finalize(x.ctx.get()));
  });
  const long bound_kib = 2 * 2048 + 3072;  // two ranks' 2 MiB, and 3 MiB of margin
  EXPECT_LE(hwm - rss_before, bound_kib) << "peak resident memory during the load grew by " << hwm - rss_before
                                          << " KiB";
#endif
}

// fsdp_export with the same naming options writes what fsdp_load_pretrained
// reads back: the names and layouts reversed (stored names and transposed
// shapes as the file had them), fp32 bitwise; bf16 files hold the params
// rounded to nearest even; past max_shard_bytes several files and an index.
TEST(Export, WhatItWritesLoadsBackWithTheSameOptionsAtAnotherWorldSize) {
  TempDir tmp;
  const auto ts = file_tensors();
  const std::string src = tmp / "w.safetensors";
  write_safetensors(src, ts);
  const auto want = expected(ts);
  const std::string opts = std::string(kOptions);
  run_ranks(3, [&](int rank, fsdp_local_group_t* group) {
    Ctx x;
    open(x, {{"sharding", "FULL_SHARD"}}, rank, group);
    if (HasFatalFailure()) return;
    ASSERT_OK(fsdp_load_pretrained(x.ctx.get(), src.c_str(), kOptions));
    ASSERT_OK(fsdp_export(x.ctx.get(), (tmp / "fp32").c_str(), kOptions));
    ASSERT_OK(fsdp_export(x.ctx.get(), (tmp / "bf16").c_str(), (opts + ";dtype=bf16;max_shard_bytes=200").c_str()));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_export(x.ctx.get(), (tmp / "fp32").c_str(), kOptions));
    EXPECT_NE(last_error_str().find("not an empty directory"), std::string::npos) << last_error_str();
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_export(x.ctx.get(), (tmp / "x").c_str(), "dtype=fp8"));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_load_pretrained(x.ctx.get(), src.c_str(), "dtype=bf16"));
    EXPECT_OK(fsdp_ctx_finalize(x.ctx.get()));
  });
  // The fp32 file has the source's names, shapes and (for F32 sources) bytes.
  std::ifstream f(tmp / "fp32/model.safetensors", std::ios::binary);
  ASSERT_TRUE(f.good());
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  std::string head(n, '\0');
  f.read(head.data(), std::streamsize(n));
  auto h = nlohmann::json::parse(head);
  EXPECT_EQ(h["__metadata__"]["format"], "pt");
  for (const FileTensor& t : ts) {
    ASSERT_TRUE(h.contains(t.name)) << t.name;
    EXPECT_EQ(h[t.name]["dtype"], "F32");
    EXPECT_EQ(h[t.name]["shape"].get<std::vector<int64_t>>(), t.shape) << t.name;
  }
  // Both load back, at world 2, with the same options.
  const int files = int(std::distance(fs::directory_iterator(tmp / "bf16"), fs::directory_iterator{}));
  EXPECT_GE(files, 3) << "max_shard_bytes=200 should split the export into several files and an index";
  EXPECT_TRUE(fs::exists(tmp / "bf16/model.safetensors.index.json"));
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    Ctx a;
    open(a, {{"sharding", "FULL_SHARD"}}, rank, group);
    if (HasFatalFailure()) return;
    ASSERT_OK(fsdp_load_pretrained(a.ctx.get(), (tmp / "fp32").c_str(), kOptions));
    EXPECT_EQ(gather(a), want);
    ASSERT_OK(fsdp_load_pretrained(a.ctx.get(), (tmp / "bf16").c_str(), kOptions));
    const auto got = gather(a);
    for (size_t k = 0; k < want.size(); ++k)
      for (size_t i = 0; i < want[k].size(); ++i)
        for (size_t e = 0; e < want[k][i].size(); ++e)
          ASSERT_EQ(got[k][i][e], round_to(FSDP_DTYPE_BF16, want[k][i][e])) << kUnits[k][i].name << "[" << e << "]";
    EXPECT_OK(fsdp_ctx_finalize(a.ctx.get()));
  });
}

}  // namespace
