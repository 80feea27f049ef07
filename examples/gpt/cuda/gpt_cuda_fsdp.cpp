// gpt_cuda_fsdp.cpp - the GPU GPT through libfsdp on device=cuda (see gpt_cuda.h).
//
// What differs from the CPU's gpt_fsdp.cpp: libfsdp's param and grad
// pointers are GPU memory in bf16, which the model reads and adds into
// directly (no cast per use), and every begin/end/step call gets the stream
// the model's work is queued on, so that libfsdp orders its gathers and
// reduce-scatters after that work without the host waiting (docs/gpu.md).
// The loss is scaled by the scale libfsdp's step keeps on the device
// (fsdp_loss_scale_device): no host read per step. With `graph` the step is
// captured once in a CUDA graph and replayed (train_gpt --graph).
#include <cuda_runtime_api.h>

#include <chrono>
#include <functional>
#include <stdexcept>
#include <string>

#include "gpt_cuda.h"
#include "gpt_fsdp.h"

namespace gpt::cuda {

#define CHECK(call) gpt::check_fsdp((call), #call)
#define TIMED(call) GPT_TIMED(library_s_, call)

FsdpGptCuda::FsdpGptCuda(fsdp_ctx_t* ctx, const Shape& shape, int batch, uint64_t seed, cudaStream_t stream,
                         bool graph)
    : ctx_(ctx), shape_(shape), stream_(stream), specs_(model_units(shape)), model_(shape, batch, stream), graph_(graph) {
  fsdp_dtype_t dt;
  CHECK(fsdp_ctx_param_dtype(ctx, &dt));
  if (dt != FSDP_DTYPE_BF16) throw std::runtime_error("the GPU GPT computes with param_dtype bf16");
  if (graph) {
    int world = 0;
    CHECK(fsdp_ctx_world_size(ctx, &world));
    if (world != 1)
      throw std::runtime_error("--graph captures one rank's step: run it at a world of one (--ranks 1 "
                               "--resume-ranks 1); ranks sharing the GPU would need one graph for all of them");
  }
  units_ = register_units(ctx, shape, specs_, seed);  // the CPU's init: both runs start from the same params
  CHECK(fsdp_loss_scale_device(ctx, &scale_dev_));
}

FsdpGptCuda::~FsdpGptCuda() {
  if (exec_ != nullptr) {
    cudaStreamSynchronize(stream_);
    cudaGraphExecDestroy(exec_);
  }
}

DeviceView FsdpGptCuda::view(size_t unit, bool grads) {
  DeviceView v;
  for (size_t i = 0; i < specs_[unit].params.size(); ++i) {
    void* p;
    CHECK(fsdp_param_ptr(units_[unit], i, &p));
    v.p.push_back(static_cast<const uint16_t*>(p));
    if (grads) {
      void* g;
      CHECK(fsdp_grad_ptr(units_[unit], i, &g));
      v.g.push_back(static_cast<uint16_t*>(g));
    }
  }
  if (!checked_device_) {  // the kernels would fault on a CPU context's host buffers
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, v.p[0]) != cudaSuccess || attr.type != cudaMemoryTypeDevice)
      throw std::runtime_error("the GPU GPT needs a context on device=cuda (its params are not GPU memory)");
    checked_device_ = true;
  }
  return v;
}

void FsdpGptCuda::forward(const uint8_t* inputs, const uint8_t* targets, bool train) {
  const size_t L = static_cast<size_t>(shape_.layers);
  fsdp_unit_t* embed = units_[0];
  TIMED(fsdp_forward_begin(embed, stream_));
  if (inputs != nullptr) {
    model_.embed_forward(view(0, false), inputs, shape_.context);
  } else {
    model_.embed_forward_staged(view(0, false));
  }
  TIMED(fsdp_forward_end(embed, stream_));
  for (size_t l = 0; l < L; ++l) {
    TIMED(fsdp_forward_begin(units_[1 + l], stream_));
    model_.block_forward(static_cast<int>(l), view(1 + l, false));
    TIMED(fsdp_forward_end(units_[1 + l], stream_));
  }
  TIMED(fsdp_forward_begin(units_[1 + L], stream_));
  model_.final_forward(view(1 + L, false));
  TIMED(fsdp_forward_end(units_[1 + L], stream_));
  TIMED(fsdp_forward_begin(embed, stream_));  // the tied head: the embed unit's second use
  // Training scales the loss by the step's loss scale (1 unless loss scaling
  // is on), read on the device: no host wait for the last step.
  model_.head_forward(view(0, false), targets, 1.0f, train ? scale_dev_ : nullptr);
  TIMED(fsdp_forward_end(embed, stream_));
}

double FsdpGptCuda::eval(const uint8_t* inputs, const uint8_t* targets) {
  forward(inputs, targets, false);
  return model_.loss();
}

double FsdpGptCuda::train_step(const uint8_t* inputs, const uint8_t* targets) {
  if (!graph_ || eager_steps_ < kGraphWarmup) {
    ++eager_steps_;
    queue_step(inputs, targets);
    return model_.loss();  // computed before the backward; waits for the stream
  }
  model_.stage(inputs, targets, shape_.context);  // the last step's loss() waited: the stream read the last batch
  if (exec_ == nullptr) {
    // Once: the step's work on the stream captured into a graph (nothing of
    // it runs now); each step then launches it.
    auto graph_check = [](cudaError_t e, const char* what) {
      if (e != cudaSuccess) throw std::runtime_error(std::string("--graph: ") + what + ": " + cudaGetErrorString(e));
    };
    graph_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize before the capture");
    graph_check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    cudaGraph_t g = nullptr;
    try {
      queue_step(nullptr, nullptr);
    } catch (...) {
      cudaStreamEndCapture(stream_, &g);
      if (g != nullptr) cudaGraphDestroy(g);
      throw;
    }
    graph_check(cudaStreamEndCapture(stream_, &g), "cudaStreamEndCapture");
    cudaError_t e = cudaGraphInstantiate(&exec_, g, 0);
    cudaGraphDestroy(g);
    graph_check(e, "cudaGraphInstantiate");
  }
  auto t0 = std::chrono::steady_clock::now();
  cudaError_t e = cudaGraphLaunch(exec_, stream_);
  library_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (e != cudaSuccess) throw std::runtime_error(std::string("--graph: cudaGraphLaunch: ") + cudaGetErrorString(e));
  return model_.loss();
}

void FsdpGptCuda::queue_step(const uint8_t* inputs, const uint8_t* targets) {
  forward(inputs, targets, true);
  const size_t L = static_cast<size_t>(shape_.layers);
  // Each use's grads are added into the grad buffer libfsdp zeroed for it.
  auto backward = [&](size_t unit, const std::function<void(const DeviceView&)>& fn) {
    TIMED(fsdp_backward_begin(units_[unit], stream_));
    fn(view(unit, true));
    TIMED(fsdp_backward_end(units_[unit], stream_));
  };
  backward(0, [&](const DeviceView& v) { model_.head_backward(v); });
  backward(1 + L, [&](const DeviceView& v) { model_.final_backward(v); });
  for (size_t l = L; l-- > 0;)
    backward(1 + l, [&](const DeviceView& v) { model_.block_backward(static_cast<int>(l), v); });
  backward(0, [&](const DeviceView& v) { model_.embed_backward(v); });
  TIMED(fsdp_step(ctx_, stream_));
}

std::vector<std::vector<float>> FsdpGptCuda::gather_params() { return gpt::gather_params(units_, specs_); }

namespace {

// A CUDA stream of its own, destroyed (after its work) with the object.
class OwnedStream {
 public:
  explicit OwnedStream(int ordinal) {
    cudaError_t e = cudaSetDevice(ordinal);  // this thread's GPU: the model's buffers go there
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking);
    if (e != cudaSuccess)
      throw std::runtime_error(std::string("the GPU GPT's stream on cuda:") + std::to_string(ordinal) + ": " +
                               cudaGetErrorString(e));
  }
  ~OwnedStream() {
    cudaStreamSynchronize(s_);
    cudaStreamDestroy(s_);
  }
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// The GPU trainer of train_gpt: the model on its own stream of the context's GPU.
class CudaTrainer : public Trainer {
 public:
  CudaTrainer(fsdp_ctx_t* ctx, int ordinal, const Shape& shape, int batch, uint64_t seed, bool graph)
      : stream_(ordinal), model_(ctx, shape, batch, seed, stream_.get(), graph) {}
  double train_step(const uint8_t* inputs, const uint8_t* targets) override {
    return model_.train_step(inputs, targets);
  }
  double eval(const uint8_t* inputs, const uint8_t* targets) override { return model_.eval(inputs, targets); }
  std::vector<std::vector<float>> gather_params() override { return model_.gather_params(); }
  double library_seconds() const override { return model_.library_seconds(); }
  size_t activation_bytes() const override { return model_.activation_bytes(); }

 private:
  // Declared before the model, so destroyed after it: the model syncs and
  // frees on the stream (and its cuBLAS and cuDNN handles are bound to it).
  OwnedStream stream_;
  FsdpGptCuda model_;
};

}  // namespace

std::unique_ptr<Trainer> make_cuda_trainer(fsdp_ctx_t* ctx, int ordinal, const Shape& shape, int batch, bool recompute,
                                           uint64_t seed, bool graph) {
  if (recompute)
    throw std::runtime_error("the GPU GPT has no --recompute: its blocks keep their activations (the CPU GPT has it)");
  return std::make_unique<CudaTrainer>(ctx, ordinal, shape, batch, seed, graph);
}

}  // namespace gpt::cuda
