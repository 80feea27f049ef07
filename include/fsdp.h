/* fsdp.h - the public C ABI of libfsdp: fully sharded data parallel training
 * (ZeRO-3) for any language. C99, no CUDA/MPI types, opaque handles only.
 *
 * A training step, as a host framework drives it:
 *
 *   for unit in forward order:  fsdp_forward_begin(unit, stream)
 *                               ... compute with fsdp_param_ptr(unit, i) ...
 *                               fsdp_forward_end(unit, stream)
 *   for unit in reverse order:  fsdp_backward_begin(unit, stream)
 *                               ... add grads into fsdp_grad_ptr(unit, i) ...
 *                               fsdp_backward_end(unit, stream)
 *   fsdp_step(ctx, stream)
 *
 * Every function returns fsdp_status_t; on failure fsdp_last_error() gives a
 * sentence (thread-local) saying what went wrong and what was expected. A
 * failed call changes nothing unless its documentation says otherwise.
 * Functions marked "collective" must be called by every rank of the context,
 * in the same order. */
#ifndef FSDP_H
#define FSDP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define FSDP_API __declspec(dllexport)
#elif defined(__GNUC__)
#define FSDP_API __attribute__((visibility("default")))
#else
#define FSDP_API
#endif

#define FSDP_VERSION_MAJOR 0
#define FSDP_VERSION_MINOR 1
#define FSDP_VERSION_PATCH 0
/* MAJOR * 10000 + MINOR * 100 + PATCH */
#define FSDP_VERSION_NUMBER (FSDP_VERSION_MAJOR * 10000 + FSDP_VERSION_MINOR * 100 + FSDP_VERSION_PATCH)

/* ---- errors ------------------------------------------------------------ */

typedef enum fsdp_status {
  FSDP_OK = 0,
  FSDP_ERR_INVALID_ARGUMENT = 1, /* NULL pointer, bad index, bad key or value */
  FSDP_ERR_INVALID_STATE = 2,    /* call out of order, or after finalize */
  FSDP_ERR_UNSUPPORTED = 3,      /* option not available in this build */
  FSDP_ERR_OUT_OF_MEMORY = 4,
  FSDP_ERR_TIMEOUT = 5,  /* a rank did not join a collective in time */
  FSDP_ERR_MISMATCH = 6, /* ranks disagree (registration, call order) */
  FSDP_ERR_COMM = 7,     /* the communicator failed or was aborted */
  FSDP_ERR_CORRUPT = 8,  /* a checkpoint failed its checks */
  FSDP_ERR_IO = 9,       /* a file could not be read or written */
  FSDP_ERR_INTERNAL = 10 /* a bug in libfsdp: please report it */
} fsdp_status_t;

/* Name of a status ("FSDP_ERR_TIMEOUT"); never NULL. */
FSDP_API const char* fsdp_status_name(fsdp_status_t status);
/* The message of the last failed call on this thread ("" if none yet). The
 * pointer stays valid until the next failed libfsdp call on this thread. */
FSDP_API const char* fsdp_last_error(void);

/* ---- logging ----------------------------------------------------------- */

typedef enum fsdp_log_level {
  FSDP_LOG_ERROR = 0,
  FSDP_LOG_WARN = 1,
  FSDP_LOG_INFO = 2,
  FSDP_LOG_DEBUG = 3
} fsdp_log_level_t;

/* Receives every enabled message; `rank` is -1 for messages of no rank. May be
 * called from any thread, one call at a time. */
typedef void (*fsdp_log_fn)(fsdp_log_level_t level, int rank, const char* message, void* user);

/* Process-wide. By default messages up to FSDP_LOG_LEVEL (error|warn|info|debug,
 * default warn) go to stderr as "[fsdp rank R level] message". */
FSDP_API fsdp_status_t fsdp_log_set_level(int level); /* an fsdp_log_level_t */
/* fn NULL restores stderr. */
FSDP_API fsdp_status_t fsdp_log_set_callback(fsdp_log_fn fn, void* user);

/* ---- version ----------------------------------------------------------- */

/* FSDP_VERSION_NUMBER of the loaded library. */
FSDP_API int fsdp_version(void);
/* One line naming the version and the compiled-in devices and communicators,
 * e.g. "libfsdp 0.1.0 devices=cpu comms=local". */
FSDP_API const char* fsdp_build_info(void);

/* ---- handles ----------------------------------------------------------- */

typedef struct fsdp_config fsdp_config_t;
typedef struct fsdp_ctx fsdp_ctx_t;
typedef struct fsdp_unit fsdp_unit_t;
typedef struct fsdp_local_group fsdp_local_group_t;

typedef enum fsdp_dtype { FSDP_DTYPE_FP32 = 0, FSDP_DTYPE_BF16 = 1, FSDP_DTYPE_FP16 = 2 } fsdp_dtype_t;

/* ---- configuration ----------------------------------------------------- */
/* Options are key/value strings. The keys, values and defaults are listed in
 * docs/configuration.md; fsdp_config_set rejects an unknown key or a bad value
 * with a message listing the valid choices. */

FSDP_API fsdp_status_t fsdp_config_create(fsdp_config_t** out);
FSDP_API void fsdp_config_destroy(fsdp_config_t* cfg); /* accepts NULL */
FSDP_API fsdp_status_t fsdp_config_set(fsdp_config_t* cfg, const char* key, const char* value);
/* Copies the canonical value of `key` (with its terminating NUL) into
 * `value`, which holds `value_nbytes` bytes. If `value_len` is not NULL it
 * receives the length without the NUL, also when the buffer is too small
 * (then FSDP_ERR_INVALID_ARGUMENT and nothing is written). */
FSDP_API fsdp_status_t fsdp_config_get(const fsdp_config_t* cfg, const char* key, char* value, size_t value_nbytes,
                                       size_t* value_len);
/* Applies every FSDP_<KEY> environment variable whose KEY (upper case) names
 * an option, e.g. FSDP_SHARDING=SHARD_GRAD_OP. Environment values override
 * values already set. Other FSDP_* variables are not options and are left
 * alone. On a bad value nothing is changed. */
FSDP_API fsdp_status_t fsdp_config_from_env(fsdp_config_t* cfg);

/* ---- processes a launcher starts ----------------------------------------- */

/* Local. Where a launcher put this process, as comm=auto and comm=mpi read
 * it: mpirun (OMPI_COMM_WORLD_*), MPICH (PMI_RANK, PMI_SIZE), or Slurm's srun
 * (SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID and this node's count
 * in SLURM_STEP_TASKS_PER_NODE; only inside a job step: a batch script is
 * not one), in that order. *rank and *world are -1 when no launcher started
 * this process; *local_rank and *local_world -1 when it does not say. Any
 * pointer may be NULL. A malformed variable is FSDP_ERR_INVALID_ARGUMENT
 * naming it. (torchrun's RANK and WORLD_SIZE are comm=nccl's and not read here.) */
FSDP_API fsdp_status_t fsdp_launcher(int* rank, int* world, int* local_rank, int* local_world);

/* ---- processes a host starts itself (comm=nccl) ------------------------- */

/* Bytes fsdp_comm_id_create writes: 256 hex digits and a NUL. */
#define FSDP_COMM_ID_NBYTES 257

/* A new id for ranks that a host starts and connects itself (no torchrun or
 * mpirun): call it on one process, send the text to every process over the
 * host's own channel, and on each set comm=nccl, comm_id=<the text> and
 * world_size=<the number of processes>, then fsdp_ctx_create(cfg, NULL,
 * <this process's rank>, &ctx). `out` receives FSDP_COMM_ID_NBYTES bytes
 * (`out_nbytes` must be at least that). An NCCL unique id: the process that
 * made it listens for the others until the communicator forms.
 * FSDP_ERR_UNSUPPORTED in a build without NCCL (fsdp_build_info). */
FSDP_API fsdp_status_t fsdp_comm_id_create(char* out, size_t out_nbytes);

/* ---- in-process ranks --------------------------------------------------- */

/* A group of `world_size` ranks living as threads of this process (the
 * `local` communicator). Each thread creates its own context on the group. */
FSDP_API fsdp_status_t fsdp_local_group_create(int world_size, fsdp_local_group_t** out);
/* Accepts NULL. The group's memory lives until its last context is
 * destroyed, so the order of destroy calls does not matter. */
FSDP_API void fsdp_local_group_destroy(fsdp_local_group_t* group);
/* For when one thread-rank fails and the others must not wait out timeout_s
 * for it. Every collective of every context on the group (its HYBRID_SHARD
 * sub-groups included), in progress or to come, fails at once with
 * FSDP_ERR_COMM and a message that carries `reason` (NULL is allowed), and
 * fsdp_ctx_create on the group fails from then on. Contexts can still be
 * destroyed. The group cannot be used again. Local: callable from any thread,
 * while other threads wait in collectives; a second call changes nothing. */
FSDP_API fsdp_status_t fsdp_local_group_abort(fsdp_local_group_t* group, const char* reason);

/* ---- context ------------------------------------------------------------ */

/* Collective. One rank's view of the job. With comm=local, `group` and `rank`
 * say which in-process rank this is (group NULL means a world of one, rank 0).
 * With comm=mpi (or comm=auto in a process started by mpirun, see
 * docs/launching.md) the ranks are processes: pass group NULL and rank -1 (or
 * the launcher's rank, which is then checked). The config is copied: later
 * changes to `cfg` do not affect the context. */
FSDP_API fsdp_status_t fsdp_ctx_create(const fsdp_config_t* cfg, fsdp_local_group_t* group, int rank, fsdp_ctx_t** out);
/* Collective. Waits for outstanding collectives on every rank; afterwards
 * every call on the context except fsdp_ctx_destroy is
 * FSDP_ERR_INVALID_STATE. */
FSDP_API fsdp_status_t fsdp_ctx_finalize(fsdp_ctx_t* ctx);
/* Local, never waits for other ranks, accepts NULL, safe from a garbage
 * collector's finalizer. Frees the context and all its units. */
FSDP_API void fsdp_ctx_destroy(fsdp_ctx_t* ctx);
FSDP_API fsdp_status_t fsdp_ctx_rank(const fsdp_ctx_t* ctx, int* rank);
FSDP_API fsdp_status_t fsdp_ctx_world_size(const fsdp_ctx_t* ctx, int* world_size);
/* The dtype of the buffers behind fsdp_param_ptr / fsdp_grad_ptr. */
FSDP_API fsdp_status_t fsdp_ctx_param_dtype(const fsdp_ctx_t* ctx, fsdp_dtype_t* dtype);
/* A failure found after the call that caused it returned: a collective that
 * failed on the comm side, or work queued on one of the context's streams
 * (the comm and copy streams, the host streams passed to the calls) that
 * failed or waited for another stream longer than timeout_s. FSDP_OK if none.
 * Never blocks. Once set it stays set: the job should be restarted from a
 * checkpoint. */
FSDP_API fsdp_status_t fsdp_ctx_async_error(const fsdp_ctx_t* ctx);

/* ---- units --------------------------------------------------------------- */

/* Collective. Registers a unit of `n_params` parameters: names[i] with
 * ndims[i] dimensions, all dims concatenated in `dims` (row-major shapes).
 * Lays the unit out flat, allocates this rank's shard (values zero) and checks
 * that every rank registered the same unit (name, param names, shapes) at the
 * same position; a difference fails on every rank with FSDP_ERR_MISMATCH and
 * a message naming the first difference. The unit belongs to the context. */
FSDP_API fsdp_status_t fsdp_unit_register(fsdp_ctx_t* ctx, const char* name, size_t n_params, const char* const* names,
                                          const int32_t* ndims, const int64_t* dims, fsdp_unit_t** out);
/* torch.nn.utils.clip_grad_norm_ for libfsdp's own optimizer: after the
 * step's last backward, before its fsdp_step. Collective. Waits for every
 * reduction and gives the global L2 norm of the grads over all ranks in
 * `*total_norm` (unscaled by the loss scale, as fsdp_last_grad_norm; a host
 * wait), and the coming fsdp_step alone multiplies the grads by
 * max_norm / (norm + 1e-6) where that is below 1, after the max_grad_norm
 * option's clip if one is set. A non-finite norm changes nothing (the step
 * skips). max_norm must be finite and > 0 (else FSDP_ERR_INVALID_ARGUMENT);
 * with optimizer=host it is FSDP_ERR_INVALID_STATE (fsdp_step_begin gives
 * the norm and the host scales the grads). The max_grad_norm option does the
 * same inside fsdp_step without a host wait: the fast path. */
FSDP_API fsdp_status_t fsdp_clip_grad_norm(fsdp_ctx_t* ctx, void* stream, double max_norm, double* total_norm);
/* fsdp_unit_register with each param's trainable flag from the start
 * (`trainable` NULL: all 1): a param registered 0 is frozen as by
 * fsdp_param_set_trainable, and a unit whose params are all 0 as by
 * fsdp_unit_set_trainable, but no grad or optimizer memory is ever allocated
 * for them (a frozen base of a fine-tuning run never costs its grads). The
 * flags are part of what the ranks must agree on. */
FSDP_API fsdp_status_t fsdp_unit_register_trainable(fsdp_ctx_t* ctx, const char* name, size_t n_params,
                                                    const char* const* names, const int32_t* ndims,
                                                    const int64_t* dims, const int32_t* trainable,
                                                    fsdp_unit_t** out);
/* Sets param `param_index` from a full fp32 host tensor of `numel` elements;
 * this rank keeps only its slice. Local, unless sync_module_states=1: then
 * collective, rank 0's `values` are used on every rank and the other ranks
 * may pass NULL. Only while the unit is not in use. */
FSDP_API fsdp_status_t fsdp_param_set_values(fsdp_unit_t* unit, size_t param_index, const float* values, size_t numel);
/* Weight decay for one param, overriding the context's weight_decay and the
 * no_weight_decay patterns (use 0 for biases and norms). */
FSDP_API fsdp_status_t fsdp_param_set_weight_decay(fsdp_unit_t* unit, size_t param_index, double weight_decay);
/* Freezes (trainable 0) or unfreezes (1) a unit of `ctx`: a frozen unit keeps
 * no grad shard and no optimizer state and reduces nothing; its backward
 * bracket still gathers the params (for the grads of its inputs), and
 * fsdp_grad_ptr / fsdp_gather_grad on it are FSDP_ERR_INVALID_STATE; fsdp_step
 * leaves its params as they are. Unfreezing gives it zero grads and fresh
 * optimizer state (Adam's bias correction counts from its next step).
 * Collective, between steps: no unit in use and no grads since the last
 * fsdp_step (else FSDP_ERR_INVALID_STATE), the same unit and choice on every
 * rank (else FSDP_ERR_MISMATCH). Units are trainable when registered. */
FSDP_API fsdp_status_t fsdp_unit_set_trainable(fsdp_ctx_t* ctx, fsdp_unit_t* unit, int trainable);
/* 1 if the unit is trainable, 0 if it is frozen. */
FSDP_API fsdp_status_t fsdp_unit_trainable(const fsdp_unit_t* unit, int* trainable);
/* Freezes (0) or unfreezes (1) one param inside a unit, the others as they
 * are: a unit that mixes frozen and trainable params lays them out in two
 * blocks, the trainable params first, each block padded and sharded on its
 * own. A frozen param then has no grad storage and no optimizer state, and
 * no bytes in the reduce-scatter or all-reduce, which covers the trainable
 * block alone (the front of the grads' buffer: no copy); the gather takes
 * one collective per block. The call lays the unit out again: its params
 * keep their values (gathered through host memory, one unit's full fp32
 * params), the params that stay trainable keep their optimizer state and
 * its age, and a param unfrozen now starts with fresh state whose Adam bias
 * correction counts from its own next step. fsdp_grad_ptr and
 * fsdp_gather_grad on a frozen param are FSDP_ERR_INVALID_STATE. With a
 * frozen block, fsdp_shard_info's shard is this rank's slice of the
 * trainable block, then of the frozen block, and its offset is that of the
 * first slice; fsdp_shard_tensors hands out the first slice. Collective and
 * between steps, as fsdp_unit_set_trainable. Params are trainable when
 * registered. */
FSDP_API fsdp_status_t fsdp_param_set_trainable(fsdp_ctx_t* ctx, fsdp_unit_t* unit, size_t param_index,
                                                int trainable);
/* 1 if the param is trainable (in its unit's layout), 0 if it is frozen. A
 * frozen unit's params keep their own choice, for when it is unfrozen. */
FSDP_API fsdp_status_t fsdp_param_trainable(const fsdp_unit_t* unit, size_t param_index, int* trainable);
/* optimizer=host: the host updates the shards itself (with params frozen
 * inside a unit: the front `numel` elements of the master, the trainable
 * block's slice, which the grads and states cover). fsdp_step_begin does
 * what fsdp_step does before its update: every reduction done, the global
 * grad norm (fsdp_last_grad_norm), the loss scaler's verdict and clipping.
 * `*update` is 0 for a step skipped for inf/nan grads (they are zeroed: the
 * host changes nothing), else 1 with `*grad_scale` the factor the host
 * multiplies every grad by (1 / loss scale, times the clip coefficient of
 * max_grad_norm; 1 without either). The host then updates each trainable
 * unit's shard in place, on `stream` (or synchronously): fsdp_shard_tensors
 * gives the fp32 master, the reduced grads and the host_state fp32 buffers
 * libfsdp keeps for it (zero at first, sharded, checkpointed as "host0",
 * "host1", ...). Padding between params is zero in all of them and must stay
 * zero. Outside the host's step fsdp_shard_tensors hands out the same
 * buffers once the last step is done (for a binding to make its views of
 * them once; they change only when the unit is laid out again: freezing,
 * loads), to be written only inside the step. fsdp_step_end waits for
 * `stream`, makes the param_dtype copies
 * follow, zeroes the grads, and counts the step (fsdp_ctx_step: during the
 * update it gives the steps before this one). Between the two only
 * fsdp_shard_tensors, fsdp_shard_info, fsdp_param_flat_range, fsdp_ctx_step,
 * fsdp_last_grad_norm, fsdp_memory_stats, fsdp_comm_stats, fsdp_unit_trainable and
 * fsdp_param_trainable may be called (else FSDP_ERR_INVALID_STATE). Collective. With another optimizer
 * fsdp_step_begin is FSDP_ERR_INVALID_STATE, and with optimizer=host so is
 * fsdp_step. */
FSDP_API fsdp_status_t fsdp_step_begin(fsdp_ctx_t* ctx, void* stream, int* update, float* grad_scale);
FSDP_API fsdp_status_t fsdp_shard_tensors(fsdp_ctx_t* ctx, fsdp_unit_t* unit, float** params, float** grads,
                                          float** states, size_t n_states, size_t* numel);
FSDP_API fsdp_status_t fsdp_step_end(fsdp_ctx_t* ctx, void* stream);
/* A param group: sets `options` on every registered param whose name matches
 * the glob `pattern` (fnmatch: '*', '?', [...]; an exact name picks one
 * param). Options, separated by ';' or ',': lr_scale=X (its lr is fsdp_set_lr's
 * times X, decoupled weight decay included, as a PyTorch param group's lr),
 * weight_decay=X, and for adam/adamw beta1=X and beta2=X (optimizer=sgd has
 * none: FSDP_ERR_INVALID_ARGUMENT). What is not given stays as it was; a later
 * call wins where groups overlap. Collective, with the same pattern and
 * options on every rank (else FSDP_ERR_MISMATCH), no unit in use (else
 * FSDP_ERR_INVALID_STATE); a pattern that matches no param, an unknown key or
 * a value out of range is FSDP_ERR_INVALID_ARGUMENT and changes nothing.
 * `matched` (may be NULL) receives the number of params it set. */
FSDP_API fsdp_status_t fsdp_set_param_group(fsdp_ctx_t* ctx, const char* pattern, const char* options,
                                            size_t* matched);

/* ---- the training step ------------------------------------------------- */

/* Collective (unless the unit's params are already gathered). Makes the
 * unit's full params usable through fsdp_param_ptr. `stream` is the stream
 * the host computes on: a cudaStream_t on CUDA; on CPU it must be NULL, the
 * calling thread, and every call is synchronous. libfsdp orders its work
 * after the host's through that stream: the stream waits for the gather here,
 * and *_end records where the host's work on the unit ends. */
FSDP_API fsdp_status_t fsdp_forward_begin(fsdp_unit_t* unit, void* stream);
/* FULL_SHARD frees the full params; SHARD_GRAD_OP and NO_SHARD keep them,
 * once the work queued on `stream` so far is done. On CPU (NULL stream) the
 * host's own work on the unit's buffers must be finished when it calls *_end:
 * a host that queues work where libfsdp cannot see it (a jitted JAX call)
 * must block on its results first, since *_end may free or reuse the memory
 * at once. */
FSDP_API fsdp_status_t fsdp_forward_end(fsdp_unit_t* unit, void* stream);
/* Collective (unless gathered). Full params usable, grad buffers zeroed (not
 * zeroed while gradient sync is off and grads are being accumulated). A unit
 * need not have run forward this step: backward_begin then gathers the params
 * itself (one gather per unit per step, for hosts that differentiate a whole
 * function at once: backward_begin on every unit, compute, add the grads,
 * backward_end in reverse order). */
FSDP_API fsdp_status_t fsdp_backward_begin(fsdp_unit_t* unit, void* stream);
/* Collective. Reduces the unit's grads into this rank's sharded grad (unless
 * gradient sync is off) and frees the full params and grads. */
FSDP_API fsdp_status_t fsdp_backward_end(fsdp_unit_t* unit, void* stream);
/* Pointer to param `param_index`'s full values (param_dtype, row-major),
 * valid between a *_begin and its *_end. Read only: where nothing is gathered
 * (a world of one, NO_SHARD) it is the library's own copy of the weights and
 * a write changes them outside the optimizer; elsewhere a write changes a
 * gathered copy that is thrown away, so a host that writes would train
 * differently at another world size. Bindings hand it out read-only where
 * their array type can say so (docs/bindings.md). On device=cuda it is GPU
 * memory (so is fsdp_grad_ptr's). */
FSDP_API fsdp_status_t fsdp_param_ptr(fsdp_unit_t* unit, size_t param_index, void** ptr);
/* Pointer to param `param_index`'s grad (param_dtype), valid between
 * fsdp_backward_begin and fsdp_backward_end. Add grads into it. */
FSDP_API fsdp_status_t fsdp_grad_ptr(fsdp_unit_t* unit, size_t param_index, void** ptr);
/* Adds a framework's gradient into param `param_index`'s grad, as the host's
 * own add into fsdp_grad_ptr would: `src` holds `numel` elements (the param's
 * count) of `src_dtype` (fp32, bf16 or fp16, whatever param_dtype is), each
 * added to the grad in fp32 and rounded once to param_dtype. For frameworks
 * whose arrays are immutable (JAX) or live in an allocator of their own
 * (Julia, Go, C): `src` is memory of the unit's device (on device=cuda GPU
 * memory of its GPU, managed memory or mapped pinned memory; else
 * FSDP_ERR_INVALID_ARGUMENT and nothing is queued). Between
 * fsdp_backward_begin and fsdp_backward_end of a trainable param. The add is
 * queued on `stream` after the work queued there so far and before the
 * fsdp_backward_end that reduces it (on the CPU's NULL stream it runs now):
 * `src` must stay valid until it has run: until the host next synchronizes
 * `stream` (on the CPU's NULL stream, until the call returns). Several calls
 * for one param add up. */
FSDP_API fsdp_status_t fsdp_grad_accumulate(fsdp_unit_t* unit, size_t param_index, const void* src,
                                            fsdp_dtype_t src_dtype, size_t numel, void* stream);
/* Collective. Queues the step after the work queued on `stream` and the
 * grad reductions, and returns without waiting for it: the global grad norm
 * (summed over the ranks on the device), the inf/nan verdict, the loss scale's
 * update and the clip coefficient (max_grad_norm) are decided on the device,
 * then the optimizer updates this rank's shards and zeroes the sharded grads.
 * Work queued on `stream` afterwards runs after the update (on the CPU's
 * NULL stream, the calling thread: the call returns when it is done); the
 * calls that read its results (fsdp_last_grad_norm, fsdp_loss_scale,
 * fsdp_ctx_step, fsdp_gather_param, saves...) wait for it. A failure of
 * earlier queued work is returned here; one of the step's own by the next
 * call that waits for it, and fsdp_ctx_async_error. If any rank's grads hold
 * inf or nan the step is skipped on every rank: params and optimizer state
 * stay as they were (the grads are still zeroed, the loss scale backs off),
 * and rank 0 logs it once the host learns of it (at the next call): a
 * warning, unless the loss scale is dynamic (where skips are routine). No
 * unit may be between *_begin and *_end. */
FSDP_API fsdp_status_t fsdp_step(fsdp_ctx_t* ctx, void* stream);
/* enabled=0: following backward passes accumulate full grads locally without
 * any communication (PyTorch's no_sync); they are reduced by the first
 * backward_end after sync is enabled again (or by fsdp_step). */
FSDP_API fsdp_status_t fsdp_set_grad_sync(fsdp_ctx_t* ctx, int enabled);
FSDP_API fsdp_status_t fsdp_set_lr(fsdp_ctx_t* ctx, double lr);
/* The scale the host multiplies its loss by before backward (so that fp16
 * grads do not underflow), and how many steps were skipped because some rank's
 * grads held inf/nan. The scale is 1 unless loss_scale is on (by default it is
 * dynamic for param_dtype=fp16); fsdp_step divides it out of the grads. */
FSDP_API fsdp_status_t fsdp_loss_scale(const fsdp_ctx_t* ctx, double* scale, uint64_t* skipped_steps);
/* Where the steps keep the loss scale: *scale receives a pointer to one
 * double in the memory of the device that holds the optimizer state (GPU
 * memory on device=cuda without offload; host memory otherwise), valid for
 * the context's life. A kernel that multiplies the loss by it reads it in
 * stream order after the last fsdp_step, with no host wait: what a step
 * captured in a CUDA graph needs (the scale changes as the graph's runs skip
 * or grow it), and what fp16 training on a GPU should use instead of
 * fsdp_loss_scale, which waits for the step. Allowed during a capture. */
FSDP_API fsdp_status_t fsdp_loss_scale_device(fsdp_ctx_t* ctx, const double** scale);
/* The global grad norm of the last fsdp_step (unscaled), before clipping;
 * inf or nan if that step was skipped. */
FSDP_API fsdp_status_t fsdp_last_grad_norm(const fsdp_ctx_t* ctx, double* norm);
/* The optimizer's step count: the fsdp_step calls that updated the params
 * (skipped steps do not count; fsdp_loss_scale counts those), as fsdp_load
 * restores it from a checkpoint. AdamW's bias correction uses it; a host can
 * resume its schedules from it. */
FSDP_API fsdp_status_t fsdp_ctx_step(const fsdp_ctx_t* ctx, uint64_t* step);

/* How fsdp_metrics_reduce combines the ranks' values. */
typedef enum fsdp_reduce_op {
  FSDP_REDUCE_SUM = 0,
  FSDP_REDUCE_AVG = 1,
  FSDP_REDUCE_MAX = 2,
  FSDP_REDUCE_MIN = 3
} fsdp_reduce_op_t;
/* Collective over every rank of the context. Replaces `values[0..count)` on
 * each rank by the sum, mean, maximum or minimum over the ranks, combined in
 * rank order so that every rank gets the same bits. For the host's metrics
 * (the mean loss of a step, token counts, each rank's memory figures for rank
 * 0 to print), not for tensors: it runs after the context's collectives in
 * flight and blocks until done. `count` is at most 2^20 and must be the same
 * on every rank; values may be NULL when count is 0. */
FSDP_API fsdp_status_t fsdp_metrics_reduce(fsdp_ctx_t* ctx, double* values, size_t count, fsdp_reduce_op_t op);

/* ---- access -------------------------------------------------------------- */

/* Collective. Copies param `param_index`'s full fp32 master values into
 * `out` (`numel` must equal the param's element count). Only while no unit
 * is in use. */
FSDP_API fsdp_status_t fsdp_gather_param(fsdp_unit_t* unit, size_t param_index, float* out, size_t numel);
/* Collective, for tests and debugging. Copies param `param_index`'s reduced
 * grad, in fp32, into `out` (`numel` must equal the param's element count):
 * what the grad shards hold after the backward passes since the last
 * fsdp_step, reduced over the ranks with reduce_op (the mean by default) and
 * not yet unscaled or clipped (a loss scale other than 1 is still in it).
 * Waits for the unit's queued reductions. Zeros right after fsdp_step (which
 * zeroes the grads). Only while the unit is not in use;
 * FSDP_ERR_INVALID_STATE while grads accumulated with gradient sync off wait
 * unreduced. */
FSDP_API fsdp_status_t fsdp_gather_grad(fsdp_unit_t* unit, size_t param_index, float* out, size_t numel);
/* This rank's flat fp32 master shard of the unit: pointer, offset of its
 * first element in the unit's flat buffer, and element count (waits for the
 * last fsdp_step's update, which writes it). Params lie in
 * the flat buffer in registration order, each start aligned to align_bytes;
 * gaps and the tail are padding. The shard is over the shard group (the world,
 * or shard_group_size ranks for HYBRID_SHARD); with offload=cpu it is host
 * memory, on device=cuda otherwise GPU memory. */
FSDP_API fsdp_status_t fsdp_shard_info(fsdp_unit_t* unit, float** ptr, size_t* offset, size_t* numel);
/* Where param `param_index` lies in the unit's flat buffer. */
FSDP_API fsdp_status_t fsdp_param_flat_range(fsdp_unit_t* unit, size_t param_index, size_t* offset, size_t* numel);

/* ---- checkpoints ------------------------------------------------------- */
/* Formats, guarantees and how other languages read them: docs/checkpoints.md. */

/* Collective. Saves the training state (fp32 params, optimizer state and step,
 * loss scale) into directory `dir`. kind "sharded": each rank of the shard
 * group writes its own shard file, in parallel, plus rank 0 a JSON metadata
 * file with the layout and a checksum per tensor. kind "full": rank 0 writes
 * model.safetensors (each param under its registered name and shape, fp32)
 * and optimizer.safetensors, gathering one unit at a time so that its memory
 * peak stays near the largest unit; param names must then be unique across
 * units. The checkpoint is assembled in a hidden sibling directory and renamed
 * into place, so `dir` always holds one whole checkpoint: the previous one
 * until the new one is complete. Grads are not saved. No unit may be in use. */
FSDP_API fsdp_status_t fsdp_save(fsdp_ctx_t* ctx, const char* dir, const char* kind);
/* Collective. Loads a checkpoint of either kind, written at any world size
 * and sharding strategy, into the registered units: the same params by
 * name and shape, in any grouping into units and any order (matched by
 * position where the units are those saved), and an optimizer keeping the
 * same state; else FSDP_ERR_INVALID_ARGUMENT naming every param missing,
 * unexpected or of another shape. Each rank reads
 * only the byte ranges that overlap its own shard and checks their checksums.
 * Restores params, optimizer state, step, learning rate and loss scale; zeroes
 * the sharded grads. A damaged checkpoint gives FSDP_ERR_CORRUPT naming the
 * file and tensor. All or nothing: every rank checks its part before any
 * rank changes anything (docs/checkpoints.md: the load reads twice and holds
 * one unit's shard of scratch). */
FSDP_API fsdp_status_t fsdp_load(fsdp_ctx_t* ctx, const char* dir);
/* Collective. fsdp_load, not strict (PyTorch's load_state_dict(strict=False)):
 * the registered params the checkpoint has (by name) get its values and
 * optimizer state; those it lacks keep their own, and the params it has that
 * are not registered are ignored. A shape that differs is still
 * FSDP_ERR_INVALID_ARGUMENT. Rank 0 logs what was left out as a warning, and
 * fsdp_load_report returns it. */
FSDP_API fsdp_status_t fsdp_load_partial(fsdp_ctx_t* ctx, const char* dir);
/* Local. What the last successful fsdp_load or fsdp_load_partial on this
 * context left out: one line "missing: NAME" per registered param the
 * checkpoint did not have, then one line "unexpected: NAME" per param it had
 * that is not registered; "" when it matched everything. Copied as
 * fsdp_config_get copies: into `text` of `text_nbytes` bytes with its NUL;
 * *text_len (if not NULL) receives the length without the NUL, also when the
 * buffer is too small (then FSDP_ERR_INVALID_ARGUMENT, nothing written). */
FSDP_API fsdp_status_t fsdp_load_report(const fsdp_ctx_t* ctx, char* text, size_t text_nbytes, size_t* text_len);
/* Collective. Sets the registered params from pretrained weights that any
 * program wrote in the safetensors format (Hugging Face's save_pretrained):
 * `path` is a .safetensors file, or a directory with
 * model.safetensors.index.json and the files its weight_map names, or with
 * model.safetensors. Params are found by name: a file's tensor name T
 * becomes a host name through `options` (NULL for none), "key=value" items
 * separated by ';' or newlines:
 *   strip_prefix=P   T without P where T starts with it
 *   add_prefix=P     P before it
 *   rename=FROM:TO   (repeatable; the first match wins) a name that matches
 *                    FROM whole, where {i} in FROM stands for a number,
 *                    becomes TO with that number in place of {i}
 *   transpose=GLOB   (repeatable; '*' and '?') 2-D params registered as the
 *                    transpose of their tensor (GPT-2's Conv1D weights)
 *   strict=0|1       default 1: every registered param must be in the files
 *                    and every tensor registered; 0 loads what matches
 * F32, BF16 and F16 tensors become the fp32 master exactly. Each rank reads
 * only the byte ranges of its own shard (a transposed param: one run of
 * columns per stored row). The optimizer state and step restart from zero;
 * grads are zeroed.
 * Names, shapes and dtypes are checked on every rank before any param
 * changes (FSDP_ERR_INVALID_ARGUMENT naming every offender; a damaged or
 * truncated file FSDP_ERR_CORRUPT naming it). fsdp_load_report lists what
 * was left out. No unit may be in use. */
FSDP_API fsdp_status_t fsdp_load_pretrained(fsdp_ctx_t* ctx, const char* path, const char* options);
/* Collective. Writes the params, consolidated, as safetensors files that
 * another program loads (Hugging Face's from_pretrained): into directory
 * `dir` (new, or empty), model.safetensors, or with max_shard_bytes
 * model-0000K-of-0000N.safetensors and model.safetensors.index.json. Each
 * file's metadata is {"format": "pt"}. `options` are fsdp_load_pretrained's
 * naming options (strip_prefix, add_prefix, rename, transpose), applied in
 * reverse, so that the same options load what they exported, plus
 *   dtype=fp32|bf16       the files' dtype (default fp32; bf16 rounds to
 *                         nearest even)
 *   max_shard_bytes=N     start another file before one would pass N bytes
 * Shard group 0 gathers one unit at a time and rank 0 writes it: the peak is
 * one full unit. Optimizer state is not written. No unit may be in use. */
FSDP_API fsdp_status_t fsdp_export(fsdp_ctx_t* ctx, const char* dir, const char* options);

/* ---- checkpoints that do not stall the step ------------------------------ */
/* docs/checkpoints.md, "Async saves and snapshots in memory". */

/* Collective. fsdp_save(ctx, dir, "sharded") without the wait for the file
 * system: at the call, the rank's state (fp32 params, optimizer state, step,
 * learning rate, loss scale; every fsdp_step queued before the call, none
 * after) is copied into host memory (pinned on a GPU; kept for the next
 * save and counted as host scratch), and a background thread writes the
 * same sharded checkpoint as fsdp_save and commits it the same crash-safe
 * way (staging directory, atomic exchange, fsync): `dir` holds the old
 * checkpoint or the new one, never a mix. Training may go on meanwhile. A
 * second fsdp_save_async, fsdp_save, fsdp_load, fsdp_load_partial or
 * fsdp_restore first waits for this one; if it failed and no call reported
 * that yet, that call fails with its error (naming the rank and file, the
 * same on every rank) and does nothing else. No unit may be in use. */
FSDP_API fsdp_status_t fsdp_save_async(fsdp_ctx_t* ctx, const char* dir);
/* Local. Waits for the last fsdp_save_async's background write and commit;
 * FSDP_OK, or its error (once: a later wait returns FSDP_OK). FSDP_OK at
 * once when none is pending. Destroying the context waits as well (and logs
 * an error no call reported). */
FSDP_API fsdp_status_t fsdp_save_wait(fsdp_ctx_t* ctx);

/* Collective. Copies the rank's state (what fsdp_save writes) into a
 * snapshot under `path`, a directory that every process of the job on this
 * node sees, best on a memory file system (/dev/shm/<job>): per rank,
 * path/rank<R>/ holds two slots, each a sharded checkpoint of the rank's
 * shard, and a marker naming the slots that are whole and their steps. The
 * copy goes into the slot that is not the newest, and the marker is replaced
 * (rename) only once it is whole, so a process killed mid-copy leaves the
 * previous snapshot restorable. Not crash-safe across a reboot or power loss
 * on a memory file system (it is a copy in RAM). No unit may be in use. */
FSDP_API fsdp_status_t fsdp_snapshot(fsdp_ctx_t* ctx, const char* path);
typedef enum fsdp_restore_source {
  FSDP_RESTORED_NOTHING = 0,   /* neither: the state is as it was */
  FSDP_RESTORED_SNAPSHOT = 1,  /* from fsdp_snapshot's memory copy */
  FSDP_RESTORED_CHECKPOINT = 2 /* from the checkpoint at checkpoint_dir */
} fsdp_restore_source_t;
/* Collective, for a process of the same job (same world size, same rank)
 * started after another stopped: restores the newest step that every rank's
 * snapshot under `path` holds whole (params, optimizer state, step, learning
 * rate, loss scale, as fsdp_load does), or, when there is none (a rank's
 * snapshot missing, deleted or of another step, or it failed its checksums),
 * loads the checkpoint at `checkpoint_dir`; with neither it changes nothing.
 * `path` or `checkpoint_dir` may be NULL or "" (not looked at). *source
 * (if not NULL) receives what was restored; rank 0 logs it and why. A
 * checkpoint that exists but does not load is an error (fsdp_load's). */
FSDP_API fsdp_status_t fsdp_restore(fsdp_ctx_t* ctx, const char* path, const char* checkpoint_dir, int* source);

/* ---- observe ------------------------------------------------------------- */

/* Bytes this rank holds, by category. Set struct_size = sizeof(the struct) before
 * the call: fields past it are not written, so older callers keep working. */
typedef struct fsdp_memory_stats_s {
  size_t struct_size;
  size_t sharded_params_nbytes;  /* fp32 master (+ param_dtype shard where kept) */
  size_t sharded_grads_nbytes;   /* fp32 sharded grads */
  size_t optimizer_state_nbytes; /* moments / momentum */
  size_t gathered_params_nbytes; /* full params of gathered units, now */
  size_t gathered_params_peak_nbytes;
  size_t unsharded_grads_nbytes; /* full grads of units in backward, now */
  size_t unsharded_grads_peak_nbytes;
  size_t total_nbytes; /* everything above, plus comm scratch */
  size_t total_peak_nbytes;
  /* total_nbytes split by where it lives: the compute device, and the host
   * (with offload=cpu: master shards, sharded grads, optimizer state, and the
   * host side of copies). Without offload everything is device memory. */
  size_t device_nbytes;
  size_t device_peak_nbytes;
  size_t host_nbytes;
  size_t host_peak_nbytes;
  /* Gather and grad slots that no unit holds now, kept for their next use
   * (part of total_nbytes and device_nbytes; docs/architecture.md, "Slots"). */
  size_t free_slots_nbytes;
  /* secondary_shard: the slices of units' full params kept from forward's
   * gather for backward's, inside the secondary group (part of total_nbytes). */
  size_t secondary_params_nbytes;
  size_t secondary_params_peak_nbytes;
} fsdp_memory_stats_t;

FSDP_API fsdp_status_t fsdp_memory_stats(const fsdp_ctx_t* ctx, fsdp_memory_stats_t* stats);
/* Peaks restart from the current values. */
FSDP_API fsdp_status_t fsdp_memory_stats_reset_peak(fsdp_ctx_t* ctx);

/* What this rank's collectives moved since the context was made (or the last
 * fsdp_comm_stats_reset), over all its communicators (world, and the shard and
 * replica groups of HYBRID_SHARD). Bytes are each collective's data as the
 * caller sees it, whatever algorithm moves it: an all-gather's result (every
 * rank's part), a reduce-scatter's input (every rank's part), an all-reduce's
 * or a broadcast's buffer. A frozen param's bytes are in the all-gathers only.
 * control_calls counts the small reductions of norms, flags and consensus
 * checks, and barriers. A world of one runs no collective: all zero. Set
 * struct_size = sizeof(the struct) before the call, as for fsdp_memory_stats. */
typedef struct fsdp_comm_stats_s {
  size_t struct_size;
  uint64_t all_gather_calls;
  uint64_t all_gather_nbytes;
  uint64_t reduce_scatter_calls;
  uint64_t reduce_scatter_nbytes;
  uint64_t all_reduce_calls;
  uint64_t all_reduce_nbytes;
  uint64_t broadcast_calls;
  uint64_t broadcast_nbytes;
  uint64_t control_calls;
  /* The times a call of this context blocked the calling thread on work it
   * had queued (a stream's or the GPU's): reads of a step's results
   * (fsdp_last_grad_norm, fsdp_loss_scale, fsdp_ctx_step), saves, loads,
   * fsdp_gather_param, fsdp_param_set_values, fsdp_step_begin... Zero for a
   * steady-state step (the brackets and fsdp_step) on every strategy. The
   * CPU's NULL stream is the calling thread itself: its waits for a gather
   * are that stream's ordering and are not counted. Threads sharing a GPU
   * also meet in each collective's barrier (not counted either). */
  uint64_t host_waits;
  /* All-to-alls: the quantized gradient reduction (reduce_dtype=int8 or
   * fp8_e4m3), whose packed grads they move instead of a reduce-scatter;
   * bytes as a reduce-scatter's: every rank's part of the send buffer. */
  uint64_t all_to_all_calls;
  uint64_t all_to_all_nbytes;
  /* Every collective's bytes above, split by the group of ranks it ran
   * over: the world (FULL_SHARD's and SHARD_GRAD_OP's shard group is the
   * world), HYBRID's shard groups and replica groups, and the secondary
   * groups of secondary_shard (backward's gathers). */
  uint64_t world_group_nbytes;
  uint64_t shard_group_nbytes;
  uint64_t replica_group_nbytes;
  uint64_t secondary_group_nbytes;
} fsdp_comm_stats_t;

FSDP_API fsdp_status_t fsdp_comm_stats(const fsdp_ctx_t* ctx, fsdp_comm_stats_t* stats);

/* The planner (docs/scaling.md, "The planner"; the tool fsdp-plan): what a
 * model costs on a cluster under each candidate configuration, before a run.
 * `request` is JSON: {"model": {"safetensors": FILE or Hugging Face DIR,
 * "unit_rule": "h.{i}."} or {"size": {"layers", "params_per_layer",
 * "other_params"}} or {"units": [{"name", "params": [{"name", "shape",
 * "frozen"}]}]}, "cluster": {"gpus", "gpus_per_node", "intra_node_GBps",
 * "inter_node_GBps", "peak_tflops", "mfu", "memory_GiB"}, "tokens_per_gpu",
 * "options": {config keys that every candidate shares}}. The answer, JSON
 * with one row per candidate (its persistent and device bytes, its bytes
 * per step per collective and per group, exactly as fsdp_memory_stats and
 * fsdp_comm_stats would count them, and its estimated times), goes into
 * `out` of `out_nbytes` bytes with its NUL; `out_len` (may be NULL) receives
 * its length, also when the buffer is too small (then
 * FSDP_ERR_INVALID_ARGUMENT). A request it cannot read is
 * FSDP_ERR_INVALID_ARGUMENT naming what. Needs no context. */
FSDP_API fsdp_status_t fsdp_plan(const char* request, char* out, size_t out_nbytes, size_t* out_len);
/* Every counter restarts from zero on this rank (not collective). */
FSDP_API fsdp_status_t fsdp_comm_stats_reset(fsdp_ctx_t* ctx);

/* Starts (or restarts, clearing) recording this rank's timeline: its calls,
 * its comm stream's collectives with unit names and bytes, memory counters. */
FSDP_API fsdp_status_t fsdp_trace_begin(fsdp_ctx_t* ctx);
/* Writes what was recorded as Chrome trace JSON (Perfetto, chrome://tracing),
 * pid = rank; recording goes on. Local. */
FSDP_API fsdp_status_t fsdp_trace_write(fsdp_ctx_t* ctx, const char* path);

#ifdef __cplusplus
}
#endif

#endif /* FSDP_H */
