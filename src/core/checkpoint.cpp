// src/core/checkpoint.cpp - Context::save and Context::load: the collective
// side of checkpoints. Who writes which file, how the ranks agree on the
// outcome of every phase (so that all return the same status), and the
// all-or-nothing load: everything is read and checked into new buffers first,
// and only when every rank succeeded do they replace the context's state. The
// file format itself is src/ckpt/.
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
#include "ckpt_stage.h"
#include "consensus.h"
#include "context.h"

namespace fsdp::core {

ckpt::Meta Context::checkpoint_meta(const std::string& kind) const {
  const Options& o = rt_.opts;
  ckpt::Meta m;
  m.kind = kind;
  m.library = ckpt::library_name();
  m.world_size = rt_.world;
  m.sharding = sharding_name(o.sharding);
  m.shard_world = kind == "sharded" ? rt_.shard_world() : 1;
  m.align_elems = o.align_bytes / sizeof(float);
  ckpt::OptimizerMeta& om = m.optimizer;
  om.kind = optimizer_name(o.optimizer);
  om.state = optimizer_.state_names();
  om.lr = o.lr;
  om.beta1 = o.beta1;
  om.beta2 = o.beta2;
  om.eps = o.eps;
  om.weight_decay = o.weight_decay;
  om.momentum = o.momentum;
  om.nesterov = o.nesterov;
  om.step = optimizer_.step_count();
  om.last_grad_norm = optimizer_.last_grad_norm();
  const LossScaler& s = optimizer_.loss_scaler();
  m.scaler = {s.scale(), s.clean_steps(), s.skipped_steps()};
  for (const auto& u : units_) {
    ckpt::UnitMeta um;
    um.name = u->name();
    um.padded_numel = u->layout().padded_numel();
    if (u->layout().has_frozen()) um.trainable_numel = static_cast<int64_t>(u->layout().trainable_padded_numel());
    um.trainable = u->trainable();
    um.state_fresh_at = u->trainable() ? optimizer_.fresh_at(u->index()) : 0;
    for (size_t i = 0; i < u->layout().n_params(); ++i) {
      const ParamSpec& p = u->layout().param(i);
      const Unit::Hyper& h = u->hyper(i);
      um.params.push_back({p.name, p.shape, p.numel, u->layout().param_offset(i), u->weight_decay(i), h.lr_scale,
                           std::isnan(h.beta1) ? -1.0 : h.beta1, std::isnan(h.beta2) ? -1.0 : h.beta2});
      um.params.back().trainable = u->param_trainable(i);
      const long at = optimizer_.param_fresh_at(u->index(), i);
      if (u->trainable() && u->param_trainable(i) && at != um.state_fresh_at) um.params.back().state_fresh_at = at;
    }
    m.units.push_back(std::move(um));
  }
  return m;
}

std::vector<Context::StateSegment> Context::shard_segments() const {
  std::vector<StateSegment> segs;
  for (size_t k = 0; k < units_.size(); ++k) {
    segs.push_back({units_[k]->master(), units_[k]->shard_numel() * sizeof(float)});
    if (!units_[k]->trainable()) continue;                          // frozen: no optimizer state
    for (size_t i = 0; i < optimizer_.state_names().size(); ++i) {  // the trainable block's slice
      segs.push_back({optimizer_.state(k, i).data(), units_[k]->trainable_shard_numel() * sizeof(float)});
    }
  }
  return segs;
}

ckpt::FileRecord Context::write_shard_file(const std::string& staged, const ckpt::Meta& meta,
                                           const std::vector<StateSegment>& segs, device::Device* dev) {
  if (ckpt::inject_io_error(rt_.rank)) {
    fail(FSDP_ERR_IO, "cannot write " +
                          base::quote_path(ckpt::join(staged, ckpt::shard_file(rt_.shard_rank(), meta.shard_world))) +
                          ": injected by FSDP_CKPT_FAULT");
  }
  std::unique_ptr<ckpt::Writer> w = ckpt::create_shard_file(staged, meta, rt_.shard_rank());
  if (dev == nullptr) {
    for (const StateSegment& s : segs) w->write(s.data, s.nbytes);
  } else {
    HostStage stage(*dev, &rt_.mem);
    for (const StateSegment& s : segs) write_from(*w, dev, stage, s.data, s.nbytes);
  }
  return w->finish();
}

std::vector<ckpt::FileRecord> Context::write_full_files(const std::string& staged, const ckpt::Meta& meta,
                                                        ckpt::FullEntries entries) {
  // Shard group 0 gathers one unit at a time; rank 0 writes it. The other
  // groups hold the same values and have nothing to do.
  if (rt_.rank >= rt_.shard_world()) return {};
  bool root = rt_.rank == 0;
  const std::vector<std::string>& states = meta.optimizer.state;
  ckpt::FullWriters files;
  // An I/O failure on rank 0 must not leave the others waiting in a gather:
  // it stops writing, keeps gathering, and reports at the end.
  Outcome io;
  auto on_root = [&](auto&& body) {
    if (root && io.ok()) io = capture(body);
  };
  // The loop below writes in the entries' order: unit by unit, and within a
  // unit one state at a time.
  on_root([&] { files = ckpt::create_full_files(staged, meta, std::move(entries)); });
  bool gather = rt_.shard_world() > 1;
  HostStage stage(*rt_.dev, &rt_.mem);  // the full unit is on the compute device, or the shard on the state device
  for (size_t k = 0; k < units_.size(); ++k) {
    Unit& u = *units_[k];
    const FlatLayout& lay = u.layout();
    for (size_t s = 0; s <= (u.trainable() ? states.size() : 0); ++s) {  // frozen: the params alone
      const float* shard = s == 0 ? u.master() : optimizer_.state(k, s - 1).as<float>();
      // The params, then each state (its trainable block), gathered one at
      // a time on the compute device: the peak is one unit.
      device::Device* where = rt_.state_dev;
      const float* flat = shard;
      Buffer full;
      if (gather) {
        full = u.gather_on_device(shard, /*trainable_block=*/s > 0, "fsdp_save");
        flat = full.as<float>();
        where = rt_.dev;
      }
      on_root([&] {
        ckpt::Writer& w = s == 0 ? *files.model : *files.optimizer;
        for (size_t i = 0; i < lay.n_params(); ++i) {
          if (s > 0 && !u.param_trainable(i)) continue;  // a frozen param has no state
          write_from(w, where, stage, flat + lay.param_offset(i), lay.param(i).numel * sizeof(float));
        }
      });
    }
  }
  std::vector<ckpt::FileRecord> recs;
  on_root([&] {
    recs.push_back(files.model->finish());
    if (files.optimizer) recs.push_back(files.optimizer->finish());
  });
  if (!io.ok()) fail(io.status, io.message);
  return recs;
}

void Context::save(const std::string& dir, const std::string& kind) {
  check_no_unit_in_use("fsdp_save");
  settle_async("fsdp_save");
  agree(*rt_.comm, "fsdp_save", "kind=" + kind + "\ndir=" + dir);
  if (kind != "sharded" && kind != "full") {
    fail(FSDP_ERR_INVALID_ARGUMENT, "fsdp_save: kind must be \"sharded\" or \"full\", not " + base::quote(kind));
  }
  if (dir.empty()) fail(FSDP_ERR_INVALID_ARGUMENT, "fsdp_save: dir is empty");
  ckpt::Meta meta = checkpoint_meta(kind);
  // Every rank checks the names, so that all fail together before any file.
  ckpt::FullEntries full;
  if (kind == "full") full = ckpt::full_entries(meta, "fsdp_save");
  TraceScope scope(rt_.trace, "save");
  const std::string what = "fsdp_save to " + base::quote_path(dir);
  const std::string staged = prepare_save(*rt_.comm, dir, what, "fsdp_save");

  std::vector<ckpt::FileRecord> mine;
  Outcome wrote = capture([&] {
    // One file per shard of the shard group: replicas (HYBRID_SHARD's other
    // groups, NO_SHARD's other ranks) hold the same shards and write nothing.
    if (kind == "full") {
      mine = write_full_files(staged, meta, std::move(full));
    } else if (rt_.rank < rt_.shard_world()) {
      mine = {write_shard_file(staged, meta, shard_segments(), rt_.state_dev)};
    }
  });
  finish_save(*rt_.comm, what, dir, std::move(meta), wrote, mine);
}

std::string Context::prepare_save(comm::Communicator& comm, const std::string& dir, const std::string& what,
                                  const char* call) const {
  const std::string staged = ckpt::staging_dir(dir);
  Outcome prep = capture([&] {
    if (rt_.rank != 0) return;
    std::string note = ckpt::prepare_staging(dir, call);
    if (!note.empty()) base::log(FSDP_LOG_WARN, rt_.rank, std::string(call) + ": " + note);
  });
  check_outcomes(comm, what + " (preparing " + staged + ")", prep.status, prep.message);
  return staged;
}

void Context::finish_save(comm::Communicator& comm, const std::string& what, const std::string& dir, ckpt::Meta meta,
                          const Outcome& wrote, const std::vector<ckpt::FileRecord>& mine) const {
  const std::string staged = ckpt::staging_dir(dir);
  const bool root = rt_.rank == 0;
  try {
    check_outcomes(comm, what, wrote.status, wrote.message);
    std::vector<std::string> recs = gather_strings(comm, ckpt::files_to_json(mine), what + " (file records)");
    Outcome commit = capture([&] {
      if (!root) return;
      for (const std::string& r : recs) {
        for (ckpt::FileRecord& f : ckpt::files_from_json(r)) meta.files.push_back(std::move(f));
      }
      ckpt::write_meta(staged, meta);
      std::string warning = ckpt::commit_dir(staged, dir);
      if (!warning.empty())
        base::log(FSDP_LOG_WARN, rt_.rank, "fsdp_save to " + base::quote_path(dir) + " succeeded, but " + warning);
    });
    check_outcomes(comm, what + " (commit)", commit.status, commit.message);
  } catch (const Error&) {
    // The previous checkpoint at `dir` is untouched; the partial one goes.
    if (root) {
      std::string warning = ckpt::remove_failed_staging(staged);
      if (!warning.empty()) base::log(FSDP_LOG_WARN, rt_.rank, what + " failed, and " + warning);
    }
    throw;
  }
}

namespace {

// "a, b and c" of up to 8 names, then "and N more".
std::string name_list(const std::vector<std::string>& names) {
  constexpr size_t kShown = 8;
  std::string out;
  for (size_t i = 0; i < names.size() && i < kShown; ++i) {
    if (i > 0) out += (i + 1 == names.size() && names.size() <= kShown) ? " and " : ", ";
    out += base::quote(names[i]);
  }
  if (names.size() > kShown) out += " and " + std::to_string(names.size() - kShown) + " more";
  return out;
}

// fsdp_load_report's text: a "missing: NAME" line per registered param not
// loaded, then an "unexpected: NAME" line per one not registered.
std::string report_lines(const std::vector<std::string>& missing, const std::vector<std::string>& unexpected) {
  std::string out;
  for (const auto& n : missing) out += "missing: " + n + "\n";
  for (const auto& n : unexpected) out += "unexpected: " + n + "\n";
  return out;
}

}  // namespace

void Context::check_no_pending_grads(const char* call) const {
  for (const auto& u : units_) {
    if (u->grads_pending()) {
      fail(FSDP_ERR_INVALID_STATE, std::string(call) + " (" + rt_.where() + "): unit " + base::quote(u->name()) +
                                       " holds grads accumulated with grad sync off; run fsdp_step first");
    }
  }
}

void Context::set_load_report(const std::string& what, std::string left_out) {
  if (!left_out.empty() && rt_.rank == 0) {
    base::log(FSDP_LOG_WARN, rt_.rank, what + " left out (kept as they were: missing; ignored: unexpected):\n" + left_out);
  }
  load_report_ = std::move(left_out);
}

std::vector<std::vector<ckpt::ParamRef>> Context::match_checkpoint(const ckpt::Meta& m, const std::string& file,
                                                                   bool strict, std::string* left_out) const {
  auto bad = [&](const std::string& msg) {
    fail(FSDP_ERR_INVALID_ARGUMENT,
         std::string(strict ? "fsdp_load" : "fsdp_load_partial") + ": checkpoint " + base::quote_path(file) +
             " does not fit this context: " + msg);
  };
  std::vector<std::string> states = optimizer_.state_names();
  if (m.optimizer.state != states) {
    auto list = [](const std::vector<std::string>& v) {
      std::string s;
      for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
      return "[" + s + "]";
    };
    bad("its optimizer " + base::quote(m.optimizer.kind) + " keeps state " + list(m.optimizer.state) +
        ", this context's '" + optimizer_name(rt_.opts.optimizer) + "' keeps " + list(states));
  }
  std::vector<std::vector<ckpt::ParamRef>> refs(units_.size());
  // The same units, params and order as saved: matched by position, so that
  // names may repeat across units.
  bool same = m.units.size() == units_.size();
  for (size_t k = 0; same && k < units_.size(); ++k) {
    const FlatLayout& lay = units_[k]->layout();
    same = m.units[k].name == units_[k]->name() && m.units[k].params.size() == lay.n_params();
    for (size_t i = 0; same && i < lay.n_params(); ++i) same = m.units[k].params[i].name == lay.param(i).name;
  }
  // Otherwise by name: another grouping into units, another order.
  std::map<std::string, ckpt::ParamRef> saved;
  std::vector<std::string> repeated;
  if (!same) {
    for (size_t k = 0; k < m.units.size(); ++k) {
      for (size_t i = 0; i < m.units[k].params.size(); ++i) {
        if (!saved.emplace(m.units[k].params[i].name, ckpt::ParamRef{k, i}).second) {
          repeated.push_back(m.units[k].params[i].name);
        }
      }
    }
    if (!repeated.empty()) {
      bad("its units differ from this context's, and its param names repeat across units (" + name_list(repeated) +
          "), so its params cannot be matched by name");
    }
  }
  std::vector<std::string> missing, shapes, seen_twice;
  std::set<std::string> used;
  for (size_t k = 0; k < units_.size(); ++k) {
    const FlatLayout& lay = units_[k]->layout();
    for (size_t i = 0; i < lay.n_params(); ++i) {
      const ParamSpec& p = lay.param(i);
      ckpt::ParamRef ref{k, i};
      if (!same) {
        auto it = saved.find(p.name);
        if (it == saved.end()) {
          missing.push_back(p.name);
          refs[k].push_back(ckpt::ParamRef{ckpt::ParamRef::kNone, 0});
          continue;
        }
        if (!used.insert(p.name).second) {
          seen_twice.push_back(p.name);
          continue;
        }
        ref = it->second;
      }
      const ckpt::ParamMeta& cp = m.units[ref.unit].params[ref.param];
      if (cp.shape != p.shape) {
        shapes.push_back(base::quote(p.name) + " (" + ckpt::shape_string(cp.shape) + " saved, " +
                         ckpt::shape_string(p.shape) + " registered)");
      }
      refs[k].push_back(ref);
    }
  }
  std::vector<std::string> unexpected;
  for (const auto& [name, ref] : saved) {
    if (!used.count(name)) unexpected.push_back(name);
  }
  *left_out = report_lines(missing, unexpected);
  if (!strict) missing.clear(), unexpected.clear();  // loaded around; shapes and repeats still fail
  std::string msg;
  auto add = [&msg](const std::string& part) { msg += (msg.empty() ? "" : "; ") + part; };
  if (!seen_twice.empty()) {
    add("param names repeat across this context's units (" + name_list(seen_twice) +
        "), so the checkpoint, saved with other units, cannot be matched by name");
  }
  if (!missing.empty()) add("registered but not in the checkpoint: " + name_list(missing));
  if (!unexpected.empty()) add("in the checkpoint but not registered: " + name_list(unexpected));
  if (!shapes.empty()) {
    std::string list;
    for (const auto& s : shapes) list += (list.empty() ? "" : ", ") + s;
    add("shapes differ: " + list);
  }
  if (!msg.empty()) bad(msg);
  return refs;
}

namespace {

// The step at which each param's loaded state was fresh: its source's (the
// checkpoint's step for a param or unit frozen when saved: no state, so
// fresh now); `current` where no param came from the file. Params of one
// unit may differ (units re-wrapped after some were unfrozen at another
// step, params unfrozen inside a unit): each keeps its own bias correction.
std::vector<long> state_fresh_at(const ckpt::Meta& meta, const std::vector<ckpt::ParamRef>& sources,
                                 const std::vector<long>& current) {
  std::vector<long> at = current;
  for (size_t i = 0; i < sources.size(); ++i) {
    const ckpt::ParamRef& r = sources[i];
    if (r.none()) continue;
    const ckpt::UnitMeta& um = meta.units.at(r.unit);
    const ckpt::ParamMeta& pm = um.params.at(r.param);
    if (!um.trainable || !pm.trainable) {
      at[i] = static_cast<long>(meta.optimizer.step);
    } else {
      at[i] = static_cast<long>(pm.state_fresh_at >= 0 ? pm.state_fresh_at : um.state_fresh_at);
    }
  }
  return at;
}

}  // namespace

void Context::load(const std::string& dir, bool strict, const std::string& label) {
  const char* call = strict ? "fsdp_load" : "fsdp_load_partial";
  check_no_unit_in_use(call);
  settle_async(call);
  if (label.empty()) agree(*rt_.comm, call, "dir=" + dir);
  TraceScope scope(rt_.trace, "load");
  // The label of its collectives, the same on every rank.
  const std::string what = label.empty() ? std::string(call) + " from " + base::quote_path(dir) : label;
  // Gathered params would be stale after the load; queued reductions write
  // the grads that the load resets.
  settle_units();
  // Two passes, so that a load holds one unit's shard more than the steady
  // state, not a second copy of the whole: the first reads every range this
  // rank needs into one scratch shard, which checks the checksum of every
  // chunk it touches, and keeps nothing; once every rank found its part
  // whole, the second reads the same ranges again straight into the params
  // and the optimizer state. The checkpoint is not written meanwhile (a
  // save replaces a directory whole, by a rename).
  std::unique_ptr<ckpt::CheckpointReader> reader;
  std::vector<std::vector<ckpt::ParamRef>> sources;
  std::string left_out;
  size_t largest = 0;
  for (const auto& u : units_) largest = std::max(largest, u->shard_numel());
  HostStage stage(*rt_.state_dev, &rt_.mem);  // the host side of reads into a device the host cannot see
  // Reads unit k's `kind` into `out` (host memory); the ranges of params the
  // checkpoint lacks (non-strict) keep what `out` holds.
  auto read_unit = [&](size_t k, const std::string& kind, float* out) {
    reader->read_shard(sources[k], kind, units_[k]->layout(), rt_.shard_rank(), out);
  };
  // Into `dst`, a shard on the state device: in place when the host sees it.
  auto read_into = [&](size_t k, const std::string& kind, float* dst) {
    const Unit& u = *units_[k];
    size_t bytes = (kind == "param" ? u.shard_numel() : u.trainable_shard_numel()) * sizeof(float);
    if (rt_.state_dev->host_visible()) return read_unit(k, kind, dst);
    float* host = static_cast<float*>(stage.get(bytes));
    rt_.state_dev->copy_to_host(host, dst, bytes);  // what the params the checkpoint lacks keep
    read_unit(k, kind, host);
    rt_.state_dev->copy_from_host(dst, host, bytes);
  };
  Outcome verified = capture([&] {
    check_no_pending_grads(call);
    reader = std::make_unique<ckpt::CheckpointReader>(dir);
    sources = match_checkpoint(reader->meta(), ckpt::join(dir, ckpt::kMetaFile), strict, &left_out);
    // On the state device where the host sees it, else the host stage the
    // second pass uses too (counted in the memory stats either way).
    Buffer counted;
    float* scratch = nullptr;
    if (rt_.state_dev->host_visible()) {
      counted = Buffer(rt_.state_dev, &rt_.mem, MemCategory::kScratch, DType::kFp32, largest, /*zeroed=*/false);
      scratch = counted.as<float>();
    } else {
      scratch = static_cast<float*>(stage.get(largest * sizeof(float)));
    }
    for (size_t k = 0; k < units_.size(); ++k) {
      read_unit(k, "param", scratch);
      if (!units_[k]->trainable()) continue;  // frozen: its state is not loaded
      for (const std::string& s : reader->meta().optimizer.state) read_unit(k, s, scratch);
    }
  });
  if (!verified.ok()) verified.message = std::string(call) + ": " + verified.message;
  check_outcomes(*rt_.comm, what, verified.status, verified.message);
  // Every rank found its part whole: read it into place.
  const ckpt::Meta& meta = reader->meta();
  Outcome read = capture([&] {
    for (size_t k = 0; k < units_.size(); ++k) {
      if (k == 1 && ckpt::inject_read_error(rt_.rank)) {
        fail(FSDP_ERR_IO, "reading " + base::quote_path(dir) + ": injected by FSDP_CKPT_FAULT");
      }
      read_into(k, "param", units_[k]->master_for_load());
      units_[k]->master_loaded();
      if (!units_[k]->trainable()) continue;
      for (size_t i = 0; i < meta.optimizer.state.size(); ++i) {
        read_into(k, meta.optimizer.state[i], optimizer_.state_for_load(k, i));
      }
    }
  });
  if (!read.ok()) {
    // Only a checkpoint damaged or replaced between the passes, or an I/O
    // error, gets here: the state is partly loaded on some rank.
    read.message = std::string(call) + ": " + read.message +
                   " (after every rank had checked its part: the checkpoint changed while it was read, and this "
                   "context's params and optimizer state are now partly loaded; load again)";
  }
  check_outcomes(*rt_.comm, what, read.status, read.message);
  optimizer_.restore(meta.optimizer.step, meta.optimizer.last_grad_norm);
  for (size_t k = 0; k < units_.size(); ++k) {
    if (!units_[k]->trainable()) continue;
    const size_t n = units_[k]->layout().n_params();
    std::vector<long> before(n);
    for (size_t i = 0; i < n; ++i) before[i] = optimizer_.param_fresh_at(k, i);
    optimizer_.set_ages(*units_[k], state_fresh_at(meta, sources[k], before));
  }
  optimizer_.restore_scaler(meta.scaler.scale, static_cast<long>(meta.scaler.clean_steps),
                           meta.scaler.skipped_steps);
  optimizer_.set_lr(meta.optimizer.lr);
  set_load_report(what, left_out);
}

}  // namespace fsdp::core

namespace fsdp::core {

namespace {

// fp32 values of `n` elements of a safetensors dtype ("F32", "BF16", "F16";
// exact conversions).
void to_f32(const std::string& dtype, const unsigned char* raw, size_t n, float* out) {
  if (dtype == "F32") {
    std::memcpy(out, raw, n * sizeof(float));
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    uint16_t h = static_cast<uint16_t>(raw[2 * i] | (raw[2 * i + 1] << 8));
    out[i] = dtype == "BF16" ? kernels::bf16_bits_to_f32(h) : kernels::fp16_bits_to_f32(h);
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
