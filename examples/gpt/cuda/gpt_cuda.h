// gpt_cuda.h - the GPT of gpt_model.h on a GPU, and driven through libfsdp on
// device=cuda.
//
// The same model as the CPU one (byte vocab 256, learned positions, pre-norm
// blocks with LayerNorm eps 1e-5, fused qkv Linear, causal multi-head
// attention with scale 1/sqrt(head_dim), tanh-form GELU MLP of 4x the width,
// final LayerNorm, head tied to wte, mean cross-entropy), with the same units
// and params in the same order, on param_dtype bf16:
//   - every Linear and the tied head: cuBLAS bf16 GEMMs accumulating in fp32
//     (cublasGemmEx, CUBLAS_COMPUTE_32F); weight grads are added by the GEMM
//     itself (beta 1) into libfsdp's bf16 grad buffers;
//   - attention: cuDNN's fused flash attention, forward and backward, causal
//     (gpt_attention.h, through cudnn-frontend);
//   - everything else: this example's kernels (gpt_cuda.cu): embedding
//     forward / backward, LayerNorm forward / backward, bias adds fused with
//     the GELU or the residual add, GELU backward, bias and norm grads (column
//     sums, deterministic), softmax cross-entropy forward / backward.
//
// Activations: the residual stream, its grad and the LayerNorm statistics are
// fp32 (a residual stream of L blocks summed in bf16 would lose the small
// updates of each block, and the loss would drift from the CPU model's); what
// a GEMM or the attention reads (LayerNorm outputs, qkv, the attention output,
// the GELU's input and output, the grads fed to GEMMs) is bf16, because cuBLAS
// takes both operands of a product in one type, cuDNN's attention takes bf16,
// and bf16 halves the activation memory that a model keeps for its backward.
// GEMM outputs that a kernel adds a bias to are fp32.
//
// Everything is queued on one CUDA stream, the one passed to libfsdp's calls
// (docs/gpu.md, "the stream contract"); nothing here waits for the GPU except
// loss(), which reads the loss back.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fsdp.h"
#include "gpt_fsdp.h"
#include "gpt_model.h"

namespace gpt::cuda {

// Why the GPU model cannot take `s` ("" when it can): gpt::shape_error's
// reasons, and the head dims cuDNN's fused attention refuses.
std::string cuda_shape_error(const Shape& s);

// One unit's params (read) and grads (added into): device pointers to bf16
// values (their bits, as uint16_t; the layout of gpt::model_units).
struct DeviceView {
  std::vector<const uint16_t*> p;
  std::vector<uint16_t*> g;
};

// The model's activations and work buffers on the current CUDA device, for
// `batch` sequences of up to `context` tokens; all work on `stream`. The call
// order is the CPU Model's: embed, blocks, final, head forward; then head,
// final, blocks in reverse, embed backward.
class Model {
 public:
  Model(const Shape& s, int batch, cudaStream_t stream);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  // `tokens` and `targets` are host bytes [batch, t] (copied when the call is made).
  void embed_forward(const DeviceView& embed, const uint8_t* tokens, int t);
  // A batch of whole contexts staged in pinned host memory (host work: the
  // token rows sorted there), then a forward that copies it from there: a
  // step a CUDA graph captures reads the batch staged before each launch.
  // Stage only once the stream has read the last staged batch (loss() waited).
  void stage(const uint8_t* tokens, const uint8_t* targets, int t);
  void embed_forward_staged(const DeviceView& embed);
  void block_forward(int layer, const DeviceView& block);
  void final_forward(const DeviceView& lnf);
  // The logits, the mean cross-entropy against `targets` (null: the staged
  // batch's) and d(loss * scale)/d(logits), the scale read from `scale_dev`
  // (device memory, when the kernel runs) where given.
  void head_forward(const DeviceView& embed, const uint8_t* targets, float scale = 1.0f,
                    const double* scale_dev = nullptr);
  // The loss of the last head_forward (waits for the stream).
  double loss();

  void head_backward(const DeviceView& embed);
  void final_backward(const DeviceView& lnf);
  void block_backward(int layer, const DeviceView& block);
  void embed_backward(const DeviceView& embed);

  // Device bytes this model holds (activations, work buffers, cuDNN's workspace).
  size_t activation_bytes() const;
  const Shape& shape() const { return s_; }
  int batch() const { return b_; }

 private:
  void embed_kernel(const DeviceView& embed);  // the forward's kernel, after the copies
  struct Impl;
  Shape s_;
  int b_;
  std::unique_ptr<Impl> impl_;
};

// The GPT trained through libfsdp on a CUDA context (device=cuda, param_dtype
// bf16), like gpt::FsdpGpt on the CPU: one unit per block, "embed" used at the
// input and again at the tied head, "lnf"; the same init (init_param, on the
// host), so a CPU run and a GPU run start from the same params.
class FsdpGptCuda : public Trainer {
 public:
  // Registers the units in `ctx` (collective) and sets their initial values.
  // `batch`: this rank's sequences per step; `stream`: the host's stream.
  // `graph`: after kGraphWarmup eager steps, the step (forward, backward,
  // fsdp_step) is captured once in a CUDA graph and each later step stages
  // its batch and launches it (a world of one: ranks sharing the GPU would
  // need one graph for all of them).
  FsdpGptCuda(fsdp_ctx_t* ctx, const Shape& shape, int batch, uint64_t seed, cudaStream_t stream, bool graph = false);
  ~FsdpGptCuda() override;
  FsdpGptCuda(const FsdpGptCuda&) = delete;
  FsdpGptCuda& operator=(const FsdpGptCuda&) = delete;

  // One training step (collective): forward and backward on `inputs` /
  // `targets` (host bytes [batch, context]), then fsdp_step. This rank's mean loss.
  double train_step(const uint8_t* inputs, const uint8_t* targets) override;
  // Forward only (collective); this rank's mean loss.
  double eval(const uint8_t* inputs, const uint8_t* targets) override;
  // Every param's full fp32 values (collective).
  std::vector<std::vector<float>> gather_params() override;
  double library_seconds() const override { return library_s_; }

  const std::vector<UnitSpec>& specs() const { return specs_; }
  size_t activation_bytes() const override { return model_.activation_bytes(); }

 private:
  static constexpr int kGraphWarmup = 2;  // eager steps before the capture: slots and tables are made
  DeviceView view(size_t unit, bool grads);
  // inputs null: the staged batch.
  void forward(const uint8_t* inputs, const uint8_t* targets, bool train);
  // The step's work, queued on the stream (no wait): forward, backward, fsdp_step.
  void queue_step(const uint8_t* inputs, const uint8_t* targets);

  fsdp_ctx_t* ctx_;
  Shape shape_;
  cudaStream_t stream_;
  std::vector<UnitSpec> specs_;
  std::vector<fsdp_unit_t*> units_;
  Model model_;
  bool checked_device_ = false;
  double library_s_ = 0;
  const double* scale_dev_ = nullptr;  // fsdp_loss_scale_device: the loss scale where the step keeps it
  bool graph_ = false;
  int eager_steps_ = 0;
  cudaGraphExec_t exec_ = nullptr;
};

// train_gpt's trainer on GPU `ordinal` (the context's "cuda:N"): FsdpGptCuda on
// a stream of its own. recompute is refused, saying why.
std::unique_ptr<Trainer> make_cuda_trainer(fsdp_ctx_t* ctx, int ordinal, const Shape& shape, int batch, bool recompute,
                                           uint64_t seed, bool graph = false);

}  // namespace gpt::cuda
