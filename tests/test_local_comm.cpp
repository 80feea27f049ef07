// The local communicator's device path (white-box): collectives over the
// memory of a DataPlane, as ranks sharing one GPU run them. Here each rank's
// "device" is a CPU WorkerStream, so the copies and reductions a collective
// queues run later than the call that queued them, as on a GPU, and one
// rank's stream runs late. The results must still be those of the host path:
// a peer's buffer is read only after the work its rank queued before the
// collective, and a rank's buffer is written again only after the peers'
// reads (and clears) of it. Each expectation is computed here from the
// inputs; removing any of the communicator's mark waits fails these tests.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/error.h"
#include "base/reduce.h"
#include "comm/local/local_comm.h"
#include "device/cpu/cpu_stream.h"
#include "kernels/cast.h"

using fsdp::DType;
using fsdp::comm::DataPlane;
using fsdp::comm::LocalComm;
using fsdp::comm::LocalGroup;
using fsdp::comm::RedOp;
using fsdp::device::Event;
using fsdp::device::WorkerStream;

namespace {

constexpr int kWorld = 3;
constexpr int kLateRank = 1;  // its stream sleeps before every task
constexpr double kTimeoutS = 30;

// One rank's device: a late-running stream and the buffers that count as its
// memory. Ranks share one address space, as threads sharing a GPU do.
class StreamPlane final : public DataPlane {
 public:
  explicit StreamPlane(int rank)
      : stream_("rank " + std::to_string(rank), {}, std::chrono::microseconds(rank == kLateRank ? 3000 : 0)) {}
  WorkerStream& stream() { return stream_; }
  // Memory of this plane: zero-filled, owned by the plane.
  float* alloc(size_t numel) {
    std::lock_guard<std::mutex> lock(mu_);
    blocks_.push_back(std::make_unique<float[]>(numel));
    ranges_.push_back({blocks_.back().get(), numel * sizeof(float)});
    return blocks_.back().get();
  }

  bool owns(const void* ptr) const override {
    std::lock_guard<std::mutex> lock(mu_);
    auto p = static_cast<const char*>(ptr);
    for (const auto& [b, n] : ranges_) {
      if (p >= reinterpret_cast<const char*>(b) && p < reinterpret_cast<const char*>(b) + n) return true;
    }
    return false;
  }
  Mark mark() override { return stream_.record(); }
  void wait(const Mark& m) override { stream_.wait(std::static_pointer_cast<Event>(m)); }
  void copy(void* dst, const void* src, size_t nbytes) override {
    stream_.submit("copy", [=] { std::memcpy(dst, src, nbytes); });
  }
  void reduce(void* out, void* const* ins, size_t n_ins, size_t numel, DType dtype, float scale, bool clear) override {
    std::vector<void*> in(ins, ins + n_ins);
    stream_.submit("reduce", [=] {
      if (clear) {
        fsdp::base::reduce_sum_clear(out, in.data(), in.size(), numel, dtype, scale);
      } else {
        fsdp::base::reduce_sum(out, in.data(), in.size(), numel, dtype, scale);
      }
    });
  }
  void reduce_f64(double* out, const double* const* ins, size_t n_ins, size_t n) override {
    std::vector<const double*> in(ins, ins + n_ins);
    stream_.submit("reduce_f64", [=] {
      for (size_t i = 0; i < n; ++i) {
        double acc = in[0][i];
        for (size_t k = 1; k < in.size(); ++k) acc += in[k][i];
        out[i] = acc;
      }
    });
  }
  void* native_stream() override { return nullptr; }  // a CPU stream has no native handle
  // Queues `fn` on the rank's stream: work of the rank's own before or after a collective.
  void later(std::function<void()> fn) { stream_.submit("host work", std::move(fn)); }

 private:
  WorkerStream stream_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<float[]>> blocks_;
  std::vector<std::pair<const float*, size_t>> ranges_;
};

// Runs fn(rank, comm, plane) on kWorld threads, each with a LocalComm whose
// plane is its own StreamPlane, and waits for every stream at the end.
void run_device_ranks(const std::function<void(int, LocalComm&, StreamPlane&)>& fn) {
  auto group = std::make_shared<LocalGroup>(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      auto plane = std::make_shared<StreamPlane>(r);
      LocalComm comm(group, r, kTimeoutS);
      ASSERT_TRUE(comm.attach_data_plane(plane));
      fn(r, comm, *plane);
      plane->stream().synchronize(kTimeoutS);
    });
  }
  for (auto& t : threads) t.join();
}

// What rank r's buffer holds at element i (small integers: every sum below is exact).
float value(int rank, size_t i) { return static_cast<float>((rank * 7 + static_cast<int>(i) * 3) % 11); }

}  // namespace

// Each rank writes its send buffer on its stream before the call and
// overwrites it right after: the gathered copy must hold the first values.
TEST(LocalCommDevicePath, AllGatherReadsPeersAfterTheirWritesAndBeforeTheirReuse) {
  constexpr size_t kN = 1000;
  std::vector<std::vector<float>> got(kWorld);
  run_device_ranks([&](int rank, LocalComm& comm, StreamPlane& plane) {
    float* send = plane.alloc(kN);
    float* recv = plane.alloc(kN * kWorld);
    plane.later([=] {
      for (size_t i = 0; i < kN; ++i) send[i] = value(rank, i);
    });
    comm.all_gather(send, recv, kN * sizeof(float), "gather");
    plane.later([=] { std::fill(send, send + kN, -1.0f); });  // the buffer's next use
    plane.stream().synchronize(kTimeoutS);
    got[static_cast<size_t>(rank)].assign(recv, recv + kN * kWorld);
  });
  for (int rank = 0; rank < kWorld; ++rank) {
    for (int r = 0; r < kWorld; ++r) {
      for (size_t i = 0; i < kN; ++i) {
        ASSERT_EQ(got[static_cast<size_t>(rank)][static_cast<size_t>(r) * kN + i], value(r, i))
            << "rank " << rank << " got element " << i << " of rank " << r;
      }
    }
  }
}

// all_to_all: rank r's part p reaches rank p's slot r, read after the
// sender's write and before its next one; the same on the host path.
TEST(LocalCommDevicePath, AllToAllDeliversEachPartToItsRankInRankOrder) {
  constexpr size_t kN = 500;  // floats per part
  auto part_value = [](int from, int to, size_t i) { return value(from, i) + 100.0f * static_cast<float>(to); };
  std::vector<std::vector<float>> got(kWorld), got_host(kWorld);
  run_device_ranks([&](int rank, LocalComm& comm, StreamPlane& plane) {
    float* send = plane.alloc(kN * kWorld);
    float* recv = plane.alloc(kN * kWorld);
    plane.later([=] {
      for (int to = 0; to < kWorld; ++to)
        for (size_t i = 0; i < kN; ++i) send[static_cast<size_t>(to) * kN + i] = part_value(rank, to, i);
    });
    comm.all_to_all(send, recv, kN * sizeof(float), "exchange");
    plane.later([=] { std::fill(send, send + kN * kWorld, -1.0f); });
    plane.stream().synchronize(kTimeoutS);
    got[static_cast<size_t>(rank)].assign(recv, recv + kN * kWorld);
    std::vector<float> hsend(kN * kWorld), hrecv(kN * kWorld, -2.0f);
    for (int to = 0; to < kWorld; ++to)
      for (size_t i = 0; i < kN; ++i) hsend[static_cast<size_t>(to) * kN + i] = part_value(rank, to, i);
    comm.all_to_all(hsend.data(), hrecv.data(), kN * sizeof(float), "exchange on the host");
    got_host[static_cast<size_t>(rank)] = hrecv;
  });
  for (int rank = 0; rank < kWorld; ++rank) {
    for (int from = 0; from < kWorld; ++from) {
      for (size_t i = 0; i < kN; ++i) {
        const size_t at = static_cast<size_t>(from) * kN + i;
        ASSERT_EQ(got[static_cast<size_t>(rank)][at], part_value(from, rank, i))
            << "rank " << rank << " element " << i << " from rank " << from;
        ASSERT_EQ(got_host[static_cast<size_t>(rank)][at], part_value(from, rank, i))
            << "host path: rank " << rank << " element " << i << " from rank " << from;
      }
    }
  }
}

// reduce_scatter_clear: every rank's range is the sum over ranks, and every
// send buffer reads as zeros afterwards, cleared by the peers' streams; a
// write the rank queues after the call lands after those clears.
TEST(LocalCommDevicePath, ReduceScatterClearSumsAndClearsBeforeTheNextWrite) {
  constexpr size_t kPer = 700;
  for (bool write_after : {false, true}) {
    std::vector<std::vector<float>> out(kWorld), sent(kWorld);
    run_device_ranks([&](int rank, LocalComm& comm, StreamPlane& plane) {
      float* send = plane.alloc(kPer * kWorld);
      float* recv = plane.alloc(kPer);
      plane.later([=] {
        for (size_t i = 0; i < kPer * kWorld; ++i) send[i] = value(rank, i);
      });
      comm.reduce_scatter_clear(send, recv, kPer, DType::kFp32, RedOp::kSum, "rs");
      if (write_after) {
        plane.later([=] { std::fill(send, send + kPer * kWorld, 5.0f); });
      }
      // This rank's stream waited for the peers' clears of its buffer.
      plane.stream().synchronize(kTimeoutS);
      out[static_cast<size_t>(rank)].assign(recv, recv + kPer);
      sent[static_cast<size_t>(rank)].assign(send, send + kPer * kWorld);
    });
    for (int rank = 0; rank < kWorld; ++rank) {
      for (size_t i = 0; i < kPer; ++i) {
        size_t g = static_cast<size_t>(rank) * kPer + i;
        float want = 0;
        for (int r = 0; r < kWorld; ++r) want += value(r, g);
        ASSERT_EQ(out[static_cast<size_t>(rank)][i], want) << "rank " << rank << " element " << i;
      }
      for (size_t i = 0; i < kPer * kWorld; ++i) {
        ASSERT_EQ(sent[static_cast<size_t>(rank)][i], write_after ? 5.0f : 0.0f)
            << "rank " << rank << "'s send buffer at " << i << (write_after ? " (written after the call)" : "");
      }
    }
  }
}

// In-place all_reduce (two phases: each rank reduces a chunk, then copies
// the others' chunks) in bf16 with the average: the bits of the host path.
TEST(LocalCommDevicePath, AllReduceInPlaceMatchesTheHostPathBitwise) {
  constexpr size_t kN = 1001;  // chunks of unequal size
  std::vector<std::vector<uint16_t>> got(kWorld);
  auto input = [](int rank, size_t i) { return fsdp::kernels::f32_to_bf16_bits(value(rank, i) * 0.37f - 1.5f); };
  run_device_ranks([&](int rank, LocalComm& comm, StreamPlane& plane) {
    auto* buf = reinterpret_cast<uint16_t*>(plane.alloc(kN));  // room for kN bf16
    plane.later([=] {
      for (size_t i = 0; i < kN; ++i) buf[i] = input(rank, i);
    });
    comm.all_reduce(buf, buf, kN, DType::kBf16, RedOp::kAvg, "ar");
    plane.stream().synchronize(kTimeoutS);
    got[static_cast<size_t>(rank)].assign(buf, buf + kN);
  });
  // The reference: the host's reduction of the same inputs.
  std::vector<std::vector<uint16_t>> in(kWorld, std::vector<uint16_t>(kN));
  std::vector<const void*> ins;
  for (int r = 0; r < kWorld; ++r) {
    for (size_t i = 0; i < kN; ++i) in[static_cast<size_t>(r)][i] = input(r, i);
    ins.push_back(in[static_cast<size_t>(r)].data());
  }
  std::vector<uint16_t> want(kN);
  fsdp::base::reduce_sum(want.data(), ins.data(), ins.size(), kN, DType::kBf16, 1.0f / kWorld);
  for (int rank = 0; rank < kWorld; ++rank) EXPECT_EQ(got[static_cast<size_t>(rank)], want) << "rank " << rank;
}

// A late root (peers must wait for its write) and a fast one (its next
// write must wait for the late peer's read).
TEST(LocalCommDevicePath, BroadcastReachesEveryRankAfterTheRootsWriteAndBeforeItsNext) {
  constexpr size_t kN = 513;
  for (int root : {kLateRank, 0}) {
    std::vector<std::vector<float>> got(kWorld);
    run_device_ranks([&](int rank, LocalComm& comm, StreamPlane& plane) {
      float* buf = plane.alloc(kN);
      if (rank == root) {
        plane.later([=] {
          for (size_t i = 0; i < kN; ++i) buf[i] = value(root, i);
        });
      }
      comm.broadcast(buf, kN * sizeof(float), root, "bcast");
      if (rank == root) plane.later([=] { std::fill(buf, buf + kN, -1.0f); });
      plane.stream().synchronize(kTimeoutS);
      if (rank != root) got[static_cast<size_t>(rank)].assign(buf, buf + kN);
    });
    for (int rank = 0; rank < kWorld; ++rank) {
      if (rank == root) continue;
      for (size_t i = 0; i < kN; ++i) {
        ASSERT_EQ(got[static_cast<size_t>(rank)][i], value(root, i)) << "rank " << rank << ", root " << root;
      }
    }
  }
}

// Host memory on the same communicator still takes the host's path (the
// engine's consensus checks and norms), and a collective where one rank
// passes plane memory and another host memory fails on every rank.
TEST(LocalCommDevicePath, HostBuffersTakeTheHostPathAndMixedPathsAreAMismatch) {
  std::vector<fsdp_status_t> status(kWorld, FSDP_OK);
  std::vector<std::string> message(kWorld);
  run_device_ranks([&](int rank, LocalComm& comm, StreamPlane& plane) {
    int64_t mine = 10 + rank;
    std::vector<int64_t> all(kWorld);
    comm.all_gather(&mine, all.data(), sizeof mine, "host gather");  // returns with the data: a host path
    for (int r = 0; r < kWorld; ++r) EXPECT_EQ(all[static_cast<size_t>(r)], 10 + r);
    std::vector<float> host(4 * kWorld), host_out(4);
    float* dev = plane.alloc(4 * kWorld);
    float* dev_out = plane.alloc(4);
    try {
      if (rank == 0) {
        comm.reduce_scatter(host.data(), host_out.data(), 4, DType::kFp32, RedOp::kSum, "mixed");
      } else {
        comm.reduce_scatter(dev, dev_out, 4, DType::kFp32, RedOp::kSum, "mixed");
      }
    } catch (const fsdp::Error& e) {
      status[static_cast<size_t>(rank)] = e.status();
      message[static_cast<size_t>(rank)] = e.what();
    }
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(status[static_cast<size_t>(r)], FSDP_ERR_MISMATCH) << "rank " << r;
    EXPECT_NE(message[static_cast<size_t>(r)].find("device memory"), std::string::npos)
        << message[static_cast<size_t>(r)];
  }
}

// sum_f64 over device memory (the step's grad norm summed over ranks sharing
// a GPU): each rank's sum is the rank-order sum of what every rank wrote on
// its stream before the call, and a rank's send is rewritten only after
// every peer read it.
TEST(LocalCommDevicePath, SumF64AddsInRankOrderAfterThePeersWritesAndBeforeTheirReuse) {
  std::vector<double> got(kWorld);
  run_device_ranks([&](int rank, LocalComm& comm, StreamPlane& plane) {
    auto* mem = reinterpret_cast<double*>(plane.alloc(4));  // send, recv
    double* send = mem;
    double* recv = mem + 1;
    // Rank order matters: 1e16 first, then ones that each round away.
    const double mine = rank == 0 ? 1e16 : 1.0;
    plane.later([=] { *send = mine; });
    comm.sum_f64(send, recv, 1, "grad norm");
    plane.later([=] { *send = -7.0; });  // the buffer's next use
    plane.stream().synchronize(kTimeoutS);
    got[static_cast<size_t>(rank)] = *recv;
  });
  for (int rank = 0; rank < kWorld; ++rank) {
    EXPECT_EQ(got[static_cast<size_t>(rank)], 1e16) << "rank " << rank << " (the ones first would give 1e16 + 2)";
  }
}

// A later communicator on the same group (a new context: its split numbers
// start again) that splits differently gets groups of its own members, not
// the earlier communicator's sub-group of the same split number.
TEST(LocalCommSplit, ALaterCommunicatorsDifferentSplitGetsItsOwnGroups) {
  auto group = std::make_shared<LocalGroup>(4);
  std::vector<int> first(4), second(4);
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&, r] {
      try {
        {
          LocalComm comm(group, r, kTimeoutS);
          first[static_cast<size_t>(r)] = comm.split(0, r, "one group of 4")->world_size();
        }
        LocalComm comm(group, r, kTimeoutS);
        auto pairs = comm.split(r / 2, r, "groups of 2");
        second[static_cast<size_t>(r)] = pairs->world_size();
        int mine[1] = {r}, got[2] = {-1, -1};
        pairs->all_gather(mine, got, sizeof mine, "members");
        EXPECT_EQ(got[0], r / 2 * 2);
        EXPECT_EQ(got[1], r / 2 * 2 + 1);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << r << ": " << e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(first[static_cast<size_t>(r)], 4);
    EXPECT_EQ(second[static_cast<size_t>(r)], 2) << "rank " << r << " got the earlier split's group";
  }
}
