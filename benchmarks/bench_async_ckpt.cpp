// benchmarks/bench_async_ckpt.cpp - what a checkpoint costs the step: the
// stall of fsdp_save_async (the call returns once the state is copied into
// host memory), of fsdp_save (the whole write) and of fsdp_snapshot (a copy
// into a memory file system), against the physical limit, a memcpy of the
// same bytes on every rank at once in the same run; and what a restart
// costs: fsdp_restore from the snapshot against fsdp_load of the disk
// checkpoint. Thread ranks; the state is fp32 params plus AdamW's two
// moments (12 B per param per rank). Each figure is the slowest rank's, the
// best of `reps` (the first fsdp_save_async, which sets up its communicator
// and buffer, is reported apart). Prints one JSON object per line.
//
//   bench_async_ckpt DIR [SHM (/dev/shm/fsdp-bench-PID)] [MiB per rank (1024)] [ranks (2)] [reps (3)]
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "fsdp.h"

using fsdp::bench::JsonLine;

namespace {

void check(fsdp_status_t s, const char* what) {
  if (s != FSDP_OK) {
    std::fprintf(stderr, "%s: %s: %s\n", what, fsdp_status_name(s), fsdp_last_error());
    std::exit(1);
  }
}

// Drops the files under `dir` from the page cache (they are clean: fsync'ed
// by the save), so that the next read comes from the disk.
void evict(const std::string& dir) {
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    const int fd = ::open(e.path().c_str(), O_RDONLY);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s DIR [SHM] [MiB per rank (1024)] [ranks (2)] [reps (3)]\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const std::string shm = argc > 2 ? argv[2] : "/dev/shm/fsdp-bench-" + std::to_string(getpid());
  const double mib = argc > 3 ? std::atof(argv[3]) : 1024;
  const int world = argc > 4 ? std::atoi(argv[4]) : 2;
  const int reps = argc > 5 ? std::atoi(argv[5]) : 3;
  if (!(mib > 0) || world < 1 || reps < 1) {
    std::fprintf(stderr, "%s: MiB per rank, ranks and reps must be positive\n", argv[0]);
    return 2;
  }
  constexpr int kUnits = 8;
  const int64_t per_unit = static_cast<int64_t>(mib * 1048576.0 / 12.0 * world / kUnits);
  const size_t state_bytes = static_cast<size_t>(per_unit) * kUnits * 12 / static_cast<size_t>(world);
  std::filesystem::create_directories(dir);
  const std::string ckpt = dir + "/bench_async_ckpt", disk = dir + "/bench_sync_ckpt";

  fsdp_local_group_t* group = nullptr;
  check(fsdp_local_group_create(world, &group), "fsdp_local_group_create");
  std::vector<fsdp_ctx_t*> ctx(static_cast<size_t>(world), nullptr);
  // Runs fn on every rank at once; returns the slowest rank's seconds.
  auto on_ranks = [&](const std::function<void(int)>& fn) {
    std::vector<double> took(static_cast<size_t>(world));
    std::vector<std::thread> t;
    for (int r = 0; r < world; ++r) {
      t.emplace_back([&, r] {
        const auto t0 = std::chrono::steady_clock::now();
        fn(r);
        took[size_t(r)] = seconds_since(t0);
      });
    }
    for (auto& x : t) x.join();
    return *std::max_element(took.begin(), took.end());
  };
  auto best = [&](const std::function<void(int)>& fn) {
    double b = 1e30;
    for (int i = 0; i < reps; ++i) b = std::min(b, on_ranks(fn));
    return b;
  };
  on_ranks([&](int r) {
    fsdp_config_t* cfg = nullptr;
    check(fsdp_config_create(&cfg), "fsdp_config_create");
    check(fsdp_config_set(cfg, "threads", "1"), "threads");
    check(fsdp_ctx_create(cfg, group, r, &ctx[size_t(r)]), "fsdp_ctx_create");
    fsdp_config_destroy(cfg);
    for (int u = 0; u < kUnits; ++u) {
      std::string name = "layers." + std::to_string(u) + ".weight";
      const char* names[] = {name.c_str()};
      int32_t nd[] = {1};
      int64_t dims[] = {per_unit};
      fsdp_unit_t* unit = nullptr;
      check(fsdp_unit_register(ctx[size_t(r)], ("layer" + std::to_string(u)).c_str(), 1, names, nd, dims, &unit),
            "fsdp_unit_register");
    }
  });

  // The limit: every rank copies its state's bytes at once, into memory
  // already touched (as fsdp_save_async's kept buffer is after its first call).
  std::vector<std::vector<char>> src(static_cast<size_t>(world)), dst(static_cast<size_t>(world));
  on_ranks([&](int r) {
    src[size_t(r)].assign(state_bytes, 1);
    dst[size_t(r)].assign(state_bytes, 0);
  });
  const double memcpy_s = best([&](int r) { std::memcpy(dst[size_t(r)].data(), src[size_t(r)].data(), state_bytes); });
  src.clear();
  dst.clear();

  const double sync_s = best([&](int r) { check(fsdp_save(ctx[size_t(r)], disk.c_str(), "sharded"), "fsdp_save"); });
  const double first_async_s =
      on_ranks([&](int r) { check(fsdp_save_async(ctx[size_t(r)], ckpt.c_str()), "fsdp_save_async"); });
  on_ranks([&](int r) { check(fsdp_save_wait(ctx[size_t(r)]), "fsdp_save_wait"); });
  double async_s = 1e30, wait_s = 1e30;
  for (int i = 0; i < reps; ++i) {
    async_s = std::min(
        async_s, on_ranks([&](int r) { check(fsdp_save_async(ctx[size_t(r)], ckpt.c_str()), "fsdp_save_async"); }));
    wait_s = std::min(wait_s, on_ranks([&](int r) { check(fsdp_save_wait(ctx[size_t(r)]), "fsdp_save_wait"); }));
  }
  const double snapshot_s = best([&](int r) { check(fsdp_snapshot(ctx[size_t(r)], shm.c_str()), "fsdp_snapshot"); });
  const double restore_s = best([&](int r) {
    int source = 0;
    check(fsdp_restore(ctx[size_t(r)], shm.c_str(), nullptr, &source), "fsdp_restore");
    if (source != FSDP_RESTORED_SNAPSHOT) {
      std::fprintf(stderr, "fsdp_restore did not restore the snapshot\n");
      std::exit(1);
    }
  });
  const double load_s = best([&](int r) { check(fsdp_load(ctx[size_t(r)], disk.c_str()), "fsdp_load"); });
  double cold_load_s = 1e30;
  for (int i = 0; i < reps; ++i) {
    evict(disk);
    cold_load_s =
        std::min(cold_load_s, on_ranks([&](int r) { check(fsdp_load(ctx[size_t(r)], disk.c_str()), "fsdp_load"); }));
  }
  on_ranks([&](int r) { fsdp_ctx_destroy(ctx[size_t(r)]); });
  fsdp_local_group_destroy(group);
  std::filesystem::remove_all(ckpt);
  std::filesystem::remove_all(disk);
  std::filesystem::remove_all(shm);

  auto line = [&](const char* bench, double s, const char* limit_name, double limit_s) {
    std::printf("%s\n", JsonLine()
                            .add("bench", bench)
                            .add("ranks", world)
                            .add("state_bytes_per_rank", double(state_bytes))
                            .add("seconds", s)
                            .add(limit_name, limit_s)
                            .add("ratio", s / limit_s)
                            .str()
                            .c_str());
  };
  line("save_async_stall", async_s, "memcpy_seconds", memcpy_s);
  line("save_async_first_call_stall", first_async_s, "memcpy_seconds", memcpy_s);
  line("save_async_background_rest", wait_s, "memcpy_seconds", memcpy_s);
  line("save_sync_stall", sync_s, "memcpy_seconds", memcpy_s);
  line("snapshot_stall", snapshot_s, "memcpy_seconds", memcpy_s);
  line("restore_from_snapshot", restore_s, "load_from_disk_seconds", load_s);
  line("restore_from_snapshot_vs_cold_disk", restore_s, "load_from_disk_evicted_from_page_cache_seconds", cold_load_s);
  return 0;
}
