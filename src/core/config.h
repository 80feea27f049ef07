// src/core/config.h - typed options of a context, parsed from key/value
// strings (fsdp_config_set) and FSDP_* environment variables. One table in
// config.cpp lists every key, its aliases, its values and its default.
#pragma once

#include <limits>
#include <string>
#include <vector>

#include "../../kernels/quant.h"
#include "../base/dtype.h"
#include "../comm/options.h"

namespace fsdp::core {

enum class Sharding { kFullShard, kShardGradOp, kNoShard, kHybridShard, kHybridShardZero2 };
// kHost: the host updates the shards itself, between fsdp_step_begin and
// fsdp_step_end, with host_state fp32 buffers per element that libfsdp keeps.
enum class OptimizerKind { kAdamW, kAdam, kSgd, kHost };
enum class ReduceOp { kAvg, kSum };
enum class BackwardPrefetch { kNone, kPre, kPost };
enum class LossScaleMode { kAuto, kDynamic, kStatic, kOff };
using comm::CommKind;
using comm::MpiAlgorithm;

const char* sharding_name(Sharding s);
// The canonical name ("adamw", "adam", "sgd"), as fsdp_config_get spells it.
std::string optimizer_name(OptimizerKind k);
// The learning rate and a weight decay as fsdp_set_lr and
// fsdp_param_set_weight_decay take them: the same range as the lr and
// weight_decay options, or FSDP_ERR_INVALID_ARGUMENT naming `call`.
void check_lr(double lr, const char* call);
void check_weight_decay(double weight_decay, const char* call);
// A list option's patterns as fsdp_config_get spells them: comma-separated.
std::string join_patterns(const std::vector<std::string>& patterns);

// One param group's hyperparameters, as fsdp_set_param_group takes them
// ("lr_scale=0.1;beta2=0.95"; ';' or ',' between items): what the options
// give, NaN for what they leave as it is.
struct ParamGroupOptions {
  double lr_scale = std::numeric_limits<double>::quiet_NaN();
  double weight_decay = std::numeric_limits<double>::quiet_NaN();
  double beta1 = std::numeric_limits<double>::quiet_NaN();
  double beta2 = std::numeric_limits<double>::quiet_NaN();
};
// FSDP_ERR_INVALID_ARGUMENT naming `call` and the item: an unknown key, a
// value out of its option's range, betas with optimizer=sgd, no item at all.
ParamGroupOptions parse_param_group(const char* text, bool adam, const char* call);

// FSDP_DEBUG_POISON=1 in the environment (debug_poison's default).
bool debug_poison_from_env();

// An option that is on, off, or left to libfsdp (`auto`).
enum class AutoBool { kAuto, kNo, kYes };
// "auto", "0" or "1", as the option reads back.
const char* auto_bool_name(AutoBool b);

struct Options {
  Sharding sharding = Sharding::kFullShard;
  DType param_dtype = DType::kFp32;
  bool reduce_dtype_auto = true;  // follow param_dtype, as PyTorch does
  DType reduce_dtype_set = DType::kFp32;
  ReduceOp reduce_op = ReduceOp::kAvg;
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double momentum = 0.0;
  int host_state = 0;  // optimizer=host: fp32 state buffers per shard element
  bool nesterov = false;
  double max_grad_norm = 0.0;
  std::vector<std::string> no_weight_decay;  // fnmatch patterns on param names
  size_t align_bytes = 64;
  double timeout_s = 300.0;
  int threads = 1;
  bool sync_module_states = false;
  // Debugging a host's integration: every gathered buffer and transient stage
  // is filled with NaN (all bits set: NaN in fp32, bf16 and fp16) when it is
  // freed, so a read after *_end shows as a NaN loss instead of stale values.
  // Its default comes from the environment, FSDP_DEBUG_POISON=1.
  bool debug_poison = debug_poison_from_env();
  bool forward_prefetch = false;
  // param_dtype != fp32: keep a param_dtype copy of the shard beside the fp32
  // master as the gathers' source (kYes), or cast the master into a transient
  // stage at each gather (kNo: 2 bytes less per param share, a cast per gather).
  // kAuto: kNo, except with offload=cpu (keeps_param_dtype_shard()).
  AutoBool keep_param_dtype_shard = AutoBool::kAuto;
  bool keeps_param_dtype_shard() const {
    return keep_param_dtype_shard == AutoBool::kYes || (keep_param_dtype_shard == AutoBool::kAuto && offload_cpu);
  }
  // The params' all-gathers on a stream and a communicator of their own
  // (kYes), or on the comm stream behind the reductions (kNo). kAuto: a GPU
  // always; the CPU where the host has a core per rank for its compute, its
  // comm stream and its gather stream (Context::gathers_apart).
  AutoBool gather_stream = AutoBool::kAuto;
  // Quantized param gathers (gather_dtype=int8|fp8_e4m3): each rank
  // quantizes its slice of the fp32 master in blocks of gather_block values
  // (kernels/quant.h), the all-gather moves the codes and scales, and the
  // gathered side dequantizes to param_dtype. The master, the grads and the
  // optimizer stay full precision. gather_quantized false: the gathers move
  // param_dtype values (the default).
  bool gather_quantized = false;
  kernels::QType gather_qtype = kernels::QType::kInt8;
  size_t gather_block = 256;
  // fnmatch patterns on unit names: the units they match gather param_dtype
  // values while gather_dtype quantizes the others' (as float8 training
  // keeps the embeddings and the output projection in full precision).
  std::vector<std::string> gather_dtype_exclude;
  // Whether the gathers of unit `unit_name` move gather_dtype's codes.
  bool quantizes_gathers_of(const std::string& unit_name) const;
  // Quantized grad reduction (reduce_dtype=int8|fp8_e4m3): the reduce-scatter
  // of a sharded strategy becomes quantize (each rank's part for every rank,
  // in blocks of reduce_block values) -> all-to-all -> dequantize and sum in
  // fp32 in rank order (kernels/quant.h). What it leaves is fp32: while it is
  // on, reduce_dtype() is fp32 (the HYBRID replicas' all-reduce, offload's
  // copy and the accumulation into the grad shard see fp32).
  bool reduce_quantized = false;
  kernels::QType reduce_qtype = kernels::QType::kInt8;
  size_t reduce_block = 256;
  // A node-local secondary shard (ZeRO++'s hpZ): after a unit's forward
  // gather each rank keeps its slice of the full params, sliced among the
  // ranks of its secondary group, and backward's gather reads from that
  // group only. 0: off; -1: the ranks of this host ("node"); n > 0: groups
  // of n consecutive ranks of the shard group.
  int secondary_shard = 0;
  // The quantized reduction's hierarchy (ZeRO++'s qgZ): where the shard
  // group spans hosts, an all-to-all inside groups of n consecutive ranks
  // first (each rank's grads summed with its host's), then one across the
  // groups, so that what leaves a host is one part per group instead of
  // one per rank. -1: the ranks of this host ("node"); 0: off (one
  // all-to-all over the shard group); n > 0: groups of n.
  int reduce_hierarchy = -1;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kPre;  // PyTorch's default
  int limit_all_gathers = 2;
  LossScaleMode loss_scale_mode = LossScaleMode::kAuto;  // auto: dynamic for fp16, off otherwise
  double loss_scale_static = 1.0;
  double loss_scale_init = 65536.0;
  double loss_scale_growth = 2.0;
  double loss_scale_backoff = 0.5;
  long loss_scale_growth_interval = 2000;
  CommKind comm = CommKind::kAuto;  // auto: mpi when launched by mpirun (and built in), else local
  MpiAlgorithm mpi_algorithm = MpiAlgorithm::kAuto;
  int shard_group_size = 0;  // HYBRID_SHARD: ranks per shard group; 0 = the local world size
  bool offload_cpu = false;  // master shard, sharded grads, optimizer state in host memory
  // The compute device: the CPU (cuda_ordinal < 0) or CUDA device
  // `cuda_ordinal` (device=cuda[:N]; N defaults to LOCAL_RANK, else 0).
  int cuda_ordinal = -1;
  // comm=nccl started by a host that runs its own processes: the id made by
  // fsdp_comm_id_create on one rank (hex) and the number of ranks joining it.
  std::string comm_id;
  int world_size = 0;
  bool on_cuda() const { return cuda_ordinal >= 0; }

  DType reduce_dtype() const { return reduce_dtype_auto ? param_dtype : reduce_dtype_set; }
  bool hybrid() const { return sharding == Sharding::kHybridShard || sharding == Sharding::kHybridShardZero2; }
  // FULL_SHARD and HYBRID_SHARD free full params after forward and gather them again for backward.
  bool reshard_after_forward() const { return sharding == Sharding::kFullShard || sharding == Sharding::kHybridShard; }
  // What the world communicator is told.
  comm::Options comm_options() const { return {comm, timeout_s, mpi_algorithm, cuda_ordinal, comm_id, world_size}; }
};

class Config {
 public:
  // Throws Error(INVALID_ARGUMENT) for an unknown key or a bad value and
  // Error(UNSUPPORTED) for a value this build cannot honour; on error the
  // options are unchanged.
  void set(const std::string& key, const std::string& value);
  std::string get(const std::string& key) const;
  // Applies FSDP_<KEY> variables; all-or-nothing.
  void apply_env();
  const Options& options() const { return options_; }

 private:
  Options options_;
};

}  // namespace fsdp::core
