// src/api/api_context.cpp - C ABI for errors, version, config, local groups and
// contexts. Handles are the C++ objects themselves behind opaque pointers.
#include <cstring>
#include <memory>
#include <string>

#include "../base/log.h"
#include "../base/text.h"
#include "../core/config.h"
#include "../core/context.h"
#include "../core/plan.h"
#include "../core/world.h"
#include "guard.h"

struct fsdp_local_group {
  std::shared_ptr<fsdp::comm::LocalGroup> group;
};

namespace base = fsdp::base;
using fsdp::fail;
using fsdp::api::guard;
using fsdp::api::require;
using fsdp::core::Config;
using fsdp::core::Context;

namespace {

thread_local std::string t_last_error;

Config* cfg_of(fsdp_config_t* c) { return reinterpret_cast<Config*>(c); }
const Config* cfg_of(const fsdp_config_t* c) { return reinterpret_cast<const Config*>(c); }
Context* ctx_of(fsdp_ctx_t* c) { return reinterpret_cast<Context*>(c); }
const Context* ctx_of(const fsdp_ctx_t* c) { return reinterpret_cast<const Context*>(c); }

// Copies `v` and its NUL into the caller's `out` of `cap` bytes; its length
// into *len (when not NULL) even where the buffer is too small (then
// FSDP_ERR_INVALID_ARGUMENT, `what` naming the text).
void copy_text(const std::string& v, const char* call, const std::string& what, char* out, size_t cap, size_t* len) {
  if (len != nullptr) *len = v.size();
  if (out == nullptr || cap < v.size() + 1) {
    fail(FSDP_ERR_INVALID_ARGUMENT, std::string(call) + ": " + what + " needs " + std::to_string(v.size() + 1) +
                                        " bytes, the buffer " +
                                        (out == nullptr ? std::string("is NULL") : "has " + std::to_string(cap)));
  }
  v.copy(out, v.size());
  out[v.size()] = '\0';
}

}  // namespace

namespace fsdp::api {
void set_last_error(const std::string& message) { t_last_error = message; }
}  // namespace fsdp::api

extern "C" {

const char* fsdp_status_name(fsdp_status_t status) {
  switch (status) {
    case FSDP_OK:
      return "FSDP_OK";
    case FSDP_ERR_INVALID_ARGUMENT:
      return "FSDP_ERR_INVALID_ARGUMENT";
    case FSDP_ERR_INVALID_STATE:
      return "FSDP_ERR_INVALID_STATE";
    case FSDP_ERR_UNSUPPORTED:
      return "FSDP_ERR_UNSUPPORTED";
    case FSDP_ERR_OUT_OF_MEMORY:
      return "FSDP_ERR_OUT_OF_MEMORY";
    case FSDP_ERR_TIMEOUT:
      return "FSDP_ERR_TIMEOUT";
    case FSDP_ERR_MISMATCH:
      return "FSDP_ERR_MISMATCH";
    case FSDP_ERR_COMM:
      return "FSDP_ERR_COMM";
    case FSDP_ERR_CORRUPT:
      return "FSDP_ERR_CORRUPT";
    case FSDP_ERR_IO:
      return "FSDP_ERR_IO";
    case FSDP_ERR_INTERNAL:
      return "FSDP_ERR_INTERNAL";
  }
  return "FSDP_ERR_UNKNOWN_STATUS";
}

const char* fsdp_last_error(void) { return t_last_error.c_str(); }

// Takes an int: a C caller may pass any value, and loading an out-of-range
// value as the enum type is already undefined in C++.
fsdp_status_t fsdp_log_set_level(int level) {
  return guard([&] {
    if (level < FSDP_LOG_ERROR || level > FSDP_LOG_DEBUG) {
      fail(FSDP_ERR_INVALID_ARGUMENT, "fsdp_log_set_level: level must be FSDP_LOG_ERROR, _WARN, _INFO or _DEBUG");
    }
    fsdp::base::set_log_level(static_cast<fsdp_log_level_t>(level));
  });
}

fsdp_status_t fsdp_log_set_callback(fsdp_log_fn fn, void* user) {
  return guard([&] { fsdp::base::set_log_callback(fn, user); });
}

int fsdp_version(void) { return FSDP_VERSION_NUMBER; }

#define FSDP_STR2(x) #x
#define FSDP_STR(x) FSDP_STR2(x)
#ifdef FSDP_HAVE_MPI
#define FSDP_COMMS_MPI "local,mpi"
#else
#define FSDP_COMMS_MPI "local"
#endif
#ifdef FSDP_HAVE_NCCL
#define FSDP_COMMS FSDP_COMMS_MPI ",nccl"
#else
#define FSDP_COMMS FSDP_COMMS_MPI
#endif

// With the CUDA parts built: the device, its toolkit and GPU architectures.
#ifdef FSDP_HAVE_CUDA
#define FSDP_DEVICES "cpu,cuda"
#define FSDP_CUDA_INFO " cuda=" FSDP_CUDA_VERSION " (sm " FSDP_CUDA_ARCHS ")"
#else
#define FSDP_DEVICES "cpu"
#define FSDP_CUDA_INFO ""
#endif

const char* fsdp_build_info(void) {
  return "libfsdp " FSDP_STR(FSDP_VERSION_MAJOR) "." FSDP_STR(FSDP_VERSION_MINOR) "." FSDP_STR(
      FSDP_VERSION_PATCH) " devices=" FSDP_DEVICES " comms=" FSDP_COMMS FSDP_CUDA_INFO;
}

fsdp_status_t fsdp_config_create(fsdp_config_t** out) {
  return guard([&] {
    require(out, "fsdp_config_create", "out");
    *out = reinterpret_cast<fsdp_config_t*>(new Config());
  });
}

void fsdp_config_destroy(fsdp_config_t* cfg) { delete cfg_of(cfg); }

fsdp_status_t fsdp_config_set(fsdp_config_t* cfg, const char* key, const char* value) {
  return guard([&] {
    require(cfg, "fsdp_config_set", "cfg");
    require(key, "fsdp_config_set", "key");
    require(value, "fsdp_config_set", "value");
    cfg_of(cfg)->set(key, value);
  });
}

fsdp_status_t fsdp_plan(const char* request, char* out, size_t out_nbytes, size_t* out_len) {
  return guard([&] {
    require(request, "fsdp_plan", "request");
    copy_text(fsdp::core::plan_request(request), "fsdp_plan", "the plan", out, out_nbytes, out_len);
  });
}

fsdp_status_t fsdp_config_get(const fsdp_config_t* cfg, const char* key, char* value, size_t value_nbytes,
                              size_t* value_len) {
  return guard([&] {
    require(cfg, "fsdp_config_get", "cfg");
    require(key, "fsdp_config_get", "key");
    copy_text(cfg_of(cfg)->get(key), "fsdp_config_get", "the value of " + base::quote(key), value, value_nbytes,
              value_len);
  });
}

fsdp_status_t fsdp_config_from_env(fsdp_config_t* cfg) {
  return guard([&] {
    require(cfg, "fsdp_config_from_env", "cfg");
    cfg_of(cfg)->apply_env();
  });
}

fsdp_status_t fsdp_launcher(int* rank, int* world, int* local_rank, int* local_world) {
  return guard([&] {
    int r = -1, w = -1, lr = -1, lw = -1;
    fsdp::core::launcher_env(&r, &w, &lr, &lw);
    if (rank != nullptr) *rank = r;
    if (world != nullptr) *world = w;
    if (local_rank != nullptr) *local_rank = lr;
    if (local_world != nullptr) *local_world = lw;
  });
}

fsdp_status_t fsdp_comm_id_create(char* out, size_t out_nbytes) {
  return guard([&] {
    require(out, "fsdp_comm_id_create", "out");
    if (out_nbytes < FSDP_COMM_ID_NBYTES) {
      fail(FSDP_ERR_INVALID_ARGUMENT, "fsdp_comm_id_create: out_nbytes is " + std::to_string(out_nbytes) +
                                          "; the id needs FSDP_COMM_ID_NBYTES (" + std::to_string(FSDP_COMM_ID_NBYTES) +
                                          ") bytes");
    }
    std::string id = fsdp::core::new_comm_id();
    std::memcpy(out, id.c_str(), id.size() + 1);
  });
}

fsdp_status_t fsdp_local_group_create(int world_size, fsdp_local_group_t** out) {
  return guard([&] {
    require(out, "fsdp_local_group_create", "out");
    if (world_size < 1 || world_size > 4096) {
      fail(FSDP_ERR_INVALID_ARGUMENT,
           "fsdp_local_group_create: world_size must be from 1 to 4096, not " + std::to_string(world_size));
    }
    auto g = std::make_unique<fsdp_local_group>();
    g->group = fsdp::core::make_local_group(world_size);
    *out = g.release();
  });
}

void fsdp_local_group_destroy(fsdp_local_group_t* group) { delete group; }

fsdp_status_t fsdp_local_group_abort(fsdp_local_group_t* group, const char* reason) {
  return guard([&] {
    require(group, "fsdp_local_group_abort", "group");
    fsdp::core::abort_local_group(*group->group, reason != nullptr && *reason != '\0' ? reason : "(no reason given)");
  });
}

fsdp_status_t fsdp_ctx_create(const fsdp_config_t* cfg, fsdp_local_group_t* group, int rank, fsdp_ctx_t** out) {
  return guard([&] {
    require(cfg, "fsdp_ctx_create", "cfg");
    require(out, "fsdp_ctx_create", "out");
    const auto& opts = cfg_of(cfg)->options();
    auto ctx =
        std::make_unique<Context>(opts, fsdp::core::make_world(opts, group != nullptr ? group->group : nullptr, rank));
    *out = reinterpret_cast<fsdp_ctx_t*>(ctx.release());
  });
}

fsdp_status_t fsdp_ctx_finalize(fsdp_ctx_t* ctx) {
  return guard([&] {
    require(ctx, "fsdp_ctx_finalize", "ctx");
    ctx_of(ctx)->check_live("fsdp_ctx_finalize");
    ctx_of(ctx)->finalize();
  });
}

void fsdp_ctx_destroy(fsdp_ctx_t* ctx) { delete ctx_of(ctx); }

fsdp_status_t fsdp_ctx_rank(const fsdp_ctx_t* ctx, int* rank) {
  return guard([&] {
    require(ctx, "fsdp_ctx_rank", "ctx");
    require(rank, "fsdp_ctx_rank", "rank");
    ctx_of(ctx)->check_live("fsdp_ctx_rank");
    *rank = ctx_of(ctx)->rank();
  });
}

fsdp_status_t fsdp_ctx_world_size(const fsdp_ctx_t* ctx, int* world_size) {
  return guard([&] {
    require(ctx, "fsdp_ctx_world_size", "ctx");
    require(world_size, "fsdp_ctx_world_size", "world_size");
    ctx_of(ctx)->check_live("fsdp_ctx_world_size");
    *world_size = ctx_of(ctx)->world_size();
  });
}

fsdp_status_t fsdp_ctx_param_dtype(const fsdp_ctx_t* ctx, fsdp_dtype_t* dtype) {
  return guard([&] {
    require(ctx, "fsdp_ctx_param_dtype", "ctx");
    require(dtype, "fsdp_ctx_param_dtype", "dtype");
    ctx_of(ctx)->check_live("fsdp_ctx_param_dtype");
    *dtype = static_cast<fsdp_dtype_t>(ctx_of(ctx)->options().param_dtype);
  });
}

fsdp_status_t fsdp_save(fsdp_ctx_t* ctx, const char* dir, const char* kind) {
  return guard([&] {
    require(ctx, "fsdp_save", "ctx");
    require(dir, "fsdp_save", "dir");
    require(kind, "fsdp_save", "kind");
    ctx_of(ctx)->check_live("fsdp_save");
    ctx_of(ctx)->save(dir, kind);
  });
}

fsdp_status_t fsdp_save_async(fsdp_ctx_t* ctx, const char* dir) {
  return guard([&] {
    require(ctx, "fsdp_save_async", "ctx");
    require(dir, "fsdp_save_async", "dir");
    ctx_of(ctx)->check_live("fsdp_save_async");
    ctx_of(ctx)->save_async(dir);
  });
}

fsdp_status_t fsdp_save_wait(fsdp_ctx_t* ctx) {
  return guard([&] {
    require(ctx, "fsdp_save_wait", "ctx");
    ctx_of(ctx)->save_wait();
  });
}

fsdp_status_t fsdp_snapshot(fsdp_ctx_t* ctx, const char* path) {
  return guard([&] {
    require(ctx, "fsdp_snapshot", "ctx");
    require(path, "fsdp_snapshot", "path");
    ctx_of(ctx)->check_live("fsdp_snapshot");
    ctx_of(ctx)->snapshot(path);
  });
}

fsdp_status_t fsdp_restore(fsdp_ctx_t* ctx, const char* path, const char* checkpoint_dir, int* source) {
  return guard([&] {
    require(ctx, "fsdp_restore", "ctx");
    ctx_of(ctx)->check_live("fsdp_restore");
    int got = ctx_of(ctx)->restore(path == nullptr ? "" : path, checkpoint_dir == nullptr ? "" : checkpoint_dir);
    if (source != nullptr) *source = got;
  });
}

fsdp_status_t fsdp_load(fsdp_ctx_t* ctx, const char* dir) {
  return guard([&] {
    require(ctx, "fsdp_load", "ctx");
    require(dir, "fsdp_load", "dir");
    ctx_of(ctx)->check_live("fsdp_load");
    ctx_of(ctx)->load(dir);
  });
}

fsdp_status_t fsdp_load_partial(fsdp_ctx_t* ctx, const char* dir) {
  return guard([&] {
    require(ctx, "fsdp_load_partial", "ctx");
    require(dir, "fsdp_load_partial", "dir");
    ctx_of(ctx)->check_live("fsdp_load_partial");
    ctx_of(ctx)->load(dir, /*strict=*/false);
  });
}

fsdp_status_t fsdp_load_pretrained(fsdp_ctx_t* ctx, const char* path, const char* options) {
  return guard([&] {
    require(ctx, "fsdp_load_pretrained", "ctx");
    require(path, "fsdp_load_pretrained", "path");
    ctx_of(ctx)->check_live("fsdp_load_pretrained");
    ctx_of(ctx)->load_pretrained(path, options);
  });
}

fsdp_status_t fsdp_export(fsdp_ctx_t* ctx, const char* dir, const char* options) {
  return guard([&] {
    require(ctx, "fsdp_export", "ctx");
    require(dir, "fsdp_export", "dir");
    ctx_of(ctx)->check_live("fsdp_export");
    ctx_of(ctx)->export_weights(dir, options);
  });
}

fsdp_status_t fsdp_load_report(const fsdp_ctx_t* ctx, char* text, size_t text_nbytes, size_t* text_len) {
  return guard([&] {
    require(ctx, "fsdp_load_report", "ctx");
    ctx_of(ctx)->check_live("fsdp_load_report");
    copy_text(ctx_of(ctx)->load_report(), "fsdp_load_report", "the report", text, text_nbytes, text_len);
  });
}

fsdp_status_t fsdp_ctx_async_error(const fsdp_ctx_t* ctx) {
  fsdp_status_t st = FSDP_OK;
  fsdp_status_t call = guard([&] {
    require(ctx, "fsdp_ctx_async_error", "ctx");
    ctx_of(ctx)->check_live("fsdp_ctx_async_error");
    st = ctx_of(ctx)->async_error();
    if (st != FSDP_OK) {
      fail(st, "fsdp_ctx_async_error: a collective failed earlier with " + std::string(fsdp_status_name(st)) +
                   "; the communicator is unusable, restart the job from its last checkpoint");
    }
  });
  return call;
}

}  // extern "C"
