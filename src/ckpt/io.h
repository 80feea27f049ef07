// src/ckpt/io.h - the file-system side of checkpoints: RAII file handles whose
// every failure is an fsdp::Error naming the path, and the steps that make a
// checkpoint crash-safe (fsync, rename into place). Plus the test-only fault
// injection (FSDP_CKPT_FAULT) that simulates a crash between two files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fsdp::ckpt {

class File {
 public:
  File() = default;
  ~File();
  File(File&& o) noexcept : fd_(o.fd_), path_(std::move(o.path_)) { o.fd_ = -1; }
  File& operator=(File&& o) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  // FSDP_ERR_CORRUPT when the file is missing (a checkpoint lacks it), IO otherwise.
  static File open_read(const std::string& path);
  // Creates a new file (fails if it exists).
  static File create(const std::string& path);

  const std::string& path() const { return path_; }
  uint64_t size() const;
  // Reads exactly n bytes at `offset`; a file that ends first is CORRUPT (truncated).
  void pread_exact(uint64_t offset, void* buf, size_t n) const;
  void write_all(const void* buf, size_t n);
  void sync();
  void close();

 private:
  int fd_ = -1;
  std::string path_;
};

bool path_exists(const std::string& path);
bool is_dir(const std::string& path);
// mkdir -p.
void make_dirs(const std::string& path);
// rm -r; quiet when the path does not exist.
void remove_tree(const std::string& path);
void sync_dir(const std::string& path);
std::string parent_dir(const std::string& path);
std::string join(const std::string& dir, const std::string& name);
// Where a checkpoint for `dir` is assembled before it is renamed into place:
// a hidden sibling, so that the rename stays on one file system.
std::string staging_dir(const std::string& dir);
bool is_empty_dir(const std::string& path);
// Refuses (FSDP_ERR_INVALID_ARGUMENT, naming `who` and `dir`) a `dir` that a
// new checkpoint must not replace: a file, or a non-empty directory that is
// not a checkpoint (it would be deleted whole).
void check_replaceable(const std::string& dir, const std::string& who);
// Readies staging_dir(dir) for a new checkpoint of `dir`: moves back a
// previous checkpoint left aside by a crash between commit_dir's two renames,
// checks `dir` is replaceable, and starts the staging directory afresh (one
// left by a crash is stale). Returns a note when it moved one back, else "".
// Where commit_dir keeps the previous checkpoint while it renames the new one
// into place on a file system without atomic exchange.
std::string aside_dir(const std::string& dir);
// Moves the complete checkpoint `staged` to `dir`. If `dir` holds an older
// checkpoint the two are swapped atomically (renameat2 RENAME_EXCHANGE), so at
// every instant `dir` is one whole checkpoint, and the old one is removed
// afterwards; without exchange the old one moves to aside_dir(dir) first. The
// parent is fsync'ed. Throws (leaving `dir` as it was) until the new
// checkpoint is in place; what fails after that (removing the old one, the
// last fsync) is returned as a warning instead.
std::string commit_dir(const std::string& staged, const std::string& dir);
std::string prepare_staging(const std::string& dir, const std::string& who);
// Removes the staging directory of a save that failed. Never throws: returns
// "" or, when it cannot (the parent became read-only, say), a warning naming
// the directory left behind, for the caller to log.
std::string remove_failed_staging(const std::string& staged);

// Test-only fault injection, read from FSDP_CKPT_FAULT (key=value, comma-separated):
//   crash_after_files=N  the process exits (_exit(86), no clean-up) once N
//                        checkpoint files have been written in it, counting
//                        across its ranks;
//   io_error_rank=R      rank R's shard write fails with FSDP_ERR_IO;
//   read_error_rank=R    rank R's reads into place (fsdp_load's second pass,
//                        fsdp_load_pretrained's read) fail with FSDP_ERR_IO
//                        after its first unit, as a disk error would;
//   no_exchange=1        commit_dir acts as on a file system without
//                        RENAME_EXCHANGE (two renames);
//   crash_after_aside=1  with no_exchange, the process exits between them;
//   cleanup_error=1      remove_failed_staging cannot remove the directory
//                        (as when its parent became read-only; root ignores
//                        permissions, so tests cannot make that happen).
// Unset in production: each check is one getenv.
void after_file_written();
bool inject_io_error(int rank);
bool inject_read_error(int rank);

}  // namespace fsdp::ckpt
