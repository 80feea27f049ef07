// gpt_fsdp.cpp - the GPT through libfsdp (see gpt_fsdp.h).
#include "gpt_fsdp.h"

#include <chrono>
#include <functional>

namespace gpt {

void check_fsdp(fsdp_status_t st, const char* call) {
  if (st != FSDP_OK)
    throw std::runtime_error(std::string(call) + ": " + fsdp_status_name(st) + ": " + fsdp_last_error());
}
#define CHECK(call) check_fsdp((call), #call)
#define TIMED(call) GPT_TIMED(library_s_, call)

// A unit's params as fp32 for the model, and where its grads go. With
// param_dtype=fp32 the model works on libfsdp's buffers directly; with bf16 the
// gathered unit is cast to fp32 once per use, and the grads of a use are
// accumulated in fp32 and added into libfsdp's bf16 grad buffers at its end.
class FsdpGpt::Access {
 public:
  Access(fsdp_unit_t* unit, const UnitSpec& spec, fsdp_dtype_t dt) : unit_(unit), spec_(spec), dt_(dt) {
    for (const ParamSpec& p : spec.params) total_ += p.numel();
  }
  fsdp_unit_t* unit() const { return unit_; }

  UnitView<float> params(std::vector<float>& cast) const {
    UnitView<float> v;
    if (dt_ == FSDP_DTYPE_BF16) cast.resize(total_);
    size_t off = 0;
    for (size_t i = 0; i < spec_.params.size(); ++i) {
      void* p;
      CHECK(fsdp_param_ptr(unit_, i, &p));
      const size_t n = spec_.params[i].numel();
      if (dt_ == FSDP_DTYPE_FP32) {
        v.p.push_back(static_cast<const float*>(p));
      } else {
        const auto* h = static_cast<const uint16_t*>(p);
        for (size_t k = 0; k < n; ++k) cast[off + k] = bf16_to_float(h[k]);
        v.p.push_back(cast.data() + off);
      }
      off += n;
    }
    return v;
  }
  bool trainable() const {
    int t = 1;
    CHECK(fsdp_unit_trainable(unit_, &t));
    return t != 0;
  }
  // The params, and the grads to add into; a frozen unit's view has none.
  UnitView<float> grads(std::vector<float>& cast, std::vector<float>& grad) const {
    UnitView<float> v = params(cast);
    if (!trainable()) return v;
    if (dt_ == FSDP_DTYPE_BF16) grad.assign(total_, 0.0f);
    size_t off = 0;
    for (size_t i = 0; i < spec_.params.size(); ++i) {
      void* g;
      CHECK(fsdp_grad_ptr(unit_, i, &g));
      v.g.push_back(dt_ == FSDP_DTYPE_FP32 ? static_cast<float*>(g) : grad.data() + off);
      off += spec_.params[i].numel();
    }
    return v;
  }
  // bf16: adds this use's fp32 grads into libfsdp's grad buffers.
  void flush(const std::vector<float>& grad) const {
    if (dt_ == FSDP_DTYPE_FP32 || !trainable()) return;
    size_t off = 0;
    for (size_t i = 0; i < spec_.params.size(); ++i) {
      void* g;
      CHECK(fsdp_grad_ptr(unit_, i, &g));
      auto* h = static_cast<uint16_t*>(g);
      const size_t n = spec_.params[i].numel();
      for (size_t k = 0; k < n; ++k) h[k] = float_to_bf16(bf16_to_float(h[k]) + grad[off + k]);
      off += n;
    }
  }

 private:
  fsdp_unit_t* unit_;
  const UnitSpec& spec_;
  fsdp_dtype_t dt_;
  size_t total_ = 0;
};

std::vector<fsdp_unit_t*> register_units(fsdp_ctx_t* ctx, const Shape& shape, const std::vector<UnitSpec>& specs,
                                         uint64_t seed) {
  std::vector<fsdp_unit_t*> units;
  for (const UnitSpec& u : specs) {
    std::vector<const char*> names;
    std::vector<int32_t> ndims;
    std::vector<int64_t> dims;
    for (const ParamSpec& p : u.params) {
      names.push_back(p.name.c_str());
      ndims.push_back(static_cast<int32_t>(p.dims.size()));
      dims.insert(dims.end(), p.dims.begin(), p.dims.end());
    }
    fsdp_unit_t* unit;
    CHECK(fsdp_unit_register(ctx, u.name.c_str(), names.size(), names.data(), ndims.data(), dims.data(), &unit));
    std::vector<float> values;
    for (size_t i = 0; i < u.params.size(); ++i) {
      values.resize(u.params[i].numel());
      init_param(shape, u.params[i], seed, values.data());
      CHECK(fsdp_param_set_values(unit, i, values.data(), values.size()));
    }
    units.push_back(unit);
  }
  return units;
}

FsdpGpt::FsdpGpt(fsdp_ctx_t* ctx, const Shape& shape, int batch, bool recompute, uint64_t seed, Lora lora)
    : ctx_(ctx),
      shape_(shape),
      specs_(model_units(shape)),
      lora_specs_(lora.on() ? lora_units(shape, lora.rank) : std::vector<UnitSpec>{}),
      model_(shape, batch, recompute, lora) {
  fsdp_dtype_t dt;
  CHECK(fsdp_ctx_param_dtype(ctx, &dt));
  if (dt != FSDP_DTYPE_FP32 && dt != FSDP_DTYPE_BF16)
    throw std::runtime_error("the GPT example computes with param_dtype fp32 or bf16");
  const std::vector<fsdp_unit_t*> units = register_units(ctx, shape, specs_, seed);
  for (size_t k = 0; k < units.size(); ++k) units_.push_back(std::make_unique<Access>(units[k], specs_[k], dt));
  if (!lora.on()) return;
  const std::vector<fsdp_unit_t*> adapters = register_units(ctx, shape, lora_specs_, seed);
  for (size_t k = 0; k < adapters.size(); ++k)
    lora_.push_back(std::make_unique<Access>(adapters[k], lora_specs_[k], dt));
  for (fsdp_unit_t* u : units) CHECK(fsdp_unit_set_trainable(ctx, u, 0));
}

FsdpGpt::~FsdpGpt() = default;

std::vector<fsdp_unit_t*> FsdpGpt::units() const {
  std::vector<fsdp_unit_t*> out;
  for (const auto* list : {&units_, &lora_})
    for (const auto& a : *list) out.push_back(a->unit());
  return out;
}

double FsdpGpt::forward(const uint8_t* inputs, const uint8_t* targets, bool train) {
  const size_t L = static_cast<size_t>(shape_.layers);
  const Access& embed = *units_[0];
  TIMED(fsdp_forward_begin(embed.unit(), nullptr));
  model_.embed_forward(embed.params(cast_), inputs, shape_.context);
  TIMED(fsdp_forward_end(embed.unit(), nullptr));
  for (size_t l = 0; l < L; ++l) {
    const Access& b = *units_[1 + l];
    const Access* a = lora_.empty() ? nullptr : lora_[l].get();
    TIMED(fsdp_forward_begin(b.unit(), nullptr));
    if (a) TIMED(fsdp_forward_begin(a->unit(), nullptr));
    const UnitView<float> av = a ? a->params(lora_cast_) : UnitView<float>{};
    model_.block_forward(static_cast<int>(l), b.params(cast_), a ? &av : nullptr);
    if (a) TIMED(fsdp_forward_end(a->unit(), nullptr));
    TIMED(fsdp_forward_end(b.unit(), nullptr));
  }
  const Access& lnf = *units_[1 + L];
  TIMED(fsdp_forward_begin(lnf.unit(), nullptr));
  model_.final_forward(lnf.params(cast_));
  TIMED(fsdp_forward_end(lnf.unit(), nullptr));
  double scale = 1.0;  // the loss scale (1 unless loss scaling is on)
  if (train) {
    uint64_t skipped;
    CHECK(fsdp_loss_scale(ctx_, &scale, &skipped));
  }
  TIMED(fsdp_forward_begin(embed.unit(), nullptr));  // the tied head: the embed unit's second use
  const double loss = model_.head_forward(embed.params(cast_), targets, scale);
  TIMED(fsdp_forward_end(embed.unit(), nullptr));
  return loss;
}

double FsdpGpt::eval(const uint8_t* inputs, const uint8_t* targets) { return forward(inputs, targets, false); }

double FsdpGpt::train_step(const uint8_t* inputs, const uint8_t* targets) {
  const double loss = forward(inputs, targets, true);
  const size_t L = static_cast<size_t>(shape_.layers);
  auto backward = [&](const Access& a, const std::function<void(const UnitView<float>&)>& fn) {
    TIMED(fsdp_backward_begin(a.unit(), nullptr));
    fn(a.grads(cast_, grad_));  // with --recompute, block_backward runs the block's forward again here
    a.flush(grad_);
    TIMED(fsdp_backward_end(a.unit(), nullptr));
  };
  backward(*units_[0], [&](const UnitView<float>& v) { model_.head_backward(v); });
  backward(*units_[1 + L], [&](const UnitView<float>& v) { model_.final_backward(v); });
  for (size_t l = L; l-- > 0;) {
    const Access* a = lora_.empty() ? nullptr : lora_[l].get();
    if (a) TIMED(fsdp_backward_begin(a->unit(), nullptr));
    backward(*units_[1 + l], [&](const UnitView<float>& v) {
      const UnitView<float> av = a ? a->grads(lora_cast_, lora_grad_) : UnitView<float>{};
      model_.block_backward(static_cast<int>(l), v, a ? &av : nullptr);
      if (a) a->flush(lora_grad_);
    });
    if (a) TIMED(fsdp_backward_end(a->unit(), nullptr));
  }
  // The embeddings' own grads (the input's rows); a frozen embed unit has
  // none and nothing before it needs a grad: no second backward use.
  if (units_[0]->trainable()) backward(*units_[0], [&](const UnitView<float>& v) { model_.embed_backward(v); });
  TIMED(fsdp_step(ctx_, nullptr));
  return loss;
}

std::vector<std::vector<float>> gather_params(const std::vector<fsdp_unit_t*>& units,
                                              const std::vector<UnitSpec>& specs) {
  std::vector<std::vector<float>> out;
  for (size_t u = 0; u < units.size(); ++u)
    for (size_t i = 0; i < specs[u].params.size(); ++i) {
      out.emplace_back(specs[u].params[i].numel());
      CHECK(fsdp_gather_param(units[u], i, out.back().data(), out.back().size()));
    }
  return out;
}

std::vector<std::vector<float>> FsdpGpt::gather_params() {
  std::vector<UnitSpec> all = specs_;
  all.insert(all.end(), lora_specs_.begin(), lora_specs_.end());
  return gpt::gather_params(units(), all);
}

}  // namespace gpt
