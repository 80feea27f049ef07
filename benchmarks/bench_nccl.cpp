// benchmarks/bench_nccl.cpp - libfsdp's NCCL all-gather and reduce-scatter
// beside NCCL's own calls on the same communicator and stream, in the same
// run: the ratio (NCCL's time over libfsdp's; goal >= 0.95) is what the
// communicator adds. NCCL's own calls go to libfsdp's data communicator,
// which is blocking (NCCL returns once the collective is queued); a result
// of ncclInProgress would still be waited out before the timing event that
// follows, and any error ends the benchmark with exit code 1. One process per GPU, started with torchrun's variables
// (examples/cuda/launch_local.sh N bench_nccl) or by mpirun; rank 0 prints
// one JSON object per collective and size. Without a GPU it prints one line
// saying it was skipped and exits 0.
//
//   launch_local.sh 2 bench_nccl [--reps 20] [--max-log2-bytes 28]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>

#include "bench_cuda_util.h"
#include "bench_util.h"
#include "comm/nccl/nccl_comm.h"
#include "comm/nccl/nccl_lib.h"
#include "core/device_plane.h"
#include "device/cuda/cuda_device.h"

using fsdp::DType;
using fsdp::bench::best_gpu_seconds;
using fsdp::bench::JsonLine;
using fsdp::device::cuda::CudaDevice;
using fsdp::device::cuda::CudaStream;

int main(int argc, char** argv) {
  int reps = 20, max_log2 = 28;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--max-log2-bytes")) max_log2 = std::atoi(argv[i + 1]);
  }
  if (CudaDevice::count() == 0) {
    std::printf("%s\n",
                JsonLine().add("bench", "nccl").add("skipped", "no CUDA device can be used here").str().c_str());
    return 0;
  }
  const char* local = std::getenv("LOCAL_RANK");
  fsdp::comm::Options opts;
  opts.kind = fsdp::comm::CommKind::kNccl;
  opts.cuda_ordinal = local != nullptr ? std::atoi(local) : 0;
  opts.timeout_s = 120;
  CudaDevice dev(opts.cuda_ordinal);
  auto comm = fsdp::comm::make_nccl_world(opts, -1);
  comm->attach_data_plane(fsdp::core::make_device_plane(dev));
  auto& nccl = dynamic_cast<fsdp::comm::NcclComm&>(*comm);
  const int world = comm->world_size();
  auto stream = dev.create_stream("bench", 1, {});
  auto& s = static_cast<CudaStream&>(*stream);
  const size_t max_bytes = size_t(1) << max_log2;
  void* send = dev.alloc(max_bytes);
  void* recv = dev.alloc(max_bytes);
  dev.zero(send, max_bytes);
  // NCCL's own call as NCCL says it went: queued (waited out if in
  // progress), or the end of the benchmark.
  auto nccl_own = [&](ncclResult_t r, const char* what) {
    while (r == ncclInProgress) {
      if (fsdp::comm::nccl().CommGetAsyncError(nccl.native(), &r) != ncclSuccess) break;
    }
    if (r != ncclSuccess) {
      std::fprintf(stderr, "bench_nccl: NCCL's own %s failed: %s\n", what, fsdp::comm::nccl().GetErrorString(r));
      std::exit(1);
    }
  };
  for (size_t total = size_t(1) << 20; total <= max_bytes; total <<= 2) {
    // all_gather: `total` bytes gathered, total / world from each rank.
    size_t per_rank = total / static_cast<size_t>(world);
    double ours = best_gpu_seconds(s, reps, [&] { comm->all_gather(send, recv, per_rank, "bench all_gather"); });
    double theirs = best_gpu_seconds(s, reps, [&] {
      nccl_own(fsdp::comm::nccl().AllGather(send, recv, per_rank, ncclUint8, nccl.native(), s.native()),
               "ncclAllGather");
    });
    // reduce_scatter of `total` bytes of bf16 grads.
    size_t numel_per_rank = per_rank / 2;
    double ours_rs = best_gpu_seconds(s, reps, [&] {
      comm->reduce_scatter(send, recv, numel_per_rank, DType::kBf16, fsdp::comm::RedOp::kAvg, "bench reduce_scatter");
    });
    double theirs_rs = best_gpu_seconds(s, reps, [&] {
      nccl_own(fsdp::comm::nccl().ReduceScatter(send, recv, numel_per_rank, ncclBfloat16, ncclAvg, nccl.native(),
                                                s.native()),
               "ncclReduceScatter");
    });
    if (comm->rank() == 0) {
      for (auto [what, t_ours, t_theirs] :
           {std::tuple{"all_gather", ours, theirs}, std::tuple{"reduce_scatter_bf16_avg", ours_rs, theirs_rs}}) {
        std::printf("%s\n", JsonLine()
                                .add("bench", "nccl")
                                .add("collective", what)
                                .add("world", world)
                                .add("bytes", static_cast<double>(total))
                                .add("libfsdp_ms", t_ours * 1e3)
                                .add("nccl_ms", t_theirs * 1e3)
                                .add("ratio_to_nccl", t_theirs / t_ours)
                                .add("bus_gbps", (world - 1.0) / world * static_cast<double>(total) / t_ours / 1e9)
                                .str()
                                .c_str());
      }
    }
  }
  comm->barrier("bench done");
  dev.free(send);
  dev.free(recv);
  return 0;
}
