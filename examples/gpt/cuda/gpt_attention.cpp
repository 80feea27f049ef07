// gpt_attention.cpp - cuDNN's fused attention through cudnn-frontend (see gpt_attention.h).
#include "gpt_attention.h"

#include <cudnn_frontend.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace gpt::cuda {
namespace {

namespace fe = cudnn_frontend;

// The tensors' uids in the variant packs.
enum : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
void check_cudnn(cudnnStatus_t s, const char* what) {
  if (s != CUDNN_STATUS_SUCCESS) throw std::runtime_error(std::string(what) + ": " + cudnnGetErrorString(s));
}
void check_fe(const fe::error_t& e, const std::string& what) {
  if (!e.is_good()) throw std::runtime_error("cuDNN attention: " + what + ": " + e.err_msg);
}

// Strides of q/k/v inside the fused qkv buffer [b, t, 3, h, d], and of y, dy
// [b, t, h, d], for the logical dims [b, h, t, d] that cuDNN takes.
std::vector<int64_t> qkv_strides(int64_t t, int64_t h, int64_t d) { return {t * 3 * h * d, d, 3 * h * d, 1}; }
std::vector<int64_t> y_strides(int64_t t, int64_t h, int64_t d) { return {t * h * d, d, h * d, 1}; }

std::shared_ptr<fe::graph::Graph> new_graph() {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

std::shared_ptr<fe::graph::Tensor_attributes> input(fe::graph::Graph& g, const char* name, int64_t uid,
                                                    std::vector<int64_t> dims, std::vector<int64_t> strides) {
  return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dims).set_stride(strides));
}

std::vector<int64_t> stats_dims(int64_t b, int64_t h, int64_t t) { return {b, h, t, 1}; }
std::vector<int64_t> stats_strides(int64_t h, int64_t t) { return {h * t, t, 1, 1}; }

}  // namespace

const char* attention_shape_error(int head_dim) {
  if (head_dim % 8) return "cuDNN's fused attention needs a head dim (width / heads) that is a multiple of 8";
  if (head_dim > 128) return "cuDNN's fused attention backward takes a head dim (width / heads) of at most 128";
  return "";
}

struct Attention::Impl {
  cudaStream_t stream;
  int64_t h, d;
  float scale;
  cudnnHandle_t handle = nullptr;
  struct Graphs {
    std::shared_ptr<fe::graph::Graph> fwd, bwd;
  };
  std::map<std::pair<int, int>, Graphs> graphs;  // by (b, t)
  void* workspace = nullptr;
  size_t workspace_nbytes = 0;

  Graphs& graphs_for(int b, int t) {
    auto it = graphs.find({b, t});
    if (it != graphs.end()) return it->second;
    const int64_t B = b, T = t;
    const std::vector<int64_t> dims = {B, h, T, d};
    Graphs gs;

    // Forward: O and the softmax stats (log-sum-exp per query row), causal.
    gs.fwd = new_graph();
    auto& f = *gs.fwd;
    auto q = input(f, "q", kQ, dims, qkv_strides(T, h, d));
    auto k = input(f, "k", kK, dims, qkv_strides(T, h, d));
    auto v = input(f, "v", kV, dims, qkv_strides(T, h, d));
    auto fwd_opts = fe::graph::SDPA_attributes()
                        .set_name("gpt_attention")
                        .set_generate_stats(true)
                        .set_attn_scale(scale)
                        .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                        .set_diagonal_band_right_bound(0);  // causal: key j <= query i
    auto [o, stats] = f.sdpa(q, k, v, fwd_opts);
    o->set_output(true).set_uid(kO).set_dim(dims).set_stride(y_strides(T, h, d));
    stats->set_output(true)
        .set_uid(kStats)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim(stats_dims(B, h, T))
        .set_stride(stats_strides(h, T));
    check_fe(f.build(handle, {fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}),
             "building the forward graph (b " + std::to_string(b) + ", t " + std::to_string(t) + ", heads " +
                 std::to_string(h) + ", head dim " + std::to_string(d) + ")");

    // Backward: dQ, dK, dV into the fused dqkv buffer.
    gs.bwd = new_graph();
    auto& g = *gs.bwd;
    auto bq = input(g, "q", kQ, dims, qkv_strides(T, h, d));
    auto bk = input(g, "k", kK, dims, qkv_strides(T, h, d));
    auto bv = input(g, "v", kV, dims, qkv_strides(T, h, d));
    auto bo = input(g, "o", kO, dims, y_strides(T, h, d));
    auto bdo = input(g, "do", kDO, dims, y_strides(T, h, d));
    auto bstats = g.tensor(fe::graph::Tensor_attributes()
                               .set_name("stats")
                               .set_uid(kStats)
                               .set_dim(stats_dims(B, h, T))
                               .set_stride(stats_strides(h, T))
                               .set_data_type(fe::DataType_t::FLOAT));
    auto bwd_opts = fe::graph::SDPA_backward_attributes()
                        .set_name("gpt_attention_backward")
                        .set_attn_scale(scale)
                        .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                        .set_diagonal_band_right_bound(0);
    auto [dq, dk, dv] = g.sdpa_backward(bq, bk, bv, bo, bdo, bstats, bwd_opts);
    dq->set_output(true).set_uid(kDQ).set_dim(dims).set_stride(qkv_strides(T, h, d));
    dk->set_output(true).set_uid(kDK).set_dim(dims).set_stride(qkv_strides(T, h, d));
    dv->set_output(true).set_uid(kDV).set_dim(dims).set_stride(qkv_strides(T, h, d));
    check_fe(g.build(handle, {fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}),
             "building the backward graph (b " + std::to_string(b) + ", t " + std::to_string(t) + ", heads " +
                 std::to_string(h) + ", head dim " + std::to_string(d) + ")");

    // One workspace for every graph: the largest. Stream-ordered, so a smaller
    // one still in use by queued work is freed after it.
    int64_t need_f = 0, need_b = 0;
    check_fe(gs.fwd->get_workspace_size(need_f), "forward workspace size");
    check_fe(gs.bwd->get_workspace_size(need_b), "backward workspace size");
    const size_t need = static_cast<size_t>(std::max(need_f, need_b));
    if (need > workspace_nbytes) {
      if (workspace) check_cuda(cudaFreeAsync(workspace, stream), "cudaFreeAsync (attention workspace)");
      workspace = nullptr;
      check_cuda(cudaMallocAsync(&workspace, need, stream), "cudaMallocAsync (attention workspace)");
      workspace_nbytes = need;
    }
    return graphs.emplace(std::make_pair(b, t), std::move(gs)).first->second;
  }
};

Attention::Attention(cudaStream_t stream, int heads, int head_dim) : impl_(std::make_unique<Impl>()) {
  const std::string why = attention_shape_error(head_dim);
  if (!why.empty()) throw std::invalid_argument(why);
  impl_->stream = stream;
  impl_->h = heads;
  impl_->d = head_dim;
  impl_->scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  check_cudnn(cudnnCreate(&impl_->handle), "cudnnCreate");
  check_cudnn(cudnnSetStream(impl_->handle, stream), "cudnnSetStream");
}

Attention::~Attention() {
  if (impl_->workspace) cudaFreeAsync(impl_->workspace, impl_->stream);
  if (impl_->handle) cudnnDestroy(impl_->handle);
}

void Attention::forward(int b, int t, const void* qkv, void* y, float* stats) {
  Impl::Graphs& gs = impl_->graphs_for(b, t);
  const size_t c = static_cast<size_t>(impl_->h * impl_->d) * 2;  // bytes of one of q, k, v per token
  auto* base = static_cast<char*>(const_cast<void*>(qkv));
  std::unordered_map<int64_t, void*> pack = {{kQ, base}, {kK, base + c}, {kV, base + 2 * c}, {kO, y}, {kStats, stats}};
  check_fe(gs.fwd->execute(impl_->handle, pack, impl_->workspace), "forward");
}

void Attention::backward(int b, int t, const void* qkv, const void* y, const void* dy, const float* stats, void* dqkv) {
  Impl::Graphs& gs = impl_->graphs_for(b, t);
  const size_t c = static_cast<size_t>(impl_->h * impl_->d) * 2;
  auto* base = static_cast<char*>(const_cast<void*>(qkv));
  auto* dbase = static_cast<char*>(dqkv);
  std::unordered_map<int64_t, void*> pack = {{kQ, base},
                                             {kK, base + c},
                                             {kV, base + 2 * c},
                                             {kO, const_cast<void*>(y)},
                                             {kDO, const_cast<void*>(dy)},
                                             {kStats, const_cast<float*>(stats)},
                                             {kDQ, dbase},
                                             {kDK, dbase + c},
                                             {kDV, dbase + 2 * c}};
  check_fe(gs.bwd->execute(impl_->handle, pack, impl_->workspace), "backward");
}

size_t Attention::workspace_bytes() const { return impl_->workspace_nbytes; }

}  // namespace gpt::cuda
