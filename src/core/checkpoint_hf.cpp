// src/core/checkpoint_hf.cpp - weights other programs wrote or will read:
// Context::load_pretrained (fsdp_load_pretrained: safetensors files by name,
// through ckpt/pretrained.h's options) and Context::export_weights
// (fsdp_export: the params consolidated into safetensors files, the names
// mapped in reverse).

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include "../../kernels/cast.h"
#include "../base/error.h"
#include "../base/log.h"
#include "../base/text.h"
#include "../ckpt/files.h"
#include "../ckpt/io.h"
#include "../ckpt/pretrained.h"
#include "../ckpt/reader.h"
#include "../ckpt/safetensors.h"
#include "ckpt_names.h"
#include "ckpt_stage.h"
#include "consensus.h"
#include "context.h"

namespace fsdp::core {

namespace {

// fp32 values of `n` elements of a safetensors dtype ("F32", "BF16", "F16";
// exact conversions).
void to_f32(const std::string& dtype, const unsigned char* raw, size_t n, float* out) {
  if (dtype == "F32") {
    std::memcpy(out, raw, n * sizeof(float));
    return;
  }
  // The dtype's name compared once, not per element (a string compare per
  // value was most of a large load's conversion).
  const bool bf16 = dtype == "BF16";
  for (size_t i = 0; i < n; ++i) {
    uint16_t h = static_cast<uint16_t>(raw[2 * i] | (raw[2 * i + 1] << 8));
    out[i] = bf16 ? kernels::bf16_bits_to_f32(h) : kernels::fp16_bits_to_f32(h);
  }
}

}  // namespace

void Context::load_pretrained(const std::string& path, const char* options) {
  const char* call = "fsdp_load_pretrained";
  check_no_unit_in_use(call);
  agree(*rt_.comm, call, "path=" + path + " options=" + std::string(options ? options : ""));
  TraceScope scope(rt_.trace, "load_pretrained");
  const std::string what = std::string(call) + " from " + base::quote_path(path);
  settle_units();
  struct Source {
    const ckpt::Reader* file = nullptr;  // null: not in the files (non-strict)
    const ckpt::TensorInfo* tensor = nullptr;
    bool transposed = false;
  };
  std::vector<std::unique_ptr<ckpt::Reader>> files;
  std::vector<std::vector<Source>> sources(units_.size());
  std::string left_out;
  // First every file's header and every name, shape and dtype: a load that
  // does not fit fails before any param changes.
  Outcome checked = capture([&] {
    check_no_pending_grads(call);
    ckpt::PretrainedOptions o = ckpt::parse_pretrained_options(options);
    for (const std::string& f : ckpt::pretrained_files(path)) {
      files.push_back(std::make_unique<ckpt::Reader>(f, nullptr, uint64_t(1) << 20, "pretrained weights file"));
    }
    std::map<std::string, Source> by_host;
    std::vector<std::string> twice, missing, shapes, dtypes;
    for (const auto& f : files) {
      for (const ckpt::TensorInfo& t : f->header().tensors) {
        std::string h = ckpt::host_name(o, t.name);
        if (!by_host.emplace(h, Source{f.get(), &t, false}).second) twice.push_back(h);
      }
    }
    std::set<std::string> used;
    for (size_t k = 0; k < units_.size(); ++k) {
      const FlatLayout& lay = units_[k]->layout();
      for (size_t i = 0; i < lay.n_params(); ++i) {
        const ParamSpec& p = lay.param(i);
        auto it = by_host.find(p.name);
        if (it == by_host.end()) {
          missing.push_back(p.name);
          sources[k].push_back(Source{});
          continue;
        }
        used.insert(p.name);
        Source s = it->second;
        s.transposed = std::any_of(o.transpose.begin(), o.transpose.end(),
                                   [&](const std::string& g) { return ckpt::glob_match(g, p.name); });
        const ckpt::TensorInfo& t = *s.tensor;
        std::vector<int64_t> want = p.shape;
        if (s.transposed) {
          if (want.size() != 2) {
            shapes.push_back(base::quote(p.name) + " (transposed, but registered with " +
                             std::to_string(want.size()) + " dimensions)");
            continue;
          }
          std::swap(want[0], want[1]);
        }
        if (t.shape != want) {
          shapes.push_back(base::quote(p.name) + " (" + ckpt::shape_string(t.shape) + " in " +
                           base::quote_path(s.file->path()) + " as " + base::quote(t.name) + ", " +
                           ckpt::shape_string(p.shape) + " registered" + (s.transposed ? ", transposed" : "") + ")");
        }
        if (t.dtype != "F32" && t.dtype != "BF16" && t.dtype != "F16") {
          dtypes.push_back(base::quote(p.name) + " (" + t.dtype + " in " + base::quote_path(s.file->path()) + ")");
        }
        sources[k].push_back(s);
      }
    }
    std::vector<std::string> unexpected;
    for (const auto& [name, s] : by_host) {
      if (!used.count(name)) unexpected.push_back(name + " (" + s.tensor->name + ")");
    }
    left_out = report_lines(missing, unexpected);
    if (!o.strict) missing.clear(), unexpected.clear();
    std::string msg;
    auto add = [&msg](const std::string& part) { msg += (msg.empty() ? "" : "; ") + part; };
    if (!twice.empty()) add("several tensors map to the same name: " + name_list(twice));
    if (!missing.empty()) add("registered but in no file: " + name_list(missing));
    if (!unexpected.empty()) add("in the files but not registered: " + name_list(unexpected));
    auto join = [](const std::vector<std::string>& items) {  // already quoted, with their details
      std::string out;
      for (size_t i = 0; i < items.size() && i < 8; ++i) out += (i ? ", " : "") + items[i];
      if (items.size() > 8) out += " and " + std::to_string(items.size() - 8) + " more";
      return out;
    };
    if (!shapes.empty()) add("shapes differ: " + join(shapes));
    if (!dtypes.empty()) add("dtypes other than F32, BF16 and F16: " + join(dtypes));
    if (!msg.empty()) {
      fail(FSDP_ERR_INVALID_ARGUMENT, std::string(call) + ": " + base::quote_path(path) + " does not fit the "
                                          "registered params: " + msg);
    }
  });
  // Failures of the files (a missing file, a damaged header) get the call's
  // name; the fit check above names it already.
  if (!checked.ok() && checked.message.rfind(call, 0) != 0) checked.message = std::string(call) + ": " + checked.message;
  check_outcomes(*rt_.comm, what, checked.status, checked.message);
  // Then each rank reads the ranges of its own shard into place, through
  // kPiece elements of the files' bytes and kPiece fp32 values (2 MiB of
  // host memory, counted) and, where the host cannot see the state device,
  // one unit's shard of host memory to stage it through.
  Outcome read = capture([&] {
    constexpr size_t kPiece = size_t(1) << 18;  // elements read and converted at a time
    HostStage stage(*rt_.state_dev, &rt_.mem);
    HostStage raw_stage(*rt_.state_dev, &rt_.mem);
    HostStage conv_stage(*rt_.state_dev, &rt_.mem);
    auto* raw = static_cast<unsigned char*>(raw_stage.get(kPiece * sizeof(float)));
    auto* conv = static_cast<float*>(conv_stage.get(kPiece * sizeof(float)));
    for (size_t k = 0; k < units_.size(); ++k) {
      if (k == 1 && ckpt::inject_read_error(rt_.rank)) {
        fail(FSDP_ERR_IO, "reading " + base::quote_path(path) + ": injected by FSDP_CKPT_FAULT");
      }
      Unit& u = *units_[k];
      const FlatLayout& lay = u.layout();
      size_t n = u.shard_numel();
      float* dst = u.master_for_load();
      float* out = dst;
      if (!rt_.state_dev->host_visible()) {
        out = static_cast<float*>(stage.get(n * sizeof(float)));
        rt_.state_dev->copy_to_host(out, dst, n * sizeof(float));  // what params not in the files keep
      }
      for (const ShardSegment& seg : u.segments()) {
        const size_t i = seg.param_index;
        const Source& s = sources[k][i];
        if (s.file == nullptr) continue;
        // Flat [a, b) of the param at `off`: its elements [a - off, b - off).
        const uint64_t off = lay.param_offset(i), a = off + seg.param_begin, b = a + seg.numel;
        const ckpt::TensorInfo& t = *s.tensor;
        size_t es = ckpt::dtype_bytes(t.dtype);
        float* o = out + seg.shard_begin;  // the param's element a - off
        if (!s.transposed) {
          for (uint64_t e = a - off; e < b - off;) {
            size_t m = static_cast<size_t>(std::min<uint64_t>(kPiece, b - off - e));
            if (t.dtype == "F32") {
              s.file->read(t.name, e * es, m * es, o);
            } else {
              s.file->read(t.name, e * es, m * es, raw);
              to_f32(t.dtype, raw, m, o);
            }
            o += m;
            e += m;
          }
          continue;
        }
        // Stored [A, B], registered [B, A]: the host's element (i, j) is the
        // file's (j, i). The host rows [i0, i1] that [h0, h1) touches are, in
        // each of the file's A rows, one run of columns; taken in groups of
        // at most kPiece host rows, and of file rows as many as fit with
        // them in kPiece values, so that a rank reads only its shard's part
        // (and up to two rows) and holds no more than kPiece values of it.
        size_t rows_a = static_cast<size_t>(t.shape[0]), cols_b = static_cast<size_t>(t.shape[1]);
        size_t h0 = static_cast<size_t>(a - off), h1 = static_cast<size_t>(b - off);
        size_t i0 = h0 / rows_a, i1 = (h1 - 1) / rows_a;
        for (size_t ia = i0; ia <= i1; ia += kPiece) {
          size_t ib = std::min(i1 + 1, ia + kPiece), run = ib - ia;
          size_t step = std::max<size_t>(1, kPiece / run);
          for (size_t ja = 0; ja < rows_a; ja += step) {
            size_t jb = std::min(rows_a, ja + step);
            for (size_t j = ja; j < jb; ++j) {
              s.file->read(t.name, (j * cols_b + ia) * es, run * es, raw);
              to_f32(t.dtype, raw, run, conv + (j - ja) * run);
            }
            for (size_t r = ia; r < ib; ++r) {  // host row r, its columns [ja, jb) within [h0, h1)
              size_t row = r * rows_a;
              size_t c0 = std::max(ja, h0 > row ? h0 - row : 0), c1 = std::min(jb, h1 - row);
              for (size_t c = c0; c < c1; ++c) o[row + c - h0] = conv[(c - ja) * run + (r - ia)];
            }
          }
        }
      }
      if (out != dst) rt_.state_dev->copy_from_host(dst, out, n * sizeof(float));
      u.master_loaded();
      for (size_t i = 0; u.trainable() && i < optimizer_.state_names().size(); ++i) {
        rt_.state_dev->zero(optimizer_.state_for_load(k, i), u.trainable_shard_numel() * sizeof(float));
      }
    }
  });
  if (!read.ok()) {
    read.message = std::string(call) + ": " + read.message +
                   " (after every rank had checked the files' headers: the params are now partly loaded; load again)";
  }
  check_outcomes(*rt_.comm, what, read.status, read.message);
  optimizer_.restore(0, 0.0);
  set_load_report(what, left_out);
}

}  // namespace fsdp::core

namespace fsdp::core {

void Context::export_weights(const std::string& dir, const char* options) {
  const char* call = "fsdp_export";
  check_no_unit_in_use(call);
  agree(*rt_.comm, call, "dir=" + dir + " options=" + std::string(options ? options : ""));
  TraceScope scope(rt_.trace, "export");
  const std::string what = std::string(call) + " to " + base::quote_path(dir);
  settle_units();
  bool root = rt_.rank == 0;
  // The plan, the same on every rank: each param's name in the files, its
  // stored shape, and the file it goes to (params in unit order).
  struct Item {
    size_t unit, param;
    std::string name;
    std::vector<int64_t> shape;
    bool transposed;
    size_t file;
  };
  std::vector<Item> items;
  std::vector<std::vector<ckpt::Writer::Entry>> plan(1);
  ckpt::PretrainedOptions o;
  Outcome planned = capture([&] {
    o = ckpt::parse_pretrained_options(options, call, /*for_export=*/true);
    std::map<std::string, std::string> seen;  // file name -> host name
    uint64_t in_file = 0;
    size_t es = o.dtype == "F32" ? 4 : 2;
    for (size_t k = 0; k < units_.size(); ++k) {
      const FlatLayout& lay = units_[k]->layout();
      for (size_t i = 0; i < lay.n_params(); ++i) {
        const ParamSpec& p = lay.param(i);
        Item it{k, i, ckpt::file_name(o, p.name), p.shape, false, 0};
        it.transposed = std::any_of(o.transpose.begin(), o.transpose.end(),
                                    [&](const std::string& g) { return ckpt::glob_match(g, p.name); });
        if (it.transposed) {
          if (it.shape.size() != 2) {
            fail(FSDP_ERR_INVALID_ARGUMENT, std::string(call) + ": param " + base::quote(p.name) +
                                                " matches a transpose glob but has " +
                                                std::to_string(it.shape.size()) + " dimensions, not 2");
          }
          std::swap(it.shape[0], it.shape[1]);
        }
        auto [at, fresh] = seen.emplace(it.name, p.name);
        if (!fresh) {
          fail(FSDP_ERR_INVALID_ARGUMENT, std::string(call) + ": params " + base::quote(at->second) + " and " +
                                              base::quote(p.name) + " would both be stored as " + base::quote(it.name));
        }
        uint64_t bytes = p.numel * es;
        if (o.max_shard_bytes > 0 && in_file > 0 && in_file + bytes > o.max_shard_bytes) {
          plan.emplace_back();
          in_file = 0;
        }
        in_file += bytes;
        it.file = plan.size() - 1;
        plan.back().push_back(ckpt::Writer::Entry{it.name, it.shape, o.dtype});
        items.push_back(std::move(it));
      }
    }
    if (root) {
      if (ckpt::path_exists(dir) && !(ckpt::is_dir(dir) && ckpt::is_empty_dir(dir))) {
        fail(FSDP_ERR_INVALID_ARGUMENT, std::string(call) + ": " + base::quote_path(dir) +
                                            " exists and is not an empty directory; export into a new one");
      }
      ckpt::make_dirs(dir);
    }
  });
  if (!planned.ok() && planned.message.rfind(call, 0) != 0) planned.message = std::string(call) + ": " + planned.message;
  check_outcomes(*rt_.comm, what, planned.status, planned.message);
  auto file_of = [&](size_t f) {
    if (plan.size() == 1) return std::string("model.safetensors");
    char buf[64];
    std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", f + 1, plan.size());
    return std::string(buf);
  };
  // Shard group 0 gathers one unit at a time; rank 0 converts each param and
  // writes it into its file (the peak: one full unit in fp32, plus one param).
  Outcome io;
  auto on_root = [&](auto&& body) {
    if (root && io.ok()) io = capture(body);
  };
  std::vector<std::string> written;
  if (rt_.rank < rt_.shard_world()) {
    bool gather = rt_.shard_world() > 1;
    HostStage stage(*rt_.dev, &rt_.mem);
    std::unique_ptr<ckpt::Writer> w;
    size_t next = 0;  // the next item to write
    std::vector<float> host, moved;
    std::vector<unsigned char> bytes;
    for (size_t k = 0; k < units_.size(); ++k) {
      Unit& u = *units_[k];
      const FlatLayout& lay = u.layout();
      device::Device* where = rt_.state_dev;
      const float* flat = u.master();
      Buffer full;
      if (gather) {
        full = u.gather_on_device(u.master(), /*trainable_block=*/false, call);
        flat = full.as<float>();
        where = rt_.dev;
      }
      on_root([&] {
        for (size_t i = 0; i < lay.n_params(); ++i, ++next) {
          const Item& it = items[next];
          if (!w) w = std::make_unique<ckpt::Writer>(ckpt::join(dir, file_of(it.file)), file_of(it.file),
                                                     plan[it.file], std::map<std::string, std::string>{{"format", "pt"}},
                                                     uint64_t(1) << 20);
          size_t n = lay.param(i).numel;
          const float* src = flat + lay.param_offset(i);
          if (!where->host_visible()) {
            float* h = static_cast<float*>(stage.get(n * sizeof(float)));
            where->copy_to_host(h, src, n * sizeof(float));
            src = h;
          }
          if (it.transposed) {  // registered [r, c], stored [c, r]
            size_t r = size_t(lay.param(i).shape[0]), c = size_t(lay.param(i).shape[1]);
            moved.resize(n);
            for (size_t a = 0; a < r; ++a)
              for (size_t b = 0; b < c; ++b) moved[b * r + a] = src[a * c + b];
            src = moved.data();
          }
          if (o.dtype == "F32") {
            w->write(src, n * sizeof(float));
          } else {
            bytes.resize(n * 2);
            for (size_t e = 0; e < n; ++e) {
              uint16_t h = kernels::f32_to_bf16_bits(src[e]);
              bytes[2 * e] = static_cast<unsigned char>(h & 0xff);
              bytes[2 * e + 1] = static_cast<unsigned char>(h >> 8);
            }
            w->write(bytes.data(), bytes.size());
          }
          if (next + 1 == items.size() || items[next + 1].file != it.file) {
            w->finish();
            w.reset();
            written.push_back(file_of(it.file));
          }
        }
      });
    }
  }
  on_root([&] {
    if (plan.size() == 1) return;
    nlohmann::ordered_json idx;
    uint64_t total = 0;
    for (const Item& it : items) {
      uint64_t n = 1;
      for (int64_t d : it.shape) n *= uint64_t(d);
      total += n * (o.dtype == "F32" ? 4 : 2);
    }
    idx["metadata"] = {{"total_size", total}};
    idx["weight_map"] = nlohmann::ordered_json::object();
    for (const Item& it : items) idx["weight_map"][it.name] = file_of(it.file);
    std::string text = idx.dump(2);
    ckpt::File f = ckpt::File::create(ckpt::join(dir, "model.safetensors.index.json"));
    f.write_all(text.data(), text.size());
    f.sync();
    f.close();
  });
  if (!io.ok()) {
    io.message = std::string(call) + ": " + io.message;
    if (root) {
      for (const std::string& f : written) std::remove(ckpt::join(dir, f).c_str());
    }
  }
  check_outcomes(*rt_.comm, what, io.status, io.message);
}

}  // namespace fsdp::core
