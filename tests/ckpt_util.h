// Test helpers for checkpoints: a small model trained through the public API
// (any world size, sharding and optimizer), an independent safetensors reader
// (header parsed here, not by libfsdp), temporary directories and file damage.
// The model's compute goes through tests/host_stream.h's Host (white-box: a
// test that includes this links fsdp_internal): at once, or late on a host
// stream (the .late CTests).
#ifndef FSDP_TESTS_CKPT_UTIL_H
#define FSDP_TESTS_CKPT_UTIL_H

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "host_stream.h"
#include "rank_runner.h"

namespace fsdp_test {

using Tensor = std::vector<float>;
using State = std::vector<std::vector<Tensor>>;  // [unit][param][elem]

// Units of a weight [rows, cols] and an odd-sized bias each: shards and
// padding fall differently at every world size.
struct Net {
  std::vector<std::vector<ParamSpec>> units;
  static Net make(int n_units, int base) {
    Net n;
    for (int k = 0; k < n_units; ++k) {
      std::string u = "blocks." + std::to_string(k);
      n.units.push_back({{u + ".weight", {base + 3 * k, base / 2 + k + 1}}, {u + ".bias", {2 * k + 7}}});
    }
    return n;
  }
  std::string unit_name(size_t k) const { return "block" + std::to_string(k); }
};

inline State make_init(const Net& net, uint64_t seed) {
  Rng rng(seed);
  State s(net.units.size());
  for (size_t k = 0; k < net.units.size(); ++k)
    for (const auto& p : net.units[k]) s[k].push_back(rng.uniform_vec(numel_of(p.shape), -0.5f, 0.5f));
  return s;
}

constexpr int kRows = 12;  // rows of data per step, split over the ranks (divisible by 1..4)

// Row b of step s's data: a target for every element of unit k's param i.
FSDP_TEST_OWN_MATH inline float target(int step, int row, size_t k, size_t i, size_t e) {
  uint64_t h = (uint64_t(step) * 1315423911u) ^ (uint64_t(row) << 20) ^ (uint64_t(k) << 40) ^ (uint64_t(i) << 52) ^ e;
  Rng r(h);
  return r.uniform(-1.f, 1.f);
}

// The grad of element e (value p) of param i of unit k at `step`: the mean of
// p - target over rows [row0, row0 + rows).
FSDP_TEST_OWN_MATH inline float mean_grad(float p, int step, int row0, int rows, size_t k, size_t i, size_t e) {
  float g = 0;
  for (int b = row0; b < row0 + rows; ++b) g += (p - target(step, b, k, i, e)) / float(rows);
  return g;
}

struct Job {
  CtxPtr ctx;
  std::vector<fsdp_unit_t*> units;
  Host host;  // after ctx: drained before the context goes
};

inline std::map<std::string, std::string> base_options(const std::string& sharding) {
  return {{"sharding", sharding},       {"optimizer", "adamw"}, {"lr", "0.01"},       {"weight_decay", "0.01"},
          {"no_weight_decay", "*bias"}, {"timeout_s", "30"},    {"loss_scale", "off"}};
}

// Creates the context and registers the net (values zero).
inline void open_job(Job& job, const Net& net, const std::map<std::string, std::string>& opts, int rank,
                     fsdp_local_group_t* group) {
  ConfigPtr cfg = make_config(opts);
  ASSERT_TRUE(cfg);
  fsdp_ctx_t* raw = nullptr;
  ASSERT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
  job.ctx.reset(raw);
  job.host.attach(raw);
  job.units.assign(net.units.size(), nullptr);
  for (size_t k = 0; k < net.units.size(); ++k)
    ASSERT_OK(register_unit(raw, net.unit_name(k), net.units[k], &job.units[k]));
}

inline void set_state(Job& job, const State& s) {
  for (size_t k = 0; k < s.size(); ++k)
    for (size_t i = 0; i < s[k].size(); ++i)
      ASSERT_OK(fsdp_param_set_values(job.units[k], i, s[k][i].data(), s[k][i].size()));
}

// Steps [s0, s1): loss = the mean over the step's rows of 0.5 * |p - target|^2,
// each rank taking the mean over its share of the rows (grads are averaged
// over the ranks, as with PyTorch). The grads are computed by job.host; a
// frozen unit's or param's are not (it has none).
inline void train(Job& job, const Net& net, int s0, int s1, int world, int rank) {
  const int rows = kRows / world;
  fsdp_dtype_t dt = FSDP_DTYPE_FP32;
  ASSERT_OK(fsdp_ctx_param_dtype(job.ctx.get(), &dt));
  void* stream = job.host.stream();
  for (int s = s0; s < s1; ++s) {
    for (auto* u : job.units) {
      ASSERT_OK(fsdp_forward_begin(u, stream));
      ASSERT_OK(fsdp_forward_end(u, stream));
    }
    for (size_t k = net.units.size(); k-- > 0;) {
      ASSERT_OK(fsdp_backward_begin(job.units[k], stream));
      int trainable = 1;
      ASSERT_OK(fsdp_unit_trainable(job.units[k], &trainable));
      for (size_t i = 0; trainable == 1 && i < net.units[k].size(); ++i) {  // a frozen unit has no grads
        int param_trainable = 1;  // nor has a frozen param
        ASSERT_OK(fsdp_param_trainable(job.units[k], i, &param_trainable));
        if (param_trainable == 0) continue;
        void* pp = nullptr;
        void* gp = nullptr;
        ASSERT_OK(fsdp_param_ptr(job.units[k], i, &pp));
        ASSERT_OK(fsdp_grad_ptr(job.units[k], i, &gp));
        const size_t n = numel_of(net.units[k][i].shape);
        job.host.run([pp, gp, n, dt, s, rank, rows, k, i] {
          for (size_t e = 0; e < n; ++e)
            add_elem(gp, e, dt, mean_grad(load_elem(pp, e, dt), s, rank * rows, rows, k, i, e));
        });
      }
      ASSERT_OK(fsdp_backward_end(job.units[k], stream));
    }
    ASSERT_OK(fsdp_step(job.ctx.get(), stream));
  }
}

inline State gather(Job& job, const Net& net) {
  State s(net.units.size());
  for (size_t k = 0; k < net.units.size(); ++k)
    for (size_t i = 0; i < net.units[k].size(); ++i) {
      s[k].emplace_back(numel_of(net.units[k][i].shape), NAN);
      EXPECT_OK(fsdp_gather_param(job.units[k], i, s[k][i].data(), s[k][i].size()));
    }
  return s;
}

inline bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}
inline bool bitwise_equal(const State& a, const State& b) {
  if (a.size() != b.size()) return false;
  for (size_t k = 0; k < a.size(); ++k) {
    if (a[k].size() != b[k].size()) return false;
    for (size_t i = 0; i < a[k].size(); ++i)
      if (!bitwise_equal(a[k][i], b[k][i])) return false;
  }
  return true;
}

// base_options, with HYBRID_SHARD's shard groups of half the world.
inline std::map<std::string, std::string> options_for(const std::string& sharding, int world) {
  auto o = base_options(sharding);
  if (sharding == "HYBRID_SHARD") o["shard_group_size"] = std::to_string(world / 2);
  return o;
}

// The uninterrupted run's gathered state after steps 0..n (index = steps done).
inline std::vector<State> reference_states(const Net& net, int world, const std::string& sharding, uint64_t seed,
                                           int n) {
  std::vector<State> ref(static_cast<size_t>(n) + 1);
  run_ranks(world, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open_job(job, net, options_for(sharding, world), rank, group);
    ASSERT_NO_FATAL_FAILURE(set_state(job, make_init(net, seed)));
    for (int s = 0; s <= n; ++s) {
      if (s > 0) {
        ASSERT_NO_FATAL_FAILURE(train(job, net, s - 1, s, world, rank));
      }
      State st = gather(job, net);
      if (rank == 0) ref[size_t(s)] = st;
    }
  });
  return ref;
}

inline uint64_t step_of(Job& job) {
  uint64_t step = 0;
  EXPECT_OK(fsdp_ctx_step(job.ctx.get(), &step));
  return step;
}

// ---- an independent safetensors reader ------------------------------------------

struct StTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  Tensor values;  // F32 only
};

// Reads a whole safetensors file by the format's definition: u64 little-endian
// header length, JSON header, data section. Fails the test on anything odd.
inline std::map<std::string, StTensor> read_safetensors(const std::string& path) {
  std::map<std::string, StTensor> out;
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << "cannot open " << path;
  if (!f.good()) return out;
  std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(bytes.at(size_t(i)));
  EXPECT_LE(8 + n, bytes.size()) << path;
  if (8 + n > bytes.size()) return out;
  auto header = nlohmann::json::parse(bytes.substr(8, n));
  const size_t data = 8 + n;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    StTensor t;
    t.dtype = it.value()["dtype"].get<std::string>();
    t.shape = it.value()["shape"].get<std::vector<int64_t>>();
    auto off = it.value()["data_offsets"].get<std::vector<uint64_t>>();
    EXPECT_EQ(t.dtype, "F32") << it.key();
    EXPECT_EQ(off[1] - off[0], numel_of(t.shape) * 4) << it.key();
    EXPECT_LE(data + off[1], bytes.size()) << it.key();
    t.values.resize(numel_of(t.shape));
    if (data + off[1] <= bytes.size()) std::memcpy(t.values.data(), bytes.data() + data + off[0], off[1] - off[0]);
    out[it.key()] = std::move(t);
  }
  return out;
}

// ---- files -------------------------------------------------------------------

// The CRC-32 of zlib (IEEE, reflected), bit by bit: independent of libfsdp's.
inline uint32_t crc32_ieee(const std::string& s) {
  uint32_t c = 0xFFFFFFFFu;
  for (unsigned char b : s) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
  }
  return ~c;
}

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "fsdp_ckpt_test_XXXXXX").string();
    path_ = mkdtemp(tmpl.data()) ? tmpl : "";
    EXPECT_FALSE(path_.empty());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

inline std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
}

// A checkpoint's metadata (fsdp_checkpoint.json), parsed.
inline nlohmann::json read_meta(const std::string& dir) {
  return nlohmann::json::parse(read_file(dir + "/fsdp_checkpoint.json"));
}

// Rewrites a checkpoint's metadata file and its CRC-32 file together: a
// consistent but wrong metadata file, as a buggy writer would leave.
inline void write_meta_consistently(const std::string& dir, const std::string& text) {
  write_file(dir + "/fsdp_checkpoint.json", text);
  char crc[16];
  std::snprintf(crc, sizeof crc, "%08x\n", unsigned(crc32_ieee(text)));
  write_file(dir + "/fsdp_checkpoint.json.crc32", crc);
}

// Where tensor `name`'s data starts in safetensors file `path`.
inline uint64_t data_offset(const std::string& path, const std::string& name) {
  std::string bytes = read_file(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(bytes.at(size_t(i)));
  auto h = nlohmann::json::parse(bytes.substr(8, n));
  return 8 + n + h[name]["data_offsets"][0].get<uint64_t>();
}

// Damages one byte of a file.
inline void flip_byte(const std::string& path, uint64_t at) {
  std::string b = read_file(path);
  b.at(at) ^= 0x10;
  write_file(path, b);
}

inline void copy_dir(const std::string& from, const std::string& to) {
  std::filesystem::remove_all(to);
  std::filesystem::copy(from, to, std::filesystem::copy_options::recursive);
}

}  // namespace fsdp_test

#endif  // FSDP_TESTS_CKPT_UTIL_H
