// The equivalence suite's cases (tests/test_equivalence.cpp): what a case
// sets, and the variants run against the reference (low precision, grad
// accumulation, no_sync, clipping, uneven sizes, hybrid groups, offload,
// frozen units and params, param groups, the quantized reduction), each with
// the tolerance its comment derives.
#ifndef FSDP_TESTS_EQUIVALENCE_CASES_H
#define FSDP_TESTS_EQUIVALENCE_CASES_H

#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "equivalence_reference.h"

namespace fsdp_test::equivalence {

// One run against the reference: its world, strategy, dtypes and options.
struct Case {
  std::string name;
  int world = 1;
  std::string sharding = "FULL_SHARD";
  int shard_group_size = 0;  // HYBRID_SHARD*: ranks per shard group (0: the library's default)
  fsdp_dtype_t dtype = FSDP_DTYPE_FP32;
  std::string reduce_dtype = "auto";
  int micro = 1;         // micro-batches per step (each half of the rank's rows)
  bool no_sync = false;  // fsdp_set_grad_sync(0) for all micro-batches but the last
  // With no_sync: sync stays off for every micro-batch and is turned on just
  // before fsdp_step, which then reduces the pending grads itself.
  bool sync_at_step = false;
  double max_grad_norm = 0;
  bool uneven = false;
  double weight_decay = 0.01;
  double tol = 1e-5;          // per tensor: max|lib - ref| / max|ref|, the largest over tensors
  bool model_metric = false;  // tol is ||lib - ref|| / ||ref|| over the whole model instead
  bool sync_module_states = false;
  bool offload = false;              // offload=cpu
  bool rank_dependent_init = false;  // ranks other than 0 set init + rank (sync_module_states must undo it)
  // No fsdp_forward_begin: every unit's backward_begin gathers its params,
  // the host computes forward and backward at once (as jax.value_and_grad
  // does), then backward_end in reverse order. One gather per unit per step.
  bool backward_only = false;
  // The host's compute runs on a CPU host stream whose tasks start this late
  // (0: the NULL stream, the calling thread, unless FSDP_TEST_LATE_HOST_US
  // says otherwise): every call gets that stream and returns before the
  // compute it must be ordered with has run.
  int host_stream_delay_us = 0;
  // Bit u: unit u frozen (fsdp_unit_set_trainable(0)) after registration,
  // unfrozen before step `unfreeze_at` (1-based; -1: never).
  unsigned frozen = 0;
  int unfreeze_at = -1;
  // Params (unit, index) frozen with fsdp_param_set_trainable(0) after
  // registration (their units mix frozen and trainable params), unfrozen
  // before step `unfreeze_at` too.
  std::vector<std::pair<size_t, size_t>> frozen_params;
  std::vector<RefOptions::Group> groups;  // fsdp_set_param_group after registration, in order
};

inline void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// ---- variants ----------------------------------------------------------------

// Low precision. Both runs round params to the dtype before every forward and
// each rank's grads to the dtype; a correct libfsdp may still differ from the
// reference in the order and rounding of the cross-rank reduction (with
// reduce_dtype=auto it runs in the param dtype: up to one rounding, relative
// u = 2^-8 for bf16, 2^-11 for fp16, per grad element) and in fp32 op order.
// Adam's step is ~lr * m/sqrt(v) whatever the grad's size, so a relative grad
// error u moves an element by about lr*u per step (20 steps * 1e-2 * 2^-8 =
// 8e-4 for bf16), but an element whose grad hovers around zero can take a
// different step of up to ~lr, and a 1-ulp change in a rounded param feeds
// back into later grads. The largest per-element error is therefore ~lr, while
// the error over the whole model (Frobenius) stays near lr*u*steps*sqrt of
// the few flipped elements: simulating plausible reduction orders (sum in
// dtype, pre-divide, post-divide, fp32 sum in either order) over several
// seeds gave at most 0.8% (auto) / 0.09% (fp32 reduce, bf16) / 0.02%
// (fp32 reduce, fp16). The tolerances below sit 3-6x above that, and at least
// 5x below the ~15% that a missing weight decay causes with weight_decay 1.0
// ((1 - lr*wd)^20 = 0.82; check_case verifies this margin). A wrong shard or
// grads from the wrong rank are O(1). Summed-instead-of-averaged grads do not
// change Adam's update; the Clip cases and fsdp_last_grad_norm catch those.
constexpr double kAutoReduceTol = 3e-2, kBf16Fp32ReduceTol = 5e-3, kFp16Fp32ReduceTol = 1e-3;

inline std::vector<Case> variant_cases() {
  std::vector<Case> cs;
  auto add = [&](Case c, int world, const char* sharding) {
    c.world = world;
    c.sharding = sharding;
    c.name += std::string("_") + sharding + "_world" + std::to_string(world);
    cs.push_back(c);
  };
  Case bf16;
  bf16.name = "Bf16";
  bf16.dtype = FSDP_DTYPE_BF16;
  bf16.weight_decay = 1.0;
  bf16.model_metric = true;
  bf16.tol = kAutoReduceTol;
  // Every strategy at worlds 2 and 4 (the mpirun CTests run those worlds).
  for (int w : {1, 2, 3, 4}) add(bf16, w, "FULL_SHARD");
  for (int w : {2, 4}) add(bf16, w, "SHARD_GRAD_OP");
  for (int w : {1, 2, 4}) add(bf16, w, "NO_SHARD");  // world 1: grads accumulate on the caller
  Case bf16_fp32 = bf16;
  bf16_fp32.name = "Bf16ReduceFp32";
  bf16_fp32.reduce_dtype = "fp32";
  bf16_fp32.tol = kBf16Fp32ReduceTol;
  for (int w : {1, 3}) add(bf16_fp32, w, "FULL_SHARD");
  add(bf16_fp32, 4, "SHARD_GRAD_OP");
  add(bf16_fp32, 2, "NO_SHARD");  // the cast to fp32 clears the grads, the all-reduce runs on the cast
  Case fp16 = bf16;
  fp16.name = "Fp16";
  fp16.dtype = FSDP_DTYPE_FP16;
  for (int w : {1, 3}) add(fp16, w, "FULL_SHARD");
  add(fp16, 4, "NO_SHARD");
  Case fp16_fp32 = fp16;
  fp16_fp32.name = "Fp16ReduceFp32";
  fp16_fp32.reduce_dtype = "fp32";
  fp16_fp32.tol = kFp16Fp32ReduceTol;
  add(fp16_fp32, 2, "FULL_SHARD");
  add(fp16_fp32, 3, "NO_SHARD");
  Case accum;
  accum.name = "GradAccumulationSyncOn";
  accum.micro = 2;
  Case no_sync = accum;
  no_sync.name = "GradAccumulationNoSync";
  no_sync.no_sync = true;
  Case clip;
  clip.name = "Clip";
  clip.max_grad_norm = 0.02;  // the grad norm is 0.04..0.25 here
  // The grad norm that clipping uses comes from the reductions' own pass over
  // the grad shard (the last one to write it), or from a pass of its own
  // where the host wrote the shard directly (alone, fp32): both with two
  // micro-batches, so that a shard written twice is measured after the second.
  Case clip_accum = clip;
  clip_accum.name = "ClipGradAccumulation";
  clip_accum.micro = 2;
  add(clip_accum, 1, "NO_SHARD");
  add(clip_accum, 2, "FULL_SHARD");
  Case clip_no_sync = clip_accum;
  clip_no_sync.name = "ClipNoSync";
  clip_no_sync.no_sync = true;
  add(clip_no_sync, 1, "FULL_SHARD");
  add(clip_no_sync, 3, "FULL_SHARD");
  Case uneven;
  uneven.name = "UnevenPadding";
  uneven.uneven = true;
  for (const Case& c : {accum, no_sync, clip, uneven}) {
    for (int w : {1, 2, 3, 4}) add(c, w, "FULL_SHARD");
    add(c, 3, "SHARD_GRAD_OP");
    add(c, 1, "NO_SHARD");  // alone: grads go straight into the grad shard
    add(c, 2, "NO_SHARD");
    add(c, 4, "NO_SHARD");
  }
  // HYBRID_SHARD: world 4 as 2 shard groups x 2 replicas (reduce-scatter in
  // the group, all-reduce across replicas), and 1 x 4 (one group: FULL_SHARD).
  for (const char* h : {"HYBRID_SHARD", "HYBRID_SHARD_ZERO2"}) {
    Case hy;
    hy.name = "Hybrid2x2";
    hy.shard_group_size = 2;
    add(hy, 4, h);
    Case hy_bf16 = bf16;
    hy_bf16.name = "Hybrid2x2Bf16";
    hy_bf16.shard_group_size = 2;
    add(hy_bf16, 4, h);
    Case hy_clip = clip;
    hy_clip.name = "Hybrid2x2Clip";
    hy_clip.shard_group_size = 2;
    add(hy_clip, 4, h);
    Case one_group;
    one_group.name = "HybridOneGroup";
    add(one_group, 4, h);  // default group size: the local world (all 4 threads)
  }
  // The quantized grad reduction (reduce_dtype=int8|fp8_e4m3), which the
  // reference models bit for bit per step (tests/test_quant_reduce.cpp
  // checks the reduced shard itself). Over 20 steps AdamW's op order leaves
  // an ulp between the runs' params, and once that moves a grad across an
  // int8 rounding boundary, the element's grad differs by a quantum (its
  // block's absmax / 127) and its Adam step by up to ~lr: with int8 the runs
  // drift apart after such a flip (measured: the grad norms agree to 1e-4
  // for the first 11 steps; after 20 the whole model is <= 5.2e-4 apart in
  // fp32 and <= 7.6e-4 in bf16, worlds 2-4). Hence whole-model tolerances of
  // 2e-3 (fp32) and 3e-3 (bf16) and norms to 2e-3 for int8; check_case
  // verifies that the unquantized reference and a missing weight decay are
  // both farther than 3x them. fp8's relative grid leaves no such flip
  // here: the per-tensor 1e-5 of fp32.
  Case q8;
  q8.name = "Int8Reduce";
  q8.reduce_dtype = "int8";
  q8.model_metric = true;
  q8.tol = kInt8ReduceTol;
  q8.weight_decay = 1.0;  // a missing weight decay then shows beyond 3x the tolerance, as for bf16
  for (int w : {1, 2, 3, 4}) add(q8, w, "FULL_SHARD");
  add(q8, 2, "SHARD_GRAD_OP");
  Case q8_offload = q8;
  q8_offload.name = "Int8ReduceOffload";
  q8_offload.offload = true;
  add(q8_offload, 2, "FULL_SHARD");
  Case q8_hybrid = q8;
  q8_hybrid.name = "Int8ReduceHybrid2x2";
  q8_hybrid.shard_group_size = 2;
  add(q8_hybrid, 4, "HYBRID_SHARD");
  Case fp8;
  fp8.name = "Fp8Reduce";
  fp8.reduce_dtype = "fp8_e4m3";
  add(fp8, 4, "FULL_SHARD");
  add(fp8, 3, "SHARD_GRAD_OP");
  Case q8_bf16 = bf16;
  q8_bf16.name = "Int8ReduceBf16";
  q8_bf16.reduce_dtype = "int8";
  q8_bf16.tol = 3e-3;
  add(q8_bf16, 2, "FULL_SHARD");
  q8_bf16.name = "Int8ReduceBf16Hybrid2x2";
  q8_bf16.shard_group_size = 2;
  add(q8_bf16, 4, "HYBRID_SHARD_ZERO2");
  // The host's compute on a late host stream (1 ms before each task): the
  // reductions must wait for its grads and a freed gathered buffer must not
  // be reused while its forward still reads it (layers 1 and 2 have the same
  // size, so the block freed by one is the next one's gather buffer).
  Case late;
  late.name = "LateHostStream";
  late.host_stream_delay_us = 1000;
  for (int w : {1, 2, 4}) add(late, w, "FULL_SHARD");
  add(late, 2, "SHARD_GRAD_OP");
  for (int w : {1, 2}) add(late, w, "NO_SHARD");
  add(late, 4, "HYBRID_SHARD");
  Case late_bf16 = bf16;
  late_bf16.name = "LateHostStreamBf16";
  late_bf16.host_stream_delay_us = 1000;
  add(late_bf16, 1, "FULL_SHARD");  // alone, bf16: the grads are added into the shard on the host stream
  add(late_bf16, 2, "FULL_SHARD");
  Case late_accum = late;
  late_accum.name = "LateHostStreamNoSync";
  late_accum.micro = 2;
  late_accum.no_sync = true;
  add(late_accum, 2, "FULL_SHARD");
  // fsdp_step itself reduces the grads that no_sync left pending: alone and
  // in bf16 those are added into the grad shard on the caller's stream, which
  // the step must wait for (review finding 2).
  auto syncing_at_step = [](Case c, const char* name) {
    c.name = name;
    c.micro = 2;
    c.no_sync = true;
    c.sync_at_step = true;
    return c;
  };
  Case until_step = syncing_at_step(Case(), "NoSyncUntilStep");
  for (int w : {1, 3}) add(until_step, w, "FULL_SHARD");
  add(until_step, 2, "NO_SHARD");
  Case until_step_bf16 = syncing_at_step(bf16, "NoSyncUntilStepBf16");
  for (int w : {1, 2}) add(until_step_bf16, w, "FULL_SHARD");
  add(until_step_bf16, 1, "NO_SHARD");
  Case late_until_step = until_step_bf16;
  late_until_step.name = "LateHostStreamNoSyncUntilStepBf16";
  late_until_step.host_stream_delay_us = 1000;
  add(late_until_step, 1, "FULL_SHARD");
  add(late_until_step, 1, "NO_SHARD");
  Case late_offload = late;
  late_offload.name = "LateHostStreamOffload";
  late_offload.offload = true;
  add(late_offload, 1, "FULL_SHARD");
  add(late_offload, 2, "FULL_SHARD");
  // Backward without forward (one gather per unit per step), with prefetch
  // left at its default (backward_prefetch=pre) and grad accumulation.
  Case bwd;
  bwd.name = "BackwardOnly";
  bwd.backward_only = true;
  for (int w : {1, 2, 3}) add(bwd, w, "FULL_SHARD");
  add(bwd, 4, "SHARD_GRAD_OP");
  add(bwd, 2, "NO_SHARD");
  Case bwd_accum = bwd;
  bwd_accum.name = "BackwardOnlyGradAccumulation";
  bwd_accum.micro = 2;
  add(bwd_accum, 2, "FULL_SHARD");
  Case bwd_hybrid = bwd;
  bwd_hybrid.name = "BackwardOnlyHybrid2x2";
  bwd_hybrid.shard_group_size = 2;
  add(bwd_hybrid, 4, "HYBRID_SHARD");
  Case uneven_bf16 = bf16;
  uneven_bf16.name = "UnevenPaddingBf16";
  uneven_bf16.uneven = true;
  add(uneven_bf16, 3, "FULL_SHARD");
  // Frozen units (issue 27): the first and third layers frozen, the others
  // trained as the reference's AdamW trains them with those params frozen
  // (no grad, not in the clipped norm); with accumulation, no_sync, prefetch
  // (backward only), offload, bf16, late host streams, and unfrozen at step 8
  // with fresh state whose bias correction counts from its first update.
  Case frozen;
  frozen.name = "Frozen";
  frozen.frozen = 0b101;
  for (int w : {1, 2, 3, 4}) {
    for (const char* sh : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"}) add(frozen, w, sh);
  }
  Case frozen_hy = frozen;
  frozen_hy.name = "FrozenHybrid2x2";
  frozen_hy.shard_group_size = 2;
  add(frozen_hy, 4, "HYBRID_SHARD");
  Case frozen_clip = clip_accum;
  frozen_clip.name = "FrozenClipGradAccumulation";
  frozen_clip.frozen = 0b101;
  frozen_clip.max_grad_norm = 0.01;
  add(frozen_clip, 1, "FULL_SHARD");
  add(frozen_clip, 3, "FULL_SHARD");
  Case frozen_no_sync = frozen;
  frozen_no_sync.name = "FrozenNoSync";
  frozen_no_sync.micro = 2;
  frozen_no_sync.no_sync = true;
  add(frozen_no_sync, 2, "FULL_SHARD");
  Case frozen_bwd = frozen;
  frozen_bwd.name = "FrozenBackwardOnly";
  frozen_bwd.backward_only = true;
  add(frozen_bwd, 2, "FULL_SHARD");
  Case frozen_offload = frozen;
  frozen_offload.name = "FrozenOffload";
  frozen_offload.offload = true;
  for (int w : {1, 2}) add(frozen_offload, w, "FULL_SHARD");
  Case frozen_late = frozen;
  frozen_late.name = "FrozenLateHostStream";
  frozen_late.host_stream_delay_us = 1000;
  add(frozen_late, 2, "FULL_SHARD");
  Case frozen_bf16 = bf16;
  frozen_bf16.name = "FrozenBf16";
  frozen_bf16.frozen = 0b101;
  add(frozen_bf16, 1, "FULL_SHARD");
  add(frozen_bf16, 3, "FULL_SHARD");
  // Param groups (issue 27): layer 1 at a tenth of the lr with other betas,
  // every bias at twice the lr, layer 2's weight with weight decay 0.5; a
  // later group wins where they overlap (layer1.bias: lr x2).
  Case groups;
  groups.name = "ParamGroups";
  groups.groups = {{"layer1.*", 0.1, 0.8, 0.95, -1}, {"*.bias", 2.0, -1, -1, -1}, {"layer2.weight", -1, -1, -1, 0.5}};
  for (int w : {1, 2, 3, 4}) add(groups, w, "FULL_SHARD");
  add(groups, 2, "SHARD_GRAD_OP");
  add(groups, 3, "NO_SHARD");
  Case groups_frozen = groups;
  groups_frozen.name = "ParamGroupsFrozenUnfrozenAtStep8";
  groups_frozen.frozen = 0b001;
  groups_frozen.unfreeze_at = 8;
  add(groups_frozen, 2, "FULL_SHARD");
  Case groups_offload = groups;
  groups_offload.name = "ParamGroupsOffload";
  groups_offload.offload = true;
  add(groups_offload, 2, "FULL_SHARD");
  // Frozen params inside trainable units (issue 27): layer 0's weight and
  // layer 2's bias frozen, their units' other params trained; each unit
  // lays its params out in a trainable and a frozen block.
  Case fp;
  fp.name = "FrozenParams";
  fp.frozen_params = {{0, 0}, {2, 1}};
  for (int w : {1, 2, 3, 4}) {
    for (const char* sh : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"}) add(fp, w, sh);
  }
  Case fp_hy = fp;
  fp_hy.name = "FrozenParamsHybrid2x2";
  fp_hy.shard_group_size = 2;
  add(fp_hy, 4, "HYBRID_SHARD");
  Case fp_clip = clip_accum;
  fp_clip.name = "FrozenParamsClipGradAccumulation";
  fp_clip.frozen_params = fp.frozen_params;
  fp_clip.max_grad_norm = 0.01;
  add(fp_clip, 3, "FULL_SHARD");
  Case fp_no_sync = fp;
  fp_no_sync.name = "FrozenParamsNoSync";
  fp_no_sync.micro = 2;
  fp_no_sync.no_sync = true;
  add(fp_no_sync, 2, "FULL_SHARD");
  Case fp_bwd = fp;
  fp_bwd.name = "FrozenParamsBackwardOnly";
  fp_bwd.backward_only = true;
  add(fp_bwd, 2, "FULL_SHARD");
  Case fp_offload = fp;
  fp_offload.name = "FrozenParamsOffload";
  fp_offload.offload = true;
  for (int w : {1, 2}) add(fp_offload, w, "FULL_SHARD");
  Case fp_late = fp;
  fp_late.name = "FrozenParamsLateHostStream";
  fp_late.host_stream_delay_us = 1000;
  add(fp_late, 2, "FULL_SHARD");
  Case fp_bf16 = bf16;
  fp_bf16.name = "FrozenParamsBf16";
  fp_bf16.frozen_params = fp.frozen_params;
  add(fp_bf16, 1, "FULL_SHARD");
  add(fp_bf16, 3, "FULL_SHARD");
  Case fp_unfrozen = fp;
  fp_unfrozen.name = "FrozenParamsUnfrozenAtStep8";
  fp_unfrozen.unfreeze_at = 8;
  // A param unfrozen at step 8 takes Adam steps from fresh state, ~lr times
  // the sign of its grad per element: an element whose grad is near zero
  // then turns fp32 rounding into up to 3e-5 of the tensor's largest value
  // (the same element differs by as much between worlds 1, 2 and 3), so the
  // whole model's relative distance is what this case bounds.
  fp_unfrozen.model_metric = true;
  for (int w : {1, 3}) add(fp_unfrozen, w, "FULL_SHARD");
  add(fp_unfrozen, 2, "NO_SHARD");
  Case fp_groups = groups;
  fp_groups.name = "FrozenParamsParamGroups";
  fp_groups.frozen_params = {{1, 0}};
  add(fp_groups, 2, "FULL_SHARD");
  Case unfrozen = frozen;
  unfrozen.name = "UnfrozenAtStep8";
  unfrozen.unfreeze_at = 8;
  for (int w : {1, 3}) add(unfrozen, w, "FULL_SHARD");
  add(unfrozen, 2, "NO_SHARD");
  return cs;
}

}  // namespace fsdp_test::equivalence

#endif  // FSDP_TESTS_EQUIVALENCE_CASES_H
