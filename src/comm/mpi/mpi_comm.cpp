// src/comm/mpi/mpi_comm.cpp - see mpi_comm.h: the check-in, the collectives on
// MPI's own non-blocking ones or the point-to-point algorithms (mpi_ring.cpp),
// split, and the world from the launcher.
#include "mpi_comm.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <functional>
#include <thread>

#include "../../base/error.h"
#include "../../base/spin.h"
#include "../../base/text.h"
#include "../../base/timer_slack.h"
#include "../launch.h"
#include "../reduce.h"
#include "mpi_env.h"

namespace fsdp::comm {
namespace {

constexpr int kTagCheck = 1;
constexpr int kTagVerdict = 2;
// Below this many bytes a reduction takes MPI's own collective (auto): a ring
// pays world - 1 latencies.
constexpr size_t kRingMinBytes = size_t(64) << 10;
// How a wait polls MPI. kData: every rank is inside the collective (it passed
// the check-in), so the transfer is under way and MPI needs polling to move
// it: full speed (yielding) for kDataSpin, then polls kDataSleep apart. A yield
// keeps the core when the thread that has work (this rank's compute, or on a
// shared core the peer we wait for) is not runnable there, and CFS does not
// honour it much anyway; a 2 us sleep hands the core over and measured faster
// than spinning for 16 MiB collectives at 2 ranks on 2 cores (all-gather
// 2.6-3.4 vs 3.2-3.4 ms, reduce-scatter 3.0-3.7 vs 3.6-4.7 ms over repeated
// runs of bench_mpi_collectives), the same at 64 MiB. kPeers:
// the check-in, where a rank waits for the others to arrive, which may take as
// long as their compute: yielding for kPeerSpin, then sleeps growing from
// kPeerSleepMin to kPeerSleepMax, so that a waiting rank costs its host a few
// percent of a core instead of all of it (ranks often share cores).
enum class Patience { kData, kPeers };
constexpr auto kDataSpin = std::chrono::microseconds(50);
constexpr auto kDataSleep = std::chrono::microseconds(2);
// 1 ms: ranks that share cores (more ranks than cores, as in the mpirun
// tests) reach a collective within a scheduler tick of each other, and a
// yield hands the core over at once, where a sleep adds its latency to every
// small collective (the 4-rank equivalence suite on 2 cores took 15.9 s with
// 50 us of spinning, 3.2 s with 1 ms, 2.6 s spinning 50 ms); a peer that is
// computing costs the waiting rank that 1 ms and then a few percent.
constexpr auto kPeerSpin = std::chrono::milliseconds(1);
constexpr auto kPeerSleepMin = std::chrono::microseconds(10);
constexpr auto kPeerSleepMax = std::chrono::microseconds(500);

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}


using base::FineTimerSlack;

// Waits for `reqs` (completed ones become MPI_REQUEST_NULL) until `deadline`.
bool poll_requests(std::vector<MPI_Request>& reqs, std::chrono::steady_clock::time_point deadline,
                   const std::atomic<bool>* aborted, Patience patience = Patience::kData) {
  FineTimerSlack slack;
  auto start = std::chrono::steady_clock::now();
  auto sleep = kPeerSleepMin;
  std::vector<int> done(reqs.size());
  for (;;) {
    int outcount = 0;
    {
      auto guard = mpi::lock();
      MPI_Testsome(static_cast<int>(reqs.size()), reqs.data(), &outcount, done.data(), MPI_STATUSES_IGNORE);
    }
    if (outcount == MPI_UNDEFINED) return true;  // every request is complete
    if (aborted != nullptr && aborted->load()) return false;
    auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return false;
    if (patience == Patience::kPeers) {
      if (now - start < kPeerSpin) {
        std::this_thread::yield();
      } else {
        slack.engage();
        std::this_thread::sleep_for(sleep);
        sleep = std::min<std::chrono::microseconds>(2 * sleep, kPeerSleepMax);
      }
    } else if (now - start < kDataSpin) {
      std::this_thread::yield();
    } else {
      // A short sleep, not a yield: the core goes to a thread that has work
      // (this rank's compute, or the peer whose data we wait for), and the
      // poll resumes within microseconds.
      slack.engage();
      std::this_thread::sleep_for(kDataSleep);
    }
  }
}

// Gives up point-to-point requests that will never complete. `buffers`
// (those of the requests) are kept for the life of the process, since MPI may
// still touch a send buffer after the request is freed.
void abandon(std::vector<MPI_Request>& reqs, std::shared_ptr<void> buffers = nullptr) {
  static std::mutex graveyard_mu;
  static std::vector<std::shared_ptr<void>> graveyard;
  if (buffers) {
    std::lock_guard<std::mutex> lock(graveyard_mu);
    graveyard.push_back(std::move(buffers));
  }
  auto guard = mpi::lock();
  for (MPI_Request& r : reqs) {
    if (r == MPI_REQUEST_NULL) continue;
    MPI_Cancel(&r);
    MPI_Request_free(&r);
  }
}

std::string seconds(double s) { return base::format_double(s); }

}  // namespace

// What a rank says it is calling; rank 0 compares every rank's with its own.
struct MpiComm::Desc {
  uint64_t seq = 0;
  uint64_t size = 0;
  uint64_t label_hash = 0;
  int32_t dtype = -1;
  int32_t op = -1;
  int32_t root = -1;
  char kind[20] = {};
  char label[96] = {};  // for messages; the hash compares the whole label

  std::string describe() const {
    std::string s =
        std::string(kind) + "(" + std::string(label, strnlen(label, sizeof label)) + ", size " + std::to_string(size);
    if (dtype >= 0) s += std::string(", ") + dtype_name(static_cast<DType>(dtype));
    if (root >= 0) s += ", root " + std::to_string(root);
    return s + ")";
  }
  bool same_as(const Desc& o) const {
    return seq == o.seq && size == o.size && label_hash == o.label_hash && dtype == o.dtype && op == o.op &&
           root == o.root && std::strncmp(kind, o.kind, sizeof kind) == 0;
  }
};

namespace {
struct Verdict {
  int32_t status = FSDP_OK;
  char message[1020] = {};
};
}  // namespace

MpiComm::MpiComm(MPI_Comm comm, std::vector<int> world_ranks, int local_world, double timeout_s, MpiAlgorithm algo)
    : comm_(comm), world_ranks_(std::move(world_ranks)), local_world_(local_world), timeout_s_(timeout_s), algo_(algo) {
  auto guard = mpi::lock();
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &world_);
}

MpiComm::~MpiComm() {
  // A failed communicator may have requests MPI can no longer complete;
  // freeing it then is not safe, and the process is about to end anyway.
  if (failure_.load() != FSDP_OK) return;
  auto guard = mpi::lock();
  MPI_Comm_free(&comm_);
}

char* MpiComm::scratch(int i, size_t nbytes) {
  std::vector<char>& s = scratch_[i];
  if (s.size() < nbytes) s.resize(nbytes);
  return s.data();
}

void MpiComm::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(reason_mu_);
    if (failure_reason_.empty()) {
      failure_reason_ = rank_name(rank_) + " aborted the communicator: " + reason;
    }
  }
  failure_.store(FSDP_ERR_COMM);
  aborted_.store(true);
  mpi::note_failure();
}

bool MpiComm::uses_ring(const char* kind, size_t nbytes) const {
  if (world_ == 1) return false;
  switch (algo_) {
    case MpiAlgorithm::kRing:
      return true;
    case MpiAlgorithm::kNative:
      return nbytes / static_cast<size_t>(world_) > kMaxPiece;  // beyond MPI's int counts
    default:
      // Measured on one host (benchmarks/bench_mpi_collectives): Open MPI's
      // all-gather is as fast as a ring, its reduce-scatter several times slower.
      // Its all-to-all is left to it too (the pairwise exchange is what it runs).
      if (std::strcmp(kind, "all_gather") == 0 || std::strcmp(kind, "all_to_all") == 0) {
        return nbytes / static_cast<size_t>(world_) > kMaxPiece;
      }
      return nbytes >= kRingMinBytes;
  }
}

template <typename Body>
void MpiComm::collective(const char* kind, size_t size, int dtype, int op, int root, const std::string& label,
                         Body&& body) {
  if (failure_.load() != FSDP_OK) {
    std::lock_guard<std::mutex> lock(reason_mu_);
    fail(FSDP_ERR_COMM,
         label + " (" + kind + ") on " + rank_name(rank_) + ": the communicator failed earlier: " + failure_reason_);
  }
  ++seq_;
  Desc d;
  d.seq = seq_;
  d.size = size;
  d.label_hash = fnv1a(label);
  d.dtype = dtype;
  d.op = op;
  d.root = root;
  std::strncpy(d.kind, kind, sizeof d.kind - 1);
  std::strncpy(d.label, label.c_str(), sizeof d.label - 1);
  what_ = label + " (" + kind + ", collective #" + std::to_string(seq_) + ")";
  try {
    check_in(d);
    body();
  } catch (const Error& e) {
    if (failure_.load() == FSDP_OK) {
      std::lock_guard<std::mutex> lock(reason_mu_);
      failure_reason_ = e.what();
    }
    failure_.store(e.status());
    mpi::note_failure();
    throw;
  }
}

bool MpiComm::poll(std::vector<MPI_Request>& reqs, Clock::time_point deadline, std::shared_ptr<void> buffers,
                   bool for_peers) {
  bool ok = poll_requests(reqs, deadline, &aborted_, for_peers ? Patience::kPeers : Patience::kData);
  if (!ok && aborted_.load()) {
    abandon(reqs, std::move(buffers));
    std::lock_guard<std::mutex> lock(reason_mu_);
    fail(FSDP_ERR_COMM, what_ + " on " + rank_name(rank_) + ": " + failure_reason_);
  }
  return ok;
}

void MpiComm::check_in(const Desc& mine_in) {
  if (world_ == 1) return;
  const std::string& what = what_;
  // On the heap: if a peer stops answering, MPI may keep these after we leave.
  struct Buffers {
    Desc mine;
    Verdict verdict;
    std::vector<Desc> got;  // rank 0: every rank's description
  };
  auto bufs = std::make_shared<Buffers>();
  bufs->mine = mine_in;
  const Desc& mine = bufs->mine;
  Verdict& verdict = bufs->verdict;
  if (rank_ == 0) {
    std::vector<Desc>& got = bufs->got;
    got.resize(static_cast<size_t>(world_));
    std::vector<MPI_Request> reqs(static_cast<size_t>(world_ - 1), MPI_REQUEST_NULL);
    {
      auto guard = mpi::lock();
      for (int r = 1; r < world_; ++r) {
        MPI_Irecv(&got[static_cast<size_t>(r)], sizeof(Desc), MPI_BYTE, r, kTagCheck, comm_,
                  &reqs[static_cast<size_t>(r - 1)]);
      }
    }
    std::vector<int> arrived;
    if (!poll(reqs, base::deadline_after(timeout_s_), bufs, /*for_peers=*/true)) {
      std::string missing;
      int n_missing = 0;
      for (int r = 1; r < world_; ++r) {
        if (reqs[static_cast<size_t>(r - 1)] != MPI_REQUEST_NULL) {
          missing += (n_missing++ ? ", " : "") + std::to_string(world_ranks_[static_cast<size_t>(r)]);
        } else {
          arrived.push_back(r);
        }
      }
      abandon(reqs, bufs);
      verdict.status = FSDP_ERR_TIMEOUT;
      std::snprintf(verdict.message, sizeof verdict.message,
                    "%s: timed out after %s s waiting for rank%s %s (seen from rank %d, which checks every "
                    "collective; the missing rank may have exited, hung, or called a different collective)",
                    what.c_str(), seconds(timeout_s_).c_str(), n_missing > 1 ? "s" : "", missing.c_str(),
                    world_ranks_[0]);
    } else {
      for (int r = 1; r < world_; ++r) arrived.push_back(r);
      for (int r = 1; r < world_ && verdict.status == FSDP_OK; ++r) {
        const Desc& other = got[static_cast<size_t>(r)];
        if (other.same_as(mine)) continue;
        verdict.status = FSDP_ERR_MISMATCH;
        std::snprintf(verdict.message, sizeof verdict.message,
                      "ranks called different collectives: rank %d called %s as its collective #%llu, rank %d "
                      "called %s as its collective #%llu; every rank must make the same collective calls in the "
                      "same order",
                      world_ranks_[0], mine.describe().c_str(), static_cast<unsigned long long>(mine.seq),
                      world_ranks_[static_cast<size_t>(r)], other.describe().c_str(),
                      static_cast<unsigned long long>(other.seq));
      }
    }
    // Tell every rank that arrived (small messages: they go out at once).
    std::vector<MPI_Request> sends(arrived.size(), MPI_REQUEST_NULL);
    {
      auto guard = mpi::lock();
      for (size_t i = 0; i < arrived.size(); ++i) {
        MPI_Isend(&verdict, sizeof verdict, MPI_BYTE, arrived[i], kTagVerdict, comm_, &sends[i]);
      }
    }
    if (!poll(sends, base::deadline_after(timeout_s_), bufs)) abandon(sends, bufs);
  } else {
    std::vector<MPI_Request> reqs(2, MPI_REQUEST_NULL);
    {
      auto guard = mpi::lock();
      MPI_Isend(&mine, sizeof(Desc), MPI_BYTE, 0, kTagCheck, comm_, &reqs[0]);
      MPI_Irecv(&verdict, sizeof verdict, MPI_BYTE, 0, kTagVerdict, comm_, &reqs[1]);
    }
    // Longer than rank 0's own wait, so that rank 0's verdict (which names a
    // missing rank) arrives first when rank 0 is alive.
    if (!poll(reqs, base::deadline_after(2 * timeout_s_ + 1), bufs, /*for_peers=*/true)) {
      abandon(reqs, bufs);
      fail(FSDP_ERR_TIMEOUT, what + ": timed out after " + seconds(2 * timeout_s_ + 1) + " s waiting for " +
                                 rank_name(0) + " (seen from " + rank_name(rank_) + "), which checks that every " +
                                 "rank reached this collective; it may have exited or hung");
    }
  }
  if (verdict.status != FSDP_OK) {
    std::string msg(verdict.message, strnlen(verdict.message, sizeof verdict.message));
    if (rank_ != 0) msg += " [reported to " + rank_name(rank_) + "]";
    fail(static_cast<fsdp_status_t>(verdict.status), msg);
  }
}

void MpiComm::wait_data(std::vector<MPI_Request>& reqs, int peer, const std::vector<int>* peers) {
  if (poll(reqs, base::deadline_after(timeout_s_))) return;
  if (peers != nullptr) {  // the first transfer still pending names its peer
    for (size_t i = 0; i < reqs.size(); ++i) {
      if (reqs[i] != MPI_REQUEST_NULL) {
        peer = (*peers)[i];
        break;
      }
    }
  }
  abandon(reqs);
  fail(FSDP_ERR_TIMEOUT, what_ + ": timed out after " + seconds(timeout_s_) + " s waiting for data from " +
                             rank_name(peer) + " (seen from " + rank_name(rank_) +
                             "); every rank had reached the collective, so that rank failed or stalled inside it");
}

void MpiComm::wait_native(MPI_Request req) {
  std::vector<MPI_Request> reqs{req};
  if (poll(reqs, base::deadline_after(timeout_s_))) return;
  // A collective request can be neither cancelled nor freed: it is left to
  // MPI, and this communicator is not freed (see the destructor).
  fail(FSDP_ERR_TIMEOUT, what_ + ": timed out after " + seconds(timeout_s_) + " s inside MPI's collective (seen from " +
                             rank_name(rank_) + "); every rank had reached it, so a rank failed or stalled inside it");
}

void MpiComm::native_sum(void* out, size_t numel, DType dtype, float scale,
                         const std::function<void(void* summed, MPI_Request* req)>& post) {
  char* summed = scratch(0, numel * dtype_size(dtype));
  MPI_Request req = MPI_REQUEST_NULL;
  {
    auto guard = mpi::lock();
    post(summed, &req);
  }
  wait_native(req);
  const void* ins[1] = {summed};
  reduce_sum(out, ins, 1, numel, dtype, scale);
}

void MpiComm::all_gather(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) {
  collective("all_gather", nbytes_per_rank, -1, -1, -1, label, [&] {
    char* mine = static_cast<char*>(recv) + static_cast<size_t>(rank_) * nbytes_per_rank;
    if (uses_ring("all_gather", nbytes_per_rank * static_cast<size_t>(world_)) || world_ == 1) {
      if (mine != send) std::memmove(mine, send, nbytes_per_rank);
      std::vector<size_t> first(static_cast<size_t>(world_) + 1);
      for (size_t c = 0; c < first.size(); ++c) first[c] = c * nbytes_per_rank;
      ring_all_gather(recv, first);
      return;
    }
    MPI_Request req = MPI_REQUEST_NULL;
    {
      auto guard = mpi::lock();
      MPI_Iallgather(mine == send ? MPI_IN_PLACE : send, as_count(nbytes_per_rank), MPI_BYTE, recv,
                     as_count(nbytes_per_rank), MPI_BYTE, comm_, &req);
    }
    wait_native(req);
  });
}

void MpiComm::all_to_all(const void* send, void* recv, size_t nbytes_per_rank, const std::string& label) {
  collective("all_to_all", nbytes_per_rank, -1, -1, -1, label, [&] {
    if (world_ == 1 || uses_ring("all_to_all", nbytes_per_rank * static_cast<size_t>(world_))) {
      pairwise_all_to_all(send, recv, nbytes_per_rank);
      return;
    }
    MPI_Request req = MPI_REQUEST_NULL;
    {
      auto guard = mpi::lock();
      MPI_Ialltoall(send, as_count(nbytes_per_rank), MPI_BYTE, recv, as_count(nbytes_per_rank), MPI_BYTE, comm_, &req);
    }
    wait_native(req);
  });
}

void MpiComm::reduce_scatter(const void* send, void* recv, size_t numel_per_rank, DType dtype, RedOp op,
                             const std::string& label) {
  reduce_scatter_impl(send, recv, numel_per_rank, dtype, op, label, false);
}

void MpiComm::reduce_scatter_clear(void* send, void* recv, size_t numel_per_rank, DType dtype, RedOp op,
                                   const std::string& label) {
  reduce_scatter_impl(send, recv, numel_per_rank, dtype, op, label, true);
}

void MpiComm::reduce_scatter_impl(const void* send, void* recv, size_t numel_per_rank, DType dtype, RedOp op,
                                  const std::string& label, bool clear) {
  if (op == RedOp::kMax || op == RedOp::kMin) fail(FSDP_ERR_INTERNAL, "mpi comm: max/min of tensors is not used");
  const size_t es = dtype_size(dtype);
  const float scale = op == RedOp::kAvg ? 1.0f / static_cast<float>(world_) : 1.0f;
  collective("reduce_scatter", numel_per_rank, static_cast<int>(dtype), static_cast<int>(op), -1, label, [&] {
    // MPI's own collectives read `send` inside: clearing it is a pass after.
    auto clear_all = [&] {
      if (clear) std::memset(const_cast<void*>(send), 0, numel_per_rank * es * static_cast<size_t>(world_));
    };
    if (world_ == 1) {
      if (recv != send) std::memcpy(recv, send, numel_per_rank * es);
      clear_all();
      return;
    }
    if (uses_ring("reduce_scatter", numel_per_rank * es * static_cast<size_t>(world_))) {
      std::vector<size_t> first(static_cast<size_t>(world_) + 1);
      for (size_t c = 0; c < first.size(); ++c) first[c] = c * numel_per_rank;
      ring_reduce_scatter(send, recv, first, dtype, scale, clear);
      return;
    }
    // MPI_Ireduce_scatter rather than _block: Open MPI picks a faster
    // algorithm for it (bench_mpi_collectives times both raw calls).
    std::vector<int> counts(static_cast<size_t>(world_), as_count(numel_per_rank));
    native_sum(recv, numel_per_rank, dtype, scale, [&](void* summed, MPI_Request* req) {
      MPI_Ireduce_scatter(send, summed, counts.data(), mpi::datatype(dtype), mpi::sum_op(dtype), comm_, req);
    });
    clear_all();
  });
}

void MpiComm::all_reduce(const void* send, void* recv, size_t numel, DType dtype, RedOp op, const std::string& label) {
  if (op == RedOp::kMax || op == RedOp::kMin) fail(FSDP_ERR_INTERNAL, "mpi comm: max/min of tensors is not used");
  const size_t es = dtype_size(dtype);
  const float scale = op == RedOp::kAvg ? 1.0f / static_cast<float>(world_) : 1.0f;
  collective("all_reduce", numel, static_cast<int>(dtype), static_cast<int>(op), -1, label, [&] {
    if (world_ == 1) {
      if (recv != send) std::memcpy(recv, send, numel * es);
      return;
    }
    if (uses_ring("all_reduce", numel * es)) {
      // Reduce-scatter into this rank's chunk of recv, then all-gather the chunks.
      std::vector<size_t> first(static_cast<size_t>(world_) + 1);
      size_t w = static_cast<size_t>(world_);
      for (size_t c = 0; c <= w; ++c) first[c] = c * (numel / w) + std::min(c, numel % w);
      char* mine = static_cast<char*>(recv) + first[static_cast<size_t>(rank_)] * es;
      ring_reduce_scatter(send, mine, first, dtype, scale);
      for (size_t& f : first) f *= es;
      ring_all_gather(recv, first);
      return;
    }
    native_sum(recv, numel, dtype, scale, [&](void* summed, MPI_Request* req) {
      MPI_Iallreduce(send, summed, as_count(numel), mpi::datatype(dtype), mpi::sum_op(dtype), comm_, req);
    });
  });
}

void MpiComm::all_reduce_f64(double* values, size_t n, RedOp op, const std::string& label) {
  collective("all_reduce_f64", n, -1, static_cast<int>(op), -1, label, [&] {
    if (world_ == 1) return;
    // Gathered and combined in rank order, so every rank gets the same bits
    // (a clipping coefficient that differed by one ulp would split replicas).
    std::vector<double> all(n * static_cast<size_t>(world_));
    MPI_Request req = MPI_REQUEST_NULL;
    {
      auto guard = mpi::lock();
      MPI_Iallgather(values, as_count(n), MPI_DOUBLE, all.data(), as_count(n), MPI_DOUBLE, comm_, &req);
    }
    wait_native(req);
    reduce_f64(values, n, world_, op, [&](int r) { return all.data() + static_cast<size_t>(r) * n; });
  });
}

void MpiComm::broadcast(void* buf, size_t nbytes, int root, const std::string& label) {
  collective("broadcast", nbytes, -1, -1, root, label, [&] {
    if (world_ == 1) return;
    for (size_t off = 0; off < nbytes; off += kMaxPiece) {
      MPI_Request req = MPI_REQUEST_NULL;
      {
        auto guard = mpi::lock();
        MPI_Ibcast(static_cast<char*>(buf) + off, as_count(std::min(kMaxPiece, nbytes - off)), MPI_BYTE, root, comm_,
                   &req);
      }
      wait_native(req);
    }
  });
}

void MpiComm::barrier(const std::string& label) {
  // The check-in is a barrier: rank 0 answers only when every rank arrived.
  collective("barrier", 0, -1, -1, -1, label, [] {});
}

std::unique_ptr<Communicator> MpiComm::split(int color, int key, const std::string& label) {
  std::unique_ptr<Communicator> out;
  collective("split", 0, -1, -1, -1, label, [&] {
    // Blocking calls, but only after every rank checked in.
    MPI_Comm sub = MPI_COMM_NULL;
    auto guard = mpi::lock();
    MPI_Comm_split(comm_, color, key, &sub);
    int sub_size = 1;
    MPI_Comm_size(sub, &sub_size);
    int me = world_ranks_[static_cast<size_t>(rank_)];
    std::vector<int> names(static_cast<size_t>(sub_size));
    MPI_Allgather(&me, 1, MPI_INT, names.data(), 1, MPI_INT, sub);
    MPI_Comm host = MPI_COMM_NULL;
    MPI_Comm_split_type(sub, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &host);
    int local = 1;
    MPI_Comm_size(host, &local);
    MPI_Comm_free(&host);
    out = std::make_unique<MpiComm>(sub, std::move(names), local, timeout_s_, algo_);
  });
  return out;
}

std::unique_ptr<Communicator> make_mpi_world(const Options& opts, int expected_rank) {
  mpi::ensure_initialized(opts.timeout_s);
  mpi::note_timeout(opts.timeout_s);
  LaunchEnv env = read_launch_env();
  int rank = 0, world = 1;
  {
    auto guard = mpi::lock();
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
  }
  if (env.present() && (env.rank != rank || env.world != world)) {
    fail(FSDP_ERR_COMM, "fsdp_ctx_create: the launcher made this process rank " + std::to_string(env.rank) + " of " +
                            std::to_string(env.world) + " (" + env.source + "), but MPI_COMM_WORLD says rank " +
                            std::to_string(rank) + " of " + std::to_string(world) +
                            (env.source == "SLURM_*"
                                 ? ": srun started the tasks without connecting their MPI; launch with srun "
                                   "--mpi=pmix (or --mpi=pmi2, whichever `srun --mpi=list` offers and the MPI "
                                   "was built with)"
                                 : ": the program uses a different MPI than the mpirun that started it (for "
                                   "example an MPICH build under Open MPI's mpirun)"));
  }
  if (expected_rank != -1 && expected_rank != rank) {
    fail(FSDP_ERR_INVALID_ARGUMENT, "fsdp_ctx_create: rank " + std::to_string(expected_rank) +
                                        " was passed, but MPI says this process is rank " + std::to_string(rank) +
                                        "; with comm=mpi pass -1 to take the launcher's rank");
  }
  // Non-blocking, so that a rank that never creates its context is a timeout.
  MPI_Comm dup = MPI_COMM_NULL;
  std::vector<MPI_Request> req(1, MPI_REQUEST_NULL);
  {
    auto guard = mpi::lock();
    MPI_Comm_idup(MPI_COMM_WORLD, &dup, req.data());
  }
  if (!poll_requests(req, base::deadline_after(opts.timeout_s), nullptr,
                     Patience::kPeers)) {  // waits for the others to start
    mpi::note_failure();
    fail(FSDP_ERR_TIMEOUT, "fsdp_ctx_create: timed out after " + seconds(opts.timeout_s) + " s on rank " +
                               std::to_string(rank) + " waiting for all " + std::to_string(world) +
                               " ranks of MPI_COMM_WORLD to create their contexts; a rank exited or hung before "
                               "fsdp_ctx_create");
  }
  int local = env.local_world;
  if (local < 1) {
    auto guard = mpi::lock();
    MPI_Comm host = MPI_COMM_NULL;
    MPI_Comm_split_type(dup, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &host);
    MPI_Comm_size(host, &local);
    MPI_Comm_free(&host);
  }
  std::vector<int> names(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) names[static_cast<size_t>(r)] = r;
  return std::make_unique<MpiComm>(dup, std::move(names), local, opts.timeout_s, opts.mpi_algorithm);
}

}  // namespace fsdp::comm
