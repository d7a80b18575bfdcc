// The GEMM of GGUF-quantized weights with int8 activations (`--quantization gguf_a8`, W4A8 /
// W8A8 as llama.cpp's CPU backend computes: its ggml_vec_dot_q4_1_q8_1 and kin):
// out[M, N] ~= x[M, K] @ W[N, K]^T (+ bias), W kept in the bits of its GGUF blocks.
//
// Each row of x is quantized per 32 K values (a sub-block s, the weights' block): amax = max
// |x|, d = amax / 127, q = round-half-even(x * (127 / amax)) (0 where amax is 0), int8, and
// sumq = sum q (Q6_K: per 16). Per output (m, n), in order over s:
//   dot = sum_k u[n, k] * q[m, k]                   exact int32 (AVX512-VNNI vpdpbusd: u8 x s8)
//   t   = a * float(dot) + b * float(sumq)          Q4_1, Q4_K  (w = a u + b)
//       = a * float(dot - off * sumq)               Q4_0 (off 8), Q5_0 (16), Q8_0 (128: u = q+128)
//       = a_lo * float(dot_lo - 128 sumq_lo) + a_hi * float(dot_hi - 128 sumq_hi)    Q6_K
//   acc = acc + t * d
// every product and sum rounded to float32 on its own (no fused multiply-add: `unfused`),
// then + bias, then rounded to bfloat16 when out is. The integer sums are exact whatever their
// order, the float steps are a fixed sequence per output: a row's result does not depend on M,
// the tiling or the thread (batch invariance), and torch's elementwise float32 ops over the
// same steps are a bitwise reference (tests/kernels/test_quant_gemm_a8.py).
//
// Layout (kernels/quant_pack.py, layout "a8"): uint8 [ceil(N / 16)][K / 32][chunk], a chunk
// per 16 columns (zero-padded) per sub-block: the quants as 64-byte vectors whose 32-bit lane
// c holds column c's K values four at a time (vpdpbusd's groups):
//   Q4_0, Q4_1, Q4_K: 4 vectors, vector i byte 4 c + j = u[c][8 i + j] | u[c][8 i + 4 + j] << 4
//   Q5_0, Q8_0, Q6_K: 8 vectors, vector i byte 4 c + j = u[c][4 i + j] (Q8_0, Q6_K: q + 128)
// then the scales as quant_layout.h's (a; a, b for Q4_1, Q4_K; Q6_K's a for K 0..15, 16..31).
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "bf16_tile.h"
#include "quant_layout.h"

namespace sluiceway {
namespace {

using quant_layout::has_b;
using quant_layout::kQ4_0;
using quant_layout::kQ4_1;
using quant_layout::kQ4_K;
using quant_layout::kQ5_0;
using quant_layout::kQ6_K;
using quant_layout::kQ8_0;
using quant_layout::scale_vecs;

constexpr bool is_nibbles(int q) { return q == kQ4_0 || q == kQ4_1 || q == kQ4_K; }
constexpr int a8_offset(int q) {
  return q == kQ4_0 ? 8 : q == kQ5_0 ? 16 : q == kQ8_0 || q == kQ6_K ? 128 : 0;
}
constexpr int64_t a8_quant_bytes(int q) { return is_nibbles(q) ? 256 : 512; }
constexpr int64_t a8_chunk_bytes(int q) {
  return a8_quant_bytes(q) + scale_vecs(q) * 16 * (quant_layout::f16_scales(q) ? 2 : 4);
}

// An a8 chunk as quant_layout's scale readers (load_scale, scale_vec) take it: they find the
// scales quant_bytes(q) past the pointer, ours follow a8_quant_bytes(q) of quants.
constexpr const uint8_t* scales_view(int q, const uint8_t* chunk) {
  return chunk + a8_quant_bytes(q) - quant_layout::quant_bytes(q);
}

float a8_scale(int q, const uint8_t* chunk, int vec, int col) {
  return quant_layout::load_scale(q, scales_view(q, chunk), vec, col);
}

void check_a8_packed(const at::Tensor& packed, int64_t qtype, int64_t n, int64_t k) {
  quant_layout::check_packed(packed, qtype, n, k, a8_chunk_bytes, "int8-activation GEMM",
                             " in the a8 layout");
}

// Row n's K values as gguf's float32 values (quant_rows for the a8 layout).
template <int Q>
void a8_dequant_row(const uint8_t* data, int64_t subs, int64_t n, float* out) {
  const int c = static_cast<int>(n % 16);
  const uint8_t* group = data + (n / 16) * subs * a8_chunk_bytes(Q);
  for (int64_t s = 0; s < subs; ++s) {
    const uint8_t* chunk = group + s * a8_chunk_bytes(Q);
    for (int kk = 0; kk < 32; ++kk) {
      int u;
      if constexpr (is_nibbles(Q)) {
        u = (chunk[64 * (kk / 8) + 4 * c + kk % 4] >> (kk % 8 < 4 ? 0 : 4)) & 15;
      } else {
        u = chunk[64 * (kk / 4) + 4 * c + kk % 4];
      }
      const float a = a8_scale(Q, chunk, Q == kQ6_K ? kk / 16 : 0, c);
      out[32 * s + kk] = has_b(Q) ? std::fma(a, static_cast<float>(u), a8_scale(Q, chunk, 1, c))
                                  : a * static_cast<float>(u - a8_offset(Q));
    }
  }
}

#if SLUICEWAY_HAVE_AVX512BF16 && defined(__AVX512VNNI__)

constexpr int kRows = 4;     // register tile: up to 4 rows x 2 column vectors
constexpr int kColVecs = 2;  // a work item's columns: 32 (fine enough to share 576 evenly)
constexpr int64_t kRowBlockBytes = 128 * 1024;  // quantized x rows per work item
// Chunks prefetched into L2 ahead of the one read (besides quant_layout::kAhead into L1): past
// the item's columns into the next ones, which the thread reads next (its items are
// contiguous). At M 1 the weights stream from DRAM and the L1 prefetch alone kept too few
// bytes in flight: SmolLM2's 120 layer GEMMs (66 MB, Q4_1, 2 threads) took 3.8-5.1 ms
// without, 2.4-3.1 ms with 32 ahead; its Q8_0 logits (30 MB) 1.5-1.7 ms and 0.7-1.1 ms
// (16, 48, 64 measured the same as 32; the tile layout's dequantizing GEMM gained nothing).
constexpr int64_t kFarAhead = 32;

// x * w rounded to float32 on its own (the empty asm keeps GCC from contracting it with the
// sum that follows into an FMA: -ffp-contract=fast is its default).
inline __m512 unfused(__m512 x, __m512 w) {
  __m512 p = _mm512_mul_ps(x, w);
  asm("" : "+v"(p));
  return p;
}

// x quantized per sub-block: q int8 [M][K], d float [M][K / 32], sumq int32 [M][K / 16] (per
// half sub-block; Q6_K's scales are per 16).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sum16;
  int64_t k;
};

inline __m512 load_f32(const void* x, bool bf16, int64_t i) {
  if (!bf16) return _mm512_loadu_ps(static_cast<const float*>(x) + i);
  const __m256i h = _mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(x) + i));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

QuantizedRows quantize_rows(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), subs = k / 32, ld = x.stride(0);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  QuantizedRows r{std::vector<int8_t>(m * k), std::vector<float>(m * subs),
                  std::vector<int32_t>(m * 2 * subs), k};
  const auto* base = static_cast<const uint8_t*>(x.data_ptr());
  const int64_t elem = bf16 ? 2 : 4;
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const void* xr = base + row * ld * elem;
      for (int64_t s = 0; s < subs; ++s) {
        const __m512 v0 = load_f32(xr, bf16, 32 * s), v1 = load_f32(xr, bf16, 32 * s + 16);
        const float amax = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        r.d[row * subs + s] = amax / 127.0f;
        const __m512i lim = _mm512_set1_epi32(127);
        __m512i q[2];
        for (int h = 0; h < 2; ++h) {
          // x * id rounded, then to the nearest integer, ties to even (MXCSR's default)
          const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(h ? v1 : v0, _mm512_set1_ps(id)));
          q[h] = _mm512_max_epi32(_mm512_min_epi32(qi, lim),
                                  _mm512_sub_epi32(_mm512_setzero_si512(), lim));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(r.q.data() + row * k + 32 * s + 16 * h),
                           _mm512_cvtepi32_epi8(q[h]));
          r.sum16[row * 2 * subs + 2 * s + h] = _mm512_reduce_add_epi32(q[h]);
        }
      }
    }
  });
  return r;
}

struct Out {
  void* data;
  bool bf16;
  int64_t ld;
  const float* bias;
};

// A sub-block's t (the header's formula) from its two integer chains, the chunk's scales
// (`chunk` as scales_view gives it) and the row's sums of q per 16 K values.
template <int Q>
inline __m512 block_term(const __m512i dot[2], const uint8_t* chunk, const int32_t* sum16) {
  const __m512 a = quant_layout::scale_vec(Q, chunk, 0);
  if constexpr (has_b(Q)) {
    const __m512 b = quant_layout::scale_vec(Q, chunk, 1);
    const __m512 sumq = _mm512_set1_ps(static_cast<float>(sum16[0] + sum16[1]));
    const __m512 dot_all = _mm512_cvtepi32_ps(_mm512_add_epi32(dot[0], dot[1]));
    return _mm512_add_ps(unfused(a, dot_all), unfused(b, sumq));
  } else if constexpr (Q == kQ6_K) {
    const __m512 a_hi = quant_layout::scale_vec(Q, chunk, 1);
    const __m512i lo = _mm512_sub_epi32(dot[0], _mm512_set1_epi32(128 * sum16[0]));
    const __m512i hi = _mm512_sub_epi32(dot[1], _mm512_set1_epi32(128 * sum16[1]));
    return _mm512_add_ps(unfused(a, _mm512_cvtepi32_ps(lo)),
                         unfused(a_hi, _mm512_cvtepi32_ps(hi)));
  } else {
    const __m512i dot_all =
        _mm512_sub_epi32(_mm512_add_epi32(dot[0], dot[1]),
                         _mm512_set1_epi32(a8_offset(Q) * (sum16[0] + sum16[1])));
    return unfused(a, _mm512_cvtepi32_ps(dot_all));
  }
}

// Output row `row`, columns [col, col + 16) (those < n): v + bias, rounded to bfloat16 or not.
inline void store(const Out& out, __m512 v, int64_t row, int64_t col, int64_t n) {
  const __mmask16 mask = bf16_tile::tail_mask(n - col);
  if (out.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, out.bias + col));
  const int64_t at = row * out.ld + col;
  if (out.bf16)
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out.data) + at, mask,
                             (__m256i)_mm512_cvtneps_pbh(v));
  else
    _mm512_mask_storeu_ps(static_cast<float*>(out.data) + at, mask, v);
}

// Rows [row, row + R) x column vectors [vec, vec + C) over the whole K.
template <int Q, int R, int C>
void micro(const QuantizedRows& xq, int64_t row, const uint8_t* data, int64_t subs, int64_t vec,
           int64_t n, const Out& out) {
  constexpr int64_t kChunk = a8_chunk_bytes(Q);
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const uint8_t* group[C];
  for (int c = 0; c < C; ++c) group[c] = data + (vec + c) * subs * kChunk;
  const int8_t* xrow[R];
  for (int r = 0; r < R; ++r) xrow[r] = xq.q.data() + (row + r) * xq.k;
  const __m512i low4 = _mm512_set1_epi8(15);
  for (int64_t s = 0; s < subs; ++s) {
    // two integer chains per output (even / odd vectors; Q6_K: K 0..15 / 16..31)
    __m512i dot[R][C][2];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) dot[r][c][0] = dot[r][c][1] = _mm512_setzero_si512();
    for (int c = 0; c < C; ++c)
      for (int64_t line = 0; line < kChunk; line += 64) {
        const uint8_t* at = group[c] + s * kChunk + line;
        _mm_prefetch(reinterpret_cast<const char*>(at + quant_layout::kAhead * kChunk),
                     _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(at + kFarAhead * kChunk), _MM_HINT_T1);
      }
    if constexpr (is_nibbles(Q)) {
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
          const __m512i v = _mm512_loadu_si512(group[c] + s * kChunk + 64 * i);
          const __m512i lo = _mm512_and_si512(v, low4);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            int32_t x0, x1;
            std::memcpy(&x0, xrow[r] + 32 * s + 8 * i, 4);
            std::memcpy(&x1, xrow[r] + 32 * s + 8 * i + 4, 4);
            dot[r][c][0] = _mm512_dpbusd_epi32(dot[r][c][0], lo, _mm512_set1_epi32(x0));
            dot[r][c][1] = _mm512_dpbusd_epi32(dot[r][c][1], hi, _mm512_set1_epi32(x1));
          }
        }
      }
    } else {
      // vectors i0 and i1 = i0 + 1 (Q6_K: i0 + 4, the other half) into the two chains
      constexpr int kStep = Q == kQ6_K ? 1 : 2, kOther = Q == kQ6_K ? 4 : 1;
#pragma GCC unroll 4
      for (int i0 = 0; i0 < 8 - kOther; i0 += kStep) {
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
          const uint8_t* w = group[c] + s * kChunk;
          const __m512i v0 = _mm512_loadu_si512(w + 64 * i0);
          const __m512i v1 = _mm512_loadu_si512(w + 64 * (i0 + kOther));
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            int32_t x0, x1;
            std::memcpy(&x0, xrow[r] + 32 * s + 4 * i0, 4);
            std::memcpy(&x1, xrow[r] + 32 * s + 4 * (i0 + kOther), 4);
            dot[r][c][0] = _mm512_dpbusd_epi32(dot[r][c][0], v0, _mm512_set1_epi32(x0));
            dot[r][c][1] = _mm512_dpbusd_epi32(dot[r][c][1], v1, _mm512_set1_epi32(x1));
          }
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      const uint8_t* chunk = scales_view(Q, group[c] + s * kChunk);
      for (int r = 0; r < R; ++r) {
        const int32_t* sum16 = xq.sum16.data() + (row + r) * 2 * subs + 2 * s;
        const __m512 d = _mm512_set1_ps(xq.d[(row + r) * subs + s]);
        acc[r][c] = _mm512_add_ps(acc[r][c], unfused(block_term<Q>(dot[r][c], chunk, sum16), d));
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) store(out, acc[r][c], row + r, 16 * (vec + c), n);
}

template <int Q, int C>
void rows_of_item(const QuantizedRows& xq, int64_t r0, int64_t r1, const uint8_t* data,
                  int64_t subs, int64_t vec, int64_t n, const Out& out) {
  int64_t r = r0;
  for (; r + kRows <= r1; r += kRows) micro<Q, kRows, C>(xq, r, data, subs, vec, n, out);
  switch (r1 - r) {
    case 3: return micro<Q, 3, C>(xq, r, data, subs, vec, n, out);
    case 2: return micro<Q, 2, C>(xq, r, data, subs, vec, n, out);
    case 1: return micro<Q, 1, C>(xq, r, data, subs, vec, n, out);
    default: return;
  }
}

template <int Q>
void run(const Out& out, const QuantizedRows& xq, int64_t m, int64_t n, const uint8_t* data) {
  const int64_t subs = xq.k / 32, vecs = (n + 15) / 16;
  const int64_t tiles = (vecs + kColVecs - 1) / kColVecs;
  const int64_t row_block = bf16_tile::row_block_rows(m, tiles, xq.k, kRows, kRowBlockBytes);
  const int64_t row_blocks = (m + row_block - 1) / row_block;
  at::parallel_for(0, row_blocks * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / row_blocks, rb = item % row_blocks;
      const int64_t r0 = rb * row_block, r1 = std::min(m, r0 + row_block);
      const int64_t vec = t * kColVecs;
      if (vecs - vec >= kColVecs)
        rows_of_item<Q, kColVecs>(xq, r0, r1, data, subs, vec, n, out);
      else
        rows_of_item<Q, 1>(xq, r0, r1, data, subs, vec, n, out);
    }
  });
}
#endif

}  // namespace

bool quant_gemm_a8_supported() {
#if SLUICEWAY_HAVE_AVX512BF16 && defined(__AVX512VNNI__)
  return true;
#else
  return false;
#endif
}

void quant_gemm_a8(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                   int64_t qtype, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), "quant_gemm_a8 runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be bfloat16 or float32 [M, K] with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.stride(1) == 1 &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "out must be float32 or bfloat16 [M, N] with contiguous rows");
  const int64_t n = out.size(1);
  check_a8_packed(packed, qtype, n, k);
  at::assert_no_overlap(out, x);
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "bias must be a contiguous float32 [N]");
#if SLUICEWAY_HAVE_AVX512BF16 && defined(__AVX512VNNI__)
  if (m == 0 || n == 0) return;
  const QuantizedRows xq = quantize_rows(x);
  const Out o{out.data_ptr(), out.scalar_type() == at::kBFloat16, out.stride(0),
              bias.has_value() ? bias->data_ptr<float>() : nullptr};
  const uint8_t* data = packed.data_ptr<uint8_t>();
  quant_layout::with_qtype(qtype, [&](auto q) { run<decltype(q)::value>(o, xq, m, n, data); });
#else
  TORCH_CHECK(false,
              "quant_gemm_a8 needs AVX512-VNNI and AVX512-BF16, which this build's CPU lacks");
#endif
}

void quant_rows_a8(at::Tensor& out, const at::Tensor& packed, const at::Tensor& ids,
                   int64_t qtype, int64_t n) {
  quant_layout::gather_rows(
      out, packed, ids, qtype, n, [&](int64_t k) { check_a8_packed(packed, qtype, n, k); },
      [](auto q, const uint8_t* data, int64_t subs, int64_t id, float* dst) {
        a8_dequant_row<decltype(q)::value>(data, subs, id, dst);
      });
}

}  // namespace sluiceway
