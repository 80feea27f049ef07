// gpt_fsdp.h - the GPT of gpt_model.h trained through libfsdp, one rank.
//
// What a host framework writes around its model: one libfsdp unit per block,
// one for the embeddings (used at the input and again at the tied head), one
// for the final norm, and the begin/end brackets around every use. The demo
// (train_gpt.cpp) and the tests (tests/test_gpt.cpp) both train through it.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "fsdp.h"
#include "gpt_model.h"

namespace gpt {

// Throws std::runtime_error "<call>: <status>: <fsdp_last_error()>" unless OK.
void check_fsdp(fsdp_status_t st, const char* call);

// Registers the units of `specs` (model_units(shape)) in `ctx` (collective)
// and sets their initial values (init_param with `seed`): the same start on
// every rank, for the CPU and the GPU model alike.
std::vector<fsdp_unit_t*> register_units(fsdp_ctx_t* ctx, const Shape& shape, const std::vector<UnitSpec>& specs,
                                         uint64_t seed);

class FsdpGpt {
 public:
  // Registers the model's units in `ctx` (collective) and sets their initial
  // values (init_param with `seed`). `batch`: this rank's sequences per step.
  FsdpGpt(fsdp_ctx_t* ctx, const Shape& shape, int batch, bool recompute, uint64_t seed);
  ~FsdpGpt();
  FsdpGpt(const FsdpGpt&) = delete;
  FsdpGpt& operator=(const FsdpGpt&) = delete;

  // One training step (collective): forward and backward through every unit
  // on `inputs` / `targets` ([batch, context] bytes), then fsdp_step. Returns
  // this rank's mean loss.
  double train_step(const uint8_t* inputs, const uint8_t* targets);
  // Forward only (collective); this rank's mean loss.
  double eval(const uint8_t* inputs, const uint8_t* targets);
  // Every param's full fp32 values in model_units order (collective).
  std::vector<std::vector<float>> gather_params();

  const std::vector<UnitSpec>& specs() const { return specs_; }
  // Seconds spent inside libfsdp's begin/end/step calls since construction:
  // what the library costs the host's thread (gathers it waits for included).
  double library_seconds() const { return library_s_; }
  size_t activation_bytes() const { return model_.activation_bytes(); }

 private:
  class Access;
  double forward(const uint8_t* inputs, const uint8_t* targets, bool train);

  fsdp_ctx_t* ctx_;
  Shape shape_;
  std::vector<UnitSpec> specs_;
  std::vector<std::unique_ptr<Access>> units_;
  Model<float> model_;
  std::vector<float> cast_, grad_;
  double library_s_ = 0;
};

}  // namespace gpt
