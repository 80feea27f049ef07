/* Proves that fsdp.h is plain C99 and that a C program can drive a whole training step through the ABI. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "fsdp.h"

static int failures = 0;

/* Records a failure when `call` does not return `expected`. */
static void expect_status(fsdp_status_t got, fsdp_status_t expected, const char* what, int line) {
  if (got != expected) {
    fprintf(stderr, "abi_c99.c:%d: %s returned %s, expected %s: %s\n", line, what, fsdp_status_name(got),
            fsdp_status_name(expected), fsdp_last_error());
    failures++;
  } else if (got != FSDP_OK && fsdp_last_error()[0] == '\0') {
    fprintf(stderr, "abi_c99.c:%d: %s failed without a message\n", line, what);
    failures++;
  }
}
#define CHECK(call) expect_status((call), FSDP_OK, #call, __LINE__)
#define CHECK_STATUS(expected, call) expect_status((call), (expected), #call, __LINE__)
#define CHECK_TRUE(cond)                                               \
  do {                                                                 \
    if (!(cond)) {                                                     \
      fprintf(stderr, "abi_c99.c:%d: expected %s\n", __LINE__, #cond); \
      failures++;                                                      \
    }                                                                  \
  } while (0)

int main(void) {
  /* A unit of two params: w [3, 2] and b [3]; y = w x + b on one sample. */
  const char* names[2] = {"lin.weight", "lin.bias"};
  const int32_t ndims[2] = {2, 1};
  const int64_t dims[3] = {3, 2, 3};
  const float w0[6] = {0.5f, -0.25f, 1.0f, 0.75f, -1.5f, 0.125f};
  const float b0[3] = {0.1f, -0.2f, 0.3f};
  const float x[2] = {1.0f, -2.0f};
  const float lr = 0.5f;
  float w[6], b[3], expected_w[6], expected_b[3];
  double norm = -1.0, sq = 0.0;
  fsdp_config_t* cfg = NULL;
  fsdp_ctx_t* ctx = NULL;
  fsdp_unit_t* unit = NULL;
  fsdp_dtype_t dtype = FSDP_DTYPE_BF16;
  fsdp_memory_stats_t stats;
  void* p = NULL;
  int rank = -1, world = -1;
  char value[32];
  size_t len = 0;
  int i, o;

  CHECK_TRUE(fsdp_version() == FSDP_VERSION_NUMBER);
  CHECK_TRUE(fsdp_build_info() != NULL && fsdp_build_info()[0] != '\0');

  CHECK(fsdp_config_create(&cfg));
  CHECK(fsdp_config_set(cfg, "optimizer", "sgd"));
  CHECK(fsdp_config_set(cfg, "lr", "0.5"));
  CHECK(fsdp_config_set(cfg, "sharding", "ZERO3"));
  CHECK_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_config_set(cfg, "no_such_option", "1"));
  CHECK(fsdp_config_get(cfg, "sharding", value, sizeof value, &len));
  CHECK_TRUE(strcmp(value, "FULL_SHARD") == 0 && len == strlen("FULL_SHARD"));

  CHECK(fsdp_ctx_create(cfg, NULL, 0, &ctx));
  fsdp_config_destroy(cfg);
  if (ctx == NULL) {
    fprintf(stderr, "no context; giving up\n");
    return 1;
  }
  CHECK(fsdp_ctx_rank(ctx, &rank));
  CHECK(fsdp_ctx_world_size(ctx, &world));
  CHECK(fsdp_ctx_param_dtype(ctx, &dtype));
  CHECK_TRUE(rank == 0 && world == 1 && dtype == FSDP_DTYPE_FP32);
  CHECK(fsdp_ctx_async_error(ctx));

  CHECK(fsdp_unit_register(ctx, "lin", 2, names, ndims, dims, &unit));
  if (unit == NULL) {
    fprintf(stderr, "no unit; giving up\n");
    fsdp_ctx_destroy(ctx);
    return 1;
  }
  CHECK(fsdp_param_set_values(unit, 0, w0, 6));
  CHECK(fsdp_param_set_values(unit, 1, b0, 3));

  /* forward: the host would compute y = w x + b from these */
  CHECK(fsdp_forward_begin(unit, NULL));
  CHECK(fsdp_param_ptr(unit, 0, &p));
  CHECK_TRUE(p != NULL && memcmp(p, w0, sizeof w0) == 0);
  CHECK(fsdp_param_ptr(unit, 1, &p));
  CHECK_TRUE(p != NULL && memcmp(p, b0, sizeof b0) == 0);
  CHECK(fsdp_forward_end(unit, NULL));
  CHECK_STATUS(FSDP_ERR_INVALID_STATE, fsdp_forward_end(unit, NULL));

  /* backward of L = sum(y): dL/db = 1, dL/dw[o][i] = x[i] */
  CHECK(fsdp_backward_begin(unit, NULL));
  CHECK(fsdp_grad_ptr(unit, 0, &p));
  if (p != NULL)
    for (o = 0; o < 3; ++o)
      for (i = 0; i < 2; ++i) ((float*)p)[o * 2 + i] += x[i];
  CHECK(fsdp_grad_ptr(unit, 1, &p));
  if (p != NULL)
    for (o = 0; o < 3; ++o) ((float*)p)[o] += 1.0f;
  CHECK(fsdp_backward_end(unit, NULL));
  CHECK(fsdp_step(ctx, NULL));

  /* plain SGD: p -= lr * g */
  for (o = 0; o < 3; ++o) {
    for (i = 0; i < 2; ++i) {
      expected_w[o * 2 + i] = w0[o * 2 + i] - lr * x[i];
      sq += (double)x[i] * x[i];
    }
    expected_b[o] = b0[o] - lr * 1.0f;
    sq += 1.0;
  }
  CHECK(fsdp_gather_param(unit, 0, w, 6));
  CHECK(fsdp_gather_param(unit, 1, b, 3));
  for (i = 0; i < 6; ++i) CHECK_TRUE(fabsf(w[i] - expected_w[i]) <= 1e-6f);
  for (o = 0; o < 3; ++o) CHECK_TRUE(fabsf(b[o] - expected_b[o]) <= 1e-6f);
  CHECK(fsdp_last_grad_norm(ctx, &norm));
  CHECK_TRUE(fabs(norm - sqrt(sq)) <= 1e-5 * sqrt(sq));

  memset(&stats, 0, sizeof stats);
  stats.struct_size = sizeof stats;
  CHECK(fsdp_memory_stats(ctx, &stats));
  CHECK_TRUE(stats.sharded_params_nbytes >= 9 * sizeof(float));
  CHECK_TRUE(stats.total_nbytes >= stats.sharded_params_nbytes);

  CHECK_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_param_ptr(NULL, 0, &p));
  CHECK(fsdp_ctx_finalize(ctx));
  CHECK_STATUS(FSDP_ERR_INVALID_STATE, fsdp_step(ctx, NULL));
  fsdp_ctx_destroy(ctx);
  fsdp_ctx_destroy(NULL);
  fsdp_config_destroy(NULL);
  fsdp_local_group_destroy(NULL);
  CHECK_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_local_group_abort(NULL, "reason"));

  if (failures != 0) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("abi_c99: ok\n");
  return 0;
}
