// Registers the CPU kernels as torch operators, torch.ops.sluiceway.<name>; each writes into
// tensors it is given (no allocation) and returns nothing, but decoder_layers, which returns
// the hidden states and the residual stream it made.
#include <torch/library.h>

#include "ops.h"

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
  m.def(
      "decoder_layers(Tensor(a!) hidden, Tensor(b!)? residual, Tensor[] weights, int[] kinds, "
      "int[] qtypes, int[] out_features, Tensor?[] biases, Tensor[] norms, Tensor?[] qk_norms, "
      "Tensor positions, Tensor cos, Tensor sin, Tensor(c!)[] kv_caches, Tensor slot_mapping, "
      "Tensor block_tables, Tensor context_lens, Tensor query_start_loc, float scale, "
      "int[] sliding_windows, int num_heads, int num_kv_heads, float eps) -> Tensor");
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
  m.impl("decoder_layers", &sluiceway::decoder_layers);
}

TORCH_LIBRARY_IMPL(sluiceway, CompositeExplicitAutograd, m) {
  m.impl("bf16_gemm_supported", &sluiceway::bf16_gemm_supported);
  m.impl("quant_gemm_a8_supported", &sluiceway::quant_gemm_a8_supported);
}
