// src/ckpt/io.cpp - see io.h.
#include "io.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "../base/error.h"
#include "../base/text.h"
#include "meta.h"

namespace fsdp::ckpt {
namespace {

[[noreturn]] void io_fail(const std::string& what, const std::string& path, int err) {
  fail(FSDP_ERR_IO, what + " " + base::quote_path(path) + ": " + std::strerror(err));
}

// The value of `key=` in FSDP_CKPT_FAULT (comma-separated key=value), or -1.
long fault_value(const char* key) {
  const char* env = std::getenv("FSDP_CKPT_FAULT");
  if (env == nullptr) return -1;
  size_t n = std::strlen(key);
  for (const char* p = env; p != nullptr && *p != '\0';) {
    if (std::strncmp(p, key, n) == 0 && p[n] == '=') return std::strtol(p + n + 1, nullptr, 10);
    p = std::strchr(p, ',');
    if (p != nullptr) ++p;
  }
  return -1;
}

[[noreturn]] void simulated_crash(const char* where) {
  std::fprintf(stderr, "[fsdp] FSDP_CKPT_FAULT: simulated crash %s\n", where);
  std::_Exit(86);
}

std::atomic<long> g_files_written{0};

}  // namespace

File::~File() { close(); }

File& File::operator=(File&& o) noexcept {
  if (this != &o) {
    close();
    fd_ = o.fd_;
    path_ = std::move(o.path_);
    o.fd_ = -1;
  }
  return *this;
}

File File::open_read(const std::string& path) {
  File f;
  f.path_ = path;
  f.fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd_ < 0) {
    int err = errno;
    if (err == ENOENT) fail(FSDP_ERR_CORRUPT, "checkpoint file " + base::quote_path(path) + " is missing");
    io_fail("cannot open", path, err);
  }
  return f;
}

File File::create(const std::string& path) {
  File f;
  f.path_ = path;
  f.fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (f.fd_ < 0) io_fail("cannot create", path, errno);
  return f;
}

uint64_t File::size() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) io_fail("cannot stat", path_, errno);
  return static_cast<uint64_t>(st.st_size);
}

void File::pread_exact(uint64_t offset, void* buf, size_t n) const {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t got = ::pread(fd_, p, n, static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      io_fail("cannot read", path_, errno);
    }
    if (got == 0) {
      fail(FSDP_ERR_CORRUPT, "checkpoint file " + base::quote_path(path_) + " is truncated: it ends before byte " +
                                 std::to_string(offset + n));
    }
    p += got;
    n -= static_cast<size_t>(got);
    offset += static_cast<uint64_t>(got);
  }
}

void File::write_all(const void* buf, size_t n) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    ssize_t put = ::write(fd_, p, n);
    if (put < 0) {
      if (errno == EINTR) continue;
      io_fail("cannot write", path_, errno);
    }
    p += put;
    n -= static_cast<size_t>(put);
  }
}

void File::sync() {
  if (::fsync(fd_) != 0) io_fail("cannot fsync", path_, errno);
}

void File::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

bool is_dir(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

void make_dirs(const std::string& path) {
  if (path.empty() || is_dir(path)) return;
  std::string parent = parent_dir(path);
  if (parent != path) make_dirs(parent);
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) io_fail("cannot create directory", path, errno);
}

void remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    DIR* d = ::opendir(path.c_str());
    if (d == nullptr) io_fail("cannot list", path, errno);
    while (struct dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name != "." && name != "..") remove_tree(join(path, name));
    }
    ::closedir(d);
    if (::rmdir(path.c_str()) != 0) io_fail("cannot remove", path, errno);
  } else if (::unlink(path.c_str()) != 0) {
    io_fail("cannot remove", path, errno);
  }
}

void sync_dir(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) io_fail("cannot open directory", path, errno);
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  // Some file systems cannot fsync a directory; their renames are then as
  // durable as they get.
  if (rc != 0 && err != EINVAL && err != EBADF) io_fail("cannot fsync directory", path, err);
}

std::string parent_dir(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  size_t slash = p.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return p.substr(0, slash);
}

std::string join(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

std::string staging_dir(const std::string& dir) {
  std::string p = dir;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  size_t slash = p.rfind('/');
  std::string base = slash == std::string::npos ? p : p.substr(slash + 1);
  return join(parent_dir(p), "." + base + ".fsdp-staging");
}

bool is_empty_dir(const std::string& path) {
  DIR* d = ::opendir(path.c_str());
  if (d == nullptr) io_fail("cannot list", path, errno);
  bool empty = true;
  while (struct dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name != "." && name != "..") empty = false;
  }
  ::closedir(d);
  return empty;
}

std::string aside_dir(const std::string& dir) { return staging_dir(dir) + ".old"; }

void check_replaceable(const std::string& dir, const std::string& who) {
  if (path_exists(dir) && !is_dir(dir))
    fail(FSDP_ERR_INVALID_ARGUMENT, who + ": " + base::quote_path(dir) + " exists and is not a directory");
  if (is_dir(dir) && !is_empty_dir(dir) && !path_exists(join(dir, kMetaFile))) {
    fail(FSDP_ERR_INVALID_ARGUMENT,
         who + ": refusing to replace " + base::quote_path(dir) +
             ": it is not empty and holds no fsdp_checkpoint.json (not a libfsdp checkpoint)");
  }
}

std::string prepare_staging(const std::string& dir, const std::string& who) {
  std::string note;
  std::string aside = aside_dir(dir);
  if (!path_exists(dir) && is_dir(aside)) {
    commit_dir(aside, dir);
    note = "moved the previous checkpoint back from " + base::quote_path(aside) + " to " + base::quote_path(dir);
  }
  check_replaceable(dir, who);
  std::string staged = staging_dir(dir);
  make_dirs(parent_dir(staged));
  remove_tree(staged);
  remove_tree(aside);
  make_dirs(staged);
  return note;
}

std::string remove_failed_staging(const std::string& staged) {
  Outcome removed = capture([&] {
    if (fault_value("cleanup_error") == 1) io_fail("cannot remove", staged, EACCES);
    remove_tree(staged);
  });
  if (removed.ok()) return "";
  return "its staging directory " + base::quote_path(staged) + " was left behind (" + removed.message +
         "); remove it by hand (the next save to the same directory also removes it)";
}

std::string commit_dir(const std::string& staged, const std::string& dir) {
  std::string target = dir;
  while (target.size() > 1 && target.back() == '/') target.pop_back();
  sync_dir(staged);
  std::string old;  // the previous checkpoint once the new one is in place
  if (!path_exists(target)) {
    if (::rename(staged.c_str(), target.c_str()) != 0)
      io_fail("cannot rename " + base::quote_path(staged) + " to", target, errno);
  } else {
    long rc = -1;
    int err = EINVAL;  // what a file system without exchange answers
#ifdef SYS_renameat2
    if (fault_value("no_exchange") != 1) {
      rc = ::syscall(SYS_renameat2, AT_FDCWD, staged.c_str(), AT_FDCWD, target.c_str(), 2 /* RENAME_EXCHANGE */);
      err = errno;
    }
#endif
    if (rc == 0) {
      old = staged;
    } else {
      if (err != EINVAL && err != ENOSYS) io_fail("cannot exchange " + base::quote_path(staged) + " with", target, err);
      // No atomic exchange on this file system: the old checkpoint moves
      // aside first. A crash between the two renames leaves it whole there;
      // the next save moves it back (docs/checkpoints.md).
      std::string aside = aside_dir(target);
      remove_tree(aside);
      if (::rename(target.c_str(), aside.c_str()) != 0) io_fail("cannot move aside", target, errno);
      if (fault_value("crash_after_aside") == 1) simulated_crash("after moving the old checkpoint aside");
      if (::rename(staged.c_str(), target.c_str()) != 0) {
        int e = errno;
        ::rename(aside.c_str(), target.c_str());  // put the old one back
        io_fail("cannot rename " + base::quote_path(staged) + " to", target, e);
      }
      old = aside;
    }
  }
  // The new checkpoint is in place: from here on, problems are warnings.
  std::string warning;
  try {
    sync_dir(parent_dir(target));
    if (!old.empty()) remove_tree(old);
  } catch (const Error& e) {
    warning = e.what();
  }
  return warning;
}

void after_file_written() {
  long n = fault_value("crash_after_files");
  if (n < 0) return;
  if (g_files_written.fetch_add(1) + 1 >= n)
    simulated_crash(("after " + std::to_string(n) + " checkpoint files").c_str());
}

bool inject_io_error(int rank) { return fault_value("io_error_rank") == rank; }

bool inject_read_error(int rank) { return fault_value("read_error_rank") == rank; }

}  // namespace fsdp::ckpt
