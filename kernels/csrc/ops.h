// The CPU kernels' entry points (each defined in its own .cpp), declared once for
// bindings.cpp, which registers them as torch operators, and for decoder_layers.cpp, which
// calls them directly. Each writes into tensors it is given; the checks are their own.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>

namespace sluiceway {

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& block_tables, const at::Tensor& context_lens,
                     const at::Tensor& query_start_loc, double scale, int64_t sliding_window);
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps);
void silu_and_mul(at::Tensor& out, const at::Tensor& x);
void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& x);
void qk_rms_norm(at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight,
                 int64_t num_heads, int64_t num_kv_heads, double eps);
void rotary_embedding_write_kv(at::Tensor& qkv, const at::Tensor& positions,
                               const at::Tensor& cos, const at::Tensor& sin,
                               at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                               int64_t num_heads, int64_t num_kv_heads);
void argmax_logsumexp(at::Tensor& argmax, at::Tensor& logsumexp, const at::Tensor& logits);
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows);
bool bf16_gemm_supported();
void bf16_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
               const std::optional<at::Tensor>& bias);
void quant_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t qtype,
                const std::optional<at::Tensor>& bias);
void quant_rows(at::Tensor& out, const at::Tensor& packed, const at::Tensor& ids,
                int64_t qtype, int64_t n);
bool quant_gemm_a8_supported();
void quant_gemm_a8(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                   int64_t qtype, const std::optional<at::Tensor>& bias);
void quant_rows_a8(at::Tensor& out, const at::Tensor& packed, const at::Tensor& ids,
                   int64_t qtype, int64_t n);
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
                          int64_t num_kv_heads, double eps);
}  // namespace sluiceway
