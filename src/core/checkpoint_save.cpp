// src/core/checkpoint_save.cpp - Context::save: the metadata of the state,
// who writes which file (a sharded save's shard files from each rank of the
// shard group, a full save's gathered units from rank 0), and the
// collective start and end every save shares with fsdp_save_async
// (prepare_save, finish_save: agreement on every phase, the commit). The
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

void add_file_records(const std::vector<std::string>& records, ckpt::Meta* meta) {
  for (const std::string& r : records) {
    for (ckpt::FileRecord& f : ckpt::files_from_json(r)) meta->files.push_back(std::move(f));
  }
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
      add_file_records(recs, &meta);
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

}  // namespace fsdp::core
