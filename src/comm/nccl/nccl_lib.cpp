// src/comm/nccl/nccl_lib.cpp - see nccl_lib.h.
#include "nccl_lib.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>

#include "../../base/error.h"

namespace fsdp::comm {
namespace {

struct Loaded {
  NcclApi api{};
  std::string error;  // why it could not be loaded; empty when it was
};

template <typename Fn>
bool bind(void* lib, const char* name, Fn* fn, std::string* error) {
  *fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (*fn == nullptr && error->empty()) *error = std::string("it has no ") + name;
  return *fn != nullptr;
}

Loaded load() {
  Loaded l;
  const char* env = std::getenv("FSDP_NCCL_LIBRARY");  // NOLINT(concurrency-mt-unsafe): read once
  std::string file = env != nullptr && *env != '\0' ? env : "libnccl.so.2";
  void* lib = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    l.error = "cannot load " + file + " (" + (why != nullptr ? why : "unknown") +
              "); install NCCL (Debian's libnccl2, or pip's nvidia-nccl-cu12 with FSDP_NCCL_LIBRARY=.../libnccl.so.2)";
    return l;
  }
  NcclApi& a = l.api;
  std::string missing;
  bind(lib, "ncclGetUniqueId", &a.GetUniqueId, &missing);
  bind(lib, "ncclCommInitRankConfig", &a.CommInitRankConfig, &missing);
  bind(lib, "ncclCommGetAsyncError", &a.CommGetAsyncError, &missing);
  bind(lib, "ncclCommAbort", &a.CommAbort, &missing);
  bind(lib, "ncclCommDestroy", &a.CommDestroy, &missing);
  bind(lib, "ncclCommUserRank", &a.CommUserRank, &missing);
  bind(lib, "ncclCommSplit", &a.CommSplit, &missing);
  bind(lib, "ncclAllGather", &a.AllGather, &missing);
  bind(lib, "ncclReduceScatter", &a.ReduceScatter, &missing);
  bind(lib, "ncclAllReduce", &a.AllReduce, &missing);
  bind(lib, "ncclBroadcast", &a.Broadcast, &missing);
  bind(lib, "ncclSend", &a.Send, &missing);
  bind(lib, "ncclRecv", &a.Recv, &missing);
  bind(lib, "ncclGroupStart", &a.GroupStart, &missing);
  bind(lib, "ncclGroupEnd", &a.GroupEnd, &missing);
  bind(lib, "ncclGetErrorString", &a.GetErrorString, &missing);
  bind(lib, "ncclGetLastError", &a.GetLastError, &missing);
  if (!missing.empty()) {
    l.error = file + " is too old for libfsdp (" + missing + "; NCCL 2.18 or newer is needed)";
    // Kept loaded: unloading a library that may have started threads is unsafe.
  }
  return l;
}

}  // namespace

const NcclApi& nccl() {
  static const Loaded loaded = load();  // thread-safe, once
  if (!loaded.error.empty()) fail(FSDP_ERR_UNSUPPORTED, "comm=nccl: " + loaded.error);
  return loaded.api;
}

}  // namespace fsdp::comm
