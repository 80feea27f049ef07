// gpt_attention.h - causal multi-head attention through cuDNN's fused
// scaled-dot-product attention (flash attention), forward and backward.
//
// The graphs are built with cudnn-frontend (the header-only C++ API of cuDNN
// 9's backend, tools/deps.sh fetches it) in gpt_attention.cpp, which g++
// compiles: the frontend's headers are host code, and keeping them out of the
// .cu keeps nvcc's part of the build small.
//
// Layouts (row-major, bf16): qkv [b, t, 3, h, d] as the fused qkv Linear
// writes it (q, k, v of token (b, t), head h at qkv + (b t) 3C + {0, C, 2C} +
// h d); y and dy [b, t, h, d] (= [b t, C], the proj Linear's input); stats
// [b, h, t] fp32, the softmax's log-sum-exp per row, kept from the forward for
// the backward. The scale is 1/sqrt(d), the mask causal (key j <= query i).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>

namespace gpt::cuda {

class Attention {
 public:
  // All work goes on `stream`; the graphs are built at the first call of each
  // shape (b, t) and kept.
  Attention(cudaStream_t stream, int heads, int head_dim);
  ~Attention();
  Attention(const Attention&) = delete;
  Attention& operator=(const Attention&) = delete;

  // y = softmax(q k^T / sqrt(d) + causal mask) v, and the stats.
  void forward(int b, int t, const void* qkv, void* y, float* stats);
  // dqkv (written, not added) from dy, with the forward's qkv, y and stats.
  void backward(int b, int t, const void* qkv, const void* y, const void* dy, const float* stats, void* dqkv);
  // Device bytes of cuDNN's workspace, now.
  size_t workspace_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Why cuDNN's fused attention cannot take heads of `head_dim` in bf16 ("" when it can).
const char* attention_shape_error(int head_dim);

}  // namespace gpt::cuda
