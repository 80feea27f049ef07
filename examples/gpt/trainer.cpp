// trainer.cpp - gpt::make_trainer: the CPU GPT, or the GPU one where it is built.
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "gpt_fsdp.h"
#ifdef FSDP_GPT_CUDA
#include "gpt_cuda.h"
#endif

namespace gpt {

std::unique_ptr<Trainer> make_trainer(fsdp_ctx_t* ctx, const std::string& device, const Shape& shape, int batch,
                                      bool recompute, uint64_t seed, Lora lora, bool graph) {
  if (device.rfind("cuda", 0) != 0) {
    if (graph)
      throw std::runtime_error("--graph captures the GPU GPT's step in a CUDA graph: it needs --device cuda");
    return std::make_unique<FsdpGpt>(ctx, shape, batch, recompute, seed, lora);
  }
  if (lora.on())
    throw std::runtime_error("device " + device +
                             ": the GPU GPT has no LoRA adapters (its kernels are the base model's); run --lora on "
                             "the CPU model (--device cpu)");
  const size_t colon = device.find(':');
  const int ordinal = colon == std::string::npos ? 0 : std::atoi(device.c_str() + colon + 1);
#ifdef FSDP_GPT_CUDA
  return cuda::make_cuda_trainer(ctx, ordinal, shape, batch, recompute, seed, graph);
#else
  (void)ordinal;
  (void)graph;
  throw std::runtime_error("device " + device +
                           ": this train_gpt was built without the GPU GPT (it needs the CUDA toolkit, cuDNN 9 and "
                           "cudnn-frontend's headers: docs/gpu.md, 'The GPT on a GPU')");
#endif
}

}  // namespace gpt
