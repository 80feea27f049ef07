// gpt_fsdp.h - the GPT of gpt_model.h trained through libfsdp, one rank.
//
// What a host framework writes around its model: one libfsdp unit per block,
// one for the embeddings (used at the input and again at the tied head), one
// for the final norm, and the begin/end brackets around every use. The demo
// (train_gpt.cpp) and the tests (tests/test_gpt.cpp) both train through it.
#pragma once

#include <chrono>
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

// Runs a libfsdp call, adds the seconds it took to `acc`, throws unless OK.
#define GPT_TIMED(acc, call)                                                                \
  do {                                                                                      \
    const auto t0_ = std::chrono::steady_clock::now();                                      \
    const fsdp_status_t st_ = (call);                                                       \
    (acc) += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count(); \
    ::gpt::check_fsdp(st_, #call);                                                          \
  } while (0)

// What train_gpt trains on one rank: the CPU model (FsdpGpt) or the GPU one
// (gpt::cuda, in CUDA builds), chosen by the context's device (make_trainer).
class Trainer {
 public:
  virtual ~Trainer() = default;
  // One training step (collective): forward and backward on `inputs` /
  // `targets` (host bytes [batch, context]), then fsdp_step. This rank's mean loss.
  virtual double train_step(const uint8_t* inputs, const uint8_t* targets) = 0;
  // Forward only (collective); this rank's mean loss.
  virtual double eval(const uint8_t* inputs, const uint8_t* targets) = 0;
  // Every param's full fp32 values in model_units order, then with LoRA the
  // adapters' in lora_units order (collective).
  virtual std::vector<std::vector<float>> gather_params() = 0;
  // Seconds spent inside libfsdp's begin/end/step calls since construction:
  // what the library costs the host's thread (waits for gathers included).
  virtual double library_seconds() const = 0;
  // Bytes of the model's own buffers (activations, work space).
  virtual size_t activation_bytes() const = 0;
};

// The trainer for a context on `device` ("cpu", "cuda:N": the context's
// config value). The GPU model computes in bf16 and has no recompute and no
// LoRA; a build without it refuses "cuda" saying why. `graph`: the GPU
// model's step captured in a CUDA graph and replayed (a world of one).
std::unique_ptr<Trainer> make_trainer(fsdp_ctx_t* ctx, const std::string& device, const Shape& shape, int batch,
                                      bool recompute, uint64_t seed, Lora lora = {}, bool graph = false);

// Every param of `units` (model_units order) gathered in full, fp32 (collective).
std::vector<std::vector<float>> gather_params(const std::vector<fsdp_unit_t*>& units,
                                              const std::vector<UnitSpec>& specs);

// Registers the units of `specs` (model_units(shape), or lora_units) in
// `ctx` (collective) and sets their initial values (init_param with `seed`):
// the same start on every rank, for the CPU and the GPU model alike.
std::vector<fsdp_unit_t*> register_units(fsdp_ctx_t* ctx, const Shape& shape, const std::vector<UnitSpec>& specs,
                                         uint64_t seed);

class FsdpGpt : public Trainer {
 public:
  // Registers the model's units in `ctx` (collective) and sets their initial
  // values (init_param with `seed`). `batch`: this rank's sequences per step.
  // With LoRA it also registers the adapter units (after the base's) and
  // freezes every base unit: only the adapters train. Load the base's
  // weights afterwards (fsdp_load_pretrained).
  FsdpGpt(fsdp_ctx_t* ctx, const Shape& shape, int batch, bool recompute, uint64_t seed, Lora lora = {});
  ~FsdpGpt() override;
  FsdpGpt(const FsdpGpt&) = delete;
  FsdpGpt& operator=(const FsdpGpt&) = delete;

  // One training step (collective): forward and backward through every unit
  // on `inputs` / `targets` ([batch, context] bytes), then fsdp_step. Returns
  // this rank's mean loss.
  double train_step(const uint8_t* inputs, const uint8_t* targets) override;
  // Forward only (collective); this rank's mean loss.
  double eval(const uint8_t* inputs, const uint8_t* targets) override;
  // Every param's full fp32 values in model_units order (collective).
  std::vector<std::vector<float>> gather_params() override;

  const std::vector<UnitSpec>& specs() const { return specs_; }
  const std::vector<UnitSpec>& lora_specs() const { return lora_specs_; }
  // The base's units (model_units order), then the adapters' (lora_units order).
  std::vector<fsdp_unit_t*> units() const;
  // Seconds spent inside libfsdp's begin/end/step calls since construction:
  // what the library costs the host's thread (gathers it waits for included).
  double library_seconds() const override { return library_s_; }
  size_t activation_bytes() const override { return model_.activation_bytes(); }

 private:
  class Access;
  double forward(const uint8_t* inputs, const uint8_t* targets, bool train);

  fsdp_ctx_t* ctx_;
  Shape shape_;
  std::vector<UnitSpec> specs_, lora_specs_;
  std::vector<std::unique_ptr<Access>> units_;
  std::vector<std::unique_ptr<Access>> lora_;  // per block, with LoRA
  Model<float> model_;
  std::vector<float> cast_, grad_, lora_cast_, lora_grad_;
  double library_s_ = 0;
};

}  // namespace gpt
