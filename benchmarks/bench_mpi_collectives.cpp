// benchmarks/bench_mpi_collectives.cpp - all_gather and reduce_scatter (fp32
// sum) through libfsdp's mpi communicator, beside Open MPI's own
// MPI_Allgather, MPI_Reduce_scatter_block and MPI_Reduce_scatter and a memcpy
// by every process at once, all timed in the same run. Run under mpirun:
//
//   mpirun -np 4 build/default/benchmarks/bench_mpi_collectives [MiB... (1 16 64)] [--reps N]
//
// Rank 0 prints one JSON object per line. Sizes are the full buffer: the
// all_gather output and the reduce_scatter input. gb_per_s is that size over
// the best time (bracketed by barriers) of --reps runs; ratios compare
// libfsdp's paths (auto, ring, native) with the raw calls and with memcpy.
// Last, "wait_for_late_peer": every rank but 0 sleeps 20 or 200 ms before a small
// all_gather, and rank 0 reports the CPU time its process spent in the call
// over the call's wall time (a wait that spins: about 1; one that sleeps: a
// few percent).
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "comm/mpi/mpi_comm.h"

using fsdp::DType;
using fsdp::bench::JsonLine;
using fsdp::comm::Communicator;
using fsdp::comm::RedOp;

namespace {

// Best time over `reps` runs of fn, each between barriers, as seen by rank 0.
double cpu_seconds(clockid_t clock = CLOCK_PROCESS_CPUTIME_ID) {
  timespec ts;
  clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double timed(int reps, const std::function<void()>& fn) {
  fn();  // warm-up: first touch, connections
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    fn();
    MPI_Barrier(MPI_COMM_WORLD);
    best = std::min(best, MPI_Wtime() - t0);
  }
  return best;
}

std::unique_ptr<Communicator> make(fsdp::comm::MpiAlgorithm algo) {
  fsdp::comm::Options o;
  o.timeout_s = 600;
  o.mpi_algorithm = algo;
  return fsdp::comm::make_mpi_world(o, -1);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<double> mib;
  int reps = 5;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else {
      mib.push_back(std::atof(argv[i]));
    }
  }
  if (mib.empty()) mib = {1, 16, 64};

  // libfsdp initialises MPI (MPI_THREAD_MULTIPLE) and finalises it at exit.
  auto comm_auto = make(fsdp::comm::MpiAlgorithm::kAuto);
  auto comm_ring = make(fsdp::comm::MpiAlgorithm::kRing);
  auto comm_native = make(fsdp::comm::MpiAlgorithm::kNative);
  int rank = comm_auto->rank(), world = comm_auto->world_size();
  auto* mpi_auto = dynamic_cast<fsdp::comm::MpiComm*>(comm_auto.get());

  for (double m : mib) {
    size_t total = static_cast<size_t>(m * 1048576.0) / (world * sizeof(float)) * world * sizeof(float);
    size_t per_rank = total / world;
    size_t n_per_rank = per_rank / sizeof(float);
    std::vector<char> src(total, 1), dst(total, 0);
    std::vector<float> fin(total / sizeof(float), 0.25f), fout(n_per_rank, 0.0f);
    std::vector<int> counts(static_cast<size_t>(world), static_cast<int>(n_per_rank));
    auto gbs = [&](double t) { return static_cast<double>(total) / t / 1e9; };

    double t_memcpy = timed(reps, [&] { std::memcpy(dst.data(), src.data(), total); });
    double t_raw_ag = timed(reps, [&] {
      MPI_Allgather(src.data(), static_cast<int>(per_rank), MPI_BYTE, dst.data(), static_cast<int>(per_rank), MPI_BYTE,
                    MPI_COMM_WORLD);
    });
    double t_raw_rsb = timed(reps, [&] {
      MPI_Reduce_scatter_block(fin.data(), fout.data(), static_cast<int>(n_per_rank), MPI_FLOAT, MPI_SUM,
                               MPI_COMM_WORLD);
    });
    double t_raw_rs = timed(
        reps, [&] { MPI_Reduce_scatter(fin.data(), fout.data(), counts.data(), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); });
    struct Path {
      const char* name;
      Communicator* comm;
      double ag, rs;
    };
    std::vector<Path> paths = {
        {"auto", comm_auto.get(), 0, 0}, {"ring", comm_ring.get(), 0, 0}, {"native", comm_native.get(), 0, 0}};
    for (Path& p : paths) {
      p.ag = timed(reps, [&] { p.comm->all_gather(src.data(), dst.data(), per_rank, "bench all_gather"); });
      p.rs = timed(reps, [&] {
        p.comm->reduce_scatter(fin.data(), fout.data(), n_per_rank, DType::kFp32, RedOp::kSum, "bench reduce_scatter");
      });
    }
    if (rank != 0) continue;
    auto line = [&](const char* bench, double t) {
      return JsonLine()
          .add("benchmark", bench)
          .add("world", world)
          .add("mib", m)
          .add("seconds", t)
          .add("gb_per_s", gbs(t));
    };
    std::printf("%s\n", line("memcpy_every_process", t_memcpy).str().c_str());
    std::printf("%s\n", line("MPI_Allgather", t_raw_ag).add("fraction_of_memcpy", t_memcpy / t_raw_ag).str().c_str());
    std::printf(
        "%s\n",
        line("MPI_Reduce_scatter_block", t_raw_rsb).add("fraction_of_memcpy", t_memcpy / t_raw_rsb).str().c_str());
    std::printf("%s\n",
                line("MPI_Reduce_scatter", t_raw_rs).add("fraction_of_memcpy", t_memcpy / t_raw_rs).str().c_str());
    for (const Path& p : paths) {
      std::string ag = std::string("fsdp_all_gather_") + p.name;
      std::string rs = std::string("fsdp_reduce_scatter_") + p.name;
      JsonLine a =
          line(ag.c_str(), p.ag).add("vs_MPI_Allgather", t_raw_ag / p.ag).add("fraction_of_memcpy", t_memcpy / p.ag);
      JsonLine r = line(rs.c_str(), p.rs)
                       .add("vs_MPI_Reduce_scatter_block", t_raw_rsb / p.rs)
                       .add("vs_MPI_Reduce_scatter", t_raw_rs / p.rs)
                       .add("fraction_of_memcpy", t_memcpy / p.rs);
      if (std::strcmp(p.name, "auto") == 0) {
        a.add("path", mpi_auto->uses_ring("all_gather", total) ? "ring" : "native");
        r.add("path", mpi_auto->uses_ring("reduce_scatter", total) ? "ring" : "native");
      }
      std::printf("%s\n%s\n", a.str().c_str(), r.str().c_str());
    }
    std::fflush(stdout);
  }

  std::vector<char> one(64, 1), all(64 * static_cast<size_t>(world));
  for (int late_ms : {20, 200}) {
    MPI_Barrier(MPI_COMM_WORLD);
    double cpu0 = cpu_seconds(), thread0 = cpu_seconds(CLOCK_THREAD_CPUTIME_ID), t0 = MPI_Wtime();
    if (rank != 0) std::this_thread::sleep_for(std::chrono::milliseconds(late_ms));
    comm_auto->all_gather(one.data(), all.data(), one.size(), "bench late peer");
    double cpu = cpu_seconds() - cpu0, wall = MPI_Wtime() - t0;
    double thread_cpu = cpu_seconds(CLOCK_THREAD_CPUTIME_ID) - thread0;
    if (rank == 0 && world > 1) {
      std::printf("%s\n", JsonLine()
                              .add("benchmark", "wait_for_late_peer")
                              .add("world", world)
                              .add("late_ms", late_ms)
                              .add("wall_s", wall)
                              .add("process_cpu_s", cpu)
                              .add("cpu_per_wall", cpu / wall)
                              .add("waiting_thread_cpu_s", thread_cpu)
                              .str()
                              .c_str());
    }
  }
  return 0;
}
