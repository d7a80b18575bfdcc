// Registers the CPU kernels as torch operators, torch.ops.sluiceway.<name>; each writes into
// tensors it is given (no allocation) and returns nothing.
#include <ATen/core/Tensor.h>

#include <optional>
#include <torch/library.h>

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

}  // namespace sluiceway

TORCH_LIBRARY(sluiceway, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, "
      "Tensor context_lens, Tensor query_start_loc, float scale, int sliding_window) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("gelu_tanh_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def(
      "qk_rms_norm(Tensor(a!) qkv, Tensor q_weight, Tensor k_weight, int num_heads, "
      "int num_kv_heads, float eps) -> ()");
  m.def(
      "rotary_embedding_write_kv(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, "
      "Tensor(b!) kv_cache, Tensor slot_mapping, int num_heads, int num_kv_heads) -> ()");
  m.def("argmax_logsumexp(Tensor(a!) argmax, Tensor(b!) logsumexp, Tensor logits) -> ()");
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
  m.def("bf16_gemm_supported() -> bool");
  m.def("bf16_gemm(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
  m.def("quant_gemm(Tensor(a!) out, Tensor x, Tensor packed, int qtype, Tensor? bias) -> ()");
  m.def("quant_rows(Tensor(a!) out, Tensor packed, Tensor ids, int qtype, int n) -> ()");
  m.def("quant_gemm_a8_supported() -> bool");
  m.def("quant_gemm_a8(Tensor(a!) out, Tensor x, Tensor packed, int qtype, Tensor? bias) -> ()");
  m.def("quant_rows_a8(Tensor(a!) out, Tensor packed, Tensor ids, int qtype, int n) -> ()");
}

TORCH_LIBRARY_IMPL(sluiceway, CPU, m) {
  m.impl("paged_attention", &sluiceway::paged_attention);
  m.impl("rms_norm", &sluiceway::rms_norm);
  m.impl("fused_add_rms_norm", &sluiceway::fused_add_rms_norm);
  m.impl("silu_and_mul", &sluiceway::silu_and_mul);
  m.impl("gelu_tanh_and_mul", &sluiceway::gelu_tanh_and_mul);
  m.impl("qk_rms_norm", &sluiceway::qk_rms_norm);
  m.impl("rotary_embedding_write_kv", &sluiceway::rotary_embedding_write_kv);
  m.impl("argmax_logsumexp", &sluiceway::argmax_logsumexp);
  m.impl("apply_token_bitmask", &sluiceway::apply_token_bitmask);
  m.impl("bf16_gemm", &sluiceway::bf16_gemm);
  m.impl("quant_gemm", &sluiceway::quant_gemm);
  m.impl("quant_rows", &sluiceway::quant_rows);
  m.impl("quant_gemm_a8", &sluiceway::quant_gemm_a8);
  m.impl("quant_rows_a8", &sluiceway::quant_rows_a8);
}

TORCH_LIBRARY_IMPL(sluiceway, CompositeExplicitAutograd, m) {
  m.impl("bf16_gemm_supported", &sluiceway::bf16_gemm_supported);
  m.impl("quant_gemm_a8_supported", &sluiceway::quant_gemm_a8_supported);
}
