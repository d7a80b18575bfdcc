// The bfloat16 GEMM's tiling and micro-kernel, shared by bf16_gemm.cpp (weights packed as
// bfloat16 pairs) and quant_gemm.cpp (GGUF weights dequantized per tile into the same pairs):
// out[M, N] = x[M, K] @ W[N, K]^T (+ bias), float32 sums, out float32 or bfloat16.
//
// AVX512-BF16 `vdpbf16ps` multiplies bfloat16 pairs exactly and accumulates in float32 (inputs
// and outputs denormals flushed), so the result equals a float32 GEMM of the widened inputs up
// to summation order, at bfloat16 GEMM speed.
//
// Batch invariance: one float32 lane per output, K pairs summed in order 0, 1, 2, ... (a K
// block's partial sums stored and reloaded exactly), whatever M, the tiling, the split of the
// work, the thread or where the weights come from: a row's result does not depend on the other
// rows, and the two kernels agree bitwise on the same bfloat16 weights.
//
// Weight pairs as the micro-kernel reads them: per 16-column vector, per K pair, 16 columns of
// (W[n][2p], W[n][2p+1]) as one 512-bit vector (a `WeightView` says where).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#include <immintrin.h>
#define SLUICEWAY_HAVE_AVX512BF16 1
#endif

namespace sluiceway {

#if SLUICEWAY_HAVE_AVX512BF16
namespace bf16_tile {

// Register tile 6 rows x 64 columns (24 float32 accumulators), K blocks of 144 pairs (the
// tile's 37 KiB of weights stay in L1 across the row groups); measured against 8 x 48, 12 x
// 32 and blocks of 32..288 pairs on SmolLM2's shapes at M 200 and 2048 (AMD Zen 5).
constexpr int kColVecs = 4;
constexpr int kTileCols = 16 * kColVecs;
constexpr int kRows = 6;
constexpr int64_t kPairBlock = 144;
constexpr int64_t kRowBlockBytes = 256 * 1024;  // x rows per work item: about this much of x

// x's K pair p of row r as a 32-bit word (the odd tail's missing half is a bfloat16 zero).
inline int32_t pair_at(const uint16_t* row, int64_t p, int64_t k) {
  if (2 * p + 1 < k) {
    int32_t v;
    std::memcpy(&v, row + 2 * p, sizeof(v));
    return v;
  }
  return static_cast<int32_t>(row[2 * p]);
}

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

struct Output {
  void* data;
  bool bf16;  // else float32
  int64_t ld;
  const float* bias;  // [N] float32 or null
};

// A tile's weight pairs read in place: pair p (absolute) of column vector c at
// w + (c * ld + p - base) * 16. A view type gives `load(c, p)` for pairs [s, s + kSpan) after
// `begin(s)` (here a no-op: quant_gemm.cpp's fused view dequantizes in `load`).
struct WeightView {
  static constexpr int64_t kSpan = int64_t{1} << 40;
  const uint32_t* w;
  int64_t ld, base;
  void begin(int64_t) {}
  __m512i load(int c, int64_t p) const { return _mm512_loadu_si512(w + (c * ld + p - base) * 16); }
};

// Rows [R] x columns [16 C] of the tile: sums over K pairs [p0, p1), continuing the float32
// partial sums in `part` ([R][kTileCols]) when p0 > 0; the last block (p1 == kp) writes `out`
// (+ bias, rounded to bfloat16 or not), the others `part`.
template <int R, int C, class View>
void micro_tile(float* part, const Output& out, int64_t row, int64_t col, const uint16_t* x,
                int64_t ldx, View w, int64_t kp, int64_t k, int64_t p0, int64_t p1,
                int64_t cols) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      acc[r][c] = p0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(part + r * kTileCols + 16 * c);
  const int64_t full_end = std::min(p1, k / 2);  // an odd K's last pair goes through pair_at
  for (int64_t s = p0; s < full_end; s += View::kSpan) {
    w.begin(s);
    for (int64_t p = s; p < std::min(full_end, s + View::kSpan); ++p) {
      __m512i b[C];
      for (int c = 0; c < C; ++c) b[c] = w.load(c, p);
      for (int r = 0; r < R; ++r) {
        int32_t a32;
        std::memcpy(&a32, x + r * ldx + 2 * p, sizeof(a32));
        const __m512bh a = (__m512bh)_mm512_set1_epi32(a32);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, (__m512bh)b[c]);
      }
    }
  }
  for (int64_t p = std::max(full_end, p0); p < p1; ++p) {  // odd K: bf16_gemm's views only
    w.begin(p);
    __m512i b[C];
    for (int c = 0; c < C; ++c) b[c] = w.load(c, p);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair_at(x + r * ldx, p, k));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, (__m512bh)b[c]);
    }
  }
  if (p1 < kp) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(part + r * kTileCols + 16 * c, acc[r][c]);
    return;
  }
  for (int c = 0; c < C; ++c) {
    const __mmask16 mask = tail_mask(cols - 16 * c);
    if (mask == 0) continue;
    const __m512 bias = out.bias ? _mm512_maskz_loadu_ps(mask, out.bias + col + 16 * c)
                                 : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 v = out.bias ? _mm512_add_ps(acc[r][c], bias) : acc[r][c];
      const int64_t at = (row + r) * out.ld + col + 16 * c;
      if (out.bf16)
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out.data) + at, mask,
                                 (__m256i)_mm512_cvtneps_pbh(v));
      else
        _mm512_mask_storeu_ps(static_cast<float*>(out.data) + at, mask, v);
    }
  }
}

template <int C, class View, int R = kRows - 1>
void tail_rows(int rows, float* part, const Output& out, int64_t row, int64_t col,
               const uint16_t* x, int64_t ldx, const View& w, int64_t kp, int64_t k,
               int64_t p0, int64_t p1, int64_t cols) {
  if constexpr (R > 0) {
    if (rows == R) {
      micro_tile<R, C>(part, out, row, col, x, ldx, w, kp, k, p0, p1, cols);
    } else {
      tail_rows<C, View, R - 1>(rows, part, out, row, col, x, ldx, w, kp, k, p0, p1, cols);
    }
  }
}

// Rows [r0, r1) of the tile at `col`; `weights.view<C>(col, p0, p1)` gives a view of the
// tile's pairs [p0, p1) (valid until its next call).
template <int C, class Weights>
void tile_rows(Weights& weights, float* part, const Output& out, int64_t r0, int64_t r1,
               int64_t col, const uint16_t* x, int64_t ldx, int64_t kp, int64_t k,
               int64_t cols) {
  for (int64_t p0 = 0; p0 < kp; p0 += kPairBlock) {  // K blocks outermost: their weights stay in L1
    const int64_t p1 = std::min(kp, p0 + kPairBlock);
    const auto w = weights.template view<C>(col, p0, p1);
    int64_t r = r0;
    for (; r + kRows <= r1; r += kRows) {
      float* pr = part + (r - r0) * kTileCols;
      micro_tile<kRows, C>(pr, out, r, col, x + r * ldx, ldx, w, kp, k, p0, p1, cols);
    }
    float* pr = part + (r - r0) * kTileCols;
    const uint16_t* xr = x + r * ldx;
    tail_rows<C>(static_cast<int>(r1 - r), pr, out, r, col, xr, ldx, w, kp, k, p0, p1, cols);
  }
}

// The tile's column vectors: C = kColVecs for whole tiles, fewer for the last one.
template <class Weights, int C = kColVecs>
void tile_cols(int vecs, Weights& weights, float* part, const Output& out, int64_t r0,
               int64_t r1, int64_t col, const uint16_t* x, int64_t ldx, int64_t kp, int64_t k,
               int64_t cols) {
  if constexpr (C > 0) {
    if (vecs == C) {
      tile_rows<C>(weights, part, out, r0, r1, col, x, ldx, kp, k, cols);
    } else {
      tile_cols<Weights, C - 1>(vecs, weights, part, out, r0, r1, col, x, ldx, kp, k, cols);
    }
  }
}

// Rows of x per work item (row block, column tile) of a tiled GEMM (this one and
// quant_gemm_f32.cpp's): about row_block_bytes of x (x_row_bytes a row), a multiple of `rows`
// (the register tile's), cut smaller when there are too few of the `tiles` column tiles to
// share evenly between the threads.
inline int64_t row_block_rows(int64_t m, int64_t tiles, int64_t x_row_bytes, int64_t rows,
                              int64_t row_block_bytes) {
  const int64_t threads = at::get_num_threads();
  int64_t row_block = std::max<int64_t>(rows, row_block_bytes / x_row_bytes / rows * rows);
  const int64_t want_splits = (8 * threads + tiles - 1) / tiles;
  if (want_splits > 1)
    row_block = std::min(row_block, std::max<int64_t>(
        rows, ((m + want_splits - 1) / want_splits + rows - 1) / rows * rows));
  return row_block;
}

// The whole GEMM: x [m, k] bfloat16 (row stride ldx) into `out` ([m, n]), kp = ceil(k / 2).
// `make_weights()` makes one thread's weight source (see tile_rows).
//
// Work items: (row block, 64-column tile). Row blocks hold about row_block_bytes of x (they
// stay in L2 across a thread's tiles), and are cut smaller when there are too few tiles to
// share evenly between the threads.
template <class MakeWeights>
void gemm(const Output& out, const uint16_t* x, int64_t ldx, int64_t m, int64_t n, int64_t k,
          int64_t kp, const MakeWeights& make_weights, int64_t row_block_bytes = kRowBlockBytes) {
  const int64_t tiles = (n + kTileCols - 1) / kTileCols;
  const int64_t row_block = row_block_rows(m, tiles, 2 * k, kRows, row_block_bytes);
  const int64_t row_blocks = (m + row_block - 1) / row_block;
  at::parallel_for(0, row_blocks * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> part(static_cast<size_t>(std::min(row_block, m)) * kTileCols);
    auto weights = make_weights();
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / row_blocks, rb = item % row_blocks;
      const int64_t r0 = rb * row_block, r1 = std::min(m, r0 + row_block);
      const int64_t col = t * kTileCols, cols = std::min<int64_t>(kTileCols, n - col);
      tile_cols(static_cast<int>((cols + 15) / 16), weights, part.data(), out, r0, r1, col, x,
                ldx, kp, k, cols);
    }
  });
}

}  // namespace bf16_tile
#endif

}  // namespace sluiceway
