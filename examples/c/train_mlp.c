/* train_mlp.c - the libfsdp demo: an MLP regression trained by N ranks that are
 * threads of this process, FULL_SHARD with bf16 params, printing the loss and
 * each rank's memory, beside the loss of the same training run on 1 rank.
 *
 *   train_mlp [--ranks N] [--steps S] [--dtype bf16|fp16|fp32] [--sharding S]
 *             [--save DIR] [--resume DIR] [--check] [--trace PREFIX]
 *
 * --save DIR writes a sharded checkpoint of the N-rank run after its last step;
 * --resume DIR loads one (written at any rank count) into both runs before
 * their first step, so the N-rank and the 1-rank run go on from it; steps are
 * numbered on from the checkpoint's. --trace PREFIX writes PREFIX.rankR.json
 * (Chrome trace) of the last 2 steps.
 *
 * Started by mpirun instead, each process is one rank (comm=auto picks mpi):
 *
 *   mpirun -np 4 train_mlp [--steps S] ...   (FSDP_* variables set options, e.g. -x FSDP_OFFLOAD=cpu)
 *
 * and rank 0 prints everything: the loss of the whole batch and every rank's
 * memory, which it gets with fsdp_metrics_reduce, so output lines never mix.
 *
 * With --check it exits with status 1 unless the loss fell at least 4x (after
 * --resume: did not rise) and the N-rank loss stays within 20% of the 1-rank
 * loss (bf16 rounds each rank's grads separately, so the two runs are close,
 * not identical).
 *
 * The model code below is what a host framework provides: forward and backward
 * of Linear+tanh layers by hand. libfsdp owns the parameters, gradients,
 * optimizer state and the collectives. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fsdp.h"

#define N_LAYERS 4
#define MAX_RANKS 16
static const int kDims[N_LAYERS + 1] = {32, 256, 256, 256, 8};
#define GLOBAL_BATCH 64

typedef struct {
  int ranks, steps, print_every, check;
  const char *dtype, *sharding, *trace, *save, *resume;
} options_t;

/* What every rank reports to rank 0 (through fsdp_metrics_reduce). */
enum { MEM_PARAMS, MEM_GRADS, MEM_OPTIM, MEM_GATHERED_PEAK, MEM_TOTAL_PEAK, MEM_DEVICE_PEAK, MEM_HOST_PEAK, N_MEM };

typedef struct {
  options_t opt;
  int world, rank; /* rank -1: this process is one rank of an mpirun job (group NULL) */
  fsdp_local_group_t* group;
  double* losses; /* [steps] loss of the whole batch, written by rank 0 */
  double* mem;    /* [world][N_MEM] every rank's memory in bytes, written by rank 0 */
  int failed;
} job_t;

/* The strategy and dtype in effect (FSDP_* variables may override the flags),
 * and the step the runs started from (after --resume: the checkpoint's). */
static char g_sharding[32], g_dtype[16];
static long g_first_step;

#define CHECK(call)                                                                                                \
  do {                                                                                                             \
    fsdp_status_t st_ = (call);                                                                                    \
    if (st_ != FSDP_OK) {                                                                                          \
      fprintf(stderr, "rank %d: %s failed: %s: %s\n", job->rank, #call, fsdp_status_name(st_), fsdp_last_error()); \
      job->failed = 1;                                                                                             \
      return NULL;                                                                                                 \
    }                                                                                                              \
  } while (0)

/* ---- bf16/fp16 <-> fp32, round to nearest even (the host's own code) ---- */
static float bits_to_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static uint32_t f32_to_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static float half_to_f32(uint16_t h, fsdp_dtype_t t) {
  if (t == FSDP_DTYPE_BF16) return bits_to_f32((uint32_t)h << 16);
  { /* fp16 */
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f) return bits_to_f32(s | 0x7f800000u | (m << 13));
    if (e) return bits_to_f32(s | ((e + 112u) << 23) | (m << 13));
    return (s ? -1.0f : 1.0f) * (float)m * 5.9604644775390625e-08f;
  }
}
static uint16_t f32_to_half(float f, fsdp_dtype_t t) {
  if (t == FSDP_DTYPE_BF16) {
    uint32_t u = f32_to_bits(f);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  { /* fp16 via the nearest representable value; the demo's values are normal */
    uint32_t u = f32_to_bits(f), s = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a >= 0x477ff000u) return (uint16_t)(s | 0x7c00u);
    if (a < 0x38800000u) return (uint16_t)(s | (uint32_t)lrintf(bits_to_f32(a) * 16777216.0f));
    a -= 0x38000000u;
    return (uint16_t)(s | ((a + 0xfffu + ((a >> 13) & 1u)) >> 13));
  }
}
static float load(const void* p, size_t i, fsdp_dtype_t t) {
  return t == FSDP_DTYPE_FP32 ? ((const float*)p)[i] : half_to_f32(((const uint16_t*)p)[i], t);
}
static void add_to(void* p, size_t i, float v, fsdp_dtype_t t) {
  if (t == FSDP_DTYPE_FP32)
    ((float*)p)[i] += v;
  else
    ((uint16_t*)p)[i] = f32_to_half(load(p, i, t) + v, t);
}

/* The optimizer step a checkpoint was saved at: "step" in the "optimizer"
 * object of DIR/fsdp_checkpoint.json (docs/checkpoints.md). A C host without
 * a JSON parser can find it with strstr; -1 if it cannot. */
static long checkpoint_step(const char* dir) {
  char path[1024], text[65536], *opt, *step;
  size_t n;
  FILE* f;
  snprintf(path, sizeof path, "%s/fsdp_checkpoint.json", dir);
  if (!(f = fopen(path, "rb"))) return -1;
  n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  text[n] = '\0';
  if (!(opt = strstr(text, "\"optimizer\"")) || !(step = strstr(opt, "\"step\":"))) return -1;
  return strtol(step + 7, NULL, 10);
}

/* ---- deterministic data: inputs and targets from a fixed teacher ---- */
static float uniform(uint64_t* state) { /* splitmix64 -> [-1, 1) */
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return (float)((double)(z >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}
static float g_x[GLOBAL_BATCH][32], g_y[GLOBAL_BATCH][8];
static void make_data(void) {
  int b, i, o;
  uint64_t rng = 42;
  for (b = 0; b < GLOBAL_BATCH; ++b) {
    for (i = 0; i < 32; ++i) g_x[b][i] = uniform(&rng);
    for (o = 0; o < 8; ++o) { /* a smooth target the MLP can fit */
      float s = 0.0f;
      for (i = 0; i < 32; ++i) s += g_x[b][i] * sinf((float)(o * 32 + i));
      g_y[b][o] = tanhf(0.3f * s);
    }
  }
}

static void* train(void* arg) {
  job_t* job = (job_t*)arg;
  fsdp_config_t* cfg = NULL;
  fsdp_ctx_t* ctx = NULL;
  fsdp_unit_t* units[N_LAYERS];
  fsdp_dtype_t dt;
  int l, step, rows, row0, is_root;
  double* mem_all;
  fsdp_memory_stats_t m;
  float *act[N_LAYERS + 1], *dact[N_LAYERS + 1];

  CHECK(fsdp_config_create(&cfg));
  CHECK(fsdp_config_set(cfg, "sharding", job->opt.sharding));
  CHECK(fsdp_config_set(cfg, "param_dtype", job->opt.dtype));
  CHECK(fsdp_config_set(cfg, "reduce_dtype", "fp32"));
  CHECK(fsdp_config_set(cfg, "optimizer", "adamw"));
  CHECK(fsdp_config_set(cfg, "lr", "3e-3"));
  CHECK(fsdp_config_set(cfg, "weight_decay", "0.01"));
  CHECK(fsdp_config_set(cfg, "no_weight_decay", "*bias"));
  CHECK(fsdp_config_set(cfg, "max_grad_norm", "1.0"));
  CHECK(fsdp_config_from_env(cfg)); /* FSDP_* variables override the above */
  if (job->rank <= 0) {
    CHECK(fsdp_config_get(cfg, "sharding", g_sharding, sizeof g_sharding, NULL));
    CHECK(fsdp_config_get(cfg, "param_dtype", g_dtype, sizeof g_dtype, NULL));
  }
  CHECK(fsdp_ctx_create(cfg, job->group, job->rank, &ctx));
  fsdp_config_destroy(cfg);
  is_root = job->rank <= 0; /* thread-rank 0, or rank 0's process (checked below) */
  CHECK(fsdp_ctx_param_dtype(ctx, &dt));
  CHECK(fsdp_ctx_rank(ctx, &job->rank));
  CHECK(fsdp_ctx_world_size(ctx, &job->world));
  is_root = job->rank == 0;
  if (GLOBAL_BATCH % job->world) {
    fprintf(stderr, "rank %d: the world size %d must divide the batch of %d\n", job->rank, job->world, GLOBAL_BATCH);
    job->failed = 1;
    return NULL;
  }
  rows = GLOBAL_BATCH / job->world;
  row0 = job->rank * rows;

  for (l = 0; l < N_LAYERS; ++l) { /* one unit per layer: W [out, in], bias [out] */
    const char* names[2] = {"weight", "bias"};
    int32_t ndims[2] = {2, 1};
    int64_t dims[3];
    char name[32];
    int in = kDims[l], out = kDims[l + 1];
    size_t i;
    float *w = malloc(sizeof(float) * (size_t)(in * out)), *b = calloc((size_t)out, sizeof(float));
    dims[0] = out;
    dims[1] = in;
    dims[2] = out;
    snprintf(name, sizeof name, "layer%d", l);
    CHECK(fsdp_unit_register(ctx, name, 2, names, ndims, dims, &units[l]));
    uint64_t rng = 1000 + (uint64_t)l; /* same init on every rank and in the 1-rank run */
    for (i = 0; i < (size_t)(in * out); ++i) w[i] = uniform(&rng) * sqrtf(3.0f / (float)in);
    CHECK(fsdp_param_set_values(units[l], 0, w, (size_t)(in * out)));
    CHECK(fsdp_param_set_values(units[l], 1, b, (size_t)out));
    free(w);
    free(b);
  }
  if (job->opt.resume) CHECK(fsdp_load(ctx, job->opt.resume)); /* any rank count; params, AdamW state, step */
  for (l = 0; l <= N_LAYERS; ++l) {
    act[l] = calloc((size_t)(rows * kDims[l]), sizeof(float));
    dact[l] = calloc((size_t)(rows * kDims[l]), sizeof(float));
  }

  for (step = 0; step < job->opt.steps; ++step) {
    double loss = 0.0, loss_scale = 1.0;
    uint64_t skipped = 0;
    int r, i, o;
    if (job->opt.trace && step == job->opt.steps - 2) CHECK(fsdp_trace_begin(ctx));
    /* fp16 grads are computed for loss * scale (1 unless loss scaling is on). */
    CHECK(fsdp_loss_scale(ctx, &loss_scale, &skipped));
    memcpy(act[0], &g_x[row0][0], sizeof(float) * (size_t)(rows * 32));
    for (l = 0; l < N_LAYERS; ++l) { /* forward: a = tanh(W a + b), linear last layer */
      void *w, *b;
      int in = kDims[l], out = kDims[l + 1];
      CHECK(fsdp_forward_begin(units[l], NULL));
      CHECK(fsdp_param_ptr(units[l], 0, &w));
      CHECK(fsdp_param_ptr(units[l], 1, &b));
      for (r = 0; r < rows; ++r)
        for (o = 0; o < out; ++o) {
          float s = load(b, (size_t)o, dt);
          for (i = 0; i < in; ++i) s += load(w, (size_t)(o * in + i), dt) * act[l][r * in + i];
          act[l + 1][r * out + o] = l + 1 < N_LAYERS ? tanhf(s) : s;
        }
      CHECK(fsdp_forward_end(units[l], NULL));
    }
    for (r = 0; r < rows; ++r) /* loss = mean over rows of sum of squared errors / 2 */
      for (o = 0; o < 8; ++o) {
        float d = act[N_LAYERS][r * 8 + o] - g_y[row0 + r][o];
        loss += 0.5 * d * d / rows;
        dact[N_LAYERS][r * 8 + o] = (float)(d * loss_scale / rows);
      }
    for (l = N_LAYERS - 1; l >= 0; --l) { /* backward */
      void *w, *gw, *gb;
      int in = kDims[l], out = kDims[l + 1];
      CHECK(fsdp_backward_begin(units[l], NULL));
      CHECK(fsdp_param_ptr(units[l], 0, &w));
      CHECK(fsdp_grad_ptr(units[l], 0, &gw));
      CHECK(fsdp_grad_ptr(units[l], 1, &gb));
      memset(dact[l], 0, sizeof(float) * (size_t)(rows * in));
      for (o = 0; o < out; ++o) {
        float gbo = 0.0f, *gwo = calloc((size_t)in, sizeof(float));
        for (r = 0; r < rows; ++r) {
          float d = dact[l + 1][r * out + o];
          if (l + 1 < N_LAYERS) d *= 1.0f - act[l + 1][r * out + o] * act[l + 1][r * out + o];
          gbo += d;
          for (i = 0; i < in; ++i) {
            gwo[i] += d * act[l][r * in + i];
            dact[l][r * in + i] += d * load(w, (size_t)(o * in + i), dt);
          }
        }
        add_to(gb, (size_t)o, gbo, dt);
        for (i = 0; i < in; ++i) add_to(gw, (size_t)(o * in + i), gwo[i], dt);
        free(gwo);
      }
      CHECK(fsdp_backward_end(units[l], NULL));
    }
    CHECK(fsdp_step(ctx, NULL));
    /* Every rank's rows weigh the same: the batch's loss is the mean of the ranks'. */
    CHECK(fsdp_metrics_reduce(ctx, &loss, 1, FSDP_REDUCE_AVG));
    if (is_root) job->losses[step] = loss;
  }
  if (job->opt.trace) {
    char path[512];
    snprintf(path, sizeof path, "%s.rank%d.json", job->opt.trace, job->rank);
    CHECK(fsdp_trace_write(ctx, path));
  }
  if (job->opt.save) CHECK(fsdp_save(ctx, job->opt.save, "sharded"));
  /* Rank 0 learns every rank's memory: each fills its own row, the sum fills all. */
  memset(&m, 0, sizeof m);
  m.struct_size = sizeof m;
  CHECK(fsdp_memory_stats(ctx, &m));
  mem_all = calloc((size_t)job->world * N_MEM, sizeof(double));
  {
    double* mine = mem_all + (size_t)job->rank * N_MEM;
    mine[MEM_PARAMS] = (double)m.sharded_params_nbytes;
    mine[MEM_GRADS] = (double)m.sharded_grads_nbytes;
    mine[MEM_OPTIM] = (double)m.optimizer_state_nbytes;
    mine[MEM_GATHERED_PEAK] = (double)m.gathered_params_peak_nbytes;
    mine[MEM_TOTAL_PEAK] = (double)m.total_peak_nbytes;
    mine[MEM_DEVICE_PEAK] = (double)m.device_peak_nbytes;
    mine[MEM_HOST_PEAK] = (double)m.host_peak_nbytes;
  }
  CHECK(fsdp_metrics_reduce(ctx, mem_all, (size_t)job->world * N_MEM, FSDP_REDUCE_SUM));
  if (is_root) memcpy(job->mem, mem_all, sizeof(double) * (size_t)job->world * N_MEM);
  free(mem_all);
  CHECK(fsdp_ctx_finalize(ctx));
  fsdp_ctx_destroy(ctx);
  for (l = 0; l <= N_LAYERS; ++l) {
    free(act[l]);
    free(dact[l]);
  }
  return NULL;
}

/* Runs the job on `world` thread-ranks (world 0: this process is one rank of
 * an mpirun job); rank 0 fills losses[steps] and mem[world][N_MEM]. Returns 0
 * on success. */
static int run(const options_t* opt, int world, double* losses, double* mem) {
  int launched = world == 0;
  pthread_t threads[MAX_RANKS];
  job_t jobs[MAX_RANKS];
  fsdp_local_group_t* group = NULL;
  int r, n = launched ? 1 : world, failed = 0;
  if (!launched && fsdp_local_group_create(world, &group) != FSDP_OK) {
    fprintf(stderr, "fsdp_local_group_create: %s\n", fsdp_last_error());
    return 1;
  }
  for (r = 0; r < n; ++r) {
    memset(&jobs[r], 0, sizeof jobs[r]);
    jobs[r].opt = *opt;
    jobs[r].world = world;
    jobs[r].rank = launched ? -1 : r;
    jobs[r].group = group;
    jobs[r].losses = losses;
    jobs[r].mem = mem;
    if (pthread_create(&threads[r], NULL, train, &jobs[r]) != 0) {
      fprintf(stderr, "pthread_create failed\n");
      return 1;
    }
  }
  for (r = 0; r < n; ++r) {
    pthread_join(threads[r], NULL);
    failed |= jobs[r].failed;
  }
  fsdp_local_group_destroy(group);
  return failed;
}

static double mib(size_t n) { return (double)n / (1024.0 * 1024.0); }

/* The size of the job a launcher (mpirun, srun) started this process in (0:
 * not started by one), and this process's rank in it. */
static int launcher_world(void) {
  int world = -1;
  return fsdp_launcher(NULL, &world, NULL, NULL) == FSDP_OK && world > 0 ? world : 0;
}
static int launcher_rank(void) {
  int rank = -1;
  return fsdp_launcher(&rank, NULL, NULL, NULL) == FSDP_OK && rank > 0 ? rank : 0;
}

static void print_loss_legend(void) {
  printf(
      "step: optimizer step (after --resume: numbered on from the checkpoint's); loss: 0.5 * squared error\n"
      "summed over the 8 outputs, mean over the %d rows, in the step's forward (before its update)\n",
      GLOBAL_BATCH);
}
static void print_memory_header(void) {
  printf(
      "\nper-rank memory in MiB: params = this rank's param shard (fp32 master, and a param_dtype copy where kept);\n"
      "grads = its fp32 grad shard; optim = its AdamW state (m, v); gathered-peak = the most held by full\n"
      "params gathered for forward and backward; total-peak = the most this rank held at once, all included,\n"
      "split into device / host peaks (host memory only with offload=cpu)\n");
  printf("%-26s %7s %7s %7s  %13s  %10s  %s\n", "", "params", "grads", "optim", "gathered-peak", "total-peak",
         "(device / host)");
}
static void print_memory(const char* who, const double* m) {
  printf("  %-24s %7.3f %7.3f %7.3f  %13.3f  %10.3f  (%.3f / %.3f)\n", who, mib((size_t)m[MEM_PARAMS]),
         mib((size_t)m[MEM_GRADS]), mib((size_t)m[MEM_OPTIM]), mib((size_t)m[MEM_GATHERED_PEAK]),
         mib((size_t)m[MEM_TOTAL_PEAK]), mib((size_t)m[MEM_DEVICE_PEAK]), mib((size_t)m[MEM_HOST_PEAK]));
}

/* --check: the loss fell at least 4x (after --resume: it did not rise). */
static int loss_fell(const options_t* opt, const double* losses) {
  double first = losses[0], last = losses[opt->steps - 1];
  return opt->resume ? !(last > first) : last * 4.0 < first;
}

/* One rank of an mpirun job: rank 0 prints everything, the others nothing. */
static int run_launched(const options_t* opt, int world) {
  double* losses = calloc((size_t)opt->steps, sizeof(double));
  double* mem = calloc((size_t)world * N_MEM, sizeof(double));
  int rank = launcher_rank(), s, r, rc = 0;
  if (run(opt, 0, losses, mem)) return 1;
  if (rank == 0) {
    printf("%s\nMLP %d-%d-%d-%d-%d, %d units, global batch %d over %d processes (mpirun or srun), %s, param_dtype %s, AdamW\n",
           fsdp_build_info(), kDims[0], kDims[1], kDims[2], kDims[3], kDims[4], N_LAYERS, GLOBAL_BATCH, world,
           g_sharding, g_dtype);
    if (opt->resume) printf("resumed from %s at step %ld\n", opt->resume, g_first_step);
    printf("\n");
    print_loss_legend();
    printf("%6s  %12s\n", "step", "loss");
    for (s = 0; s < opt->steps; ++s)
      if (s % opt->print_every == 0 || s == opt->steps - 1) printf("%6ld  %12.6f\n", g_first_step + s + 1, losses[s]);
    print_memory_header();
    for (r = 0; r < world; ++r) {
      char who[64];
      snprintf(who, sizeof who, "rank %d of %d", r, world);
      print_memory(who, mem + (size_t)r * N_MEM);
    }
    if (opt->save) printf("\nsaved a sharded checkpoint of step %ld to %s\n", g_first_step + opt->steps, opt->save);
    fflush(stdout);
    if (opt->check && !loss_fell(opt, losses)) {
      fprintf(stderr, "check failed: loss %g -> %g\n", losses[0], losses[opt->steps - 1]);
      rc = 1;
    }
  }
  free(losses);
  free(mem);
  return rc;
}

int main(int argc, char** argv) {
  options_t opt = {4, 60, 10, 0, "bf16", "FULL_SHARD", NULL, NULL, NULL}, one;
  double *loss_n, *loss_1, *mem_n, *mem_1;
  int a, s, r, bad = 0;
  for (a = 1; a < argc && !bad; ++a) {
    const char* v = a + 1 < argc ? argv[a + 1] : NULL;
    if (!strcmp(argv[a], "--check")) {
      opt.check = 1;
      continue;
    }
    if (v == NULL) {
      bad = 1;
    } else if (!strcmp(argv[a], "--ranks")) {
      opt.ranks = atoi(v);
    } else if (!strcmp(argv[a], "--steps")) {
      opt.steps = atoi(v);
    } else if (!strcmp(argv[a], "--dtype")) {
      opt.dtype = v;
    } else if (!strcmp(argv[a], "--sharding")) {
      opt.sharding = v;
    } else if (!strcmp(argv[a], "--save")) {
      opt.save = v;
    } else if (!strcmp(argv[a], "--resume")) {
      opt.resume = v;
    } else if (!strcmp(argv[a], "--trace")) {
      opt.trace = v;
    } else {
      bad = 1;
    }
    ++a; /* the value */
  }
  if (bad || opt.ranks < 1 || opt.ranks > MAX_RANKS || GLOBAL_BATCH % opt.ranks || opt.steps < 1) {
    fprintf(stderr,
            "usage: %s [--ranks N (divides %d, <= %d)] [--steps S] [--dtype bf16|fp16|fp32]\n"
            "       [--sharding FULL_SHARD|SHARD_GRAD_OP|NO_SHARD|HYBRID_SHARD|HYBRID_SHARD_ZERO2]\n"
            "       [--save DIR] [--resume DIR] [--check] [--trace PREFIX]\n",
            argv[0], GLOBAL_BATCH, MAX_RANKS);
    return 2;
  }
  make_data();
  if (opt.resume) g_first_step = checkpoint_step(opt.resume) > 0 ? checkpoint_step(opt.resume) : 0;
  if (launcher_world() > 1) return run_launched(&opt, launcher_world());
  loss_n = calloc((size_t)opt.steps, sizeof(double));
  loss_1 = calloc((size_t)opt.steps, sizeof(double));
  mem_n = calloc((size_t)opt.ranks * N_MEM, sizeof(double));
  mem_1 = calloc(N_MEM, sizeof(double));
  one = opt; /* the 1-rank run beside it: same data, same start, writes nothing */
  one.save = NULL;
  one.trace = NULL;
  if (run(&opt, opt.ranks, loss_n, mem_n) || run(&one, 1, loss_1, mem_1)) return 1;
  printf("%s\nMLP %d-%d-%d-%d-%d, %d units, global batch %d, %s, param_dtype %s, AdamW\n", fsdp_build_info(), kDims[0],
         kDims[1], kDims[2], kDims[3], kDims[4], N_LAYERS, GLOBAL_BATCH, g_sharding, g_dtype);
  if (opt.resume) printf("both runs resumed from %s at step %ld\n", opt.resume, g_first_step);
  printf("\n");
  print_loss_legend();
  printf("loss (N ranks): %d thread-ranks, each on %d rows; loss (1 rank): the same training unsharded on one rank\n",
         opt.ranks, GLOBAL_BATCH / opt.ranks);
  printf("%6s  %14s  %14s\n", "step", "loss (N ranks)", "loss (1 rank)");
  for (s = 0; s < opt.steps; ++s)
    if (s % opt.print_every == 0 || s == opt.steps - 1)
      printf("%6ld  %14.6f  %14.6f\n", g_first_step + s + 1, loss_n[s], loss_1[s]);
  print_memory_header();
  for (r = 0; r < opt.ranks; ++r) {
    char who[64];
    snprintf(who, sizeof who, "rank %d of %d", r, opt.ranks);
    print_memory(who, mem_n + (size_t)r * N_MEM);
  }
  print_memory("1-rank run", mem_1);
  if (opt.save) printf("\nsaved a sharded checkpoint of step %ld to %s\n", g_first_step + opt.steps, opt.save);
  s = opt.steps - 1;
  if (opt.check && (!loss_fell(&opt, loss_n) || fabs(loss_n[s] - loss_1[s]) > 0.2 * loss_1[s])) {
    fprintf(stderr, "check failed: loss %g -> %g on %d ranks, %g on 1 rank\n", loss_n[0], loss_n[s], opt.ranks,
            loss_1[s]);
    return 1;
  }
  free(loss_n);
  free(loss_1);
  free(mem_n);
  free(mem_1);
  return 0;
}
