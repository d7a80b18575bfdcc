// The bfloat16 GEMM of the linear layers and the logits: out[M, N] = x[M, K] @ W[N, K]^T (+ bias),
// with float32 sums, out float32 (the logits: a bfloat16 logit has 8 significant bits and the
// top two of a vocabulary tie exactly, often) or bfloat16 (rounded once, to nearest even).
//
// The tiling, micro-kernel and summation order (vdpbf16ps, K pairs in order: batch invariant)
// are bf16_tile.h's, shared with quant_gemm.cpp. oneDNN's GEMM, which this replaces in
// bfloat16, picks its reduction by shape (K 1536: a row's result changes with M;
// tests/worker/test_batch_invariance.py).
//
// Weight layout (pack_bf16_pairs in kernels/cpu_ops.py): [ceil(N/16)][ceil(K/2)][16][2] bf16,
// i.e. per 16-column block, per K pair, 16 columns of (W[n][2p], W[n][2p+1]), zero-padded.
#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>

#include "bf16_tile.h"

namespace sluiceway {

#if SLUICEWAY_HAVE_AVX512BF16
namespace {

// The packed weight read in place: column vector c of the tile at `col` is 16-column block
// col / 16 + c, kp pairs each.
struct Packed {
  const uint32_t* wp;
  int64_t kp;
  template <int C>
  bf16_tile::WeightView view(int64_t col, int64_t, int64_t) const {
    return {wp + (col / 16) * kp * 16, kp, 0};
  }
};

}  // namespace
#endif

bool bf16_gemm_supported() {
#if SLUICEWAY_HAVE_AVX512BF16
  return true;
#else
  return false;
#endif
}

void bf16_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
               const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && out.device().is_cpu(),
              "bf16_gemm runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "x must be bfloat16 [M, K] with contiguous rows");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous(),
              "packed must be a contiguous bfloat16 [ceil(N/16), ceil(K/2), 16, 2] weight");
  const int64_t m = x.size(0), k = x.size(1), kp = packed.size(1);
  TORCH_CHECK(kp == (k + 1) / 2, "packed holds ", 2 * kp, " K values, x has K = ", k);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.stride(1) == 1 &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16) &&
                  (out.size(1) + 15) / 16 == packed.size(0),
              "out must be float32 or bfloat16 [M, N] with contiguous rows, "
              "ceil(N / 16) == packed.size(0)");
  at::assert_no_overlap(out, x);
  const int64_t n = out.size(1);
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "bias must be a contiguous float32 [N]");
  if (k == 0) {  // an empty sum: the bias, or zeros
    if (bias.has_value())
      out.copy_(bias->unsqueeze(0).expand({m, n}));
    else
      out.zero_();
    return;
  }
#if SLUICEWAY_HAVE_AVX512BF16
  if (m == 0 || n == 0) return;
  const bf16_tile::Output o{out.data_ptr(), out.scalar_type() == at::kBFloat16, out.stride(0),
                            bias.has_value() ? bias->data_ptr<float>() : nullptr};
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  bf16_tile::gemm(o, xp, x.stride(0), m, n, k, kp, [wp, kp] { return Packed{wp, kp}; });
#else
  TORCH_CHECK(false, "bf16_gemm needs AVX512-BF16, which this build's CPU lacks");
#endif
}

}  // namespace sluiceway
