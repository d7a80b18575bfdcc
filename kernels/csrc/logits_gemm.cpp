// The logits GEMM in bfloat16 with float32 results: out[M, N] = x[M, K] @ W[N, K]^T, each
// output the float32 sum of exact bfloat16 products, never rounded to bfloat16 (a bfloat16
// logit has 8 significant bits: the top two of a vocabulary tie exactly, often).
//
// AVX512-BF16 `vdpbf16ps` multiplies bfloat16 pairs exactly and accumulates in float32 (inputs
// and outputs denormals flushed), so the result equals a float32 GEMM of the widened inputs up
// to summation order, at bfloat16 GEMM speed (oneDNN has no bfloat16 -> float32 linear in torch).
// Summation order: one float32 lane per output, K pairs in order 0, 1, 2, ...: a row's result
// does not depend on M, on the other rows, on the tiling or on the thread.
//
// Weight layout (pack_bf16_pairs in kernels/cpu_ops.py): [ceil(N/16)][ceil(K/2)][16][2] bf16,
// i.e. per 16-column block, per K pair, 16 columns of (W[n][2p], W[n][2p+1]), zero-padded.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define SLUICEWAY_HAVE_AVX512BF16 1
#endif

namespace sluiceway {

#if SLUICEWAY_HAVE_AVX512BF16
namespace {

constexpr int kColVecs = 4;  // 64 columns per tile: 4 zmm of weights per K pair
constexpr int kRows = 6;     // rows per micro-tile: 6 x 4 = 24 float32 accumulators
constexpr int64_t kPairBlock = 64;  // K pairs per block: 4 KiB of weights per zmm column
constexpr int64_t kRowBlock = 240;  // rows of x per pass over the weights (240 x 8 KiB max)

// x's K pair p of row r as a 32-bit word (the odd tail's missing half is a bfloat16 zero).
inline int32_t pair_at(const uint16_t* row, int64_t p, int64_t k) {
  if (2 * p + 1 < k) {
    int32_t v;
    std::memcpy(&v, row + 2 * p, sizeof(v));
    return v;
  }
  return static_cast<int32_t>(row[2 * p]);
}

// out[R, 16 C] (+)= x[R, pairs p0..p1) . w: the first K block starts from zero, the others
// continue from the float32 partial sums in out (a store and reload are exact: the order of
// the sum is the same as one pass).
template <int R, int C>
void micro_tile(float* out, int64_t ldo, const uint16_t* x, int64_t ldx, const uint32_t* w,
                int64_t kp, int64_t k, int64_t p0, int64_t p1, int64_t cols) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const int64_t left = cols - 16 * c;
      const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
      acc[r][c] = p0 == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, out + r * ldo + 16 * c);
    }
  const int64_t full_end = std::min(p1, k / 2);  // an odd K's last pair goes through pair_at
  for (int64_t p = p0; p < full_end; ++p) {
    __m512i b[C];
    for (int c = 0; c < C; ++c) b[c] = _mm512_loadu_si512(w + (c * kp + p) * 16);
    for (int r = 0; r < R; ++r) {
      int32_t a32;
      std::memcpy(&a32, x + r * ldx + 2 * p, sizeof(a32));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(a32);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, (__m512bh)b[c]);
    }
  }
  for (int64_t p = std::max(full_end, p0); p < p1; ++p) {
    __m512i b[C];
    for (int c = 0; c < C; ++c) b[c] = _mm512_loadu_si512(w + (c * kp + p) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair_at(x + r * ldx, p, k));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, (__m512bh)b[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const int64_t left = cols - 16 * c;
      if (left >= 16)
        _mm512_storeu_ps(out + r * ldo + 16 * c, acc[r][c]);
      else if (left > 0)
        _mm512_mask_storeu_ps(out + r * ldo + 16 * c, (__mmask16)((1u << left) - 1), acc[r][c]);
    }
}

// One 16 C-column tile of out for m rows: K in blocks of kPairBlock pairs, so that the tile's
// weights of one block (C x 4 KiB) stay in L1 while every row group reads them.
template <int C>
void column_tile(float* out, int64_t ldo, const uint16_t* x, int64_t ldx, const uint32_t* w,
                 int64_t m, int64_t kp, int64_t k, int64_t cols) {
  for (int64_t p0 = 0; p0 < kp; p0 += kPairBlock) {
    const int64_t p1 = std::min(kp, p0 + kPairBlock);
    int64_t r = 0;
    for (; r + kRows <= m; r += kRows)
      micro_tile<kRows, C>(out + r * ldo, ldo, x + r * ldx, ldx, w, kp, k, p0, p1, cols);
    float* o = out + r * ldo;
    const uint16_t* xr = x + r * ldx;
    switch (m - r) {
      case 1: micro_tile<1, C>(o, ldo, xr, ldx, w, kp, k, p0, p1, cols); break;
      case 2: micro_tile<2, C>(o, ldo, xr, ldx, w, kp, k, p0, p1, cols); break;
      case 3: micro_tile<3, C>(o, ldo, xr, ldx, w, kp, k, p0, p1, cols); break;
      case 4: micro_tile<4, C>(o, ldo, xr, ldx, w, kp, k, p0, p1, cols); break;
      case 5: micro_tile<5, C>(o, ldo, xr, ldx, w, kp, k, p0, p1, cols); break;
      default: break;
    }
  }
}

}  // namespace
#endif

bool bf16_gemm_fp32_supported() {
#if SLUICEWAY_HAVE_AVX512BF16
  return true;
#else
  return false;
#endif
}

void bf16_gemm_fp32(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "x must be bfloat16 [M, K] with contiguous rows");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous(),
              "packed must be a contiguous bfloat16 [ceil(N/16), ceil(K/2), 16, 2] weight");
  const int64_t m = x.size(0), k = x.size(1), kp = packed.size(1);
  TORCH_CHECK(kp == (k + 1) / 2, "packed holds ", 2 * kp, " K values, x has K = ", k);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.size(0) == m &&
                  out.stride(1) == 1 && out.size(1) <= 16 * packed.size(0),
              "out must be float32 [M, N] with contiguous rows, N <= 16 * packed.size(0)");
#if SLUICEWAY_HAVE_AVX512BF16
  const int64_t n = out.size(1), ldo = out.stride(0), ldx = x.stride(0);
  if (m == 0 || n == 0) return;
  const int64_t tile_cols = 16 * kColVecs;
  const int64_t tiles = (n + tile_cols - 1) / tile_cols;
  float* o = out.data_ptr<float>();
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {  // rows in blocks that stay in L2
      const int64_t rows = std::min(kRowBlock, m - r0);
      const uint16_t* xb = xp + r0 * ldx;
      for (int64_t t = begin; t < end; ++t) {
        const int64_t col = t * tile_cols, cols = std::min(tile_cols, n - col);
        const uint32_t* w = wp + (col / 16) * kp * 16;
        float* ot = o + r0 * ldo + col;
        if (cols > 48)
          column_tile<4>(ot, ldo, xb, ldx, w, rows, kp, k, cols);
        else if (cols > 32)
          column_tile<3>(ot, ldo, xb, ldx, w, rows, kp, k, cols);
        else if (cols > 16)
          column_tile<2>(ot, ldo, xb, ldx, w, rows, kp, k, cols);
        else
          column_tile<1>(ot, ldo, xb, ldx, w, rows, kp, k, cols);
      }
    }
  });
#else
  TORCH_CHECK(false, "bf16_gemm_fp32 needs AVX512-BF16, which this build's CPU lacks");
#endif
}

}  // namespace sluiceway
