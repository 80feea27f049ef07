// gpt_model.h - a small GPT, forward and backward by hand, on the CPU.
//
// What a host framework brings to libfsdp: the model's math. Nothing here
// knows libfsdp; the model reads its params and adds into its grads through
// plain pointers, one unit at a time, so the same code trains under libfsdp
// (train_gpt.cpp: the pointers are a unit's gathered buffers) and as the
// unsharded reference of the tests (the pointers are plain vectors).
//
// The model: byte tokens (vocab 256), learned positions, `layers` pre-norm
// blocks
//   x = x + proj(attn(ln1(x)));  x = x + fc2(gelu(fc(ln2(x))))
// with causal multi-head self-attention (one fused qkv Linear), a GELU (tanh
// form) MLP of 4x the width, a final LayerNorm, and the head tied to the token
// embedding: logits = lnf(x) wte^T. Loss: mean cross-entropy over the tokens.
//
// Units (each one libfsdp unit): "embed" {wte [256, C], wpe [T, C]}, used at
// the input and again at the head; "h<l>" per block; "lnf" the final norm.
// With LoRA (fine-tuning, --lora R): a unit "h<l>.lora" per block holds the
// adapters of its four projections; the base's params may then be frozen,
// which the model sees as a view without grads.
// Matrix products go through OpenBLAS (cblas_sgemm / cblas_dgemm): the model
// is a template on float (training) and double (the finite-difference check).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace gpt {

constexpr int kVocab = 256;

struct Shape {
  int layers = 4, width = 128, heads = 4, context = 128;
  int head_dim() const { return width / heads; }
};
// Why a shape cannot be built ("" when it can).
std::string shape_error(const Shape& s);

struct ParamSpec {
  std::string name;           // unique across the model, e.g. "h0.attn.qkv.weight"
  std::vector<int64_t> dims;  // row-major shape
  size_t numel() const;
};

// The params of each unit in registration order (the indices below).
enum EmbedParam { kWte, kWpe, kEmbedParams };
enum BlockParam { kLn1W, kLn1B, kQkvW, kQkvB, kProjW, kProjB, kLn2W, kLn2B, kFcW, kFcB, kFc2W, kFc2B, kBlockParams };
enum FinalParam { kLnfW, kLnfB, kFinalParams };

// Units in forward order: "embed", "h0" .. "h<L-1>", "lnf".
struct UnitSpec {
  std::string name;
  std::vector<ParamSpec> params;
};
std::vector<UnitSpec> model_units(const Shape& s);
size_t param_count(const Shape& s);
// LoRA (Hu et al., 2021) on each block's four projections (attn.qkv,
// attn.proj, mlp.fc, mlp.fc2): y = W x + b + (alpha / rank) B (A x), with
// A [rank, in] and B [out, rank]. A starts uniform in +-1/sqrt(in) (PEFT's
// Kaiming init), B at zero, so training starts from the base model exactly.
struct Lora {
  int rank = 0;  // 0: no adapters
  double alpha = 0;
  bool on() const { return rank > 0; }
  double scale() const { return on() ? alpha / rank : 0.0; }
};
enum LoraParam { kQkvLoraA, kQkvLoraB, kProjLoraA, kProjLoraB, kFcLoraA, kFcLoraB, kFc2LoraA, kFc2LoraB, kLoraParams };
// The adapter units "h<l>.lora", one per block in block order, each with
// "h<l>.attn.qkv.lora_A", "h<l>.attn.qkv.lora_B", ... in LoraParam order.
std::vector<UnitSpec> lora_units(const Shape& s, int rank);
// fnmatch patterns of the params that take no weight decay: biases, norms, embeddings.
extern const char* const kNoWeightDecay;

// The initial values of a param (GPT-2's: N(0, 0.02), residual projections
// N(0, 0.02/sqrt(2L)), norms 1, biases 0), from a generator seeded by the
// param's name and `seed`: the same on every rank and in every test.
void init_param(const Shape& s, const ParamSpec& p, uint64_t seed, float* out);

// Pointers to one unit's params (read) and grads (added into). A frozen
// unit's view has no grads (g empty): its input grads still flow through it.
template <typename T>
struct UnitView {
  std::vector<const T*> p;
  std::vector<T*> g;
  T* grad(size_t i) const { return g.empty() ? nullptr : g[i]; }
};

// Activations for a batch of `batch` sequences of `t` <= context tokens.
// With recompute, a block keeps only its input after forward and runs its
// forward again inside its backward.
template <typename T>
class Model {
 public:
  Model(const Shape& s, int batch, bool recompute, Lora lora = {});

  // Forward, unit by unit; `tokens` is [batch, t] (t <= context).
  void embed_forward(const UnitView<T>& embed, const uint8_t* tokens, int t);
  // With LoRA, `lora` is the block's adapter unit (required).
  void block_forward(int layer, const UnitView<T>& block, const UnitView<T>* lora = nullptr);
  void final_forward(const UnitView<T>& lnf);
  // The head (the embed unit's second use): the mean cross-entropy against
  // `targets` [batch, t]; keeps d(loss * scale)/d(logits) for head_backward.
  double head_forward(const UnitView<T>& embed, const uint8_t* targets, double scale = 1.0);
  // Logits of the last position of sequence 0 (for sampling), after head_forward
  // with targets == nullptr.
  const T* last_logits() const;

  // Backward, in reverse: adds into the views' grads.
  void head_backward(const UnitView<T>& embed);
  void final_backward(const UnitView<T>& lnf);
  void block_backward(int layer, const UnitView<T>& block, const UnitView<T>* lora = nullptr);
  void embed_backward(const UnitView<T>& embed);

  // Bytes of activations this model holds (for the demo's memory line).
  size_t activation_bytes() const;
  const Shape& shape() const { return s_; }
  int batch() const { return b_; }

 private:
  struct BlockActs {  // what one block's backward needs
    std::vector<T> ln1, mean1, rstd1, qkv, att, y, xmid, ln2, mean2, rstd2, fc, act;
    std::vector<T> lora[4];  // with LoRA: A x of each projection [n, rank], in LoraParam / 2 order
  };
  void run_block(int layer, const UnitView<T>& u, const UnitView<T>* lora, BlockActs& a, T* out);
  const UnitView<T>* check_lora(const UnitView<T>* lora) const;
  BlockActs& acts_of(int layer) { return recompute_ ? scratch_ : acts_[static_cast<size_t>(layer)]; }

  Shape s_;
  int b_, t_ = 0;
  bool recompute_;
  Lora lora_;
  std::vector<T> dlora_;  // LoRA backward scratch [n, rank]
  const uint8_t* tokens_ = nullptr;
  std::vector<std::vector<T>> x_;  // residual stream: x_[l] is block l's input, x_[L] the last output
  std::vector<BlockActs> acts_;    // per block (empty with recompute)
  BlockActs scratch_;              // the recomputed block (with recompute)
  std::vector<T> lnf_, meanf_, rstdf_, probs_, dlogits_, dx_, dx2_, dtmp_, dqkv_, datt_, dbig_;
  bool with_targets_ = false;
};

// ---- data --------------------------------------------------------------------

// A byte corpus split into train (the first 90%) and validation (the rest).
struct Corpus {
  std::vector<uint8_t> train, val;
};
// Reads `path` (dropping '\r'); throws std::runtime_error naming the file.
Corpus load_corpus(const std::string& path);
// Random bytes (the benchmark's data), `n` of them, split like a text.
Corpus random_corpus(size_t n, uint64_t seed);
// The entropy in nats of `text` under the byte frequencies of `train`
// (add-one smoothed): what a model that knows only byte counts would score.
double unigram_loss(const std::vector<uint8_t>& train, const std::vector<uint8_t>& text);
// Sequence `index` of the global batch of step `step`: `t + 1` bytes (inputs
// and the targets one to the right) starting at an offset drawn from
// (seed, step, index), the same on every rank whatever the world size.
void sample_window(const std::vector<uint8_t>& data, uint64_t seed, int64_t step, int index, int t, uint8_t* out);
// Sequences first .. first+count-1 of the batch of `step`: their t tokens
// into inputs [count, t], the next tokens into targets [count, t].
void load_batch(const std::vector<uint8_t>& data, uint64_t seed, int64_t step, int first, int count, int t,
                uint8_t* inputs, uint8_t* targets);
// The validation windows' seed: the run's seed plus this.
constexpr uint64_t kValSeedOffset = 77;

// The learning rate of step `step` (1-based) of `total`: linear warmup over
// the first 5% of the steps, then cosine decay to a tenth of `base`.
double lr_schedule(double base, int64_t step, int64_t total);

// bf16 <-> fp32 (round to nearest even), as the host converts a gathered unit.
float bf16_to_float(uint16_t h);
uint16_t float_to_bf16(float f);

}  // namespace gpt
