// The GEMM of GGUF-quantized weights with float32 activations (`--quantization gguf --dtype
// float32`): out[M, N] = x[M, K] @ W[N, K]^T (+ bias), float32, W kept in its blocks
// (quant_layout.h) and dequantized per work item (row block x 64-column tile) and per K block
// into a thread's buffer of gguf's float32 values.
//
// Each output is one float32 lane summed over k = 0, 1, ..., K - 1 in order, every step a
// rounded product then a rounded sum (never a fused multiply-add: `unfused` keeps the compiler
// from contracting them), the bias added last. So a plain float32 loop over K
//   acc = 0; for k: acc = acc + x[:, k] * w[:, k]; acc + bias
// (tests/kernels/test_quant_gemm.py, torch's elementwise ops) is a bitwise reference, and a
// row's result does not depend on M, the tiling or the thread (batch invariance).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bf16_tile.h"
#include "quant_layout.h"

namespace sluiceway {

#if SLUICEWAY_HAVE_AVX512BF16
namespace {

using namespace quant_layout;

constexpr int kRows = 4;     // register tile: 4 rows x 4 column vectors (16 accumulators)
constexpr int kColVecs = 4;  // 64 columns, as bf16_tile's
constexpr int kTileCols = 16 * kColVecs;
constexpr int64_t kKBlock = 128;  // K values a tile dequantizes at once: 32 KiB, stays in L1
constexpr int64_t kRowBlockBytes = 256 * 1024;  // x rows per work item: about this much of x

// x * w rounded to float32 on its own: the empty asm hides the product from the compiler,
// which would otherwise fuse it with the sum into one FMA (-ffp-contract=fast, GCC's default).
inline __m512 unfused(__m512 x, __m512 w) {
  __m512 p = _mm512_mul_ps(x, w);
  asm("" : "+v"(p));
  return p;
}

struct Out {
  float* data;
  int64_t ld;
  const float* bias;  // [N] or null
};

// Columns [col, col + 16 C) of the K block [k0, k0 + len) into buf[c][kk][16] (kk < len),
// each k as a vector of its 16 columns' values.
template <int Q, int C>
void dequant_block(const uint8_t* data, int64_t subs, int64_t col, int64_t k0, int64_t len,
                   float* buf) {
  // lane i of a K-value vector: column i, taken from the pair's interleaved halves
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                         30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int c = 0; c < C; ++c) {
    const uint8_t* group = data + (col / 16 + c) * subs * chunk_bytes(Q);
    for (int64_t kk = 0; kk < len; kk += 32) {
      const uint8_t* chunk = group + ((k0 + kk) / 32) * chunk_bytes(Q);
      prefetch_ahead<Q>(chunk);
      const Scales<Q> sc = load_scales<Q>(chunk);
      float* dst = buf + (c * kKBlock + kk) * 16;
      for (int p = 0; p < 16; ++p) {
        __m512 w[2];
        dequant_pair_f32<Q>(chunk, sc, p, w);
        _mm512_storeu_ps(dst + 32 * p, _mm512_permutex2var_ps(w[0], even, w[1]));
        _mm512_storeu_ps(dst + 32 * p + 16, _mm512_permutex2var_ps(w[0], odd, w[1]));
      }
    }
  }
}

// Rows [R] x columns [16 C] (cols of them real) over the K block's `len` values, continuing
// the sums stored in `out` unless `first`; the last block adds the bias.
template <int R, int C>
void micro_tile(const Out& out, int64_t row, int64_t col, int64_t cols, const float* x,
                int64_t ldx, const float* buf, int64_t len, bool first, bool last) {
  __m512 acc[R][C];
  __mmask16 mask[C];
  for (int c = 0; c < C; ++c) mask[c] = bf16_tile::tail_mask(cols - 16 * c);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      acc[r][c] = first ? _mm512_setzero_ps()
                        : _mm512_maskz_loadu_ps(mask[c], out.data + (row + r) * out.ld + col +
                                                             16 * c);
  for (int64_t kk = 0; kk < len; ++kk) {
    __m512 w[C];
    for (int c = 0; c < C; ++c) w[c] = _mm512_loadu_ps(buf + (c * kKBlock + kk) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + kk]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_add_ps(acc[r][c], unfused(a, w[c]));
    }
  }
  for (int c = 0; c < C; ++c) {
    if (mask[c] == 0) continue;
    const bool bias = last && out.bias != nullptr;
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask[c], out.bias + col + 16 * c)
                          : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 v = bias ? _mm512_add_ps(acc[r][c], b) : acc[r][c];
      _mm512_mask_storeu_ps(out.data + (row + r) * out.ld + col + 16 * c, mask[c], v);
    }
  }
}

template <int C, int R = kRows>
void rows_of(int rows, const Out& out, int64_t row, int64_t col, int64_t cols, const float* x,
             int64_t ldx, const float* buf, int64_t len, bool first, bool last) {
  if constexpr (R > 0) {
    if (rows == R)
      micro_tile<R, C>(out, row, col, cols, x, ldx, buf, len, first, last);
    else
      rows_of<C, R - 1>(rows, out, row, col, cols, x, ldx, buf, len, first, last);
  }
}

// Rows [r0, r1) of the tile at `col` (C column vectors), K blocks outermost: a block's
// dequantized weights stay in L1 across the row groups.
template <int Q, int C>
void tile(const Out& out, const float* x, int64_t ldx, int64_t r0, int64_t r1, int64_t col,
          int64_t cols, int64_t k, const uint8_t* data, float* buf) {
  for (int64_t k0 = 0; k0 < k; k0 += kKBlock) {
    const int64_t len = std::min(kKBlock, k - k0);
    dequant_block<Q, C>(data, k / 32, col, k0, len, buf);
    const bool first = k0 == 0, last = k0 + len == k;
    for (int64_t r = r0; r < r1; r += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, r1 - r));
      rows_of<C>(rows, out, r, col, cols, x + r * ldx + k0, ldx, buf, len, first, last);
    }
  }
}

template <int Q, int C = kColVecs>
void tile_cols(int vecs, const Out& out, const float* x, int64_t ldx, int64_t r0, int64_t r1,
               int64_t col, int64_t cols, int64_t k, const uint8_t* data, float* buf) {
  if constexpr (C > 0) {
    if (vecs == C)
      tile<Q, C>(out, x, ldx, r0, r1, col, cols, k, data, buf);
    else
      tile_cols<Q, C - 1>(vecs, out, x, ldx, r0, r1, col, cols, k, data, buf);
  }
}

// Work items (row block, 64-column tile) as bf16_tile::gemm cuts them (row_block_rows).
template <int Q>
void run(const Out& out, const float* x, int64_t ldx, int64_t m, int64_t n, int64_t k,
         const uint8_t* data) {
  const int64_t tiles = (n + kTileCols - 1) / kTileCols;
  const int64_t row_block = bf16_tile::row_block_rows(m, tiles, 4 * k, kRows, kRowBlockBytes);
  const int64_t row_blocks = (m + row_block - 1) / row_block;
  at::parallel_for(0, row_blocks * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(kColVecs * kKBlock * 16));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / row_blocks, rb = item % row_blocks;
      const int64_t r0 = rb * row_block, r1 = std::min(m, r0 + row_block);
      const int64_t col = t * kTileCols, cols = std::min<int64_t>(kTileCols, n - col);
      tile_cols<Q>(static_cast<int>((cols + 15) / 16), out, x, ldx, r0, r1, col, cols, k, data,
                   buf.data());
    }
  });
}

}  // namespace
#endif

void quant_gemm_f32(at::Tensor& out, const at::Tensor& x, const uint8_t* data, int64_t qtype,
                    const float* bias) {
  TORCH_CHECK(out.scalar_type() == at::kFloat, "with float32 x, out must be float32");
#if SLUICEWAY_HAVE_AVX512BF16
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  if (m == 0 || n == 0) return;
  const Out o{out.data_ptr<float>(), out.stride(0), bias};
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  quant_layout::with_qtype(
      qtype, [&](auto q) { run<decltype(q)::value>(o, xp, ldx, m, n, k, data); });
#else
  TORCH_CHECK(false, "quant_gemm needs AVX512-BF16, which this build's CPU lacks");
#endif
}

}  // namespace sluiceway
