// src/comm/local/local_comm.cpp - shared-memory collectives (see local_comm.h).
// Reductions accumulate in fp32 in fixed rank order, so every rank computes the
// same bits and results do not depend on thread timing.
#include "local_comm.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "../../base/error.h"
#include "../reduce.h"
#include "../split.h"

namespace fsdp::comm {
namespace {

// Reduces element range [first, first + numel) of every rank's `send` into
// `out` (pointing at that range of the output).
// With `clear`, the range of every rank's `send` is zeroed as it is read:
// ranks reduce disjoint ranges, so together they clear every buffer whole.
// With a `plane`, the plane's reduction does it on the rank's stream.
void reduce_range(LocalGroup& g, DataPlane* plane, void* out, size_t first, size_t numel, DType dtype, RedOp op,
                  bool clear = false) {
  if (op == RedOp::kMax || op == RedOp::kMin) fail(FSDP_ERR_INTERNAL, "local comm: max/min of tensors is not used");
  int world = g.world_size();
  float scale = op == RedOp::kAvg ? 1.0f / static_cast<float>(world) : 1.0f;
  thread_local std::vector<void*> ins;  // kept: a collective allocates nothing once warm
  ins.resize(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    // Only reduce_scatter_clear's sends are written, and those are writable.
    ins[static_cast<size_t>(r)] =
        const_cast<char*>(static_cast<const char*>(g.slot(r).send)) + first * dtype_size(dtype);
  }
  if (plane != nullptr) {
    plane->reduce(out, ins.data(), ins.size(), numel, dtype, scale, clear);
  } else if (clear) {
    reduce_sum_clear(out, ins.data(), ins.size(), numel, dtype, scale);
  } else {
    reduce_sum(out, ins.data(), ins.size(), numel, dtype, scale);
  }
}

std::string describe(const CollectiveDesc& d) {
  std::string label = d.label_text;
  if (d.label_size >= sizeof d.label_text) label += "...";
  std::string s = std::string(d.kind) + "(" + label + ", size " + std::to_string(d.size);
  if (d.dtype >= 0) s += std::string(", ") + dtype_name(static_cast<DType>(d.dtype));
  if (d.root >= 0) s += ", root " + std::to_string(d.root);
  if (d.device) s += ", device memory";
  return s + ")";
}

bool same(const CollectiveDesc& a, const CollectiveDesc& b) {
  return std::strcmp(a.kind, b.kind) == 0 && a.size == b.size && a.dtype == b.dtype && a.op == b.op &&
         a.root == b.root && a.device == b.device && a.label_hash == b.label_hash && a.label_size == b.label_size;
}

}  // namespace

void CollectiveDesc::copy_label() {
  static const std::string kNone;
  const std::string& l = label != nullptr ? *label : kNone;
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (char c : l) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  label_hash = h;
  label_size = l.size();
  size_t n = std::min(l.size(), sizeof label_text - 1);
  std::memcpy(label_text, l.data(), n);
  label_text[n] = '\0';
}

LocalComm::LocalComm(std::shared_ptr<LocalGroup> group, int rank, double timeout_s)
    : group_(std::move(group)), rank_(rank), timeout_s_(timeout_s) {
  group_->claim(rank_);
}

LocalComm::~LocalComm() { group_->release(rank_); }

void LocalComm::sync(base::FunctionRef<std::string()> what) {
  if (on_plane_) publish_mark();
  group_->arrive_and_wait(rank_, timeout_s_, what);
  if (on_plane_) wait_for_peers_marks();
}

void LocalComm::publish_mark() { group_->slot(rank_).marks[plane_phases_ & 1] = plane_->mark(); }

void LocalComm::wait_for_peers_marks() {
  for (int r = 0; r < world_size(); ++r) {
    if (r != rank_) plane_->wait(group_->slot(r).marks[plane_phases_ & 1]);
  }
  ++plane_phases_;
}

void LocalComm::move(void* dst, const void* src, size_t nbytes) {
  if (on_plane_) {
    plane_->copy(dst, src, nbytes);
  } else {
    std::memcpy(dst, src, nbytes);
  }
}

bool LocalComm::attach_data_plane(std::shared_ptr<DataPlane> plane) {
  plane_ = std::move(plane);
  return true;
}

void LocalComm::run(CollectiveDesc desc, const void* send, void* recv, base::FunctionRef<void()> body) {
  // Each rank decides from its own buffers; the check below makes sure that
  // all took the same path.
  desc.device = plane_ != nullptr && (plane_->owns(send) || plane_->owns(recv));
  on_plane_ = desc.device;
  if (world_size() == 1 && failure_.load() == FSDP_OK) {
    // Alone: nobody to wait for or to compare with. The group may still have
    // been aborted (a destroyed context, an external abort): then the full path
    // below reports it.
    if (!group_->aborted()) {
      Slot& mine = group_->slot(rank_);  // the bodies read the ranks' slots, this one's included
      mine.seq = ++seq_;
      mine.send = send;
      mine.recv = recv;
      body();
      return;
    }
  }
  try {
    run_checked(desc, send, recv, body);
  } catch (const Error& e) {
    failure_.store(e.status());  // every way out of a collective by error breaks the group
    throw;
  }
}

void LocalComm::run_checked(CollectiveDesc desc, const void* send, void* recv, base::FunctionRef<void()> body) {
  ++seq_;
  uint64_t seq = seq_;
  auto what = [&desc, seq] {
    return (desc.label ? *desc.label : std::string()) + " (" + desc.kind + ", collective #" + std::to_string(seq) + ")";
  };
  desc.copy_label();
  Slot& mine = group_->slot(rank_);
  mine.desc = desc;
  mine.seq = seq_;
  mine.send = send;
  mine.recv = recv;
  // The first phase's mark is waited for only once every rank is known to
  // run the same collective (a rank on the host path publishes none).
  if (on_plane_) publish_mark();
  group_->arrive_and_wait(rank_, timeout_s_, what);
  for (int r = 0; r < world_size(); ++r) {
    const Slot& other = group_->slot(r);
    if (!same(other.desc, mine.desc) || other.seq != mine.seq) {
      // Every rank sees the same slots, so every rank fails here, together.
      std::string msg = "ranks called different collectives: rank " + std::to_string(group_->world_rank(rank_)) +
                        " called " + describe(mine.desc) + " as its collective #" + std::to_string(mine.seq) +
                        ", rank " + std::to_string(group_->world_rank(r)) + " called " + describe(other.desc) +
                        " as its collective #" + std::to_string(other.seq) +
                        "; every rank must make the same collective calls in the same order";
      group_->abort(FSDP_ERR_MISMATCH, msg);
      fail(FSDP_ERR_MISMATCH, msg);
    }
  }
  if (on_plane_) wait_for_peers_marks();
  body();
  sync(what);
}

void LocalComm::all_gather(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) {
  CollectiveDesc d{"all_gather", nbytes_per_rank, -1, -1, -1, &label};
  run(d, send, recv, [&] {
    int world = world_size();
    // Start at our own rank so that ranks read different peers at a time.
    for (int k = 0; k < world; ++k) {
      int r = (rank_ + k) % world;
      move(static_cast<char*>(recv) + static_cast<size_t>(r) * nbytes_per_rank, group_->slot(r).send, nbytes_per_rank);
    }
  });
}

void LocalComm::reduce_scatter(const void* send, void* recv, size_t numel_per_rank, DType dtype, RedOp op,
                               const std::string& label) {
  CollectiveDesc d{"reduce_scatter", numel_per_rank, static_cast<int>(dtype), static_cast<int>(op), -1, &label};
  run(d, send, recv, [&] {
    reduce_range(*group_, plane(), recv, static_cast<size_t>(rank_) * numel_per_rank, numel_per_rank, dtype, op);
  });
}

void LocalComm::reduce_scatter_clear(void* send, void* recv, size_t numel_per_rank, DType dtype, RedOp op,
                                     const std::string& label) {
  // The same collective as reduce_scatter for the rank check: a rank that
  // clears and one that does not still agree on the data.
  CollectiveDesc d{"reduce_scatter", numel_per_rank, static_cast<int>(dtype), static_cast<int>(op), -1, &label};
  run(d, send, recv, [&] {
    reduce_range(*group_, plane(), recv, static_cast<size_t>(rank_) * numel_per_rank, numel_per_rank, dtype, op, true);
  });
}

void LocalComm::all_to_all(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) {
  CollectiveDesc d{"all_to_all", nbytes_per_rank, -1, -1, -1, &label};
  run(d, send, recv, [&] {
    int world = world_size();
    const size_t mine = static_cast<size_t>(rank_) * nbytes_per_rank;
    for (int k = 0; k < world; ++k) {  // starting at our own rank, as all_gather
      int r = (rank_ + k) % world;
      move(static_cast<char*>(recv) + static_cast<size_t>(r) * nbytes_per_rank,
           static_cast<const char*>(group_->slot(r).send) + mine, nbytes_per_rank);
    }
  });
}

void LocalComm::all_reduce(const void* send, void* recv, size_t numel, DType dtype, RedOp op,
                           const std::string& label) {
  CollectiveDesc d{"all_reduce", numel, static_cast<int>(dtype), static_cast<int>(op), -1, &label};
  size_t world = static_cast<size_t>(world_size());
  size_t chunk = (numel + world - 1) / world;
  size_t es = dtype_size(dtype);
  auto range = [&](size_t r) {
    size_t b = std::min(numel, r * chunk);
    return std::make_pair(b, std::min(numel, b + chunk) - b);
  };
  run(d, send, recv, [&] {
    // Phase 1: each rank reduces its own chunk; phase 2: it copies the others'.
    auto [b, n] = range(static_cast<size_t>(rank_));
    reduce_range(*group_, plane(), static_cast<char*>(recv) + b * es, b, n, dtype, op);
    sync([&] { return label + " (all_reduce, collective #" + std::to_string(seq_) + ", second phase)"; });
    for (size_t r = 0; r < world; ++r) {
      if (r == static_cast<size_t>(rank_)) continue;
      auto [rb, rn] = range(r);
      move(static_cast<char*>(recv) + rb * es,
           static_cast<const char*>(group_->slot(static_cast<int>(r)).recv) + rb * es, rn * es);
    }
  });
}

void LocalComm::all_reduce_f64(double* values, size_t n, RedOp op, const std::string& label) {
  CollectiveDesc d{"all_reduce_f64", n, -1, static_cast<int>(op), -1, &label};
  thread_local std::vector<double> in;  // kept, as reduce_range's
  in.assign(values, values + n);
  run(d, in.data(), values, [&] {
    reduce_f64(values, n, world_size(), op, [&](int r) { return static_cast<const double*>(group_->slot(r).send); });
  });
}

void LocalComm::sum_f64(const double* send, double* recv, size_t n, const std::string& label) {
  if (plane_ == nullptr || !plane_->owns(recv)) {
    Communicator::sum_f64(send, recv, n, label);  // host memory: all_reduce_f64's rank order
    return;
  }
  // The GPU's memory (ranks as threads sharing it): each rank adds every
  // rank's `send` in rank order into its own `recv` on its stream, after the
  // others' marks; the closing phase keeps `send` until all have read it.
  CollectiveDesc d{"sum_f64", n, -1, static_cast<int>(RedOp::kSum), -1, &label};
  run(d, send, recv, [&] {
    thread_local std::vector<const double*> ins;  // kept, as reduce_range's
    ins.resize(static_cast<size_t>(world_size()));
    for (int r = 0; r < world_size(); ++r) ins[static_cast<size_t>(r)] = static_cast<const double*>(group_->slot(r).send);
    plane_->reduce_f64(recv, ins.data(), ins.size(), n);
  });
}

void LocalComm::broadcast(void* buf, size_t nbytes, int root, const std::string& label) {
  CollectiveDesc d{"broadcast", nbytes, -1, -1, root, &label};
  run(d, buf, buf, [&] {
    if (rank_ != root) move(buf, group_->slot(root).send, nbytes);
  });
}

void LocalComm::abort(const std::string& reason) {
  failure_.store(FSDP_ERR_COMM);
  group_->abort(FSDP_ERR_COMM,
                "rank " + std::to_string(group_->world_rank(rank_)) + " aborted the communicator: " + reason);
}

void LocalComm::barrier(const std::string& label) {
  CollectiveDesc d{"barrier", 0, -1, -1, -1, &label};
  run(d, nullptr, nullptr, [] {});
}

std::unique_ptr<Communicator> LocalComm::split(int color, int key, const std::string& label) {
  size_t world = static_cast<size_t>(world_size());
  int64_t mine[2] = {color, key};
  std::vector<int64_t> all(2 * world);
  all_gather(mine, all.data(), sizeof mine, label);
  std::vector<int> members = split_members(all, color);  // group ranks of my color
  std::vector<int> names;
  int new_rank = 0;
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i] == rank_) new_rank = static_cast<int>(i);
    names.push_back(group_->world_rank(members[i]));
  }
  // seq_ is the same on every rank here, so it tells this split from others.
  auto child = std::make_unique<LocalComm>(group_->child(seq_, color, names), new_rank, timeout_s_);
  child->attach_data_plane(plane_);
  return child;
}

}  // namespace fsdp::comm
