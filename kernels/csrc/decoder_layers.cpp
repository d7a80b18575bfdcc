// A Llama-family decoder's layers in one operator call (worker/model.py's DecoderLayer.forward,
// one after the other): the same kernels in the same order on the same tensors, so the hidden
// states are bitwise those of the per-operator path, without its Python and dispatcher work
// between kernels (~10 operator calls a layer; at batch 1 that work was about a quarter of
// the embedded model's 8 ms decode step, measured with torch's profiler).
//
// Per layer l (H hidden, Hq/Hkv heads, D head dim, I intermediate; x the normed rows):
//   l == 0 and no residual: x = rms_norm(hidden), residual = hidden
//   else:                   residual += hidden; x = rms_norm(residual)   (in place in hidden)
//   qkv = x @ Wqkv^T (+ b); [q/k RMSNorm per head]; RoPE of q, k; K, V into kv_caches[l]
//   attn = paged_attention(q) over the layer's window; o = attn @ Wo^T (+ b)
//   residual += o; x = rms_norm(residual); gu = x @ Wgu^T (+ b); act = silu(gate) * up
//   hidden = act @ Wdown^T (+ b)
// Each linear is one of the kinds below (LINEAR_KINDS in kernels/cpu_ops.py): its packed
// weight, ggml type and output features come in the flat lists, 4 per layer in the order
// qkv, o, gate_up, down.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "ops.h"

namespace sluiceway {
namespace {

enum LinearKind : int64_t { kBf16Pairs = 0, kQuantTile = 1, kQuantA8 = 2 };

struct Linear {
  at::Tensor weight;
  int64_t kind, qtype;
  std::optional<at::Tensor> bias;
};

void run_linear(at::Tensor& out, const at::Tensor& x, const Linear& w) {
  switch (w.kind) {
    case kBf16Pairs: return bf16_gemm(out, x, w.weight, w.bias);
    case kQuantTile: return quant_gemm(out, x, w.weight, w.qtype, w.bias);
    case kQuantA8: return quant_gemm_a8(out, x, w.weight, w.qtype, w.bias);
    default: TORCH_CHECK(false, "unknown linear kind ", w.kind);
  }
}

}  // namespace

at::Tensor decoder_layers(at::Tensor& hidden, const std::optional<at::Tensor>& residual,
                          at::TensorList weights, at::IntArrayRef kinds, at::IntArrayRef qtypes,
                          at::IntArrayRef out_features,
                          const c10::List<std::optional<at::Tensor>>& biases, at::TensorList norms,
                          const c10::List<std::optional<at::Tensor>>& qk_norms,
                          const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                          at::TensorList kv_caches, const at::Tensor& slot_mapping,
                          const at::Tensor& block_tables, const at::Tensor& context_lens,
                          const at::Tensor& query_start_loc, double scale,
                          at::IntArrayRef sliding_windows, int64_t num_heads,
                          int64_t num_kv_heads, double eps) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 4 * layers &&
                  static_cast<int64_t>(kinds.size()) == 4 * layers &&
                  static_cast<int64_t>(qtypes.size()) == 4 * layers &&
                  static_cast<int64_t>(out_features.size()) == 4 * layers &&
                  static_cast<int64_t>(biases.size()) == 4 * layers &&
                  static_cast<int64_t>(norms.size()) == 2 * layers &&
                  static_cast<int64_t>(qk_norms.size()) == 2 * layers &&
                  static_cast<int64_t>(sliding_windows.size()) == layers,
              "decoder_layers: per layer 4 weights, kinds, qtypes, out_features and biases, "
              "2 norms and 2 qk_norms, 1 kv_cache and 1 sliding window");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be a contiguous [T, H]");
  const int64_t t = hidden.size(0), h = hidden.size(1);
  const int64_t head_dim = 2 * cos.size(1);
  const auto options = hidden.options();
  // the residual stream: mutated in place, as the per-operator path does
  at::Tensor stream = residual.has_value() ? *residual : hidden;
  at::Tensor x = hidden;  // the rows the next linear reads
  at::Tensor attn = at::empty({t, num_heads, head_dim}, options);
  at::Tensor o = at::empty({t, h}, options);
  at::Tensor out;  // the last down projection's rows
  for (int64_t l = 0; l < layers; ++l) {
    auto linear = [&](int64_t i) {
      const int64_t j = 4 * l + i;
      return Linear{weights[j], kinds[j], qtypes[j], biases.get(j)};
    };
    if (l == 0 && !residual.has_value()) {
      x = at::empty({t, h}, options);
      rms_norm(x, hidden, norms[0], eps);
    } else {
      fused_add_rms_norm(x, stream, norms[2 * l], eps);
    }
    at::Tensor qkv = at::empty({t, out_features[4 * l]}, options);
    run_linear(qkv, x, linear(0));
    const std::optional<at::Tensor> q_norm = qk_norms.get(2 * l);
    if (q_norm.has_value()) {
      const std::optional<at::Tensor> k_norm = qk_norms.get(2 * l + 1);
      TORCH_CHECK(k_norm.has_value(), "decoder_layers: a q norm without a k norm");
      qk_rms_norm(qkv, *q_norm, *k_norm, num_heads, num_kv_heads, eps);
    }
    at::Tensor cache = kv_caches[l];
    rotary_embedding_write_kv(qkv, positions, cos, sin, cache, slot_mapping, num_heads,
                              num_kv_heads);
    const at::Tensor q = qkv.narrow(1, 0, num_heads * head_dim).view({t, num_heads, head_dim});
    paged_attention(attn, q, cache, block_tables, context_lens, query_start_loc, scale,
                    sliding_windows[l]);
    run_linear(o, attn.view({t, num_heads * head_dim}), linear(1));
    fused_add_rms_norm(o, stream, norms[2 * l + 1], eps);
    at::Tensor gate_up = at::empty({t, out_features[4 * l + 2]}, options);
    run_linear(gate_up, o, linear(2));
    at::Tensor act = at::empty({t, out_features[4 * l + 2] / 2}, options);
    silu_and_mul(act, gate_up);
    out = at::empty({t, out_features[4 * l + 3]}, options);
    run_linear(out, act, linear(3));
    x = out;
  }
  return layers ? out : hidden;
}

}  // namespace sluiceway
