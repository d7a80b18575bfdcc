// The packed layout of GGUF-quantized weights (kernels/quant_pack.py) and its dequantization,
// shared by quant_gemm.cpp (bfloat16 activations) and quant_gemm_f32.cpp (float32);
// quant_gemm_a8.cpp (int8 activations) keeps its own quants' layout and these scales.
//
// Layout (kernels/quant_pack.py): uint8 [ceil(N / 16)][K / 32][chunk], a chunk per 16 columns
// (zero-padded) per 32 K values (a sub-block) holding its 16 K pairs: per pair p the 32 values
// v[j], j = 2 c + h for column c and K 32 s + 2 p + h, so that lanes 0..15 (columns 0..7) and
// 16..31 (columns 8..15) convert to one vector of bfloat16 pairs with one vcvtne2ps2bf16:
//   Q8_0, Q6_K: 32 int8 q = u - offset per pair (512 bytes; Q6_K's 6 bits widened to 8)
//   Q4_0, Q4_1, Q4_K: 16 bytes per pair, byte j = v[j] | v[j + 16] << 4 (256 bytes)
//   Q5_0: those 256 bytes, then a uint32 per pair, bit j = v[j] >> 4 (64 bytes)
// then the scales, a vector of 16 columns each: Q8_0, Q4_0, Q5_0 a (the file's float16 d);
// Q4_1 a, b (float16 d, m); Q4_K a = d * sc, b = -dmin * m (float32); Q6_K a for pairs 0..7,
// a for pairs 8..15 (float32 d * scale). w = fma(a, u, b) (Q4_1, Q4_K), a * (u - off) (Q4_0:
// off 8, Q5_0: 16), a * q (Q8_0, Q6_K).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "bf16_tile.h"

namespace sluiceway {
namespace quant_layout {

constexpr int64_t kAhead = 4;  // sub-blocks prefetched ahead (prefetch_ahead)
// ggml's type ids.
enum QType : int { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };

constexpr bool is_bytes(int q) { return q == kQ8_0 || q == kQ6_K; }
constexpr bool has_b(int q) { return q == kQ4_1 || q == kQ4_K; }
constexpr bool f16_scales(int q) { return q != kQ4_K && q != kQ6_K; }
constexpr int scale_vecs(int q) { return q == kQ4_1 || q == kQ4_K || q == kQ6_K ? 2 : 1; }
constexpr int offset(int q) { return q == kQ4_0 ? 8 : q == kQ5_0 ? 16 : 0; }
constexpr int64_t quant_bytes(int q) { return is_bytes(q) ? 512 : q == kQ5_0 ? 320 : 256; }
constexpr int64_t chunk_bytes(int q) {
  return quant_bytes(q) + scale_vecs(q) * 16 * (f16_scales(q) ? 2 : 4);
}

inline float load_scale(int q, const uint8_t* chunk, int vec, int col) {
  const uint8_t* p = chunk + quant_bytes(q);
  if (f16_scales(q)) {
    uint16_t h;
    std::memcpy(&h, p + (vec * 16 + col) * 2, sizeof(h));
    return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
  }
  float f;
  std::memcpy(&f, p + (vec * 16 + col) * 4, sizeof(f));
  return f;
}

// A packed weight's checks: a supported type, then uint8 [ceil(N / 16), K / 32, chunk] with
// chunk = chunk_of(qtype) (quant_gemm_a8.cpp's layout passes its own, naming itself in `gemm`
// and `layout`).
inline void check_packed(const at::Tensor& packed, int64_t qtype, int64_t n, int64_t k,
                         int64_t (*chunk_of)(int) = chunk_bytes,
                         const char* gemm = "quantized GEMM", const char* layout = "") {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ5_0 || qtype == kQ8_0 ||
                  qtype == kQ4_K || qtype == kQ6_K,
              "no ", gemm, " for ggml type ", qtype);
  const int64_t chunk = chunk_of(static_cast<int>(qtype));
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 3 &&
                  packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(0) == (n + 15) / 16 && packed.size(1) * 32 == k &&
                  packed.size(2) == chunk,
              "packed must be a contiguous uint8 [ceil(N / 16), K / 32, ", chunk, "] weight",
              layout, " (N ", n, ", K ", k, ")");
}

// f(std::integral_constant<int, Q>{}) for ggml type `qtype` (one that check_packed accepts):
// the kernels' one switch from a runtime type to their templates.
template <class F>
decltype(auto) with_qtype(int64_t qtype, F&& f) {
  switch (qtype) {
    case kQ4_0: return f(std::integral_constant<int, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int, kQ4_1>{});
    case kQ5_0: return f(std::integral_constant<int, kQ5_0>{});
    case kQ8_0: return f(std::integral_constant<int, kQ8_0>{});
    case kQ4_K: return f(std::integral_constant<int, kQ4_K>{});
    default: return f(std::integral_constant<int, kQ6_K>{});
  }
}

// quant_rows and quant_rows_a8: out[r] (float32 [R, K]) = row ids[r] of the [n, K] weight
// `packed` as gguf's float32 values; `check(k)` checks packed (after out and ids), `row(q,
// data, subs, id, dst)` writes one row of type q (an integral_constant) into dst.
template <class Check, class Row>
void gather_rows(at::Tensor& out, const at::Tensor& packed, const at::Tensor& ids,
                 int64_t qtype, int64_t n, const Check& check, const Row& row) {
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && out.scalar_type() == at::kFloat &&
                  out.is_contiguous(),
              "out must be a contiguous float32 [R, K]");
  TORCH_CHECK(ids.device().is_cpu() && ids.dim() == 1 && ids.scalar_type() == at::kLong &&
                  ids.is_contiguous() && ids.size(0) == out.size(0),
              "ids must be a contiguous int64 [R]");
  const int64_t k = out.size(1);
  check(k);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < ids.size(0); ++r)
    TORCH_CHECK(id[r] >= 0 && id[r] < n, "row ", id[r], " out of range [0, ", n, ")");
  const uint8_t* data = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t subs = k / 32;
  at::parallel_for(0, ids.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      with_qtype(qtype, [&](auto q) { row(q, data, subs, id[r], o + r * k); });
  });
}

#if SLUICEWAY_HAVE_AVX512BF16
inline __m512 scale_vec(int q, const uint8_t* chunk, int vec) {
  const uint8_t* p = chunk + quant_bytes(q);
  if (f16_scales(q))
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + vec * 32)));
  return _mm512_loadu_ps(p + vec * 64);
}

// A chunk's scales per half of a pair's 32 lanes: [0] columns 0..7, each twice (its two K
// values), [1] columns 8..15; a1: Q6_K's pairs 8..15.
template <int Q>
struct Scales {
  __m512 a0[2], a1[2], b[2];
};

template <int Q>
inline Scales<Q> load_scales(const uint8_t* chunk) {
  const __m512i lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  Scales<Q> sc;
  const __m512 a = scale_vec(Q, chunk, 0);
  sc.a0[0] = _mm512_permutexvar_ps(lo, a), sc.a0[1] = _mm512_permutexvar_ps(hi, a);
  if constexpr (Q == kQ6_K) {
    const __m512 a1 = scale_vec(Q, chunk, 1);
    sc.a1[0] = _mm512_permutexvar_ps(lo, a1), sc.a1[1] = _mm512_permutexvar_ps(hi, a1);
  }
  if constexpr (has_b(Q)) {
    const __m512 b = scale_vec(Q, chunk, 1);
    sc.b[0] = _mm512_permutexvar_ps(lo, b), sc.b[1] = _mm512_permutexvar_ps(hi, b);
  }
  return sc;
}

// Pair p (0..15) of a chunk as gguf's float32 values: w[h] holds columns 8 h .. 8 h + 7, each
// twice (lane 2 c' + i: column 8 h + c', K value 2 p + i of the sub-block).
template <int Q>
inline void dequant_pair_f32(const uint8_t* chunk, const Scales<Q>& sc, int p, __m512 w[2]) {
  if constexpr (is_bytes(Q)) {
    const auto* q = reinterpret_cast<const __m128i*>(chunk + p * 32);
    for (int h = 0; h < 2; ++h) {
      const __m512 a = Q == kQ6_K && p >= 8 ? sc.a1[h] : sc.a0[h];
      w[h] = _mm512_mul_ps(a, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + h))));
    }
  } else {
    const __m512i v = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + p * 16)));
    __m512i u[2] = {_mm512_and_si512(v, _mm512_set1_epi32(15)), _mm512_srli_epi32(v, 4)};
    if constexpr (Q == kQ5_0) {
      uint32_t bits;
      std::memcpy(&bits, chunk + 256 + 4 * p, sizeof(bits));
      const __m512i sixteen = _mm512_set1_epi32(16);
      u[0] = _mm512_mask_or_epi32(u[0], static_cast<__mmask16>(bits), u[0], sixteen);
      u[1] = _mm512_mask_or_epi32(u[1], static_cast<__mmask16>(bits >> 16), u[1], sixteen);
    }
    for (int h = 0; h < 2; ++h) {
      if constexpr (has_b(Q)) {
        w[h] = _mm512_fmadd_ps(sc.a0[h], _mm512_cvtepi32_ps(u[h]), sc.b[h]);
      } else {
        const __m512i q = _mm512_sub_epi32(u[h], _mm512_set1_epi32(offset(Q)));
        w[h] = _mm512_mul_ps(sc.a0[h], _mm512_cvtepi32_ps(q));
      }
    }
  }
}

// The chunk kAhead sub-blocks after `chunk` into L1: a tile reads its columns' chunks as
// kColVecs slow streams (the dequantization between loads), which the hardware prefetchers
// keep too few lines ahead of (SmolLM2's 576 x 576 Q4_1 at M 1, weights from DRAM, 1
// thread: 32 us without, 22 us with 2 ahead, 22 with 4; Q8_0: 31, 26, 21). A prefetch past
// the weight's end never faults.
template <int Q>
inline void prefetch_ahead(const uint8_t* chunk) {
  const uint8_t* next = chunk + kAhead * chunk_bytes(Q);
  for (int64_t line = 0; line < chunk_bytes(Q); line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(next + line), _MM_HINT_T0);
}

#endif

}  // namespace quant_layout

// quant_gemm with float32 x and out (quant_gemm_f32.cpp), its arguments checked by quant_gemm.
void quant_gemm_f32(at::Tensor& out, const at::Tensor& x, const uint8_t* data, int64_t qtype,
                    const float* bias);

}  // namespace sluiceway
