// gpt_cuda.cu - the GPT's forward and backward on a GPU (see gpt_cuda.h): the
// kernels, the cuBLAS products, and the calls into cuDNN's attention.
//
// Every kernel is deterministic: the column sums (bias and LayerNorm grads)
// reduce in a fixed order in two passes (partial sums per block of rows, then
// the partials in order), and the embedding's grads gather the rows of each
// token from a list sorted on the host instead of scattering with atomics.
// (cuDNN's attention backward and cuBLAS may still add in varying order.)
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "gpt_attention.h"
#include "gpt_cuda.h"

namespace gpt::cuda {
namespace {

using bf16 = __nv_bfloat16;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("gpt cuda: ") + what + ": " + cudaGetErrorString(e));
}
void check_blas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("gpt cuda: ") + what + ": cuBLAS status " +
                             std::to_string(static_cast<int>(s)));
}
// After a launch: a bad configuration shows here, a fault at the next sync.
void launched(const char* kernel) { check(cudaGetLastError(), kernel); }

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / 32;  // the row kernels: one warp per row
constexpr int kParts = 64;                    // the column sums' first pass: at most this many row blocks
constexpr float kLnEps = 1e-5f;
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2/pi)

unsigned grid_for(size_t n) { return static_cast<unsigned>(std::min<size_t>((n + kThreads - 1) / kThreads, 65536)); }
unsigned row_grid(int rows) { return static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock); }

__device__ __forceinline__ float f32(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float f32(float v) { return v; }
// The grads are bf16: add in fp32, round once.
__device__ __forceinline__ void add_into(bf16* g, size_t i, float v) { g[i] = __float2bfloat16(f32(g[i]) + v); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float gelu(float x) {
  return 0.5f * x * (1.0f + tanhf(kGeluK * (x + 0.044715f * x * x * x)));
}
__device__ __forceinline__ float gelu_grad(float x) {
  const float th = tanhf(kGeluK * (x + 0.044715f * x * x * x));
  const float du = kGeluK * (1.0f + 3.0f * 0.044715f * x * x);
  return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du;
}

#define GRID_STRIDE(i, n)                                                              \
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<size_t>(gridDim.x) * blockDim.x)

// ---- kernels -------------------------------------------------------------------

// x[r, k] = wte[token r, k] + wpe[r mod t, k].
__global__ void embed_forward_kernel(const uint8_t* tokens, const bf16* wte, const bf16* wpe, float* x, int t, int c,
                                     size_t total) {
  GRID_STRIDE(i, total) {
    const size_t row = i / c, k = i % c;
    x[i] = f32(wte[static_cast<size_t>(tokens[row]) * c + k]) + f32(wpe[(row % t) * c + k]);
  }
}
// dwte[v, k] += the sum of dx[r, k] over the rows r of token v (rows[offsets[v] .. offsets[v+1])).
__global__ void embed_wte_grad_kernel(const float* dx, const int* rows, const int* offsets, bf16* g, int c) {
  const int v = blockIdx.y, k = blockIdx.x * blockDim.x + threadIdx.x;
  const int begin = offsets[v], end = offsets[v + 1];
  if (k >= c || begin == end) return;
  float s = 0.0f;
  for (int i = begin; i < end; ++i) s += dx[static_cast<size_t>(rows[i]) * c + k];
  add_into(g, static_cast<size_t>(v) * c + k, s);
}
// dwpe[p, k] += the sum over the sequences b of dx[b t + p, k].
__global__ void embed_wpe_grad_kernel(const float* dx, bf16* g, int b, int t, int c) {
  GRID_STRIDE(i, static_cast<size_t>(t) * c) {
    const size_t p = i / c, k = i % c;
    float s = 0.0f;
    for (int bb = 0; bb < b; ++bb) s += dx[(static_cast<size_t>(bb) * t + p) * c + k];
    add_into(g, i, s);
  }
}

// y = (x - mean) * rstd * w + b per row (bf16), keeping mean and rstd (fp32).
__global__ void layernorm_forward_kernel(const float* x, const bf16* w, const bf16* b, bf16* y, float* mean,
                                         float* rstd, int n, int c) {
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= n) return;
  const float* xr = x + static_cast<size_t>(row) * c;
  float s = 0.0f;
  for (int k = lane; k < c; k += 32) s += xr[k];
  const float m = warp_sum(s) / c;
  float v = 0.0f;
  for (int k = lane; k < c; k += 32) v += (xr[k] - m) * (xr[k] - m);
  const float r = rsqrtf(warp_sum(v) / c + kLnEps);
  bf16* yr = y + static_cast<size_t>(row) * c;
  for (int k = lane; k < c; k += 32) yr[k] = __float2bfloat16((xr[k] - m) * r * f32(w[k]) + f32(b[k]));
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}
// The input grad of a LayerNorm: dx (+)= rstd (dy w - mean(dy w) - xhat mean(dy w xhat)).
__global__ void layernorm_backward_kernel(const float* dy, const float* x, const float* mean, const float* rstd,
                                          const bf16* w, float* dx, int n, int c, bool add) {
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= n) return;
  const size_t off = static_cast<size_t>(row) * c;
  const float m = mean[row], r = rstd[row];
  float sd = 0.0f, sdx = 0.0f;
  for (int k = lane; k < c; k += 32) {
    const float d = dy[off + k] * f32(w[k]);
    sd += d;
    sdx += d * (x[off + k] - m) * r;
  }
  sd = warp_sum(sd) / c;
  sdx = warp_sum(sdx) / c;
  for (int k = lane; k < c; k += 32) {
    const float xhat = (x[off + k] - m) * r;
    const float v = r * (dy[off + k] * f32(w[k]) - sd - xhat * sdx);
    dx[off + k] = add ? dx[off + k] + v : v;
  }
}

// Column sums of a [n, cols] matrix (K sums per column), into bf16 grads:
// the first pass sums each of up to kParts blocks of rows per column, the
// second adds the partials in order. What is summed comes from `Op`.
template <typename T>
struct BiasTerms {  // d bias: the column sums of dy
  const T* dy;
  __device__ void operator()(size_t r, int col, int cols, float* acc) const { acc[0] += f32(dy[r * cols + col]); }
};
struct NormTerms {  // d w: the column sums of dy xhat; d b: of dy
  const float *dy, *x, *mean, *rstd;
  __device__ void operator()(size_t r, int col, int cols, float* acc) const {
    const float d = dy[r * cols + col];
    acc[0] += d * (x[r * cols + col] - mean[r]) * rstd[r];
    acc[1] += d;
  }
};
template <int K, typename Op>
__global__ void column_partials_kernel(Op op, float* partial, int n, int cols, int rows_per_part) {
  __shared__ float sh[K][8][33];
  const int tx = threadIdx.x, ty = threadIdx.y, col = blockIdx.x * 32 + tx, part = blockIdx.y;
  float acc[K] = {};
  if (col < cols) {
    const int end = min(n, (part + 1) * rows_per_part);
    for (int r = part * rows_per_part + ty; r < end; r += 8) op(static_cast<size_t>(r), col, cols, acc);
  }
  for (int k = 0; k < K; ++k) sh[k][ty][tx] = acc[k];
  __syncthreads();
  if (ty == 0 && col < cols) {
    for (int k = 0; k < K; ++k) {
      float s = 0.0f;
      for (int j = 0; j < 8; ++j) s += sh[k][j][tx];
      partial[(static_cast<size_t>(part) * K + k) * cols + col] = s;
    }
  }
}
template <int K>
__global__ void column_finish_kernel(const float* partial, int parts, int cols, bf16* g0, bf16* g1) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  for (int k = 0; k < K; ++k) {
    float s = 0.0f;
    for (int p = 0; p < parts; ++p) s += partial[(static_cast<size_t>(p) * K + k) * cols + col];
    add_into(k == 0 ? g0 : g1, col, s);
  }
}

// out = bf16(z + b[col]): the qkv Linear's bias.
__global__ void bias_bf16_kernel(const float* z, const bf16* b, bf16* out, int cols, size_t total) {
  GRID_STRIDE(i, total) out[i] = __float2bfloat16(z[i] + f32(b[i % cols]));
}
// out = res + z + b[col]: a residual block's output (attention proj, MLP fc2).
__global__ void bias_residual_kernel(const float* res, const float* z, const bf16* b, float* out, int cols,
                                     size_t total) {
  GRID_STRIDE(i, total) out[i] = res[i] + (z[i] + f32(b[i % cols]));
}
// pre = bf16(z + b[col]), act = bf16(gelu(pre)): the MLP's fc and its GELU
// (the GELU of the rounded input, which the backward's gelu_grad also sees).
__global__ void bias_gelu_kernel(const float* z, const bf16* b, bf16* pre, bf16* act, int cols, size_t total) {
  GRID_STRIDE(i, total) {
    const bf16 u = __float2bfloat16(z[i] + f32(b[i % cols]));
    pre[i] = u;
    act[i] = __float2bfloat16(gelu(f32(u)));
  }
}
// d = dact gelu'(pre), in fp32 (d may be dact) and bf16.
__global__ void gelu_backward_kernel(const float* dact, const bf16* pre, float* d, bf16* d16, size_t total) {
  GRID_STRIDE(i, total) {
    const float v = dact[i] * gelu_grad(f32(pre[i]));
    d[i] = v;
    d16[i] = __float2bfloat16(v);
  }
}
__global__ void to_bf16_kernel(const float* x, bf16* y, size_t total) {
  GRID_STRIDE(i, total) y[i] = __float2bfloat16(x[i]);
}

// Per row of logits [n, 256]: loss[r] = logsumexp - logit[target], and
// dlogits = (softmax - onehot(target)) * k, k = scale / n: the scale given,
// or where `scale_dev` is set, the one libfsdp's step keeps in device memory
// (fsdp_loss_scale_device: read when the kernel runs, as a graph's replay
// must), in the same float arithmetic.
__global__ void cross_entropy_kernel(const float* logits, const uint8_t* targets, float scale,
                                     const double* scale_dev, float* row_loss, bf16* dlogits, int n) {
  const float k = (scale_dev != nullptr ? static_cast<float>(*scale_dev) : scale) / static_cast<float>(n);
  static_assert(kVocab == 256, "one warp holds a row of 8 values per lane");
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= n) return;
  const float* l = logits + static_cast<size_t>(row) * kVocab;
  float v[8], mx = -INFINITY;
  for (int j = 0; j < 8; ++j) mx = fmaxf(mx, v[j] = l[lane + 32 * j]);
  mx = warp_max(mx);
  float s = 0.0f;
  for (int j = 0; j < 8; ++j) s += (v[j] = expf(v[j] - mx));
  s = warp_sum(s);
  const int target = targets[row];
  const float inv = 1.0f / s;
  bf16* d = dlogits + static_cast<size_t>(row) * kVocab;
  for (int j = 0; j < 8; ++j) {
    const int idx = lane + 32 * j;
    d[idx] = __float2bfloat16((v[j] * inv - (idx == target ? 1.0f : 0.0f)) * k);
  }
  if (lane == 0) row_loss[row] = logf(s) + mx - l[target];
}
// *out = the sum of v[0..n) in double, in a fixed order (one block).
__global__ void sum_kernel(const float* v, int n, double* out) {
  __shared__ double sh[kThreads];
  double s = 0.0;
  for (int i = threadIdx.x; i < n; i += kThreads) s += v[i];
  sh[threadIdx.x] = s;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w) sh[threadIdx.x] += sh[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = sh[0];
}

}  // namespace

std::string cuda_shape_error(const Shape& s) {
  std::string why = shape_error(s);
  if (why.empty()) why = attention_shape_error(s.head_dim());
  return why;
}

// ---- the model ---------------------------------------------------------------------

struct Model::Impl {
  struct BlockActs {  // what one block's backward needs
    bf16 *ln1, *qkv, *y, *ln2, *pre, *act;
    float *mean1, *rstd1, *stats, *xmid, *mean2, *rstd2;
  };

  cudaStream_t stream;
  cublasHandle_t blas = nullptr;
  std::unique_ptr<Attention> attention;
  std::vector<void*> allocations;
  size_t nbytes = 0;

  std::vector<float*> x;  // residual stream: x[l] is block l's input, x[L] the last output
  std::vector<BlockActs> acts;
  bf16 *lnf, *dlogits, *small16, *dy16, *big16;
  float *meanf, *rstdf, *logits, *row_loss, *dx, *dx2, *tmp, *big, *partial;
  double* loss_sum;
  uint8_t *tokens, *targets;
  int *token_rows, *token_offsets;
  std::vector<int> host_rows, host_offsets;
  // stage(): the batch in pinned host memory, copied from there by the
  // staged forward (a graph's memcpy nodes read a fixed address): tokens,
  // targets, the token rows and offsets, one block.
  void* pinned = nullptr;
  uint8_t *pin_tokens = nullptr, *pin_targets = nullptr;
  int *pin_rows = nullptr, *pin_offsets = nullptr;
  int t = 0, rows = 0;  // this batch's tokens per sequence, and batch * t
  bool have_loss = false;

  template <typename T>
  T* alloc(size_t n) {
    void* p = nullptr;
    check(cudaMalloc(&p, n * sizeof(T)), "cudaMalloc (activations)");
    allocations.push_back(p);
    nbytes += n * sizeof(T);
    return static_cast<T*>(p);
  }

  // Row-major products (cuBLAS is column-major: a row-major [r, c] matrix is
  // its transpose, [c, r] column-major), bf16 inputs, fp32 accumulation.
  void gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void* a, int lda, const void* b,
            int ldb, float beta, void* c, cudaDataType_t ct, int ldc) {
    const float one = 1.0f;
    check_blas(cublasGemmEx(blas, ta, tb, m, n, k, &one, a, CUDA_R_16BF, lda, b, CUDA_R_16BF, ldb, &beta, c, ct, ldc,
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx");
  }
  // y[n, out] = x[n, in] W[out, in]^T (fp32 out: a kernel adds the bias).
  void linear(const bf16* xin, const uint16_t* w, float* y, int n, int in, int out) {
    gemm(CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, w, in, xin, in, 0.0f, y, CUDA_R_32F, out);
  }
  // dx[n, in] = dy[n, out] W[out, in], as fp32 or bf16.
  void linear_dx(const bf16* dy, const uint16_t* w, void* dxout, cudaDataType_t dt, int n, int in, int out) {
    gemm(CUBLAS_OP_N, CUBLAS_OP_N, in, n, out, w, in, dy, out, 0.0f, dxout, dt, in);
  }
  // dW[out, in] += dy[n, out]^T x[n, in], into the bf16 grad (beta 1).
  void linear_dw(const bf16* dy, const bf16* xin, uint16_t* dw, int n, int in, int out) {
    gemm(CUBLAS_OP_N, CUBLAS_OP_T, in, out, n, xin, in, dy, out, 1.0f, dw, CUDA_R_16BF, in);
  }

  template <int K, typename Op>
  void column_sums(const Op& op, int cols, uint16_t* g0, uint16_t* g1) {
    const int parts = std::max(1, std::min(kParts, (rows + 127) / 128));
    const int per = (rows + parts - 1) / parts;
    column_partials_kernel<K><<<dim3((cols + 31) / 32, parts), dim3(32, 8), 0, stream>>>(op, partial, rows, cols, per);
    launched("column_partials_kernel");
    column_finish_kernel<K><<<(cols + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
        partial, parts, cols, reinterpret_cast<bf16*>(g0), reinterpret_cast<bf16*>(g1));
    launched("column_finish_kernel");
  }
  template <typename T>
  void bias_grad(const T* dy, uint16_t* g, int cols) {
    column_sums<1>(BiasTerms<T>{dy}, cols, g, nullptr);
  }

  void layernorm(const float* in, const uint16_t* w, const uint16_t* b, bf16* out, float* mean, float* rstd, int c) {
    layernorm_forward_kernel<<<row_grid(rows), kThreads, 0, stream>>>(
        in, reinterpret_cast<const bf16*>(w), reinterpret_cast<const bf16*>(b), out, mean, rstd, rows, c);
    launched("layernorm_forward_kernel");
  }
  // dx (+)= the input grad; gw, gb += the param grads.
  void layernorm_backward(const float* dy, const float* in, const float* mean, const float* rstd, const uint16_t* w,
                          float* dxout, bool add, uint16_t* gw, uint16_t* gb, int c) {
    layernorm_backward_kernel<<<row_grid(rows), kThreads, 0, stream>>>(
        dy, in, mean, rstd, reinterpret_cast<const bf16*>(w), dxout, rows, c, add);
    launched("layernorm_backward_kernel");
    column_sums<2>(NormTerms{dy, in, mean, rstd}, c, gw, gb);
  }
  void to_bf16(const float* in, bf16* out, size_t n) {
    to_bf16_kernel<<<grid_for(n), kThreads, 0, stream>>>(in, out, n);
    launched("to_bf16_kernel");
  }
};

namespace {
const bf16* as_bf16(const uint16_t* p) { return reinterpret_cast<const bf16*>(p); }
bf16* as_bf16(uint16_t* p) { return reinterpret_cast<bf16*>(p); }
}  // namespace

Model::Model(const Shape& s, int batch, cudaStream_t stream) : s_(s), b_(batch), impl_(std::make_unique<Impl>()) {
  const std::string why = cuda_shape_error(s);
  if (!why.empty()) throw std::invalid_argument("gpt shape: " + why);
  if (batch < 1) throw std::invalid_argument("gpt: the batch must be >= 1");
  Impl& m = *impl_;
  m.stream = stream;
  try {
    check_blas(cublasCreate(&m.blas), "cublasCreate");
    check_blas(cublasSetStream(m.blas, stream), "cublasSetStream");
    m.attention = std::make_unique<Attention>(stream, s.heads, s.head_dim());
    const size_t n = static_cast<size_t>(batch) * s.context, c = static_cast<size_t>(s.width);
    for (int l = 0; l <= s.layers; ++l) m.x.push_back(m.alloc<float>(n * c));
    for (int l = 0; l < s.layers; ++l) {
      Impl::BlockActs a{};
      a.ln1 = m.alloc<bf16>(n * c), a.qkv = m.alloc<bf16>(3 * n * c), a.y = m.alloc<bf16>(n * c);
      a.ln2 = m.alloc<bf16>(n * c), a.pre = m.alloc<bf16>(4 * n * c), a.act = m.alloc<bf16>(4 * n * c);
      a.mean1 = m.alloc<float>(n), a.rstd1 = m.alloc<float>(n), a.mean2 = m.alloc<float>(n),
      a.rstd2 = m.alloc<float>(n);
      a.stats = m.alloc<float>(n * s.heads), a.xmid = m.alloc<float>(n * c);
      m.acts.push_back(a);
    }
    m.lnf = m.alloc<bf16>(n * c), m.meanf = m.alloc<float>(n), m.rstdf = m.alloc<float>(n);
    m.logits = m.alloc<float>(n * kVocab), m.dlogits = m.alloc<bf16>(n * kVocab), m.row_loss = m.alloc<float>(n);
    m.loss_sum = m.alloc<double>(1);
    m.dx = m.alloc<float>(n * c), m.dx2 = m.alloc<float>(n * c), m.tmp = m.alloc<float>(n * c);
    m.big = m.alloc<float>(4 * n * c);
    m.small16 = m.alloc<bf16>(n * c), m.dy16 = m.alloc<bf16>(n * c), m.big16 = m.alloc<bf16>(4 * n * c);
    m.partial = m.alloc<float>(static_cast<size_t>(kParts) * 2 * 4 * c);
    m.tokens = m.alloc<uint8_t>(n), m.targets = m.alloc<uint8_t>(n);
    m.token_rows = m.alloc<int>(n), m.token_offsets = m.alloc<int>(kVocab + 1);
  } catch (...) {
    for (void* p : m.allocations) cudaFree(p);
    if (m.blas) cublasDestroy(m.blas);
    throw;
  }
}

Model::~Model() {
  Impl& m = *impl_;
  cudaStreamSynchronize(m.stream);  // nothing queued may still use the buffers
  m.attention.reset();
  if (m.pinned != nullptr) cudaFreeHost(m.pinned);
  for (void* p : m.allocations) cudaFree(p);
  if (m.blas) cublasDestroy(m.blas);
}

size_t Model::activation_bytes() const { return impl_->nbytes + impl_->attention->workspace_bytes(); }

namespace {

// The rows of each token, for the embedding's backward (a counting sort):
// offsets[v] .. offsets[v + 1] index rows[] for token v.
void sort_token_rows(const uint8_t* tokens, size_t n, std::vector<int>& rows, std::vector<int>& offsets) {
  offsets.assign(kVocab + 1, 0);
  for (size_t r = 0; r < n; ++r) ++offsets[tokens[r] + 1];
  for (int v = 0; v < kVocab; ++v) offsets[v + 1] += offsets[v];
  rows.resize(n);
  std::vector<int> next(offsets.begin(), offsets.end() - 1);
  for (size_t r = 0; r < n; ++r) rows[static_cast<size_t>(next[tokens[r]]++)] = static_cast<int>(r);
}

}  // namespace

void Model::embed_forward(const DeviceView& u, const uint8_t* tokens, int t) {
  if (t < 1 || t > s_.context) throw std::invalid_argument("gpt: sequence length out of range");
  Impl& m = *impl_;
  m.t = t;
  m.rows = b_ * t;
  m.have_loss = false;
  const size_t n = static_cast<size_t>(m.rows);
  sort_token_rows(tokens, n, m.host_rows, m.host_offsets);
  // From pageable memory: each call returns once its bytes are staged.
  check(cudaMemcpyAsync(m.tokens, tokens, n, cudaMemcpyHostToDevice, m.stream), "copying the tokens");
  check(cudaMemcpyAsync(m.token_rows, m.host_rows.data(), n * sizeof(int), cudaMemcpyHostToDevice, m.stream),
        "copying the token rows");
  check(cudaMemcpyAsync(m.token_offsets, m.host_offsets.data(), (kVocab + 1) * sizeof(int), cudaMemcpyHostToDevice,
                        m.stream),
        "copying the token offsets");
  embed_kernel(u);
}

void Model::embed_kernel(const DeviceView& u) {
  Impl& m = *impl_;
  const size_t n = static_cast<size_t>(m.rows), c = static_cast<size_t>(s_.width);
  embed_forward_kernel<<<grid_for(n * c), kThreads, 0, m.stream>>>(m.tokens, as_bf16(u.p[kWte]), as_bf16(u.p[kWpe]),
                                                                   m.x[0], m.t, s_.width, n * c);
  launched("embed_forward_kernel");
}

void Model::stage(const uint8_t* tokens, const uint8_t* targets, int t) {
  if (t != s_.context) throw std::invalid_argument("gpt: a staged batch is of whole contexts");
  Impl& m = *impl_;
  const size_t n = static_cast<size_t>(b_) * s_.context;
  if (m.pinned == nullptr) {
    const size_t bytes = 2 * n + (n + kVocab + 1) * sizeof(int) + 64;
    check(cudaHostAlloc(&m.pinned, bytes, cudaHostAllocPortable), "cudaHostAlloc (the staged batch)");
    m.pin_rows = static_cast<int*>(m.pinned);
    m.pin_offsets = m.pin_rows + n;
    m.pin_tokens = reinterpret_cast<uint8_t*>(m.pin_offsets + kVocab + 1);
    m.pin_targets = m.pin_tokens + n;
  }
  // The stream read the last staged batch already: the caller waited for its
  // loss (loss()) before staging the next.
  sort_token_rows(tokens, n, m.host_rows, m.host_offsets);
  std::memcpy(m.pin_tokens, tokens, n);
  std::memcpy(m.pin_targets, targets, n);
  std::memcpy(m.pin_rows, m.host_rows.data(), n * sizeof(int));
  std::memcpy(m.pin_offsets, m.host_offsets.data(), (kVocab + 1) * sizeof(int));
  m.t = t;
  m.rows = static_cast<int>(n);
}

void Model::embed_forward_staged(const DeviceView& u) {
  Impl& m = *impl_;
  if (m.pinned == nullptr) throw std::logic_error("gpt cuda: embed_forward_staged before stage()");
  m.have_loss = false;
  const size_t n = static_cast<size_t>(m.rows);
  check(cudaMemcpyAsync(m.tokens, m.pin_tokens, n, cudaMemcpyHostToDevice, m.stream), "copying the tokens");
  check(cudaMemcpyAsync(m.targets, m.pin_targets, n, cudaMemcpyHostToDevice, m.stream), "copying the targets");
  check(cudaMemcpyAsync(m.token_rows, m.pin_rows, n * sizeof(int), cudaMemcpyHostToDevice, m.stream),
        "copying the token rows");
  check(cudaMemcpyAsync(m.token_offsets, m.pin_offsets, (kVocab + 1) * sizeof(int), cudaMemcpyHostToDevice, m.stream),
        "copying the token offsets");
  embed_kernel(u);
}

void Model::block_forward(int layer, const DeviceView& u) {
  Impl& m = *impl_;
  Impl::BlockActs& a = m.acts.at(static_cast<size_t>(layer));
  const int c = s_.width, n = m.rows;
  const size_t nc = static_cast<size_t>(n) * c;
  const float* x = m.x[static_cast<size_t>(layer)];
  // Attention: x + proj(attn(ln1(x))).
  m.layernorm(x, u.p[kLn1W], u.p[kLn1B], a.ln1, a.mean1, a.rstd1, c);
  m.linear(a.ln1, u.p[kQkvW], m.big, n, c, 3 * c);
  bias_bf16_kernel<<<grid_for(3 * nc), kThreads, 0, m.stream>>>(m.big, as_bf16(u.p[kQkvB]), a.qkv, 3 * c, 3 * nc);
  launched("bias_bf16_kernel");
  m.attention->forward(b_, m.t, a.qkv, a.y, a.stats);
  m.linear(a.y, u.p[kProjW], m.tmp, n, c, c);
  bias_residual_kernel<<<grid_for(nc), kThreads, 0, m.stream>>>(x, m.tmp, as_bf16(u.p[kProjB]), a.xmid, c, nc);
  launched("bias_residual_kernel");
  // MLP: xmid + fc2(gelu(fc(ln2(xmid)))).
  m.layernorm(a.xmid, u.p[kLn2W], u.p[kLn2B], a.ln2, a.mean2, a.rstd2, c);
  m.linear(a.ln2, u.p[kFcW], m.big, n, c, 4 * c);
  bias_gelu_kernel<<<grid_for(4 * nc), kThreads, 0, m.stream>>>(m.big, as_bf16(u.p[kFcB]), a.pre, a.act, 4 * c, 4 * nc);
  launched("bias_gelu_kernel");
  m.linear(a.act, u.p[kFc2W], m.tmp, n, 4 * c, c);
  bias_residual_kernel<<<grid_for(nc), kThreads, 0, m.stream>>>(a.xmid, m.tmp, as_bf16(u.p[kFc2B]),
                                                                m.x[static_cast<size_t>(layer) + 1], c, nc);
  launched("bias_residual_kernel");
}

void Model::final_forward(const DeviceView& u) {
  Impl& m = *impl_;
  m.layernorm(m.x.back(), u.p[kLnfW], u.p[kLnfB], m.lnf, m.meanf, m.rstdf, s_.width);
}

void Model::head_forward(const DeviceView& u, const uint8_t* targets, float scale, const double* scale_dev) {
  Impl& m = *impl_;
  const int n = m.rows;
  m.linear(m.lnf, u.p[kWte], m.logits, n, s_.width, kVocab);  // logits = lnf(x) wte^T
  if (targets != nullptr) {
    check(cudaMemcpyAsync(m.targets, targets, static_cast<size_t>(n), cudaMemcpyHostToDevice, m.stream),
          "copying the targets");
  } else if (m.pinned == nullptr) {
    throw std::invalid_argument("gpt cuda: head_forward needs the targets (or a staged batch)");
  }
  cross_entropy_kernel<<<row_grid(n), kThreads, 0, m.stream>>>(m.logits, m.targets, scale, scale_dev, m.row_loss,
                                                               m.dlogits, n);
  launched("cross_entropy_kernel");
  sum_kernel<<<1, kThreads, 0, m.stream>>>(m.row_loss, n, m.loss_sum);
  launched("sum_kernel");
  m.have_loss = true;
}

double Model::loss() {
  Impl& m = *impl_;
  if (!m.have_loss) throw std::logic_error("gpt cuda: loss() before head_forward");
  double sum = 0;
  check(cudaMemcpyAsync(&sum, m.loss_sum, sizeof sum, cudaMemcpyDeviceToHost, m.stream), "copying the loss");
  check(cudaStreamSynchronize(m.stream), "waiting for the loss");
  return sum / m.rows;
}

void Model::head_backward(const DeviceView& u) {
  Impl& m = *impl_;
  if (!m.have_loss) throw std::logic_error("gpt cuda: head_backward without head_forward");
  const int n = m.rows, c = s_.width;
  m.linear_dx(m.dlogits, u.p[kWte], m.dx, CUDA_R_32F, n, c, kVocab);  // d lnf(x) = dlogits wte
  m.linear_dw(m.dlogits, m.lnf, u.g[kWte], n, c, kVocab);             // d wte += dlogits^T lnf(x)
}

void Model::final_backward(const DeviceView& u) {
  Impl& m = *impl_;
  m.layernorm_backward(m.dx, m.x.back(), m.meanf, m.rstdf, u.p[kLnfW], m.dx2, false, u.g[kLnfW], u.g[kLnfB], s_.width);
  std::swap(m.dx, m.dx2);
}

void Model::block_backward(int layer, const DeviceView& u) {
  Impl& m = *impl_;
  Impl::BlockActs& a = m.acts.at(static_cast<size_t>(layer));
  const int c = s_.width, n = m.rows;
  const size_t nc = static_cast<size_t>(n) * c;
  float* dout = m.dx;  // d loss / d (block output); becomes d loss / d (block input)
  // MLP: dact = dout Wfc2, through the GELU, then d ln2 = dfc Wfc.
  m.to_bf16(dout, m.small16, nc);
  m.linear_dx(m.small16, u.p[kFc2W], m.big, CUDA_R_32F, n, 4 * c, c);
  m.linear_dw(m.small16, a.act, u.g[kFc2W], n, 4 * c, c);
  m.bias_grad(dout, u.g[kFc2B], c);
  gelu_backward_kernel<<<grid_for(4 * nc), kThreads, 0, m.stream>>>(m.big, a.pre, m.big, m.big16, 4 * nc);
  launched("gelu_backward_kernel");
  m.linear_dx(m.big16, u.p[kFcW], m.tmp, CUDA_R_32F, n, c, 4 * c);
  m.linear_dw(m.big16, a.ln2, u.g[kFcW], n, c, 4 * c);
  m.bias_grad(static_cast<const float*>(m.big), u.g[kFcB], 4 * c);
  // d xmid = dout + LN2's input grad (added into dout in place).
  m.layernorm_backward(m.tmp, a.xmid, a.mean2, a.rstd2, u.p[kLn2W], dout, true, u.g[kLn2W], u.g[kLn2B], c);
  // Attention: dy = d xmid Wproj (bf16, cuDNN's dO), then cuDNN's backward into dqkv.
  m.to_bf16(dout, m.small16, nc);
  m.linear_dx(m.small16, u.p[kProjW], m.dy16, CUDA_R_16BF, n, c, c);
  m.linear_dw(m.small16, a.y, u.g[kProjW], n, c, c);
  m.bias_grad(dout, u.g[kProjB], c);
  bf16* dqkv = m.big16;  // [n, 3c], free again after the MLP's backward
  m.attention->backward(b_, m.t, a.qkv, a.y, m.dy16, a.stats, dqkv);
  m.linear_dx(dqkv, u.p[kQkvW], m.tmp, CUDA_R_32F, n, c, 3 * c);
  m.linear_dw(dqkv, a.ln1, u.g[kQkvW], n, c, 3 * c);
  m.bias_grad(static_cast<const bf16*>(dqkv), u.g[kQkvB], 3 * c);
  // d x = d xmid + LN1's input grad.
  m.layernorm_backward(m.tmp, m.x[static_cast<size_t>(layer)], a.mean1, a.rstd1, u.p[kLn1W], dout, true, u.g[kLn1W],
                       u.g[kLn1B], c);
}

void Model::embed_backward(const DeviceView& u) {
  Impl& m = *impl_;
  const int c = s_.width;
  embed_wte_grad_kernel<<<dim3((c + kThreads - 1) / kThreads, kVocab), kThreads, 0, m.stream>>>(
      m.dx, m.token_rows, m.token_offsets, as_bf16(u.g[kWte]), c);
  launched("embed_wte_grad_kernel");
  embed_wpe_grad_kernel<<<grid_for(static_cast<size_t>(m.t) * c), kThreads, 0, m.stream>>>(m.dx, as_bf16(u.g[kWpe]), b_,
                                                                                           m.t, c);
  launched("embed_wpe_grad_kernel");
}

}  // namespace gpt::cuda
