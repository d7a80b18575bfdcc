// The GEMM of GGUF-quantized weights: out[M, N] = x[M, K] @ W[N, K]^T, x float32, out float32,
// W kept in the bits of its GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K), repacked once at
// load (kernels/quant_pack.py) into one layout for every type:
//
//   w[n][k] = a[n][s] * (u[n][k] - off)        (Q8_0, Q4_0, Q5_0, Q6_K)
//   w[n][k] = fma(a[n][s], u[n][k], b[n][s])    (Q4_1, Q4_K: b = m, or -dmin * m)
//
// u the unsigned nbits-bit quant (4, 5, 6 or 8 bits), s = k / G the sub-block (G 32, or 16 for
// Q6_K), a and b float32 computed at load exactly as gguf.quants.dequantize does. a * u is
// exact in float32 for every type (at most 24 significant bits), so the fma rounds once, as
// gguf's `a * u + b` does: the dequantized weight is bitwise gguf's.
//
// Layout: per 16 rows (a group, zero-padded) and per sub-block, `stride` bytes:
//   G / 2 x 16 bytes: byte (j, l) = u[2j][l] & 15 | (u[2j + 1][l] & 15) << 4 (l the row)
//   (nbits - 4) planes x G uint16: bit l of plane p, k = bit 4 + p of u[k][l]
//   16 float32 a, then 16 float32 b (Q4_1, Q4_K only)
//
// Compute: a K chunk of the tile's weights is dequantized to float32 (in L1), then multiplied
// with float32 FMA, one lane per output, K summed in order 0, 1, 2, ... (partial sums stored
// and reloaded exactly): out[m][n] = fma(x[m][K-1], w[n][K-1], ... fma(x[m][0], w[n][0], 0)),
// whatever M, the tiling or the thread (batch invariance). tests/kernels/test_quant_gemm.py
// checks it bitwise against that recurrence written in torch.
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define SLUICEWAY_HAVE_AVX512 1
#endif

namespace sluiceway {

#if SLUICEWAY_HAVE_AVX512
namespace {

constexpr int kColVecs = 4;  // 64 columns a tile
constexpr int kTileCols = 16 * kColVecs;
constexpr int kRows = 6;
constexpr int64_t kChunk = 256;    // K values dequantized at a time: 64 KiB of float32 weights
constexpr int64_t kRowBlock = 96;  // x rows per work item (the chunk is dequantized once each)

struct Format {
  const uint8_t* data;
  int64_t subblocks, stride;  // per group
  int g, nbits, off;
  bool has_b;
};

// Dequantizes K values [k0, k0 + len) of groups [g0, g0 + vecs) into buf[k - k0][c][16].
void dequant_chunk(float* buf, const Format& f, int64_t g0, int vecs, int64_t k0, int64_t len) {
  const int64_t q_bytes = f.g * 8, plane_bytes = static_cast<int64_t>(f.g) * 2;
  const int planes = f.nbits - 4;
  const __m512i low = _mm512_set1_epi32(15), offset = _mm512_set1_epi32(f.off);
  for (int c = 0; c < vecs; ++c) {
    for (int64_t s = k0 / f.g; s < (k0 + len) / f.g; ++s) {
      const uint8_t* p = f.data + ((g0 + c) * f.subblocks + s) * f.stride;
      const auto* plane = reinterpret_cast<const uint16_t*>(p + q_bytes);
      const uint8_t* scales = p + q_bytes + planes * plane_bytes;
      const __m512 a = _mm512_loadu_ps(scales);
      const __m512 b = f.has_b ? _mm512_loadu_ps(scales + 64) : _mm512_setzero_ps();
      float* out = buf + (s * f.g - k0) * kTileCols + 16 * c;
      for (int j = 0; j < f.g / 2; ++j) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(p + 16 * j)));
        __m512i u[2] = {_mm512_and_si512(v, low), _mm512_srli_epi32(v, 4)};
        for (int h = 0; h < 2; ++h) {
          const int k = 2 * j + h;
          for (int q = 0; q < planes; ++q)
            u[h] = _mm512_mask_add_epi32(u[h], static_cast<__mmask16>(plane[q * f.g + k]), u[h],
                                         _mm512_set1_epi32(16 << q));
          // a * u is exact: the fma rounds once, as gguf's a * u + b; a * (u - off) is exact.
          const __m512 w = f.has_b ? _mm512_fmadd_ps(a, _mm512_cvtepi32_ps(u[h]), b)
                                   : _mm512_mul_ps(a, _mm512_cvtepi32_ps(
                                                          _mm512_sub_epi32(u[h], offset)));
          _mm512_storeu_ps(out + k * kTileCols, w);
        }
      }
    }
  }
}

struct Output {
  float* data;
  int64_t ld;
};

// Rows [R] x columns [16 C]: continues the sums in `part` ([R][kTileCols]) over the chunk's
// K values [0, len) (x from column k0); `last` writes `out` instead of `part`.
template <int R, int C>
void micro_tile(float* part, const Output& out, int64_t row, int64_t col, const float* x,
                int64_t ldx, const float* buf, int64_t len, bool first, bool last, int64_t cols) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      acc[r][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(part + r * kTileCols + 16 * c);
  for (int64_t k = 0; k < len; ++k) {
    __m512 b[C];
    for (int c = 0; c < C; ++c) b[c] = _mm512_loadu_ps(buf + k * kTileCols + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(a, b[c], acc[r][c]);
    }
  }
  if (!last) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(part + r * kTileCols + 16 * c, acc[r][c]);
    return;
  }
  for (int c = 0; c < C; ++c) {
    const int64_t left = cols - 16 * c;
    if (left <= 0) continue;
    const __mmask16 mask = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(out.data + (row + r) * out.ld + col + 16 * c, mask, acc[r][c]);
  }
}

template <int C, int R = kRows - 1>
void tail_rows(int rows, float* part, const Output& out, int64_t row, int64_t col,
               const float* x, int64_t ldx, const float* buf, int64_t len, bool first, bool last,
               int64_t cols) {
  if constexpr (R > 0) {
    if (rows == R)
      micro_tile<R, C>(part, out, row, col, x, ldx, buf, len, first, last, cols);
    else
      tail_rows<C, R - 1>(rows, part, out, row, col, x, ldx, buf, len, first, last, cols);
  }
}

template <int C>
void tile_rows(float* part, float* buf, const Output& out, const Format& f, int64_t r0,
               int64_t r1, int64_t col, const float* x, int64_t ldx, int64_t k, int64_t cols) {
  for (int64_t k0 = 0; k0 < k; k0 += kChunk) {  // K chunks outermost: their weights stay in L1
    const int64_t len = std::min(kChunk, k - k0);
    dequant_chunk(buf, f, col / 16, C, k0, len);
    const bool first = k0 == 0, last = k0 + len == k;
    int64_t r = r0;
    for (; r + kRows <= r1; r += kRows)
      micro_tile<kRows, C>(part + (r - r0) * kTileCols, out, r, col, x + r * ldx + k0, ldx, buf,
                           len, first, last, cols);
    tail_rows<C>(static_cast<int>(r1 - r), part + (r - r0) * kTileCols, out, r, col,
                 x + r * ldx + k0, ldx, buf, len, first, last, cols);
  }
}

template <int C>
void tile_cols(int vecs, float* part, float* buf, const Output& out, const Format& f, int64_t r0,
               int64_t r1, int64_t col, const float* x, int64_t ldx, int64_t k, int64_t cols) {
  if constexpr (C > 0) {
    if (vecs == C)
      tile_rows<C>(part, buf, out, f, r0, r1, col, x, ldx, k, cols);
    else
      tile_cols<C - 1>(vecs, part, buf, out, f, r0, r1, col, x, ldx, k, cols);
  }
}

}  // namespace
#endif

void quant_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t group,
                int64_t nbits, int64_t offset, bool has_b) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && out.device().is_cpu(),
              "quant_gemm runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x must be float32 [M, K] with contiguous rows");
  TORCH_CHECK(group == 16 || group == 32, "group must be 16 or 32");
  TORCH_CHECK(nbits >= 4 && nbits <= 8, "nbits must be 4..8");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  const int64_t stride = group * 8 + (nbits - 4) * group * 2 + (has_b ? 128 : 64);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(0) == (n + 15) / 16 && packed.size(1) * group == k &&
                  packed.size(2) == stride,
              "packed must be a contiguous uint8 [ceil(N/16), K/group, stride] weight");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.stride(1) == 1 &&
                  out.scalar_type() == at::kFloat,
              "out must be float32 [M, N] with contiguous rows");
  at::assert_no_overlap(out, x);
#if SLUICEWAY_HAVE_AVX512
  if (m == 0 || n == 0) return;
  if (k == 0) {
    out.zero_();
    return;
  }
  const Format f{packed.data_ptr<uint8_t>(), packed.size(1), stride, static_cast<int>(group),
                 static_cast<int>(nbits), static_cast<int>(offset), has_b};
  const Output o{out.data_ptr<float>(), out.stride(0)};
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const int64_t tiles = (n + kTileCols - 1) / kTileCols;
  const int64_t row_blocks = (m + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, row_blocks * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> part(static_cast<size_t>(kRowBlock) * kTileCols);
    std::vector<float> buf(static_cast<size_t>(kChunk) * kTileCols);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / row_blocks, rb = item % row_blocks;
      const int64_t r0 = rb * kRowBlock, r1 = std::min(m, r0 + kRowBlock);
      const int64_t col = t * kTileCols, cols = std::min<int64_t>(kTileCols, n - col);
      tile_cols<kColVecs>(static_cast<int>((cols + 15) / 16), part.data(), buf.data(), o, f, r0,
                          r1, col, xp, ldx, k, cols);
    }
  });
#else
  TORCH_CHECK(false, "quant_gemm needs AVX512, which this build's CPU lacks");
#endif
}

}  // namespace sluiceway
