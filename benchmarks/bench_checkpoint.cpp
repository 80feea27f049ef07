// benchmarks/bench_checkpoint.cpp - sharded fsdp_save and fsdp_load at 4
// local ranks (threads), through the public API, as bytes per second and as a
// fraction of the disk's own bandwidth measured in the same run on the same
// directory: one plain sequential write (then fsync) of a file of the same
// total size, and sequential reads of it: into one reused 8 MiB buffer (the
// file system's own speed), and into a newly allocated buffer of the whole
// size, as a load must (it reads into new buffers, so that a failed load
// changes nothing; first-touch page faults are part of that cost). Prints
// one JSON object per line.
//
//   bench_checkpoint DIR [M params (64)] [reps (3)]
//
// The checkpoint holds fp32 params plus AdamW's two moments: 12 B per param,
// plus headers and metadata. Reads come from the page cache when the files
// fit in memory, for the checkpoint and the plain read alike.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "fsdp.h"

using fsdp::bench::best_seconds;
using fsdp::bench::JsonLine;

namespace {

constexpr int kWorld = 4;
constexpr int kUnits = 8;

void check(fsdp_status_t s, const char* what) {
  if (s != FSDP_OK) {
    std::fprintf(stderr, "%s: %s: %s\n", what, fsdp_status_name(s), fsdp_last_error());
    std::exit(1);
  }
}

// Sequential write of `n` bytes in 8 MiB pieces, then fsync.
void plain_write(const std::string& path, size_t n) {
  std::vector<char> buf(8u << 20, 1);
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) std::exit(1);
  for (size_t done = 0; done < n;) {
    size_t k = std::min(buf.size(), n - done);
    if (::write(fd, buf.data(), k) != static_cast<ssize_t>(k)) std::exit(1);
    done += k;
  }
  if (::fsync(fd) != 0) std::exit(1);
  ::close(fd);
}

// Reads the file in 8 MiB pieces into one reused buffer, or (whole) into a
// new buffer of its size.
void plain_read(const std::string& path, size_t n, bool whole) {
  const size_t piece = 8u << 20;
  std::unique_ptr<char[]> buf(new char[whole ? n : piece]);  // not touched before the reads
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) std::exit(1);
  for (size_t done = 0; done < n;) {
    ssize_t k = ::read(fd, buf.get() + (whole ? done : 0), std::min(piece, n - done));
    if (k <= 0) std::exit(1);
    done += static_cast<size_t>(k);
  }
  ::close(fd);
}

size_t dir_bytes(const std::string& dir) {
  size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) n += e.file_size();
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s DIR [M params (64)] [reps (3)]\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const size_t params = static_cast<size_t>((argc > 2 ? std::atof(argv[2]) : 64) * 1048576.0);
  if (params < 1024) {
    std::fprintf(stderr, "%s: M params must be at least 0.001 (got '%s')\n", argv[0], argv[2]);
    return 2;
  }
  const int reps = argc > 3 ? std::atoi(argv[3]) : 3;
  std::filesystem::create_directories(dir);
  const std::string ckpt = dir + "/bench_ckpt";

  fsdp_local_group_t* group = nullptr;
  check(fsdp_local_group_create(kWorld, &group), "fsdp_local_group_create");
  std::vector<fsdp_ctx_t*> ctx(kWorld, nullptr);
  auto on_ranks = [&](const std::function<void(int)>& fn) {
    std::vector<std::thread> t;
    for (int r = 0; r < kWorld; ++r) t.emplace_back(fn, r);
    for (auto& x : t) x.join();
  };
  on_ranks([&](int r) {
    fsdp_config_t* cfg = nullptr;
    check(fsdp_config_create(&cfg), "fsdp_config_create");
    check(fsdp_config_set(cfg, "threads", "1"), "threads");
    check(fsdp_ctx_create(cfg, group, r, &ctx[size_t(r)]), "fsdp_ctx_create");
    fsdp_config_destroy(cfg);
    const int64_t per_unit = static_cast<int64_t>(params / kUnits);
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

  double save_s = best_seconds(
      reps, [&] { on_ranks([&](int r) { check(fsdp_save(ctx[size_t(r)], ckpt.c_str(), "sharded"), "fsdp_save"); }); });
  const size_t bytes = dir_bytes(ckpt);
  double load_s = best_seconds(
      reps, [&] { on_ranks([&](int r) { check(fsdp_load(ctx[size_t(r)], ckpt.c_str()), "fsdp_load"); }); });
  const std::string plain = dir + "/bench_plain";
  double write_s = best_seconds(reps, [&] { plain_write(plain, bytes); });
  double read_s = best_seconds(reps, [&] { plain_read(plain, bytes, false); });
  double read_new_s = best_seconds(reps, [&] { plain_read(plain, bytes, true); });
  std::filesystem::remove(plain);
  std::filesystem::remove_all(ckpt);

  std::printf("%s\n", JsonLine()
                          .add("bench", "checkpoint_save_sharded")
                          .add("ranks", kWorld)
                          .add("bytes", double(bytes))
                          .add("seconds", save_s)
                          .add("GBps", bytes / save_s / 1e9)
                          .add("disk_write_GBps", bytes / write_s / 1e9)
                          .add("fraction_of_disk_write", write_s / save_s)
                          .str()
                          .c_str());
  std::printf("%s\n", JsonLine()
                          .add("bench", "checkpoint_load_sharded")
                          .add("ranks", kWorld)
                          .add("bytes", double(bytes))
                          .add("seconds", load_s)
                          .add("GBps", bytes / load_s / 1e9)
                          .add("disk_read_GBps", bytes / read_s / 1e9)
                          .add("fraction_of_disk_read", read_s / load_s)
                          .add("disk_read_into_new_memory_GBps", bytes / read_new_s / 1e9)
                          .add("fraction_of_disk_read_into_new_memory", read_new_s / load_s)
                          .str()
                          .c_str());
  on_ranks([&](int r) { fsdp_ctx_destroy(ctx[size_t(r)]); });
  fsdp_local_group_destroy(group);
  return 0;
}
