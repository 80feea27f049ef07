// benchmarks/bench_collectives.cpp - all_gather and reduce_scatter of the local
// (shared-memory) communicator across in-process ranks (4 by default), as
// memory bandwidth and as a fraction of the memcpy bandwidth of as many
// concurrent threads measured in the same run. Prints one JSON object per line.
//
// Traffic per rank: all_gather of S total bytes reads S and writes S (a memcpy
// of S); reduce_scatter of S input bytes reads S and writes S / world.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "comm/local/local_comm.h"

using fsdp::DType;
using fsdp::bench::JsonLine;
using fsdp::comm::LocalComm;
using fsdp::comm::LocalGroup;
using fsdp::comm::RedOp;

namespace {

// Runs body(rank, comm) on `world` threads; returns rank 0's best time of
// `reps` repetitions, each bracketed by barriers so all ranks start together.
template <typename Body>
double time_ranks(int world, int reps, Body body) {
  auto group = std::make_shared<LocalGroup>(world);
  std::vector<double> best(static_cast<size_t>(world), 1e30);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      LocalComm comm(group, r, 600.0);
      body(r, comm);  // warm-up: first touch of every page
      for (int i = 0; i < reps; ++i) {
        comm.barrier("bench start");
        auto t0 = std::chrono::steady_clock::now();
        body(r, comm);
        comm.barrier("bench end");
        double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best[static_cast<size_t>(r)] = std::min(best[static_cast<size_t>(r)], t);
      }
    });
  }
  for (auto& t : threads) t.join();
  return best[0];
}

}  // namespace

int main(int argc, char** argv) {
  // Usage: bench_collectives [MiB (64)] [reps (5)] [world (4)]
  size_t total = size_t{64} << 20;  // bytes: all_gather output, reduce_scatter input
  int reps = 5;
  int world = 4;
  if (argc > 1) total = static_cast<size_t>(std::atof(argv[1]) * 1048576.0);
  if (argc > 2) reps = std::atoi(argv[2]);
  if (argc > 3) world = std::atoi(argv[3]);
  total = total / (world * sizeof(float)) * world * sizeof(float);
  size_t per_rank = total / world;

  std::vector<std::vector<char>> src(static_cast<size_t>(world), std::vector<char>(total, 1));
  std::vector<std::vector<char>> dst(static_cast<size_t>(world), std::vector<char>(total, 0));
  double t_memcpy = time_ranks(world, reps, [&](int r, LocalComm&) {
    std::memcpy(dst[static_cast<size_t>(r)].data(), src[static_cast<size_t>(r)].data(), total);
  });
  double memcpy_gbs = 2.0 * static_cast<double>(total) * world / t_memcpy / 1e9;

  double t_ag = time_ranks(world, reps, [&](int r, LocalComm& comm) {
    comm.all_gather(src[static_cast<size_t>(r)].data(), dst[static_cast<size_t>(r)].data(), per_rank, "bench");
  });
  double ag_gbs = 2.0 * static_cast<double>(total) * world / t_ag / 1e9;

  std::vector<std::vector<float>> fsrc(static_cast<size_t>(world), std::vector<float>(total / sizeof(float), 0.25f));
  std::vector<std::vector<float>> fdst(static_cast<size_t>(world), std::vector<float>(per_rank / sizeof(float), 0.0f));
  double t_rs = time_ranks(world, reps, [&](int r, LocalComm& comm) {
    comm.reduce_scatter(fsrc[static_cast<size_t>(r)].data(), fdst[static_cast<size_t>(r)].data(),
                        per_rank / sizeof(float), DType::kFp32, RedOp::kAvg, "bench");
  });
  double rs_gbs = (static_cast<double>(total) + static_cast<double>(per_rank)) * world / t_rs / 1e9;

  std::printf("%s\n", JsonLine()
                          .add("benchmark", "memcpy_world_threads")
                          .add("world", world)
                          .add("bytes", static_cast<double>(total))
                          .add("seconds", t_memcpy)
                          .add("gb_per_s", memcpy_gbs)
                          .str()
                          .c_str());
  std::printf("%s\n", JsonLine()
                          .add("benchmark", "local_all_gather")
                          .add("world", world)
                          .add("bytes", static_cast<double>(total))
                          .add("seconds", t_ag)
                          .add("gb_per_s", ag_gbs)
                          .add("fraction_of_memcpy", ag_gbs / memcpy_gbs)
                          .str()
                          .c_str());
  std::printf("%s\n", JsonLine()
                          .add("benchmark", "local_reduce_scatter_fp32")
                          .add("world", world)
                          .add("bytes", static_cast<double>(total))
                          .add("seconds", t_rs)
                          .add("gb_per_s", rs_gbs)
                          .add("fraction_of_memcpy", rs_gbs / memcpy_gbs)
                          .str()
                          .c_str());
  return 0;
}
