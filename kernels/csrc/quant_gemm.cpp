// The GEMM of GGUF-quantized weights: out[M, N] = x[M, K] @ W[N, K]^T, x float32, out float32,
// W kept in the bits of its GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K), repacked once at
// load (kernels/quant_pack.py): per row n, per 32 K values (a sub-block), `stride` bytes:
//
//   table kinds (4- and 5-bit quants u: Q4_0, Q4_1, Q5_0, Q4_K):
//     16 bytes, byte i = u[i] & 15 | (u[i + 16] & 15) << 4; 5-bit: a uint32, bit i = u[i] >> 4;
//     float32 a, then float32 b (Q4_1, Q4_K):
//     w = fma(a, u, b)  or  a * (u - off) (Q4_0: off 8, Q5_0: 16)
//   byte kind (Q8_0, and Q6_K widened from 6 bits): 32 int8 q = u - off, float32 a per 32 K
//     values (Q8_0) or per 16 (Q6_K, two): w = a * q
//
// a and b are computed at load as gguf.quants.dequantize does and a * u is exact in float32
// (at most 24 significant bits), so the fma rounds once, as gguf's a * u + b: w is bitwise
// gguf's dequantized weight. The table kinds dequantize with a permute from the sub-block's
// table of its 16 (32) possible values (built with one fma per 16 values).
//
// Sums: 16 float32 lanes per output; lane l sums k = l, l + 16, l + 32, ... in order with FMA
// (acc = fma(x[k], w[k], acc) from 0), then the lanes are added in a fixed tree (l + l+8, then
// + 4, + 2, + 1), whatever M, the tiling or the thread: a row's result does not depend on the
// other rows (batch invariance). tests/kernels/test_quant_gemm.py writes this order in torch.
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#include <immintrin.h>
#define SLUICEWAY_HAVE_AVX512 1
#endif

namespace sluiceway {

#if SLUICEWAY_HAVE_AVX512
namespace {

enum Kind { kTable4 = 0, kTable5 = 1, kBytes = 2 };
constexpr int kRows = 4;        // register tile: 4 x rows x 4 outputs (16 accumulators)
constexpr int kCols = 4;
constexpr int64_t kRowBlock = 64;   // x rows per work item: 64 x K float32 stay in L2
constexpr int64_t kColBlock = 64;   // outputs per work item

struct Format {
  const uint8_t* data;
  int64_t subs, stride;
  int off, scales;  // scales: a values per sub-block (bytes kind)
};

inline float load_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Row n's K values [32 s, 32 s + 32) as float32: w0 (the first 16), w1.
template <int K, bool B>
inline void dequant32(const Format& f, int64_t n, int64_t s, __m512& w0, __m512& w1) {
  const uint8_t* p = f.data + (n * f.subs + s) * f.stride;
  if constexpr (K == kBytes) {
    const __m512 a0 = _mm512_set1_ps(load_f32(p + 32));
    const __m512 a1 = f.scales == 2 ? _mm512_set1_ps(load_f32(p + 36)) : a0;
    const auto* q = reinterpret_cast<const __m128i*>(p);
    w0 = _mm512_mul_ps(a0, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
    w1 = _mm512_mul_ps(a1, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
  } else {
    constexpr int extra = K == kTable5 ? 4 : 0;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 a = _mm512_set1_ps(load_f32(p + 16 + extra));
    __m512 lo, hi;  // the table: w for u = 0..15, 16..31
    if constexpr (B) {
      const __m512 b = _mm512_set1_ps(load_f32(p + 20 + extra));
      lo = _mm512_fmadd_ps(a, iota, b);
      if constexpr (K == kTable5)
        hi = _mm512_fmadd_ps(a, _mm512_add_ps(iota, _mm512_set1_ps(16.0f)), b);
    } else {  // a * (u - off): exact
      const __m512 shift = _mm512_set1_ps(static_cast<float>(-f.off));
      lo = _mm512_mul_ps(a, _mm512_add_ps(iota, shift));
      if constexpr (K == kTable5)
        hi = _mm512_mul_ps(a, _mm512_add_ps(iota, _mm512_add_ps(shift, _mm512_set1_ps(16.0f))));
    }
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    __m512i i0 = _mm512_and_si512(v, _mm512_set1_epi32(15)), i1 = _mm512_srli_epi32(v, 4);
    if constexpr (K == kTable5) {
      uint32_t h;
      std::memcpy(&h, p + 16, sizeof(h));
      const __m512i sixteen = _mm512_set1_epi32(16);
      i0 = _mm512_mask_or_epi32(i0, static_cast<__mmask16>(h), i0, sixteen);
      i1 = _mm512_mask_or_epi32(i1, static_cast<__mmask16>(h >> 16), i1, sixteen);
      w0 = _mm512_permutex2var_ps(lo, i0, hi);
      w1 = _mm512_permutex2var_ps(lo, i1, hi);
    } else {
      w0 = _mm512_permutexvar_ps(i0, lo);
      w1 = _mm512_permutexvar_ps(i1, lo);
    }
  }
}

// The fixed tree: lanes l + l+8, then + 4, + 2, + 1.
inline float lane_sum(__m512 v) {
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

struct Tile {
  const float* x;
  int64_t ldx;
  float* out;
  int64_t ldo;
  int64_t k;
};

// Rows [R] x outputs [n0, n0 + C): weights from `wbuf` ([C][K] float32) when given, else
// dequantized here (the same values: dequantization is exact).
template <int K, bool B, int R, int C, bool Buffered>
void micro_tile(const Format& f, const Tile& t, int64_t n0, const float* wbuf) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t s = 0; s < f.subs; ++s) {
    __m512 w[2][C];
    for (int c = 0; c < C; ++c) {
      if constexpr (Buffered) {
        w[0][c] = _mm512_loadu_ps(wbuf + c * t.k + 32 * s);
        w[1][c] = _mm512_loadu_ps(wbuf + c * t.k + 32 * s + 16);
      } else {
        dequant32<K, B>(f, n0 + c, s, w[0][c], w[1][c]);
      }
    }
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_loadu_ps(t.x + r * t.ldx + 32 * s + 16 * h);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv, w[h][c], acc[r][c]);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) t.out[r * t.ldo + n0 + c] = lane_sum(acc[r][c]);
}

template <int K, bool B, int C, int R = kRows>
void rows_tail(int rows, const Format& f, const Tile& t, int64_t n0, const float* wbuf) {
  if constexpr (R > 0) {
    if (rows == R && wbuf)
      micro_tile<K, B, R, C, true>(f, t, n0, wbuf);
    else if (rows == R)
      micro_tile<K, B, R, C, false>(f, t, n0, wbuf);
    else
      rows_tail<K, B, C, R - 1>(rows, f, t, n0, wbuf);
  }
}

template <int K, bool B, int C = kCols>
void cols_tail(int cols, int rows, const Format& f, const Tile& t, int64_t n0,
               const float* wbuf) {
  if constexpr (C > 0) {
    if (cols == C)
      rows_tail<K, B, C>(rows, f, t, n0, wbuf);
    else
      cols_tail<K, B, C - 1>(cols, rows, f, t, n0, wbuf);
  }
}

// x rows [r0, r1) x outputs [c0, c1). More than one row tile: each C outputs' weights are
// dequantized once into wbuf ([kCols][K]) and reused by the row tiles.
template <int K, bool B>
void block(const Format& f, const Tile& t, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
           float* wbuf) {
  for (int64_t n0 = c0; n0 < c1; n0 += kCols) {
    const int cols = static_cast<int>(std::min<int64_t>(kCols, c1 - n0));
    const float* w = nullptr;
    if (r1 - r0 > kRows) {
      for (int c = 0; c < cols; ++c)
        for (int64_t s = 0; s < f.subs; ++s) {
          __m512 w0, w1;
          dequant32<K, B>(f, n0 + c, s, w0, w1);
          _mm512_storeu_ps(wbuf + c * t.k + 32 * s, w0);
          _mm512_storeu_ps(wbuf + c * t.k + 32 * s + 16, w1);
        }
      w = wbuf;
    }
    for (int64_t r = r0; r < r1; r += kRows) {
      const Tile rt{t.x + r * t.ldx, t.ldx, t.out + r * t.ldo, t.ldo, t.k};
      cols_tail<K, B>(cols, static_cast<int>(std::min<int64_t>(kRows, r1 - r)), f, rt, n0, w);
    }
  }
}

}  // namespace
#endif

void quant_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t kind,
                int64_t offset, int64_t scales, bool has_b) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && out.device().is_cpu(),
              "quant_gemm runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x must be float32 [M, K] with contiguous rows");
  TORCH_CHECK(kind >= 0 && kind <= 2 && (scales == 1 || scales == 2), "bad kind or scales");
  TORCH_CHECK(kind == 2 || scales == 1, "the table kinds hold one scale per 32 values");
  TORCH_CHECK(kind != 2 || !has_b, "the bytes kind has no b");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  const int64_t stride =
      kind == 2 ? 32 + 4 * scales : 16 + (kind == 1 ? 4 : 0) + (has_b ? 8 : 4);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(0) == n && packed.size(1) * 32 == k && packed.size(2) == stride,
              "packed must be a contiguous uint8 [N, K / 32, ", stride, "] weight");
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
  const Format f{packed.data_ptr<uint8_t>(), packed.size(1), stride, static_cast<int>(offset),
                 static_cast<int>(scales)};
  const Tile t{x.data_ptr<float>(), x.stride(0), out.data_ptr<float>(), out.stride(0), k};
  const int64_t row_blocks = (m + kRowBlock - 1) / kRowBlock;
  const int64_t col_blocks = (n + kColBlock - 1) / kColBlock;
  at::parallel_for(0, row_blocks * col_blocks, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> wbuf(new float[kCols * k]);  // written before it is read
    for (int64_t item = begin; item < end; ++item) {
      const int64_t cb = item / row_blocks, rb = item % row_blocks;
      const int64_t r0 = rb * kRowBlock, r1 = std::min(m, r0 + kRowBlock);
      const int64_t c0 = cb * kColBlock, c1 = std::min(n, c0 + kColBlock);
      if (kind == kBytes)
        block<kBytes, false>(f, t, r0, r1, c0, c1, wbuf.get());
      else if (kind == kTable5)
        has_b ? block<kTable5, true>(f, t, r0, r1, c0, c1, wbuf.get())
              : block<kTable5, false>(f, t, r0, r1, c0, c1, wbuf.get());
      else
        has_b ? block<kTable4, true>(f, t, r0, r1, c0, c1, wbuf.get())
              : block<kTable4, false>(f, t, r0, r1, c0, c1, wbuf.get());
    }
  });
#else
  TORCH_CHECK(false, "quant_gemm needs AVX512, which this build's CPU lacks");
#endif
}

}  // namespace sluiceway
