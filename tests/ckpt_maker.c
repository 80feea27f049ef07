/* Makes real libfsdp checkpoints for test_fsdp_ckpt.py through the public C ABI
 * only, and loads them back at any world size, printing every param's gathered
 * values as hex float bits so that the test can compare them bitwise.
 *
 *   ckpt_maker make SHARDED_DIR FULL_DIR [options]   world 4, 2 steps, both saves ("-" skips one)
 *   ckpt_maker load DIR WORLD [options]              loads DIR at WORLD ranks
 *   options: --step        (load) one more training step after the load
 *            --optimizer K adamw (default), adam or sgd
 *            --momentum M  sgd momentum (default 0: no state)
 *            --dup-names   unit "head" reuses the name "block.bias" (sharded only)
 *            --reserved-name  unit "head" names a param "__metadata__" (sharded only)
 *            --skip-last   (make) the last step's grads hold inf, so it is skipped
 *            --sharding S  the strategy (default FULL_SHARD)
 *
 * Output (rank 0): one line per param, "<name> <numel> <hex bits>...". */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fsdp.h"

#define N_UNITS 3
#define MAX_PARAMS 3
#define MAX_RANKS 64

typedef struct {
  const char* name;
  size_t n;
  const char* names[MAX_PARAMS];
  int32_t ndims[MAX_PARAMS];
  int64_t dims[2 * MAX_PARAMS];
} unit_def;

/* block.bias and head.bias have 7 elements: padding inside and after units. */
static unit_def g_units[N_UNITS] = {
    {"embed", 1, {"embed.weight"}, {2}, {10, 8}},
    {"block", 3, {"block.weight", "block.bias", "block.norm"}, {2, 1, 1}, {6, 6, 7, 3}},
    {"head", 2, {"head.weight", "head.bias"}, {2, 1}, {2, 6, 7}},
};

static struct {
  int make;
  const char* dirs[2]; /* make: sharded, full; load: dir */
  int world;
  int extra_step;
  int skip_last;
  const char* optimizer;
  const char* momentum;
  const char* sharding;
  fsdp_local_group_t* group;
  int failed;
  pthread_mutex_t lock;
} g;

static size_t param_numel(const unit_def* u, size_t p) {
  size_t d = 0, n = 1, i;
  int32_t k;
  for (i = 0; i < p; ++i) d += (size_t)u->ndims[i];
  for (k = 0; k < u->ndims[p]; ++k) n *= (size_t)u->dims[d + (size_t)k];
  return n;
}

static int check(fsdp_status_t st, const char* what, int rank) {
  if (st == FSDP_OK) return 1;
  pthread_mutex_lock(&g.lock);
  fprintf(stderr, "ckpt_maker rank %d: %s: %s: %s\n", rank, what, fsdp_status_name(st), fsdp_last_error());
  g.failed = 1;
  pthread_mutex_unlock(&g.lock);
  return 0;
}

/* One training step with deterministic grads, the same on every rank. */
static int train_step(fsdp_ctx_t* ctx, fsdp_unit_t** units, int step, int poison, int rank) {
  size_t u, p, i;
  void* ptr = NULL;
  for (u = 0; u < N_UNITS; ++u) {
    if (!check(fsdp_forward_begin(units[u], NULL), "fsdp_forward_begin", rank)) return 0;
    if (!check(fsdp_forward_end(units[u], NULL), "fsdp_forward_end", rank)) return 0;
  }
  for (u = N_UNITS; u-- > 0;) {
    if (!check(fsdp_backward_begin(units[u], NULL), "fsdp_backward_begin", rank)) return 0;
    for (p = 0; p < g_units[u].n; ++p) {
      size_t n = param_numel(&g_units[u], p);
      float* gr;
      if (!check(fsdp_grad_ptr(units[u], p, &ptr), "fsdp_grad_ptr", rank)) return 0;
      gr = (float*)ptr;
      for (i = 0; i < n; ++i) gr[i] += (float)((long)((i * 13 + (size_t)step * 7 + u * 3 + p) % 17) - 8) / 16.0f;
      if (poison && u == 0 && p == 0) gr[0] = INFINITY;
    }
    if (!check(fsdp_backward_end(units[u], NULL), "fsdp_backward_end", rank)) return 0;
  }
  return check(fsdp_step(ctx, NULL), "fsdp_step", rank);
}

static void print_params(fsdp_unit_t** units, int rank) {
  size_t u, p, i;
  for (u = 0; u < N_UNITS; ++u) {
    for (p = 0; p < g_units[u].n; ++p) {
      size_t n = param_numel(&g_units[u], p);
      float* v = (float*)malloc(n * sizeof(float));
      if (v == NULL || !check(fsdp_gather_param(units[u], p, v, n), "fsdp_gather_param", rank)) {
        free(v);
        return;
      }
      if (rank == 0) {
        printf("%s %zu", g_units[u].names[p], n);
        for (i = 0; i < n; ++i) {
          uint32_t bits;
          memcpy(&bits, &v[i], sizeof bits);
          printf(" %08x", (unsigned)bits);
        }
        printf("\n");
      }
      free(v);
    }
  }
}

static void* rank_main(void* arg) {
  int rank = (int)(intptr_t)arg;
  fsdp_config_t* cfg = NULL;
  fsdp_ctx_t* ctx = NULL;
  fsdp_unit_t* units[N_UNITS] = {NULL, NULL, NULL};
  size_t u, p, i;
  int ok = check(fsdp_config_create(&cfg), "fsdp_config_create", rank);
  ok = ok && check(fsdp_config_set(cfg, "sharding", g.sharding), "fsdp_config_set sharding", rank);
  ok = ok && check(fsdp_config_set(cfg, "optimizer", g.optimizer), "fsdp_config_set optimizer", rank);
  ok = ok && check(fsdp_config_set(cfg, "momentum", g.momentum), "fsdp_config_set momentum", rank);
  ok = ok && check(fsdp_config_set(cfg, "lr", "0.01"), "fsdp_config_set lr", rank);
  ok = ok && check(fsdp_config_set(cfg, "threads", "1"), "fsdp_config_set threads", rank);
  ok = ok && check(fsdp_config_set(cfg, "timeout_s", "60"), "fsdp_config_set timeout_s", rank);
  ok = ok && check(fsdp_ctx_create(cfg, g.group, rank, &ctx), "fsdp_ctx_create", rank);
  fsdp_config_destroy(cfg);
  for (u = 0; ok && u < N_UNITS; ++u) {
    ok = check(fsdp_unit_register(ctx, g_units[u].name, g_units[u].n, g_units[u].names, g_units[u].ndims,
                                  g_units[u].dims, &units[u]),
               "fsdp_unit_register", rank);
  }
  if (ok && g.make) {
    int step;
    for (u = 0; ok && u < N_UNITS; ++u) {
      for (p = 0; ok && p < g_units[u].n; ++p) {
        size_t n = param_numel(&g_units[u], p);
        float* v = (float*)malloc(n * sizeof(float));
        if (v == NULL) {
          fprintf(stderr, "ckpt_maker rank %d: out of memory\n", rank);
          ok = 0;
          break;
        }
        for (i = 0; i < n; ++i) v[i] = (float)((long)((i * 37 + u * 11 + p * 5) % 101) - 50) / 64.0f;
        ok = check(fsdp_param_set_values(units[u], p, v, n), "fsdp_param_set_values", rank);
        free(v);
      }
    }
    for (step = 1; ok && step <= 2; ++step) ok = train_step(ctx, units, step, g.skip_last && step == 2, rank);
    if (ok && strcmp(g.dirs[0], "-") != 0) ok = check(fsdp_save(ctx, g.dirs[0], "sharded"), "fsdp_save sharded", rank);
    if (ok && strcmp(g.dirs[1], "-") != 0) ok = check(fsdp_save(ctx, g.dirs[1], "full"), "fsdp_save full", rank);
  } else if (ok) {
    ok = check(fsdp_load(ctx, g.dirs[0]), "fsdp_load", rank);
    if (ok && g.extra_step) ok = train_step(ctx, units, 3, 0, rank);
  }
  if (ok) print_params(units, rank);
  /* After a failure other ranks may be waiting in a collective: destroy
   * (local, never waits) rather than finalize. */
  if (ok) check(fsdp_ctx_finalize(ctx), "fsdp_ctx_finalize", rank);
  fsdp_ctx_destroy(ctx);
  return NULL;
}

static int usage(void) {
  fprintf(stderr,
          "usage: ckpt_maker make SHARDED_DIR FULL_DIR [options]\n"
          "       ckpt_maker load DIR WORLD [options]\n"
          "options: --step --optimizer K --momentum M --dup-names --reserved-name --skip-last --sharding S\n");
  return 2;
}

int main(int argc, char** argv) {
  pthread_t threads[MAX_RANKS];
  int r, a;
  if (argc < 4) return usage();
  memset(&g, 0, sizeof g);
  pthread_mutex_init(&g.lock, NULL);
  g.optimizer = "adamw";
  g.momentum = "0";
  g.sharding = "FULL_SHARD";
  if (strcmp(argv[1], "make") == 0) {
    g.make = 1;
    g.dirs[0] = argv[2];
    g.dirs[1] = argv[3];
    g.world = 4;
  } else if (strcmp(argv[1], "load") == 0) {
    g.dirs[0] = argv[2];
    g.world = atoi(argv[3]);
    if (g.world < 1 || g.world > MAX_RANKS) return usage();
  } else {
    return usage();
  }
  for (a = 4; a < argc; ++a) {
    if (strcmp(argv[a], "--step") == 0) {
      g.extra_step = 1;
    } else if (strcmp(argv[a], "--skip-last") == 0) {
      g.skip_last = 1;
    } else if (strcmp(argv[a], "--dup-names") == 0) {
      g_units[2].names[1] = "block.bias";
    } else if (strcmp(argv[a], "--reserved-name") == 0) {
      g_units[2].names[1] = "__metadata__";
    } else if (strcmp(argv[a], "--optimizer") == 0 && a + 1 < argc) {
      g.optimizer = argv[++a];
    } else if (strcmp(argv[a], "--sharding") == 0 && a + 1 < argc) {
      g.sharding = argv[++a];
    } else if (strcmp(argv[a], "--momentum") == 0 && a + 1 < argc) {
      g.momentum = argv[++a];
    } else {
      return usage();
    }
  }
  if (!check(fsdp_local_group_create(g.world, &g.group), "fsdp_local_group_create", -1)) return 1;
  for (r = 0; r < g.world; ++r) {
    if (pthread_create(&threads[r], NULL, rank_main, (void*)(intptr_t)r) != 0) {
      fprintf(stderr, "ckpt_maker: cannot start rank %d's thread\n", r);
      abort(); /* the started ranks would wait in a collective for it */
    }
  }
  for (r = 0; r < g.world; ++r) pthread_join(threads[r], NULL);
  fsdp_local_group_destroy(g.group);
  fflush(stdout);
  return g.failed ? 1 : 0;
}
