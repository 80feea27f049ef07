// fsdp_set_param_group (issue 27): a param group's lr scale follows
// fsdp_set_lr, exactly (SGD with lr 1: param -= lr * scale * mean grad); the
// checkpoint records the groups; misuse is refused on every rank and changes
// nothing. The groups' training against a single-process reference with
// PyTorch's per-group lr, betas and weight decay is in test_equivalence.cpp
// (the ParamGroups* cases).
#include <string>
#include <vector>

#include "ckpt_util.h"

using namespace fsdp_test;

namespace {

const std::vector<std::vector<ParamSpec>> kUnits = {{{"a.w", {8}}, {"a.b", {3}}}, {{"b.w", {8}}}};

void open(Job& job, const std::map<std::string, std::string>& opts, int rank, fsdp_local_group_t* group) {
  ConfigPtr cfg = make_config(opts);
  ASSERT_TRUE(cfg);
  fsdp_ctx_t* raw = nullptr;
  ASSERT_OK(fsdp_ctx_create(cfg.get(), group, rank, &raw));
  job.ctx.reset(raw);
  for (size_t k = 0; k < kUnits.size(); ++k) {
    fsdp_unit_t* u = nullptr;
    ASSERT_OK(register_unit(raw, "u" + std::to_string(k), kUnits[k], &u));
    job.units.push_back(u);
    for (size_t i = 0; i < kUnits[k].size(); ++i) {
      std::vector<float> ones(numel_of(kUnits[k][i].shape), 1.0f);
      ASSERT_OK(fsdp_param_set_values(u, i, ones.data(), ones.size()));
    }
  }
}

// One step in which rank r's grads are all r + 1 (the mean over 2 ranks: 1.5).
void step(Job& job, int rank) {
  for (size_t k = 0; k < kUnits.size(); ++k) {
    ASSERT_OK(fsdp_backward_begin(job.units[k], nullptr));
    for (size_t i = 0; i < kUnits[k].size(); ++i) {
      void* g = nullptr;
      ASSERT_OK(fsdp_grad_ptr(job.units[k], i, &g));
      for (size_t e = 0; e < numel_of(kUnits[k][i].shape); ++e) static_cast<float*>(g)[e] = float(rank + 1);
    }
    ASSERT_OK(fsdp_backward_end(job.units[k], nullptr));
  }
  ASSERT_OK(fsdp_step(job.ctx.get(), nullptr));
}

std::vector<float> param(Job& job, size_t k, size_t i) {
  std::vector<float> out(numel_of(kUnits[k][i].shape));
  EXPECT_OK(fsdp_gather_param(job.units[k], i, out.data(), out.size()));
  return out;
}

const std::map<std::string, std::string> kSgd = {
    {"optimizer", "sgd"}, {"lr", "1"}, {"weight_decay", "0"}, {"timeout_s", "20"}, {"loss_scale", "off"}};

}  // namespace

TEST(ParamGroups, TheLrScaleFollowsSetLrExactly) {
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open(job, kSgd, rank, group);
    if (HasFatalFailure()) return;
    size_t matched = 0;
    ASSERT_OK(fsdp_set_param_group(job.ctx.get(), "a.*", "lr_scale=0.25", &matched));
    EXPECT_EQ(matched, 2u);
    ASSERT_NO_FATAL_FAILURE(step(job, rank));  // a.*: 1 - 0.25 * 1.5; b.w: 1 - 1.5
    ASSERT_OK(fsdp_set_lr(job.ctx.get(), 2.0));
    ASSERT_NO_FATAL_FAILURE(step(job, rank));  // a.*: - 2 * 0.25 * 1.5; b.w: - 2 * 1.5
    EXPECT_EQ(param(job, 0, 0), std::vector<float>(8, 1.0f - 0.375f - 0.75f));
    EXPECT_EQ(param(job, 0, 1), std::vector<float>(3, 1.0f - 0.375f - 0.75f));
    EXPECT_EQ(param(job, 1, 0), std::vector<float>(8, 1.0f - 1.5f - 3.0f));
  });
}

TEST(ParamGroups, TheCheckpointRecordsThem) {
  TempDir tmp;
  const std::string dir = tmp / "ck";
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open(job, {{"optimizer", "adamw"}, {"timeout_s", "20"}}, rank, group);
    if (HasFatalFailure()) return;
    ASSERT_OK(fsdp_set_param_group(job.ctx.get(), "b.w", "lr_scale=0.5, beta2=0.95", nullptr));
    ASSERT_OK(fsdp_save(job.ctx.get(), dir.c_str(), "sharded"));
  });
  nlohmann::json meta = nlohmann::json::parse(read_file(dir + "/fsdp_checkpoint.json"));
  const nlohmann::json& bw = meta["units"][1]["params"][0];
  EXPECT_EQ(bw["lr_scale"], 0.5);
  EXPECT_EQ(bw["beta2"], 0.95);
  EXPECT_FALSE(bw.contains("beta1"));
  EXPECT_FALSE(meta["units"][0]["params"][0].contains("lr_scale"));
}

TEST(ParamGroups, MisuseIsRefusedOnEveryRankAndChangesNothing) {
  run_ranks(2, [&](int rank, fsdp_local_group_t* group) {
    Job job;
    open(job, kSgd, rank, group);
    if (HasFatalFailure()) return;
    fsdp_ctx_t* ctx = job.ctx.get();
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_set_param_group(nullptr, "*", "lr_scale=1", nullptr));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_set_param_group(ctx, nullptr, "lr_scale=1", nullptr));
    EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_set_param_group(ctx, "*", nullptr, nullptr));
    const std::vector<std::pair<const char*, const char*>> bad = {
        {"*", "colour=blue"},   {"*", "lr_scale=-1"},    {"*", "lr_scale=+-0"}, {"*", "lr_scale"},
        {"*", ""},              {"*", "beta1=0.9"},      {"nothing.*", "lr_scale=2"}, {"", "lr_scale=2"},
        {"*", "weight_decay=nan"}};
    for (const auto& [pattern, options] : bad) {
      EXPECT_STATUS(FSDP_ERR_INVALID_ARGUMENT, fsdp_set_param_group(ctx, pattern, options, nullptr))
          << pattern << " " << options;
      EXPECT_NE(last_error_str().find("fsdp_set_param_group"), std::string::npos) << last_error_str();
    }
    // Ranks that disagree.
    EXPECT_STATUS(FSDP_ERR_MISMATCH, fsdp_set_param_group(ctx, "*", rank == 0 ? "lr_scale=2" : "lr_scale=3", nullptr));
    // A unit in use.
    ASSERT_OK(fsdp_forward_begin(job.units[0], nullptr));
    EXPECT_STATUS(FSDP_ERR_INVALID_STATE, fsdp_set_param_group(ctx, "*", "lr_scale=2", nullptr));
    ASSERT_OK(fsdp_forward_end(job.units[0], nullptr));
    // Nothing changed: a step is plain SGD with lr 1 everywhere.
    ASSERT_NO_FATAL_FAILURE(step(job, rank));
    EXPECT_EQ(param(job, 0, 0), std::vector<float>(8, 1.0f - 1.5f));
    EXPECT_EQ(param(job, 1, 0), std::vector<float>(8, 1.0f - 1.5f));
  });
}
