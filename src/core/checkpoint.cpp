// src/core/checkpoint.cpp - Context::load (fsdp_load, fsdp_load_partial): how
// a registered param finds its source in a checkpoint (by position or by
// name), and the all-or-nothing load: everything is read and checked into
// scratch first, and only when every rank succeeded do they read into the
// context's state. Saves are checkpoint_save.cpp; the file format src/ckpt/.

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
