// Proves that every misuse of the C ABI by one process (NULLs, bad options and
// launcher variables) fails with the documented status and a message and
// changes nothing; test_misuse_ranks.cpp has what ranks do to each other.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "misuse_util.h"

using namespace fsdp_test;
using namespace fsdp_test::misuse;

namespace {

// ---- errors and version -------------------------------------------------------

TEST(Status, EveryStatusHasItsEnumName) {
#define FSDP_NAME_CASE(s) \
  { s, #s }
  const std::vector<std::pair<fsdp_status_t, std::string>> all = {FSDP_NAME_CASE(FSDP_OK),
                                                                  FSDP_NAME_CASE(FSDP_ERR_INVALID_ARGUMENT),
                                                                  FSDP_NAME_CASE(FSDP_ERR_INVALID_STATE),
                                                                  FSDP_NAME_CASE(FSDP_ERR_UNSUPPORTED),
                                                                  FSDP_NAME_CASE(FSDP_ERR_OUT_OF_MEMORY),
                                                                  FSDP_NAME_CASE(FSDP_ERR_TIMEOUT),
                                                                  FSDP_NAME_CASE(FSDP_ERR_MISMATCH),
                                                                  FSDP_NAME_CASE(FSDP_ERR_COMM),
                                                                  FSDP_NAME_CASE(FSDP_ERR_CORRUPT),
                                                                  FSDP_NAME_CASE(FSDP_ERR_IO),
                                                                  FSDP_NAME_CASE(FSDP_ERR_INTERNAL)};
#undef FSDP_NAME_CASE
  for (const auto& s : all) {
    const char* n = fsdp_status_name(s.first);
    ASSERT_NE(n, nullptr);
    EXPECT_EQ(std::string(n), s.second);
  }
  EXPECT_NE(fsdp_status_name(static_cast<fsdp_status_t>(15)), nullptr);
}

TEST(Version, MatchesHeaderAndBuildInfoNamesIt) {
  EXPECT_EQ(fsdp_version(), FSDP_VERSION_NUMBER);
  const char* info = fsdp_build_info();
  ASSERT_NE(info, nullptr);
  const std::string s = info;
  const std::string version = std::to_string(FSDP_VERSION_MAJOR) + "." + std::to_string(FSDP_VERSION_MINOR) + "." +
                              std::to_string(FSDP_VERSION_PATCH);
  EXPECT_TRUE(contains(s, version)) << s;
  EXPECT_TRUE(contains(s, "cpu")) << s;
  EXPECT_FALSE(contains(s, "\n")) << "one line";
}

TEST(LastError, IsPerThreadAndEmptyOnAFreshThread) {
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_create(nullptr));
  std::string other;
  std::thread([&] { other = fsdp_last_error(); }).join();
  EXPECT_EQ(other, "");
  EXPECT_FALSE(last_error_str().empty());
}

// ---- NULL handles and outputs -------------------------------------------------

TEST(NullArguments, EveryFunctionRejectsNullHandlesAndOutputs) {
  fsdp_config_destroy(nullptr);
  fsdp_ctx_destroy(nullptr);
  fsdp_local_group_destroy(nullptr);
  Single s;
  make_single(s);
  if (HasFatalFailure()) return;
  fsdp_ctx_t* ctx = s.ctx.get();
  fsdp_unit_t* unit = s.unit;
  ConfigPtr cfg = make_config({});
  ASSERT_TRUE(cfg);
  char buf[64];
  size_t n = 0, off = 0;
  int i = 0;
  double d = 0;
  uint64_t u64 = 0;
  float f[12] = {0};
  float* fp = nullptr;
  void* p = nullptr;
  fsdp_dtype_t dt;
  fsdp_ctx_t* c_out = nullptr;
  fsdp_unit_t* u_out = nullptr;
  fsdp_local_group_t* g_out = nullptr;
  fsdp_memory_stats_t ms;
  ms.struct_size = sizeof ms;
  const char* names[] = {"x"};
  const char* null_name[] = {nullptr};
  const int32_t nd[] = {1};
  const int64_t dims[] = {3};
  const std::vector<Call> calls = {
      {"config_create", [&] { return fsdp_config_create(nullptr); }},
      {"config_set cfg", [&] { return fsdp_config_set(nullptr, "lr", "0.1"); }},
      {"config_set key", [&] { return fsdp_config_set(cfg.get(), nullptr, "0.1"); }},
      {"config_set value", [&] { return fsdp_config_set(cfg.get(), "lr", nullptr); }},
      {"config_get cfg", [&] { return fsdp_config_get(nullptr, "lr", buf, sizeof buf, &n); }},
      {"config_get key", [&] { return fsdp_config_get(cfg.get(), nullptr, buf, sizeof buf, &n); }},
      {"config_get value", [&] { return fsdp_config_get(cfg.get(), "lr", nullptr, sizeof buf, &n); }},
      {"config_from_env", [&] { return fsdp_config_from_env(nullptr); }},
      {"local_group_create out", [&] { return fsdp_local_group_create(2, nullptr); }},
      {"local_group_create 0", [&] { return fsdp_local_group_create(0, &g_out); }},
      {"local_group_create -1", [&] { return fsdp_local_group_create(-1, &g_out); }},
      {"ctx_create cfg", [&] { return fsdp_ctx_create(nullptr, nullptr, 0, &c_out); }},
      {"ctx_create out", [&] { return fsdp_ctx_create(cfg.get(), nullptr, 0, nullptr); }},
      {"ctx_create rank 1 of world 1", [&] { return fsdp_ctx_create(cfg.get(), nullptr, 1, &c_out); }},
      {"ctx_create rank -2", [&] { return fsdp_ctx_create(cfg.get(), nullptr, -2, &c_out); }},
      {"ctx_finalize", [&] { return fsdp_ctx_finalize(nullptr); }},
      {"ctx_rank ctx", [&] { return fsdp_ctx_rank(nullptr, &i); }},
      {"ctx_rank out", [&] { return fsdp_ctx_rank(ctx, nullptr); }},
      {"ctx_world_size ctx", [&] { return fsdp_ctx_world_size(nullptr, &i); }},
      {"ctx_world_size out", [&] { return fsdp_ctx_world_size(ctx, nullptr); }},
      {"ctx_param_dtype ctx", [&] { return fsdp_ctx_param_dtype(nullptr, &dt); }},
      {"ctx_param_dtype out", [&] { return fsdp_ctx_param_dtype(ctx, nullptr); }},
      {"ctx_async_error", [&] { return fsdp_ctx_async_error(nullptr); }},
      {"unit_register ctx", [&] { return fsdp_unit_register(nullptr, "v", 1, names, nd, dims, &u_out); }},
      {"unit_register name", [&] { return fsdp_unit_register(ctx, nullptr, 1, names, nd, dims, &u_out); }},
      {"unit_register names", [&] { return fsdp_unit_register(ctx, "v", 1, nullptr, nd, dims, &u_out); }},
      {"unit_register names[0]", [&] { return fsdp_unit_register(ctx, "v", 1, null_name, nd, dims, &u_out); }},
      {"unit_register ndims", [&] { return fsdp_unit_register(ctx, "v", 1, names, nullptr, dims, &u_out); }},
      {"unit_register dims", [&] { return fsdp_unit_register(ctx, "v", 1, names, nd, nullptr, &u_out); }},
      {"unit_register out", [&] { return fsdp_unit_register(ctx, "v", 1, names, nd, dims, nullptr); }},
      {"param_set_values unit", [&] { return fsdp_param_set_values(nullptr, 0, f, 12); }},
      {"param_set_values values", [&] { return fsdp_param_set_values(unit, 0, nullptr, 12); }},
      {"param_set_weight_decay", [&] { return fsdp_param_set_weight_decay(nullptr, 0, 0.0); }},
      {"forward_begin", [&] { return fsdp_forward_begin(nullptr, nullptr); }},
      {"forward_end", [&] { return fsdp_forward_end(nullptr, nullptr); }},
      {"backward_begin", [&] { return fsdp_backward_begin(nullptr, nullptr); }},
      {"backward_end", [&] { return fsdp_backward_end(nullptr, nullptr); }},
      {"param_ptr unit", [&] { return fsdp_param_ptr(nullptr, 0, &p); }},
      {"grad_ptr unit", [&] { return fsdp_grad_ptr(nullptr, 0, &p); }},
      {"step", [&] { return fsdp_step(nullptr, nullptr); }},
      {"set_grad_sync", [&] { return fsdp_set_grad_sync(nullptr, 1); }},
      {"set_lr", [&] { return fsdp_set_lr(nullptr, 0.1); }},
      {"last_grad_norm ctx", [&] { return fsdp_last_grad_norm(nullptr, &d); }},
      {"last_grad_norm out", [&] { return fsdp_last_grad_norm(ctx, nullptr); }},
      {"ctx_step ctx", [&] { return fsdp_ctx_step(nullptr, &u64); }},
      {"ctx_step out", [&] { return fsdp_ctx_step(ctx, nullptr); }},
      {"gather_param unit", [&] { return fsdp_gather_param(nullptr, 0, f, 12); }},
      {"gather_param out", [&] { return fsdp_gather_param(unit, 0, nullptr, 12); }},
      {"gather_grad unit", [&] { return fsdp_gather_grad(nullptr, 0, f, 12); }},
      {"gather_grad out", [&] { return fsdp_gather_grad(unit, 0, nullptr, 12); }},
      {"shard_info unit", [&] { return fsdp_shard_info(nullptr, &fp, &off, &n); }},
      {"shard_info ptr", [&] { return fsdp_shard_info(unit, nullptr, &off, &n); }},
      {"shard_info offset", [&] { return fsdp_shard_info(unit, &fp, nullptr, &n); }},
      {"shard_info numel", [&] { return fsdp_shard_info(unit, &fp, &off, nullptr); }},
      {"param_flat_range unit", [&] { return fsdp_param_flat_range(nullptr, 0, &off, &n); }},
      {"param_flat_range offset", [&] { return fsdp_param_flat_range(unit, 0, nullptr, &n); }},
      {"param_flat_range numel", [&] { return fsdp_param_flat_range(unit, 0, &off, nullptr); }},
      {"memory_stats ctx", [&] { return fsdp_memory_stats(nullptr, &ms); }},
      {"memory_stats out", [&] { return fsdp_memory_stats(ctx, nullptr); }},
      {"memory_stats_reset_peak", [&] { return fsdp_memory_stats_reset_peak(nullptr); }},
  };
  for (const auto& c : calls) {
    SCOPED_TRACE(c.first);
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, c.second());
  }
  // Outputs are only valid inside a pass: NULL there is an argument error too.
  ASSERT_OK(fsdp_forward_begin(unit, nullptr));
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_param_ptr(unit, 0, nullptr));
  ASSERT_OK(fsdp_forward_end(unit, nullptr));
  ASSERT_OK(fsdp_backward_begin(unit, nullptr));
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_grad_ptr(unit, 0, nullptr));
  ASSERT_OK(fsdp_backward_end(unit, nullptr));
  // Nothing above broke the context.
  EXPECT_OK(fsdp_step(ctx, nullptr));
  EXPECT_OK(fsdp_ctx_finalize(ctx));
}

// ---- configuration -----------------------------------------------------------

TEST(Config, UnknownKeyFailsAndListsValidKeys) {
  ConfigPtr cfg = make_config({});
  ASSERT_TRUE(cfg);
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_set(cfg.get(), "shardin", "FULL_SHARD"));
  EXPECT_TRUE(contains(last_error_str(), "sharding")) << last_error_str();
  char buf[32];
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_get(cfg.get(), "no_such_key", buf, sizeof buf, nullptr));
}

TEST(Config, BadValuesFailListingValidChoicesAndChangeNothing) {
  ConfigPtr cfg = make_config({{"sharding", "NO_SHARD"}, {"param_dtype", "bf16"}, {"optimizer", "sgd"}});
  ASSERT_TRUE(cfg);
  struct Bad {
    const char *key, *value, *listed;  // `listed`: a valid choice the message must name
  };
  // clang-format off
  const std::vector<Bad> bad = {
      {"sharding", "HALF_SHARD", "FULL_SHARD"}, {"param_dtype", "fp64", "bf16"}, {"mp", "int8", "fp16"},
      {"reduce_dtype", "int4", "fp32"}, {"reduce_op", "max", "avg"}, {"optimizer", "lion", "adamw"},
      {"comm", "smoke_signals", "local"}, {"device", "abacus", "cpu"}, {"sync_module_states", "maybe", nullptr},
      {"nesterov", "perhaps", nullptr}, {"lr", "fast", nullptr}, {"weight_decay", "", nullptr},
      {"align_bytes", "48", nullptr}, {"align_bytes", "2", nullptr}, {"align_bytes", "8192", nullptr},
      {"timeout_s", "soon", nullptr}, {"max_grad_norm", "1.0x", nullptr},
      {"sharding", "HYBRID", "HYBRID_SHARD_ZERO2"}, {"offload", "nvme", "cpu"}, {"shard_group_size", "-1", nullptr},
      {"mpi_algorithm", "tree", "ring"}, {"gather_stream", "sometimes", "auto"}};
  // clang-format on
  for (const auto& b : bad) {
    SCOPED_TRACE(std::string(b.key) + "=" + b.value);
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_set(cfg.get(), b.key, b.value));
    if (b.listed) {
      EXPECT_TRUE(contains(last_error_str(), b.listed)) << last_error_str();
    }
  }
  EXPECT_EQ(get_option(cfg.get(), "sharding"), "NO_SHARD");
  EXPECT_EQ(get_option(cfg.get(), "param_dtype"), "bf16");
  EXPECT_EQ(get_option(cfg.get(), "optimizer"), "sgd");
}

TEST(Config, OptionsOfOtherBuildsAreUnsupported) {
  ConfigPtr cfg = make_config({{"sharding", "NO_SHARD"}});
  ASSERT_TRUE(cfg);
  std::vector<std::pair<const char*, const char*>> other;
  if (!have_nccl()) {
    other.push_back({"comm", "nccl"});
    static const std::string kId(256, 'a');
    other.push_back({"comm_id", kId.c_str()});
  }
  const bool have_mpi = std::string(fsdp_build_info()).find("mpi") != std::string::npos;
  if (!have_mpi) other.push_back({"comm", "mpi"});
  if (!have_cuda()) {
    for (const char* d : {"cuda", "cuda:0", "gpu"}) other.push_back({"device", d});
  }
  for (const auto& kv : other) {
    SCOPED_TRACE(std::string(kv.first) + "=" + kv.second);
    EXPECT_STATUS(FSDP_ERR_UNSUPPORTED, fsdp_config_set(cfg.get(), kv.first, kv.second));
  }
  EXPECT_EQ(get_option(cfg.get(), "sharding"), "NO_SHARD");
}

// device=cuda[:N] reads back with the ordinal it resolved to: N, else the
// launcher's LOCAL_RANK, else 0.
TEST(Config, DeviceCudaReadsBackWithItsOrdinal) {
  if (!have_cuda()) GTEST_SKIP() << "this build has no CUDA device: device=cuda is checked as unsupported above";
  ConfigPtr cfg = make_config({});
  ASSERT_TRUE(cfg);
  ASSERT_OK(fsdp_config_set(cfg.get(), "device", "cuda:3"));
  EXPECT_EQ(get_option(cfg.get(), "device"), "cuda:3");
  ASSERT_EQ(setenv("LOCAL_RANK", "2", 1), 0);
  ASSERT_OK(fsdp_config_set(cfg.get(), "device", "cuda"));
  EXPECT_EQ(get_option(cfg.get(), "device"), "cuda:2");
  ASSERT_EQ(unsetenv("LOCAL_RANK"), 0);
  ASSERT_OK(fsdp_config_set(cfg.get(), "device", "GPU"));
  EXPECT_EQ(get_option(cfg.get(), "device"), "cuda:0");
  for (const char* bad : {"cuda:", "cuda:x", "cuda:-1", "cuda:1024", "tpu"}) {
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_set(cfg.get(), "device", bad)) << bad;
  }
  EXPECT_EQ(get_option(cfg.get(), "device"), "cuda:0") << "a refused value changes nothing";
  ASSERT_OK(fsdp_config_set(cfg.get(), "device", "cpu"));
  EXPECT_EQ(get_option(cfg.get(), "device"), "cpu");
}

// device=cuda runs at several ranks sharing the GPU (the local communicator)
// and with offload=cpu (tests/test_cuda_engine.cpp trains both ways where a
// GPU is present); on a machine without a GPU every rank is told so.
TEST(Config, DeviceCudaRunsOrSaysThereIsNoGpu) {
  if (!have_cuda()) GTEST_SKIP() << "this build has no CUDA device";
  for (const char* offload : {"none", "cpu"}) {
    run_ranks(2, [offload](int rank, fsdp_local_group_t* group) {
      ConfigPtr cfg = make_config({{"device", "cuda:0"}, {"offload", offload}});
      ASSERT_TRUE(cfg);
      fsdp_ctx_t* ctx = nullptr;
      const fsdp_status_t st = fsdp_ctx_create(cfg.get(), group, rank, &ctx);
      if (st == FSDP_OK) {
        fsdp_ctx_destroy(ctx);
      } else {
        EXPECT_EQ(st, FSDP_ERR_UNSUPPORTED) << fsdp_last_error();
        EXPECT_TRUE(contains(fsdp_last_error(), "no CUDA device")) << fsdp_last_error();
        EXPECT_EQ(ctx, nullptr);
      }
    });
  }
}

// comm=nccl's options: a host-passed id reads back as given and must be 256
// hex digits; world_size goes with it; an id goes with comm=nccl; nccl needs
// device=cuda; fsdp_comm_id_create checks its buffer and makes an id (or says
// that NCCL cannot be loaded here). All before any GPU is touched.
TEST(Config, NcclOptionsAreCheckedBeforeAnyGpuIsTouched) {
  if (!have_nccl()) GTEST_SKIP() << "this build has no NCCL communicator (checked as unsupported above)";
  const std::string id(256, 'c');
  ConfigPtr cfg = make_config({{"comm", "nccl"}, {"comm_id", id.c_str()}, {"world_size", "2"}});
  ASSERT_TRUE(cfg);
  EXPECT_EQ(get_option(cfg.get(), "comm"), "nccl");
  EXPECT_EQ(get_option(cfg.get(), "comm_id"), id);
  EXPECT_EQ(get_option(cfg.get(), "world_size"), "2");
  for (const std::string& bad : {std::string(255, 'c'), std::string(256, 'g'), std::string("0x12")}) {
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_set(cfg.get(), "comm_id", bad.c_str()));
    EXPECT_TRUE(contains(fsdp_last_error(), "256 hex digits")) << fsdp_last_error();
  }
  EXPECT_EQ(get_option(cfg.get(), "comm_id"), id) << "a refused value changes nothing";
  fsdp_ctx_t* ctx = nullptr;
  // comm=nccl needs the GPU device.
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_ctx_create(cfg.get(), nullptr, 0, &ctx));
  EXPECT_TRUE(contains(fsdp_last_error(), "needs device=cuda")) << fsdp_last_error();
  // world_size alone, and an id with another communicator.
  ConfigPtr world_only = make_config({{"world_size", "2"}});
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_ctx_create(world_only.get(), nullptr, 0, &ctx));
  EXPECT_TRUE(contains(fsdp_last_error(), "world_size goes with comm_id")) << fsdp_last_error();
  ConfigPtr local_id = make_config({{"comm", "local"}, {"comm_id", id.c_str()}, {"world_size", "2"}});
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_ctx_create(local_id.get(), nullptr, 0, &ctx));
  EXPECT_TRUE(contains(fsdp_last_error(), "goes with comm=nccl")) << fsdp_last_error();
  // A group's threads are not NCCL ranks.
  run_ranks(2, [](int rank, fsdp_local_group_t* group) {
    ConfigPtr nccl = make_config({{"comm", "nccl"}});
    fsdp_ctx_t* c = nullptr;
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_ctx_create(nccl.get(), group, rank, &c));
    EXPECT_TRUE(contains(fsdp_last_error(), "pass group NULL")) << fsdp_last_error();
  });
  EXPECT_EQ(ctx, nullptr);
  char small[16];
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_comm_id_create(nullptr, FSDP_COMM_ID_NBYTES));
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_comm_id_create(small, sizeof small));
  EXPECT_TRUE(contains(fsdp_last_error(), "FSDP_COMM_ID_NBYTES")) << fsdp_last_error();
  char out[FSDP_COMM_ID_NBYTES];
  fsdp_status_t st = fsdp_comm_id_create(out, sizeof out);
  if (st == FSDP_OK) {
    ASSERT_EQ(std::strlen(out), 256u);
    EXPECT_EQ(std::string(out).find_first_not_of("0123456789abcdef"), std::string::npos) << out;
    EXPECT_STATUS(FSDP_OK, fsdp_config_set(cfg.get(), "comm_id", out));  // what the host passes on
  } else {
    EXPECT_EQ(st, FSDP_ERR_UNSUPPORTED) << fsdp_last_error();
    EXPECT_TRUE(contains(fsdp_last_error(), "libnccl")) << fsdp_last_error();
  }
}

TEST(Config, AliasesReadBackAsCanonicalNames) {
  ConfigPtr cfg = make_config({});
  ASSERT_TRUE(cfg);
  struct Alias {
    const char *key, *value, *canonical;
  };
  // clang-format off
  const std::vector<Alias> cases = {
      {"sharding", "FULL_SHARD", "FULL_SHARD"}, {"sharding", "ZERO3", "FULL_SHARD"},
      {"sharding", "SHARD_GRAD_OP", "SHARD_GRAD_OP"}, {"sharding", "SHARD_GRAD", "SHARD_GRAD_OP"},
      {"sharding", "ZERO2", "SHARD_GRAD_OP"}, {"sharding", "NO_SHARD", "NO_SHARD"}, {"sharding", "DDP", "NO_SHARD"},
      {"param_dtype", "float32", "fp32"}, {"param_dtype", "bfloat16", "bf16"}, {"param_dtype", "float16", "fp16"},
      {"mp", "bf16", "bf16"}, {"mp", "fp16", "fp16"}, {"param_dtype", "fp32", "fp32"},
      {"reduce_dtype", "bf16", "bf16"}, {"reduce_dtype", "auto", "auto"}, {"reduce_op", "sum", "sum"},
      {"optimizer", "adam", "adam"}, {"optimizer", "sgd", "sgd"}, {"device", "cpu", "cpu"},
      {"comm", "local", "local"}, {"comm", "auto", "auto"},
      {"sharding", "HYBRID_SHARD", "HYBRID_SHARD"}, {"sharding", "hsdp", "HYBRID_SHARD"},
      {"sharding", "_HYBRID_SHARD_ZERO2", "HYBRID_SHARD_ZERO2"}, {"shard_group_size", "2", "2"},
      {"offload", "cpu", "cpu"}, {"cpu_offload", "1", "cpu"}, {"offload", "none", "none"},
      {"mpi_algorithm", "ring", "ring"}, {"mpi_algorithm", "native", "native"},
      {"gather_stream", "on", "1"}, {"gather_stream", "no", "0"}, {"gather_stream", "AUTO", "auto"},
      {"keep_param_dtype_shard", "true", "1"}, {"keep_param_dtype_shard", "auto", "auto"}};
  // clang-format on
  for (const auto& c : cases) {
    SCOPED_TRACE(std::string(c.key) + "=" + c.value);
    EXPECT_OK(fsdp_config_set(cfg.get(), c.key, c.value));
    EXPECT_EQ(get_option(cfg.get(), std::string(c.key) == "mp" ? "param_dtype" : c.key), c.canonical);
  }
  struct Number {
    const char *key, *text;
    double value;
  };
  const std::vector<Number> numbers = {
      {"lr", "0.25", 0.25},        {"beta1", "0.5", 0.5},     {"eps", "1e-6", 1e-6}, {"timeout_s", "0.5", 0.5},
      {"align_bytes", "256", 256}, {"max_grad_norm", "2", 2}, {"threads", "2", 2}};
  for (const auto& nv : numbers) {
    EXPECT_OK(fsdp_config_set(cfg.get(), nv.key, nv.text));
    EXPECT_DOUBLE_EQ(std::strtod(get_option(cfg.get(), nv.key).c_str(), nullptr), nv.value) << nv.key;
  }
  for (const char* on : {"1", "true", "on"}) {
    EXPECT_OK(fsdp_config_set(cfg.get(), "nesterov", on));
    const std::string v = get_option(cfg.get(), "nesterov");
    EXPECT_TRUE(v == "1" || v == "true" || v == "on") << on << " read back as " << v;
  }
}

TEST(Config, DefaultsAreTheDocumentedOnes) {
  ConfigPtr cfg = make_config({});
  ASSERT_TRUE(cfg);
  EXPECT_EQ(get_option(cfg.get(), "optimizer"), "adamw");
  EXPECT_EQ(get_option(cfg.get(), "reduce_op"), "avg");
  EXPECT_EQ(get_option(cfg.get(), "reduce_dtype"), "auto");
  EXPECT_EQ(get_option(cfg.get(), "param_dtype"), "fp32");
  EXPECT_EQ(get_option(cfg.get(), "gather_stream"), "auto");
  const std::vector<std::pair<const char*, double>> numbers = {
      {"lr", 1e-3},    {"beta1", 0.9},       {"beta2", 0.999},    {"eps", 1e-8},      {"weight_decay", 0},
      {"momentum", 0}, {"max_grad_norm", 0}, {"align_bytes", 64}, {"timeout_s", 300}, {"threads", 1}};
  for (const auto& kv : numbers)
    EXPECT_DOUBLE_EQ(std::strtod(get_option(cfg.get(), kv.first).c_str(), nullptr), kv.second) << kv.first;
}

TEST(Config, GetReportsLengthAndWritesNothingWhenTheBufferIsTooSmall) {
  ConfigPtr cfg = make_config({{"sharding", "SHARD_GRAD_OP"}});
  ASSERT_TRUE(cfg);
  const std::string want = "SHARD_GRAD_OP";
  char buf[32];
  std::memset(buf, 'x', sizeof buf);
  size_t len = 0;
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_get(cfg.get(), "sharding", buf, want.size(), &len));
  EXPECT_EQ(len, want.size());
  for (char ch : buf) EXPECT_EQ(ch, 'x') << "a failed get wrote into the buffer";
  len = 0;
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_get(cfg.get(), "sharding", nullptr, 0, &len));
  EXPECT_EQ(len, want.size()) << "a NULL, 0-byte buffer still reports the length";
  EXPECT_OK(fsdp_config_get(cfg.get(), "sharding", buf, want.size() + 1, nullptr));
  EXPECT_EQ(std::string(buf), want);
}

// Sets FSDP_* variables for one test and removes them afterwards.
class EnvVars {
 public:
  explicit EnvVars(std::vector<std::pair<std::string, std::string>> vars) : vars_(std::move(vars)) {
    for (const auto& kv : vars_) setenv(kv.first.c_str(), kv.second.c_str(), 1);
  }
  ~EnvVars() {
    for (const auto& kv : vars_) unsetenv(kv.first.c_str());
  }

 private:
  std::vector<std::pair<std::string, std::string>> vars_;
};

// comm=auto on a GPU takes NCCL when a launcher (torchrun's variables) says
// this process is one of several, and the local communicator otherwise. Seen
// through the error of the path taken: without a GPU, the nccl path says so
// before any bootstrap, the local one when the context makes its device;
// with a GPU, rank 0 of 2 waits for a rank 1 that never comes and names it.
TEST(Config, AutoTakesNcclOnAGpuUnderALauncher) {
  if (!have_nccl()) GTEST_SKIP() << "this build has no NCCL communicator";
  ConfigPtr cfg = make_config({{"device", "cuda:0"}, {"timeout_s", "1"}});
  ASSERT_TRUE(cfg);
  fsdp_ctx_t* ctx = nullptr;
  {
    EnvVars launcher({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1"}});
    fsdp_status_t st = fsdp_ctx_create(cfg.get(), nullptr, -1, &ctx);
    EXPECT_NE(st, FSDP_OK);
    EXPECT_TRUE(contains(fsdp_last_error(), "comm=nccl: no CUDA device") ||
                contains(fsdp_last_error(), "bootstrap: rank 1 did not connect"))
        << fsdp_last_error();
  }
  fsdp_status_t st = fsdp_ctx_create(cfg.get(), nullptr, -1, &ctx);
  if (st == FSDP_OK) {
    fsdp_ctx_destroy(ctx);  // a GPU is here: alone, the local communicator
  } else {
    EXPECT_TRUE(contains(fsdp_last_error(), "device=cuda: no CUDA device")) << fsdp_last_error();
  }
}

TEST(Config, FromEnvAppliesOptionsAndIgnoresOtherFsdpVariables) {
  ConfigPtr cfg = make_config({{"sharding", "NO_SHARD"}, {"lr", "0.5"}});
  ASSERT_TRUE(cfg);
  EnvVars env({{"FSDP_SHARDING", "ZERO2"}, {"FSDP_OPTIMIZER", "sgd"}, {"FSDP_NOT_AN_OPTION_XYZ", "1"}});
  EXPECT_OK(fsdp_config_from_env(cfg.get()));
  EXPECT_EQ(get_option(cfg.get(), "sharding"), "SHARD_GRAD_OP");
  EXPECT_EQ(get_option(cfg.get(), "optimizer"), "sgd");
  EXPECT_DOUBLE_EQ(std::strtod(get_option(cfg.get(), "lr").c_str(), nullptr), 0.5) << "unset in env: kept";
}

TEST(Config, FromEnvWithABadValueChangesNothing) {
  ConfigPtr cfg = make_config({{"sharding", "NO_SHARD"}, {"optimizer", "adam"}});
  ASSERT_TRUE(cfg);
  EnvVars env({{"FSDP_SHARDING", "ZERO2"}, {"FSDP_OPTIMIZER", "lion"}});
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_from_env(cfg.get()));
  EXPECT_TRUE(contains(last_error_str(), "FSDP_OPTIMIZER") || contains(last_error_str(), "optimizer"))
      << last_error_str();
  EXPECT_EQ(get_option(cfg.get(), "sharding"), "NO_SHARD");
  EXPECT_EQ(get_option(cfg.get(), "optimizer"), "adam");
}

TEST(Config, ContextKeepsACopyOfItsConfig) {
  ConfigPtr cfg = make_config({{"param_dtype", "bf16"}});
  ASSERT_TRUE(cfg);
  fsdp_ctx_t* raw = nullptr;
  ASSERT_OK(fsdp_ctx_create(cfg.get(), nullptr, 0, &raw));
  CtxPtr ctx(raw);
  ASSERT_OK(fsdp_config_set(cfg.get(), "param_dtype", "fp16"));
  cfg.reset();  // destroying it must not matter either
  fsdp_dtype_t dt = FSDP_DTYPE_FP32;
  EXPECT_OK(fsdp_ctx_param_dtype(ctx.get(), &dt));
  EXPECT_EQ(dt, FSDP_DTYPE_BF16);
  EXPECT_OK(fsdp_ctx_finalize(ctx.get()));
}

}  // namespace

// ---- launcher variables ------------------------------------------------------

// Sets an environment variable for the scope of a test.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) { setenv(name, value, 1); }
  ~ScopedEnv() { unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
};

TEST(Launch, AMalformedLauncherVariableIsRefusedNamingIt) {
  if (launcher_world() > 0) GTEST_SKIP() << "runs outside mpirun";
  ScopedEnv size("OMPI_COMM_WORLD_SIZE", "four");
  ScopedEnv rank("OMPI_COMM_WORLD_RANK", "0");
  ConfigPtr cfg = make_config({});
  ASSERT_TRUE(cfg);
  fsdp_ctx_t* raw = nullptr;
  EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_ctx_create(cfg.get(), nullptr, -1, &raw));
  EXPECT_TRUE(contains(last_error_str(), "OMPI_COMM_WORLD_SIZE")) << last_error_str();
  EXPECT_EQ(raw, nullptr);
}

TEST(Launch, AProcessOfAnMpirunJobIsRefusedByABuildWithoutMpi) {
  if (std::string(fsdp_build_info()).find("mpi") != std::string::npos) {
    GTEST_SKIP() << "this build has the mpi communicator (CI also builds without it)";
  }
  ScopedEnv size("OMPI_COMM_WORLD_SIZE", "4");
  ScopedEnv rank("OMPI_COMM_WORLD_RANK", "1");
  ConfigPtr cfg = make_config({});
  ASSERT_TRUE(cfg);
  fsdp_ctx_t* raw = nullptr;
  EXPECT_STATUS(FSDP_ERR_UNSUPPORTED, fsdp_ctx_create(cfg.get(), nullptr, -1, &raw));
  EXPECT_TRUE(contains(last_error_str(), "rank 1 of 4")) << last_error_str();
  // Running the processes as independent jobs is possible, but only on purpose.
  ConfigPtr local = make_config({{"comm", "local"}});
  ASSERT_TRUE(local);
  ASSERT_OK(fsdp_ctx_create(local.get(), nullptr, -1, &raw));
  fsdp_ctx_destroy(raw);
}

// ---- debug_poison: a read after *_end shows as NaN --------------------------

// With debug_poison=1 a gathered buffer is filled with NaN once the host's
// stream is done with it, so a view kept past fsdp_forward_end reads NaN in
// every dtype instead of params that look right (the autograd bug a binding's
// glue can make: issue 25). Without it, the same read still sees the params.
TEST(DebugPoison, AViewReadAfterItsEndIsNanInEveryDtype) {
  for (const char* dtype : {"fp32", "bf16", "fp16"}) {
    for (bool poison : {false, true}) {
      SCOPED_TRACE(std::string(dtype) + (poison ? " poisoned" : " plain"));
      run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
        ConfigPtr cfg =
            make_config({{"param_dtype", dtype}, {"debug_poison", poison ? "1" : "0"}, {"timeout_s", "20"}});
        ASSERT_TRUE(cfg);
        fsdp_ctx_t* raw = nullptr;
        ASSERT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
        CtxPtr ctx(raw);
        fsdp_unit_t* u = nullptr;
        ASSERT_OK(register_unit(raw, "u", {{"w", {64}}}, &u));
        const std::vector<float> ones(64, 1.0f);
        ASSERT_OK(fsdp_param_set_values(u, 0, ones.data(), 64));
        fsdp_dtype_t dt;
        ASSERT_OK(fsdp_ctx_param_dtype(raw, &dt));
        ASSERT_OK(fsdp_forward_begin(u, nullptr));
        void* p = nullptr;
        ASSERT_OK(fsdp_param_ptr(u, 0, &p));
        EXPECT_EQ(load_elem(p, 5, dt), 1.0f);
        ASSERT_OK(fsdp_forward_end(u, nullptr));
        double x = 1.0;  // a collective on the comm stream: the fill queued before it is done
        ASSERT_OK(fsdp_metrics_reduce(raw, &x, 1, FSDP_REDUCE_SUM));
        for (size_t i = 0; i < 64; ++i) {
          const float v = load_elem(p, i, dt);  // the slot is the pool's, still mapped
          if (poison) {
            ASSERT_TRUE(std::isnan(v)) << "element " << i << " reads " << v << " after forward_end";
          } else {
            ASSERT_EQ(v, 1.0f) << "element " << i;
          }
        }
        EXPECT_OK(fsdp_ctx_finalize(raw));
      });
    }
  }
}

// FSDP_DEBUG_POISON=1 in the environment turns it on for configs made after.
TEST(DebugPoison, TheEnvironmentSetsTheDefault) {
  char value[8] = {};
  ConfigPtr plain = make_config({});
  ASSERT_OK(fsdp_config_get(plain.get(), "debug_poison", value, sizeof value, nullptr));
  EXPECT_STREQ(value, "0");
  setenv("FSDP_DEBUG_POISON", "1", 1);
  ConfigPtr env = make_config({});
  unsetenv("FSDP_DEBUG_POISON");
  ASSERT_OK(fsdp_config_get(env.get(), "debug_poison", value, sizeof value, nullptr));
  EXPECT_STREQ(value, "1");
  ConfigPtr off = make_config({{"debug_poison", "0"}});
  ASSERT_OK(fsdp_config_get(off.get(), "debug_poison", value, sizeof value, nullptr));
  EXPECT_STREQ(value, "0") << "the key wins over the environment";
}
