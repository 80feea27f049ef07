// src/core/context.cpp - see context.h.
#include "context.h"

#include <fnmatch.h>

#include <algorithm>
#include <cmath>
#include <locale>
#include <set>
#include <sstream>

#include "../base/error.h"
#include "../base/text.h"
#include "../device/cpu/cpu_device.h"
#include "../device/factory.h"
#include "async_save.h"
#include "consensus.h"
#include "device_plane.h"

namespace fsdp::core {
namespace {

// The options every rank must share, one per line (threads may differ).
std::string describe(const Options& o) {
  std::ostringstream os;
  os.imbue(std::locale::classic());  // ranks on hosts with other locales must write the same text
  os.precision(17);
  os << "sharding=" << sharding_name(o.sharding) << "\nparam_dtype=" << dtype_name(o.param_dtype)
     << "\nreduce_dtype=" << dtype_name(o.reduce_dtype()) << ","
     << (o.reduce_quantized ? static_cast<int>(o.reduce_qtype) : -1) << "," << o.reduce_block
     << "\nsecondary_shard=" << o.secondary_shard << "\nreduce_hierarchy=" << o.reduce_hierarchy
     << "\nreduce_op=" << static_cast<int>(o.reduce_op) << "\noptimizer=" << static_cast<int>(o.optimizer)
     << "\nlr=" << o.lr << "\nbeta1=" << o.beta1 << "\nbeta2=" << o.beta2 << "\neps=" << o.eps
     << "\nweight_decay=" << o.weight_decay << "\nmomentum=" << o.momentum << "\nnesterov=" << o.nesterov
     << "\nmax_grad_norm=" << o.max_grad_norm << "\nalign_bytes=" << o.align_bytes
     << "\nkeep_param_dtype_shard=" << o.keeps_param_dtype_shard()
     << "\ngather_stream=" << auto_bool_name(o.gather_stream)
     << "\ngather_dtype=" << (o.gather_quantized ? static_cast<int>(o.gather_qtype) : -1) << "," << o.gather_block
     << "\ngather_dtype_exclude=" << join_patterns(o.gather_dtype_exclude)
     << "\nforward_prefetch=" << o.forward_prefetch << "\nbackward_prefetch=" << static_cast<int>(o.backward_prefetch)
     << "\nlimit_all_gathers=" << o.limit_all_gathers << "\nloss_scale=" << static_cast<int>(o.loss_scale_mode) << ","
     << o.loss_scale_static << "," << o.loss_scale_init << "," << o.loss_scale_growth << "," << o.loss_scale_backoff
     << "," << o.loss_scale_growth_interval << "\nsync_module_states=" << o.sync_module_states
     << "\ncomm=" << static_cast<int>(o.comm) << "\nmpi_algorithm=" << static_cast<int>(o.mpi_algorithm)
     << "\nshard_group_size=" << o.shard_group_size << "\noffload=" << o.offload_cpu
     << "\ndevice=" << (o.on_cuda() ? "cuda" : "cpu") << "\nno_weight_decay=";
  for (const auto& p : o.no_weight_decay) os << p << ",";
  return os.str();
}

std::string describe(size_t index, const std::string& name, const std::vector<ParamSpec>& params,
                     const std::vector<bool>& frozen) {
  std::ostringstream os;
  os.imbue(std::locale::classic());
  os << "unit #" << index << " '" << name << "' with " << params.size() << " params\n";
  for (size_t i = 0; i < params.size(); ++i) {
    os << "param " << i << " '" << params[i].name << "' shape [";
    for (size_t d = 0; d < params[i].shape.size(); ++d) os << (d ? ", " : "") << params[i].shape[d];
    os << "]" << (i < frozen.size() && frozen[i] ? " frozen" : "") << "\n";
  }
  return os.str();
}

}  // namespace

Context::Context(const Options& opts, std::unique_ptr<comm::Communicator> world)
    : rt_(opts), optimizer_(rt_), scheduler_(rt_, units_) {
  world_ = std::make_unique<comm::CountingComm>(std::move(world), comm_counters_);
  rt_.rank = world_->rank();
  rt_.world = world_->world_size();
  dev_ = device::make_compute_device(opts.cuda_ordinal, opts.threads);
  // Memory the host cannot read (a GPU's) is moved by the communicator with
  // the device's own copies and reductions, where its ranks share it.
  if (!dev_->host_visible() && !world_->attach_data_plane(make_device_plane(*dev_)) && rt_.world > 1) {
    fail(FSDP_ERR_UNSUPPORTED, "fsdp_ctx_create: device=" + std::string(dev_->name()) + " at a world of " +
                                   std::to_string(rt_.world) +
                                   " needs a communicator that moves GPU memory: comm=nccl (processes with a GPU "
                                   "each) or the local communicator (ranks as threads of one process sharing the "
                                   "GPU); comm=mpi moves host memory only (docs/gpu.md)");
  }
  if (opts.keep_param_dtype_shard == AutoBool::kNo && opts.offload_cpu) {
    fail(FSDP_ERR_UNSUPPORTED,
         "fsdp_ctx_create: keep_param_dtype_shard=0 with offload=cpu: the param_dtype shard on the host is what "
         "each gather copies to the device, half the bytes of the fp32 master; casting at the gather instead "
         "would double that traffic to save host memory, so libfsdp keeps it (use keep_param_dtype_shard=1)");
  }
  if (opts.reduce_quantized && opts.sharding == Sharding::kNoShard && rt_.world > 1) {
    fail(FSDP_ERR_UNSUPPORTED,
         "fsdp_ctx_create: reduce_dtype=" +
             std::string(opts.reduce_qtype == kernels::QType::kInt8 ? "int8" : "fp8_e4m3") +
             " quantizes the reduce-scatter of a sharded strategy (each rank sums the quantized parts of its own "
             "shard); NO_SHARD all-reduces whole grads, which it does not quantize: use a sharded strategy, or "
             "reduce_dtype=bf16 to halve NO_SHARD's bytes");
  }
  if (!opts.gather_quantized && !opts.gather_dtype_exclude.empty()) {
    fail(FSDP_ERR_INVALID_ARGUMENT,
         "fsdp_ctx_create: gather_dtype_exclude=" + join_patterns(opts.gather_dtype_exclude) +
             " names units whose gathers stay in param_dtype while gather_dtype quantizes the others'; with "
             "gather_dtype=param no gather is quantized (set gather_dtype=int8 or fp8_e4m3, or leave "
             "gather_dtype_exclude empty)");
  }
  rt_.dev = dev_.get();
  rt_.state_dev = dev_.get();
  Trace* trace = &rt_.trace;
  if (opts.offload_cpu) {
    // The optimizer runs here, on the host's SIMD kernels and thread pool,
    // over memory the device copies to and from fastest (pinned for a GPU).
    host_ = std::make_unique<device::CpuDevice>(opts.threads, device::Pool::kHost, dev_->host_memory());
    rt_.state_dev = host_.get();
    auto on_copy = [trace](const std::string& name, bool begin) { trace->add(name, begin ? 'B' : 'E', Track::kCopy); };
    copy_in_ = dev_->create_stream("copy_in", 0, {on_copy, nullptr, opts.timeout_s});
    copy_out_ = dev_->create_stream("copy_out", 0, {on_copy, nullptr, opts.timeout_s});
    host_work_ = host_->create_stream("host_work", 0, {on_copy, nullptr, opts.timeout_s});
    rt_.copy_in = copy_in_.get();
    rt_.copy_out = copy_out_.get();
    rt_.host_work = host_work_.get();
  }
  stream_ = dev_->create_stream(
      "comm", 1,
      {[trace](const std::string& name, bool begin) { trace->add(name, begin ? 'B' : 'E', Track::kComm); },
       [this](const std::string& reason) { abort_comms(reason); }, opts.timeout_s});
  sync_world_ = std::make_unique<SyncComm>(*stream_, *world_);
  rt_.comm = sync_world_.get();
  rt_.world_comm = world_.get();
  rt_.stream = stream_.get();
  rt_.sched = &scheduler_;
  gather_slots_ = std::make_unique<SlotPool>(rt_.dev, &rt_.mem, MemCategory::kGatheredParams, opts.param_dtype, 1);
  grad_slots_ = std::make_unique<SlotPool>(rt_.dev, &rt_.mem, MemCategory::kUnshardedGrads, opts.param_dtype, 2);
  rt_.gather_slots = gather_slots_.get();
  rt_.grad_slots = grad_slots_.get();
  agree(*rt_.comm, "fsdp_ctx_create (config)", describe(rt_.opts));
  setup_groups();
  setup_secondary();
  setup_reduce_hierarchy();
  if (rt_.shard_size > 1 && !gathers_apart()) {
    // The gathers share the comm stream and the shard group's communicator
    // with the reductions, in the order the host issued them.
    rt_.gather_stream = stream_.get();
    rt_.gather_comm = rt_.shard_comm;
  } else if (rt_.shard_size > 1) {
    // A communicator and a stream of their own for the params' gathers, so
    // that a prefetched gather never queues behind a reduction. Split off
    // the shard group's: the same ranks, collectives ordered apart.
    SyncComm& group = opts.hybrid() ? *sync_shard_ : *sync_world_;
    gather_comm_ = group.split(0, rt_.shard_index, "split off the gathers' communicator");
    gather_stream_ = dev_->create_stream(
        "gather", 1,
        {[trace](const std::string& name, bool begin) { trace->add(name, begin ? 'B' : 'E', Track::kGather); },
         [this](const std::string& reason) { abort_comms(reason); }, opts.timeout_s});
    rt_.gather_comm = gather_comm_.get();
    rt_.gather_stream = gather_stream_.get();
    // A synchronous call meets the other ranks on the gathers' communicator
    // too: a rank whose host made it where another issued a gather fails at
    // once, naming both, instead of waiting until timeout_s.
    sync_world_->set_fence(gather_stream_.get(), gather_comm_.get());
    if (sync_shard_) sync_shard_->set_fence(gather_stream_.get(), gather_comm_.get());
  }
}

void Context::abort_comms(const std::string& reason) {
  for (comm::Communicator* c : {world_.get(), shard_.get(), replica_.get(), gather_comm_.get(), secondary_.get(),
                                reduce_local_.get(), reduce_cross_.get()}) {
    if (c != nullptr) c->abort(reason);
  }
}

fsdp_status_t Context::async_error() const {
  for (const comm::Communicator* c : {world_.get(), shard_.get(), replica_.get(), gather_comm_.get(), secondary_.get(),
                                      reduce_local_.get(), reduce_cross_.get()}) {
    if (c != nullptr && c->failure() != FSDP_OK) return c->failure();
  }
  // Work that failed on a stream: the engine's own, and the host's streams
  // the transitions were given (a gather the host's stream waited for failed).
  for (const device::Stream* s :
       {gather_stream_.get(), stream_.get(), copy_in_.get(), copy_out_.get(), host_work_.get()}) {
    if (s != nullptr && s->failure() != FSDP_OK) return s->failure();
  }
  for (const device::Stream* s : rt_.async_callers) {
    if (s->failure() != FSDP_OK) return s->failure();
  }
  return FSDP_OK;
}

// Members go in reverse order: the comm stream stops first (its tasks use unit
// buffers and the communicators), then optimizer state and units free their
// buffers through dev_; the communicators go last but one.
Context::~Context() = default;

void Context::agree_or_refuse(const std::string& what, const std::string& text, fsdp_status_t status,
                              const std::string& refusal) {
  try {
    agree(*rt_.comm, what, text);
  } catch (const Error& e) {
    // The refusing rank reports its reason; the others report the mismatch.
    if (!refusal.empty() && e.status() == FSDP_ERR_MISMATCH) fail(status, refusal);
    throw;
  }
  if (!refusal.empty()) fail(status, refusal);
}

Unit& Context::register_unit(const std::string& name, std::vector<ParamSpec> params, std::string problem,
                              std::vector<bool> frozen) {
  // Register collectively even when this rank's arguments are bad, so that the
  // other ranks learn of it instead of waiting.
  size_t index = units_.size();
  std::string what = "fsdp_unit_register of unit #" + std::to_string(index);
  std::set<std::string> seen;
  for (const ParamSpec& p : params) {
    if (problem.empty() && !seen.insert(p.name).second)
      problem = "param name " + base::quote(p.name) + " appears twice";
  }
  std::string text = problem.empty() ? describe(index, name, params, frozen) : "invalid registration: " + problem;
  agree_or_refuse(what, text, FSDP_ERR_INVALID_ARGUMENT,
                  problem.empty() ? "" : what + " " + base::quote(name) + ": " + problem);
  // More units than the sums of squares have room for: they move, once
  // nothing that writes one is queued.
  if (optimizer_.unit_slots_full() && !units_.empty()) settle_units();
  auto unit = std::make_unique<Unit>(rt_, index, name, std::move(params), std::move(frozen));
  optimizer_.add_unit(*unit);
  units_.push_back(std::move(unit));
  return *units_.back();
}

std::string Context::between_steps_problem() const {
  std::string problem;
  for (const auto& u : units_) {
    if (problem.empty() && u->in_use()) {
      problem = "unit " + base::quote(u->name()) + " is " + unit_state_name(u->state()) +
                "; freeze or unfreeze between steps, with no unit in use";
    }
    if (problem.empty() && u->holds_grads()) {
      problem = "unit " + base::quote(u->name()) +
                " holds grads for the coming step (a backward ran since the last fsdp_step); freeze or unfreeze "
                "after fsdp_step";
    }
  }
  return problem;
}

void Context::set_trainable(Unit& unit, bool trainable) {
  const char* call = "fsdp_unit_set_trainable";
  // Checked here, then agreed on: a rank whose call is refused still joins,
  // so that the others fail too instead of training another model.
  const std::string problem = between_steps_problem();
  std::string what = std::string(call) + " (" + rt_.where() + ")";
  std::string text = "unit #" + std::to_string(unit.index()) + " " + base::quote(unit.name()) +
                     (trainable ? " trainable" : " frozen") + (problem.empty() ? "" : " (refused: " + problem + ")");
  agree_or_refuse(call, text, FSDP_ERR_INVALID_STATE, problem.empty() ? "" : what + ": " + problem);
  if (unit.trainable() == trainable) return;
  settle_units();
  unit.set_trainable(trainable);
  optimizer_.set_trainable(unit, trainable);
}

void Context::set_param_trainable(Unit& unit, size_t param_index, bool trainable) {
  const char* call = "fsdp_param_set_trainable";
  const std::string problem = between_steps_problem();
  std::string what = std::string(call) + " (" + rt_.where() + ")";
  std::string text = "unit #" + std::to_string(unit.index()) + " " + base::quote(unit.name()) + " param #" +
                     std::to_string(param_index) + (trainable ? " trainable" : " frozen") +
                     (problem.empty() ? "" : " (refused: " + problem + ")");
  agree_or_refuse(call, text, FSDP_ERR_INVALID_STATE, problem.empty() ? "" : what + ": " + problem);
  if (unit.param_trainable(param_index) == trainable) return;
  settle_units();
  // Collective from here on, the same on every rank: the state's trainable
  // block gathered as it is, then the unit and its state laid out again.
  const FlatLayout old = unit.layout();
  std::vector<std::vector<float>> old_states;
  for (size_t i = 0; unit.trainable() && i < optimizer_.state_names().size(); ++i) {
    old_states.push_back(unit.gather_to_host(optimizer_.state(unit.index(), i).as<float>(), true, call));
  }
  std::vector<bool> frozen(old.n_params());
  for (size_t i = 0; i < frozen.size(); ++i) frozen[i] = old.frozen(i);
  frozen[param_index] = !trainable;
  unit.relayout(frozen);
  optimizer_.relayout(unit, old, old_states);
}

size_t Context::set_param_group(const std::string& pattern, const char* options) {
  const char* call = "fsdp_set_param_group";
  if (rt_.opts.optimizer == OptimizerKind::kHost) {
    fail(FSDP_ERR_UNSUPPORTED, std::string(call) + ": optimizer=host keeps its own hyperparameters; libfsdp's "
                                                   "param groups set those of its own optimizers");
  }
  std::string problem;
  fsdp_status_t status = FSDP_ERR_INVALID_ARGUMENT;
  ParamGroupOptions g;
  try {
    if (pattern.empty()) fail(FSDP_ERR_INVALID_ARGUMENT, std::string(call) + ": the pattern is empty");
    g = parse_param_group(options, rt_.opts.optimizer != OptimizerKind::kSgd, call);
  } catch (const Error& e) {
    problem = e.what();
  }
  for (const auto& u : units_) {
    if (problem.empty() && u->in_use()) {
      problem = std::string(call) + " (" + rt_.where() + "): unit " + base::quote(u->name()) + " is " +
                unit_state_name(u->state()) + "; set param groups between steps";
      status = FSDP_ERR_INVALID_STATE;
    }
  }
  std::vector<std::pair<Unit*, size_t>> matched;
  for (const auto& u : units_) {
    for (size_t i = 0; i < u->layout().n_params(); ++i) {
      if (fnmatch(pattern.c_str(), u->layout().param(i).name.c_str(), 0) == 0) matched.emplace_back(u.get(), i);
    }
  }
  if (problem.empty() && matched.empty()) {
    problem = std::string(call) + ": " + base::quote(pattern) + " matches no registered param";
  }
  // The same groups on every rank, or a model trained differently per rank.
  std::string text = "pattern=" + pattern + " options=" + std::string(options != nullptr ? options : "") +
                     (problem.empty() ? "" : " (refused: " + problem + ")");
  agree_or_refuse(call, text, status, problem);
  for (const auto& [u, i] : matched) u->set_group(i, g);
  return matched.size();
}

void Context::check_no_unit_in_use(const char* call) const {
  for (const auto& u : units_) {
    if (u->in_use()) {
      fail(FSDP_ERR_INVALID_STATE, std::string(call) + " (rank " + std::to_string(rt_.rank) + "): unit " +
                                       base::quote(u->name()) + " is " + unit_state_name(u->state()) +
                                       "; call its *_end first");
    }
  }
}

void Context::settle_units() {
  for (const auto& u : units_) u->drop_stale_gathered();
  for (const auto& u : units_) u->wait_reductions();
  rt_.reductions_in_flight.clear();
  rt_.wait_step();
  // A collective that NCCL aborted completes its GPU event as if it had run:
  // the waits above pass, and what they waited for holds whatever the buffer
  // held. The communicators know; nothing may read those results.
  for (const comm::Communicator* c : {world_.get(), shard_.get(), replica_.get(), gather_comm_.get(), secondary_.get(),
                                      reduce_local_.get(), reduce_cross_.get()}) {
    if (c != nullptr && c->failure() != FSDP_OK) {
      fail(c->failure(), rt_.where() + ": a collective of this context failed earlier (fsdp_ctx_async_error " +
                             "reported it); its results are not used");
    }
  }
}

device::Stream& Context::step_stream(device::Stream& caller) {
  if (rt_.offload()) return *host_work_;
  if (rt_.alone()) return caller;
  return *stream_;
}

void Context::check_failures(const char* call) const {
  // A stream's failure carries its message (the rank that did not come, the
  // work that stalled); a communicator's alone only says it failed.
  for (const device::Stream* s :
       {gather_stream_.get(), stream_.get(), copy_in_.get(), copy_out_.get(), host_work_.get()}) {
    if (s != nullptr) s->rethrow_failure();
  }
  for (const device::Stream* s : rt_.async_callers) s->rethrow_failure();
  for (const comm::Communicator* c : {world_.get(), shard_.get(), replica_.get(), gather_comm_.get(), secondary_.get(),
                                      reduce_local_.get(), reduce_cross_.get()}) {
    if (c != nullptr && c->failure() != FSDP_OK) {
      fail(c->failure(), std::string(call) + " (" + rt_.where() +
                             "): a collective of this context failed earlier (fsdp_ctx_async_error reported it); "
                             "its results are not used");
    }
  }
}

void Context::step(device::Stream& caller) {
  if (rt_.opts.optimizer == OptimizerKind::kHost) {
    fail(FSDP_ERR_INVALID_STATE, "fsdp_step (" + rt_.where() +
                                     "): optimizer=host updates the shards itself: call fsdp_step_begin, update "
                                     "each trainable unit's shard (fsdp_shard_tensors), then fsdp_step_end");
  }
  check_gather_exclusions("fsdp_step");
  rt_.join_capture(caller, "fsdp_step");
  device::Stream& run = step_stream(caller);
  settle_for_step(caller, run, "fsdp_step");
  // Queued after the reductions and the caller's work; returns without
  // waiting (the caller's stream waits for it: on the CPU's NULL stream, the
  // calling thread). Leaves every grad shard zero, the step skipped or not.
  optimizer_.step(units_, caller, run);
  for (const auto& u : units_) u->grads_cleared();
  scheduler_.on_step();
}

double Context::clip_grad_norm(device::Stream& caller, double max_norm) {
  const char* call = "fsdp_clip_grad_norm";
  if (!(max_norm > 0.0) || !std::isfinite(max_norm)) {
    fail(FSDP_ERR_INVALID_ARGUMENT, std::string(call) + " (" + rt_.where() + "): max_norm must be a finite number > 0, "
                                        "not " + base::format_double(max_norm));
  }
  if (rt_.opts.optimizer == OptimizerKind::kHost) {
    fail(FSDP_ERR_INVALID_STATE, std::string(call) + " (" + rt_.where() +
                                     "): optimizer=host: fsdp_step_begin gives the norm (fsdp_last_grad_norm); "
                                     "the host's update scales the grads by its own coefficient");
  }
  device::Stream& run = step_stream(caller);
  settle_for_step(caller, run, call);
  // torch.nn.utils.clip_grad_norm_: the norm before the clip is returned;
  // the coming update alone scales the grads (a non-finite norm is the
  // step's to skip).
  const double norm = optimizer_.grad_norm(units_, caller, run);
  const double coef = max_norm / (norm + 1e-6);
  if (std::isfinite(norm) && coef < 1.0) optimizer_.set_clip(coef, run);
  return norm;
}

void Context::check_gather_exclusions(const char* call) {
  if (exclusions_checked_) return;
  for (const std::string& pat : rt_.opts.gather_dtype_exclude) {
    auto matches = [&pat](const std::unique_ptr<Unit>& u) { return fnmatch(pat.c_str(), u->name().c_str(), 0) == 0; };
    if (std::none_of(units_.begin(), units_.end(), matches)) {
      std::string names;
      for (size_t i = 0; i < units_.size() && i < 8; ++i) names += (i ? ", " : "") + base::quote(units_[i]->name());
      fail(FSDP_ERR_INVALID_ARGUMENT,
           std::string(call) + ": gather_dtype_exclude's pattern " + base::quote(pat) + " matches none of the " +
               std::to_string(units_.size()) + " units registered (" + names + (units_.size() > 8 ? ", ..." : "") +
               "), so every unit's gathers would be quantized; fix the pattern (fnmatch, on unit names)");
    }
  }
  exclusions_checked_ = true;
}

void Context::settle_for_step(device::Stream& caller, device::Stream& run, const char* call) {
  check_no_unit_in_use(call);
  for (const auto& u : units_) {
    if (u->grads_pending() && !rt_.grad_sync) {
      fail(FSDP_ERR_INVALID_STATE, std::string(call) + " (rank " + std::to_string(rt_.rank) + "): unit " +
                                       base::quote(u->name()) +
                                       " holds grads accumulated with grad sync off; call "
                                       "fsdp_set_grad_sync(ctx, 1) and run the last backward pass first");
    }
  }
  check_failures(call);
  TraceScope scope(rt_.trace, "step");
  // Grads left pending by no_sync are reduced now, after the caller's stream
  // wrote them (alone: on that stream). Every reduction is queued before the
  // step on the stream it runs on (or one the step waits for): no host wait.
  for (const auto& u : units_) u->reduce_pending_grads(caller);
  // Gathered params the update makes stale go; the update waits for their
  // gathers, which read the shards.
  for (const auto& u : units_) u->drop_stale_gathered(&run);
  rt_.reductions_in_flight.clear();
}

bool Context::step_begin(device::Stream& caller, float* grad_scale) {
  if (rt_.opts.optimizer != OptimizerKind::kHost) {
    fail(FSDP_ERR_INVALID_STATE, "fsdp_step_begin (" + rt_.where() + "): optimizer=" +
                                     optimizer_name(rt_.opts.optimizer) +
                                     " is libfsdp's own: call fsdp_step (fsdp_step_begin is optimizer=host's)");
  }
  check_gather_exclusions("fsdp_step_begin");
  rt_.join_capture(caller, "fsdp_step_begin");
  device::Stream& run = step_stream(caller);
  settle_for_step(caller, run, "fsdp_step_begin");
  // Gathered params of the last pass are dropped above: the next gather
  // reads the updated shards. The host's update needs the verdict: this waits.
  host_update_ = optimizer_.host_begin(units_, caller, run, grad_scale);
  rt_.host_step_open = true;
  return host_update_;
}

void Context::step_end(device::Stream& caller) {
  if (!rt_.host_step_open) {
    fail(FSDP_ERR_INVALID_STATE, "fsdp_step_end (" + rt_.where() + "): no fsdp_step_begin before it");
  }
  {
    // The host's update, queued on its stream, is done before the copies
    // and the next gathers read the shards.
    TraceScope wait(rt_.trace, "wait for the host's update");
    caller.synchronize(rt_.opts.timeout_s);
  }
  rt_.host_step_open = false;
  optimizer_.host_end(units_, host_update_);
  for (const auto& u : units_) u->grads_cleared();
  scheduler_.on_step();
}

void Context::set_lr(double lr) {
  check_lr(lr, "fsdp_set_lr");
  optimizer_.set_lr(lr);
}

double Context::last_grad_norm() const {
  // A skipped step (inf/nan grads) ran too: its norm is the inf or nan.
  // Inside the host's step (optimizer=host) the norm is this step's, known
  // since fsdp_step_begin, though the step is counted at fsdp_step_end.
  if (optimizer_.steps_run() == 0 && !rt_.host_step_open) {
    fail(FSDP_ERR_INVALID_STATE, "fsdp_last_grad_norm: no fsdp_step has run yet on this context");
  }
  return optimizer_.last_grad_norm();
}

void Context::metrics_reduce(double* values, size_t count, int op) {
  constexpr size_t kMaxCount = size_t(1) << 20;
  if (count > kMaxCount) {
    fail(FSDP_ERR_INVALID_ARGUMENT, "fsdp_metrics_reduce: count is " + std::to_string(count) + "; at most " +
                                        std::to_string(kMaxCount) + " values (it is for metrics, not tensors)");
  }
  // Indexed by fsdp_reduce_op_t.
  static constexpr comm::RedOp kOps[] = {comm::RedOp::kSum, comm::RedOp::kAvg, comm::RedOp::kMax, comm::RedOp::kMin};
  static_assert(FSDP_REDUCE_SUM == 0 && FSDP_REDUCE_AVG == 1 && FSDP_REDUCE_MAX == 2 && FSDP_REDUCE_MIN == 3);
  if (op < 0 || op > FSDP_REDUCE_MIN) {
    fail(FSDP_ERR_INVALID_ARGUMENT, "fsdp_metrics_reduce: op is " + std::to_string(op) +
                                        "; expected FSDP_REDUCE_SUM, _AVG, _MAX or _MIN (0 to 3)");
  }
  double none = 0.0;  // count 0 still joins the other ranks, so that a mismatch is found
  rt_.comm->all_reduce_f64(count > 0 ? values : &none, count, kOps[op], "fsdp_metrics_reduce");
}

void Context::finalize() {
  check_no_unit_in_use("fsdp_ctx_finalize");
  settle_units();
  optimizer_.settled();  // the last step's skip, if any, is said
  rt_.comm->barrier("fsdp_ctx_finalize");
  rt_.finalized = true;
}

}  // namespace fsdp::core
