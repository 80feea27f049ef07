// src/ckpt/meta.cpp - see meta.h.
#include "meta.h"

#include <algorithm>

#include <cmath>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "../base/error.h"
#include "../base/text.h"

namespace fsdp::ckpt {
namespace {

using json = nlohmann::ordered_json;

// Typed access to the fields of one JSON object; every failure is CORRUPT
// naming the file and the field's path.
class Fields {
 public:
  Fields(const std::string& file, const json& j, std::string path) : file_(file), j_(j), path_(std::move(path)) {
    if (!j_.is_object()) bad("is not an object");
  }
  [[noreturn]] void bad(const std::string& msg) const {
    fail(FSDP_ERR_CORRUPT, "checkpoint metadata " + base::quote_path(file_) + ": " +
                               (path_.empty() ? "the document" : path_) + " " + msg);
  }
  const json& get(const char* key) const {
    auto it = j_.find(key);
    if (it == j_.end()) Fields(file_, j_, sub(key)).bad("is missing");
    return *it;
  }
  std::string sub(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }
  std::string str(const char* key) const {
    const json& v = get(key);
    if (!v.is_string()) at(key).bad("is not a string");
    return v.get<std::string>();
  }
  double num(const char* key) const {
    const json& v = get(key);
    if (!v.is_number()) at(key).bad("is not a number");
    return v.get<double>();
  }
  // JSON has no inf or nan: they are written as null (the grad norm of a
  // skipped step) and read back as nan.
  double num_or_nan(const char* key) const {
    const json& v = get(key);
    if (v.is_null()) return std::nan("");
    return num(key);
  }
  bool has(const char* key) const { return j_.find(key) != j_.end(); }
  bool boolean(const char* key) const {
    const json& v = get(key);
    if (!v.is_boolean()) at(key).bad("is not true or false");
    return v.get<bool>();
  }
  uint64_t u64(const char* key, uint64_t max = UINT64_MAX) const {
    const json& v = get(key);
    uint64_t out = 0;
    if (v.is_number_unsigned()) {
      out = v.get<uint64_t>();
    } else if (v.is_number_integer() && v.get<int64_t>() >= 0) {
      out = static_cast<uint64_t>(v.get<int64_t>());
    } else {
      at(key).bad("is not a non-negative integer");
    }
    if (out > max) at(key).bad("is " + std::to_string(out) + ", more than " + std::to_string(max));
    return out;
  }
  const json& array(const char* key) const {
    const json& v = get(key);
    if (!v.is_array()) at(key).bad("is not an array");
    return v;
  }
  Fields at(const char* key) const { return Fields(file_, empty(), sub(key), 0); }
  Fields object(const char* key) const { return Fields(file_, get(key), sub(key)); }
  Fields element(const json& v, const std::string& key, size_t i) const {
    return Fields(file_, v, sub(key) + "[" + std::to_string(i) + "]");
  }

 private:
  Fields(const std::string& file, const json& j, std::string path, int) : file_(file), j_(j), path_(std::move(path)) {}
  static const json& empty() {
    static const json e = json::object();
    return e;
  }
  const std::string& file_;
  const json& j_;
  std::string path_;
};

std::vector<uint32_t> u32_list(const Fields& f, const char* key) {
  const json& arr = f.get(key);
  std::vector<uint32_t> out;
  if (!arr.is_array()) f.at(key).bad("is not an array");
  out.reserve(arr.size());
  for (const json& v : arr) {
    if (!v.is_number_unsigned() || v.get<uint64_t>() > UINT32_MAX) f.at(key).bad("holds a value that is not a CRC-32");
    out.push_back(static_cast<uint32_t>(v.get<uint64_t>()));
  }
  return out;
}

bool safe_file_name(const std::string& s) {
  return !s.empty() && s.size() < 256 && s.find('/') == std::string::npos && s != "." && s != ".." && s[0] != '.';
}

json files_json(const std::vector<FileRecord>& files) {
  json out = json::array();
  for (const FileRecord& f : files) {
    json tensors = json::object();
    for (const auto& [name, sums] : f.tensors) tensors[name] = {{"crc32", sums.crc32}, {"chunk_crc32", sums.chunks}};
    out.push_back({{"name", f.name},
                   {"size", f.size},
                   {"header_bytes", f.header_bytes},
                   {"header_crc32", f.header_crc32},
                   {"tensors", tensors}});
  }
  return out;
}

std::vector<FileRecord> parse_files(const std::string& file, const Fields& root) {
  const json& files = root.array("files");
  std::vector<FileRecord> out;
  std::set<std::string> file_names;
  for (size_t fi = 0; fi < files.size(); ++fi) {
    Fields ff = root.element(files[fi], "files", fi);
    FileRecord f;
    f.name = ff.str("name");
    if (!safe_file_name(f.name)) ff.at("name").bad("is not a plain file name");
    if (!file_names.insert(f.name).second) ff.at("name").bad("repeats " + base::quote(f.name));
    f.size = ff.u64("size");
    f.header_bytes = ff.u64("header_bytes");
    f.header_crc32 = static_cast<uint32_t>(ff.u64("header_crc32", UINT32_MAX));
    const json& tensors = ff.get("tensors");
    if (!tensors.is_object()) ff.at("tensors").bad("is not an object");
    for (auto it = tensors.begin(); it != tensors.end(); ++it) {
      Fields tf(file, it.value(), ff.sub("tensors") + "." + it.key());
      TensorSums s;
      s.crc32 = static_cast<uint32_t>(tf.u64("crc32", UINT32_MAX));
      s.chunks = u32_list(tf, "chunk_crc32");
      f.tensors[it.key()] = std::move(s);
    }
    out.push_back(std::move(f));
  }
  return out;
}

}  // namespace

std::string files_to_json(const std::vector<FileRecord>& files) {
  json j;
  j["files"] = files_json(files);
  return j.dump();
}

std::vector<FileRecord> files_from_json(const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) fail(FSDP_ERR_INTERNAL, "checkpoint file records are not valid JSON");
  return parse_files("(file records)", Fields("(file records)", j, ""));
}

const FileRecord& Meta::file(const std::string& name) const {
  for (const FileRecord& f : files) {
    if (f.name == name) return f;
  }
  fail(FSDP_ERR_CORRUPT, "checkpoint metadata lists no file " + base::quote(name));
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string shard_tensor(size_t unit, const std::string& kind) { return "units." + std::to_string(unit) + "." + kind; }

std::string shard_file(int shard, int shard_world) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "shard-%05d-of-%05d.safetensors", shard, shard_world);
  return buf;
}

std::vector<std::string> tensor_kinds(const OptimizerMeta& o) {
  std::vector<std::string> kinds = {"param"};
  kinds.insert(kinds.end(), o.state.begin(), o.state.end());
  return kinds;
}

std::vector<std::string> tensor_kinds(const OptimizerMeta& o, const UnitMeta& u) {
  return u.trainable ? tensor_kinds(o) : std::vector<std::string>{"param"};
}

std::vector<std::string> tensor_kinds(const OptimizerMeta& o, const UnitMeta& u, const ParamMeta& p) {
  return p.trainable ? tensor_kinds(o, u) : std::vector<std::string>{"param"};
}

void UnitMeta::locate(uint64_t pos, int shard_world, int* shard, uint64_t* within) const {
  const uint64_t w = static_cast<uint64_t>(shard_world), block = trainable_block(), t = block / w;
  if (pos < block) {
    *shard = static_cast<int>(pos / t);
    *within = pos % t;
    return;
  }
  const uint64_t f = (padded_numel - block) / w, q = pos - block;
  *shard = static_cast<int>(q / f);
  *within = t + q % f;
}

const char* full_file(const std::string& kind) { return kind == "param" ? kModelFile : kOptimizerFile; }

std::string full_tensor(const std::string& param, const std::string& kind) {
  return kind == "param" ? param : param + "." + kind;
}

std::string library_name() {
  return "libfsdp " + std::to_string(FSDP_VERSION_MAJOR) + "." + std::to_string(FSDP_VERSION_MINOR) + "." +
         std::to_string(FSDP_VERSION_PATCH);
}

std::string to_json(const Meta& m) {
  json j;
  j["format"] = kFormatName;
  j["format_version"] = kFormatVersion;
  j["kind"] = m.kind;
  j["library"] = m.library;
  j["world_size"] = m.world_size;
  j["sharding"] = m.sharding;
  j["shard_world"] = m.shard_world;
  j["align_elems"] = m.align_elems;
  j["checksum"] = {{"algorithm", "crc32"}, {"chunk_bytes", m.chunk_bytes}};
  const OptimizerMeta& o = m.optimizer;
  j["optimizer"] = {{"kind", o.kind},
                    {"state", o.state},
                    {"lr", o.lr},
                    {"beta1", o.beta1},
                    {"beta2", o.beta2},
                    {"eps", o.eps},
                    {"weight_decay", o.weight_decay},
                    {"momentum", o.momentum},
                    {"nesterov", o.nesterov},
                    {"step", o.step},
                    {"last_grad_norm", o.last_grad_norm}};
  j["loss_scaler"] = {
      {"scale", m.scaler.scale}, {"clean_steps", m.scaler.clean_steps}, {"skipped_steps", m.scaler.skipped_steps}};
  json units = json::array();
  for (const UnitMeta& u : m.units) {
    json params = json::array();
    for (const ParamMeta& p : u.params) {
      json pj = {{"name", p.name},
                 {"shape", p.shape},
                 {"numel", p.numel},
                 {"offset", p.offset},
                 {"weight_decay", p.weight_decay}};
      if (p.lr_scale != 1.0) pj["lr_scale"] = p.lr_scale;
      if (p.beta1 >= 0) pj["beta1"] = p.beta1;
      if (p.beta2 >= 0) pj["beta2"] = p.beta2;
      if (!p.trainable) pj["trainable"] = false;
      if (p.state_fresh_at >= 0) pj["state_fresh_at"] = p.state_fresh_at;
      params.push_back(std::move(pj));
    }
    json uj = {{"name", u.name}, {"padded_numel", u.padded_numel}, {"params", params}};
    if (u.trainable_numel >= 0 && u.trainable_block() != u.padded_numel) uj["trainable_numel"] = u.trainable_numel;
    if (!u.trainable) uj["trainable"] = false;
    if (u.state_fresh_at != 0) uj["state_fresh_at"] = u.state_fresh_at;
    units.push_back(std::move(uj));
  }
  j["units"] = units;
  j["files"] = files_json(m.files);
  return j.dump(1) + "\n";
}

Meta parse_meta(const std::string& file, const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) fail(FSDP_ERR_CORRUPT, "checkpoint metadata " + base::quote_path(file) + " is not valid JSON");
  Fields root(file, j, "");
  if (root.str("format") != kFormatName) root.at("format").bad("is not \"" + std::string(kFormatName) + "\"");
  uint64_t version = root.u64("format_version");
  if (version != static_cast<uint64_t>(kFormatVersion)) {
    root.at("format_version")
        .bad("is " + std::to_string(version) + "; this libfsdp reads version " + std::to_string(kFormatVersion));
  }
  Meta m;
  m.kind = root.str("kind");
  if (m.kind != "sharded" && m.kind != "full") root.at("kind").bad("is neither \"sharded\" nor \"full\"");
  m.library = root.str("library");
  m.world_size = static_cast<int>(root.u64("world_size", 1u << 20));
  m.sharding = root.str("sharding");
  m.shard_world = static_cast<int>(root.u64("shard_world", 1u << 20));
  if (m.world_size < 1) root.at("world_size").bad("is 0; a job has at least one rank");
  if (m.shard_world < 1) root.at("shard_world").bad("is 0; a checkpoint has at least one shard");
  if (!m.sharded() && m.shard_world != 1) root.at("shard_world").bad("must be 1 in a full checkpoint");
  m.align_elems = root.u64("align_elems", 1u << 20);
  if (m.align_elems < 1) root.at("align_elems").bad("is 0");
  Fields cs = root.object("checksum");
  if (cs.str("algorithm") != "crc32") cs.at("algorithm").bad("is not \"crc32\"");
  m.chunk_bytes = cs.u64("chunk_bytes", uint64_t{1} << 40);
  if (m.chunk_bytes < 1024) cs.at("chunk_bytes").bad("is below 1024");

  Fields of = root.object("optimizer");
  OptimizerMeta& o = m.optimizer;
  o.kind = of.str("kind");
  std::vector<std::string> want;
  if (o.kind == "adamw" || o.kind == "adam") {
    want = {"exp_avg", "exp_avg_sq"};
  } else if (o.kind != "sgd" && o.kind != "host") {
    of.at("kind").bad("is " + base::quote(o.kind) + ", not adamw, adam, sgd or host");
  }
  for (const json& s : of.array("state")) {
    if (!s.is_string()) of.at("state").bad("holds a non-string");
    o.state.push_back(s.get<std::string>());
  }
  if (o.kind == "sgd" && !(o.state.empty() || o.state == std::vector<std::string>{"momentum"})) {
    of.at("state").bad("must be [] or [\"momentum\"] for sgd");
  }
  if (o.kind == "host") {  // the host's optimizer: host0, host1, ... (host_state of them, at most 8)
    if (o.state.size() > 8) of.at("state").bad("holds more than 8 buffers");
    for (size_t i = 0; i < o.state.size(); ++i) {
      if (o.state[i] != "host" + std::to_string(i)) of.at("state").bad("must be [\"host0\", \"host1\", ...] for host");
    }
  }
  if ((o.kind == "adamw" || o.kind == "adam") && o.state != want) {
    of.at("state").bad("must be [\"exp_avg\", \"exp_avg_sq\"] for " + o.kind);
  }
  o.lr = of.num("lr");
  o.beta1 = of.num("beta1");
  o.beta2 = of.num("beta2");
  o.eps = of.num("eps");
  o.weight_decay = of.num("weight_decay");
  o.momentum = of.num("momentum");
  o.nesterov = of.boolean("nesterov");
  o.step = static_cast<int64_t>(of.u64("step", uint64_t{1} << 62));
  o.last_grad_norm = of.num_or_nan("last_grad_norm");
  Fields sf = root.object("loss_scaler");
  m.scaler.scale = sf.num("scale");
  if (!(m.scaler.scale > 0)) sf.at("scale").bad("must be positive");
  m.scaler.clean_steps = static_cast<int64_t>(sf.u64("clean_steps", uint64_t{1} << 62));
  m.scaler.skipped_steps = sf.u64("skipped_steps");

  const json& units = root.array("units");
  std::set<std::string> all_names;
  bool names_unique = true;
  for (size_t ui = 0; ui < units.size(); ++ui) {
    Fields uf = root.element(units[ui], "units", ui);
    UnitMeta u;
    u.name = uf.str("name");
    u.padded_numel = uf.u64("padded_numel", uint64_t{1} << 60);
    if (m.sharded() && (u.padded_numel == 0 || u.padded_numel % static_cast<uint64_t>(m.shard_world) != 0)) {
      uf.at("padded_numel").bad("is not a positive multiple of shard_world");
    }
    if (uf.has("trainable_numel")) {
      u.trainable_numel = static_cast<int64_t>(uf.u64("trainable_numel", u.padded_numel));
      if (m.sharded() && u.trainable_block() % static_cast<uint64_t>(m.shard_world) != 0) {
        uf.at("trainable_numel").bad("is not a multiple of shard_world");
      }
    }
    const json& params = uf.array("params");
    std::vector<std::pair<uint64_t, uint64_t>> ranges;  // [offset, end) of every param, to check for overlaps
    for (size_t pi = 0; pi < params.size(); ++pi) {
      Fields pf = uf.element(params[pi], "params", pi);
      ParamMeta p;
      p.name = pf.str("name");
      if (!m.sharded() && p.name == "__metadata__") pf.at("name").bad("is reserved by safetensors");
      uint64_t numel = 1;
      for (const json& d : pf.array("shape")) {
        if (!d.is_number_integer() || d.get<int64_t>() < 0 || d.get<int64_t>() > (int64_t{1} << 50)) {
          pf.at("shape").bad("holds a bad dimension");
        }
        p.shape.push_back(d.get<int64_t>());
        if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d.get<int64_t>()), &numel)) {
          pf.at("shape").bad("is too large");
        }
      }
      p.numel = pf.u64("numel", uint64_t{1} << 60);
      if (p.numel != numel) pf.at("numel").bad("does not match the shape");
      p.offset = pf.u64("offset", uint64_t{1} << 60);
      if (m.sharded() && p.offset + p.numel > u.padded_numel) pf.at("offset").bad("passes padded_numel");
      if (pf.has("trainable")) p.trainable = pf.boolean("trainable");
      // A trainable param lies in the trainable block, a frozen one after it.
      if (m.sharded() && p.numel > 0 &&
          (p.trainable ? p.offset + p.numel > u.trainable_block() : p.offset < u.trainable_block())) {
        pf.at("offset").bad(p.trainable ? "passes the trainable block" : "lies in the trainable block");
      }
      ranges.push_back({p.offset, p.offset + p.numel});
      p.weight_decay = pf.num("weight_decay");
      if (pf.has("lr_scale")) p.lr_scale = pf.num("lr_scale");
      if (pf.has("beta1")) p.beta1 = pf.num("beta1");
      if (pf.has("beta2")) p.beta2 = pf.num("beta2");
      if (pf.has("state_fresh_at")) {
        p.state_fresh_at = static_cast<int64_t>(pf.u64("state_fresh_at", uint64_t{1} << 62));
        if (p.state_fresh_at > m.optimizer.step) pf.at("state_fresh_at").bad("is past optimizer.step");
      }
      names_unique = all_names.insert(p.name).second && names_unique;
      u.params.push_back(std::move(p));
    }
    std::sort(ranges.begin(), ranges.end());
    for (size_t i = 1; m.sharded() && i < ranges.size(); ++i) {
      if (ranges[i].first < ranges[i - 1].second && ranges[i].first < ranges[i].second) {
        uf.at("params").bad("hold params whose offsets overlap");
      }
    }
    // Optional (absent in checkpoints of earlier versions): trainable, and
    // the step at which the state was fresh.
    if (uf.has("trainable")) u.trainable = uf.boolean("trainable");
    if (uf.has("state_fresh_at")) {
      u.state_fresh_at = static_cast<int64_t>(uf.u64("state_fresh_at", uint64_t{1} << 62));
      if (u.state_fresh_at > m.optimizer.step) uf.at("state_fresh_at").bad("is past optimizer.step");
    }
    m.units.push_back(std::move(u));
  }
  if (!m.sharded() && !names_unique) root.at("units").bad("repeat a param name, which a full checkpoint cannot hold");

  m.files = parse_files(file, root);
  // The files and tensors the layout implies must all be listed.
  std::map<std::string, const FileRecord*> by_name;
  for (const FileRecord& f : m.files) by_name[f.name] = &f;
  auto expect_tensor = [&](const std::string& fname, const std::string& tname) {
    auto it = by_name.find(fname);
    if (it == by_name.end()) root.at("files").bad("does not list " + base::quote(fname));
    if (it->second->tensors.count(tname) == 0) {
      root.at("files").bad("does not list tensor " + base::quote(tname) + " of " + base::quote(fname));
    }
  };
  size_t expected_files = 0;
  if (m.sharded()) {
    for (int s = 0; s < m.shard_world; ++s) {
      for (size_t u = 0; u < m.units.size(); ++u) {
        for (const std::string& k : tensor_kinds(o, m.units[u])) {
          expect_tensor(shard_file(s, m.shard_world), shard_tensor(u, k));
        }
      }
    }
    expected_files = static_cast<size_t>(m.shard_world);
  } else {
    for (const UnitMeta& u : m.units) {
      for (const ParamMeta& p : u.params) {
        for (const std::string& k : tensor_kinds(o, u, p)) expect_tensor(full_file(k), full_tensor(p.name, k));
      }
    }
    expected_files = o.state.empty() ? 1 : 2;
  }
  if (m.files.size() != expected_files) {
    root.at("files").bad("lists " + std::to_string(m.files.size()) + " files, the layout needs " +
                         std::to_string(expected_files));
  }
  return m;
}

}  // namespace fsdp::ckpt
