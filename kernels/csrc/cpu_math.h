// Scalar helpers the CPU kernels share, written so that GCC/Clang vectorize the loops that call
// them (no function calls, no branches the vectorizer cannot turn into selects).
//
// Every loop in these kernels vectorizes across tokens (the 16 keys of a block) or across the
// head dimension, never across the rows of a batch, and reduces in a fixed order: a row's
// result does not depend on which other rows share the step or the thread that computed it.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

// Runs the statement list with `scalar_t` bound to the tensor dtype's C++ type, for the
// dtypes a model runs in (ATen's dispatch: an unsupported dtype is a clear error).
#define SLUICEWAY_DISPATCH(dtype, name, ...)                                       \
  AT_DISPATCH_SWITCH(dtype, name,                                                  \
                     AT_DISPATCH_CASE(at::kFloat, [&] { __VA_ARGS__; })            \
                     AT_DISPATCH_CASE(at::kBFloat16, [&] { __VA_ARGS__; })         \
                     AT_DISPATCH_CASE(at::kHalf, [&] { __VA_ARGS__; }))

namespace sluiceway {

inline float to_float(float x) { return x; }

// bfloat16 is the upper half of a float32: widening is exact.
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float to_float(c10::Half x) { return static_cast<float>(x); }

// An int8 or fp8 KV cache's value (kernels/kv_quant.py): exact in float32.
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(c10::Float8_e4m3fn x) { return static_cast<float>(x); }

// A quantized KV cache's element type: values with a float32 scale per token after them.
template <typename C>
constexpr bool is_quantized_kv() {
  return std::is_same_v<C, int8_t> || std::is_same_v<C, c10::Float8_e4m3fn>;
}

template <typename T>
inline T from_float(float x);

template <>
inline float from_float<float>(float x) {
  return x;
}

// Round to nearest even, as c10::BFloat16(float) does (NaN stays a quiet NaN).
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  uint32_t is_nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  c10::BFloat16 out;
  out.x = static_cast<uint16_t>(is_nan ? 0x7FC0u : rounded);
  return out;
}

template <>
inline c10::Half from_float<c10::Half>(float x) {
  return c10::Half(x);
}

}  // namespace sluiceway

namespace sluiceway {

// 16 float32 lanes as a GCC/Clang vector type: one AVX-512 register, two AVX2 ones; the
// compiler keeps these in registers where arrays of floats would be spilled.
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef int8_t v16i8 __attribute__((vector_size(16)));
typedef int16_t v16i16 __attribute__((vector_size(32)));

inline v16f splat(float x) { return v16f{} + x; }

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// With AVX-512 one vpmovzxwd from memory and one shift: GCC 12 tuned for Zen 4 (-march=native)
// splits the generic form into 256-bit halves, 6 instructions per vector, which in the
// attention's loops competed with its FMAs. The same values; measured on an AMD EPYC (Zen 4,
// 2 cores), SmolLM2's heads over 30 layers' pools: prefill attention of 8 x 256 rows 187 ->
// 150 ms, decode of batch 200 at context 320 89 -> 82 ms (cache-resident 47 -> 38 ms).
inline v16f load16(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<v16f>(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#else
  v16u16 raw;
  std::memcpy(&raw, p, sizeof(raw));
  return reinterpret_cast<v16f>(__builtin_convertvector(raw, v16i) << 16);
#endif
}

inline v16f load16(const c10::Half* p) {
  v16f v;
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}

// 16 int8 values (an int8 KV cache's) widened to float32: vpmovsxbd + vcvtdq2ps with
// AVX-512; GCC 12 turns a direct int8 -> float __builtin_convertvector into 16 scalar
// conversions, so elsewhere the widening goes through int16 and int32 vectors.
inline v16f load16(const int8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<v16f>(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#else
  v16i8 raw;
  std::memcpy(&raw, p, sizeof(raw));
  return __builtin_convertvector(__builtin_convertvector(__builtin_convertvector(raw, v16i16), v16i),
                                 v16f);
#endif
}

// 16 e4m3 values widened exactly: sign | exponent-and-mantissa << 7 is the fp16 of the value
// times 2**-8 (bias 15 vs 7, subnormals included), then vcvtph2ps and * 256.
inline v16f load16(const c10::Float8_e4m3fn* p) {
#if defined(__AVX512F__)
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
  return reinterpret_cast<v16f>(_mm512_cvtph_ps(h)) * 256.0f;
#else
  v16f v;
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

inline void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof(v)); }

template <typename T>
inline void store16(T* p, v16f v) {
  for (int i = 0; i < 16; ++i) p[i] = from_float<T>(v[i]);
}

// from_float<BFloat16>'s rounding on 16 lanes at once. GCC vectorized the loop above for
// bfloat16 only while load16 was generic vector code: with load16's intrinsics it went lane
// by lane and silu_and_mul took 3.2x as long (2,048 x 3,072: 30 -> 97 ms for 30 calls).
inline void store16(c10::BFloat16* p, v16f v) {
#if defined(__AVX512F__)
  const __m512i bits = reinterpret_cast<__m512i>(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
  const __m512i out = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(out));
#else
  for (int i = 0; i < 16; ++i) p[i] = from_float<c10::BFloat16>(v[i]);
#endif
}

// exp(x) in float32 to about 2 ulp, lane by lane (Cephes' expf: x = n ln2 + r with a
// two-constant Cody-Waite reduction, a degree-5 minimax polynomial for e^r, 2^n built in the
// exponent bits). exp(-inf) and anything below -87.3 is 0; above 88.3 it saturates at e^88.3.
inline v16f fast_exp16(v16f x) {
  const v16f lo = splat(-87.3f), hi = splat(88.3f);
  v16f clamped = x < lo ? lo : x;
  clamped = clamped > hi ? hi : clamped;
  const v16f n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  v16f r = clamped - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  v16f p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
  return x < lo ? splat(0.0f) : p * reinterpret_cast<v16f>(e);
}

// One lane of fast_exp16: the same value (for the few scalars: rescale factors, row tails).
inline float fast_exp(float x) { return fast_exp16(splat(x))[0]; }

// Horizontal max (exact in any order) and sum, as a fixed tree of lane shuffles: halves, then
// quarters, eighths and pairs (((v0 + v8) + (v4 + v12)) + ((v2 + v10) + (v6 + v14))) + ...
inline v16f max16(v16f a, v16f b) { return a > b ? a : b; }

inline float reduce_max(v16f v) {
  v = max16(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = max16(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = max16(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = max16(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}

inline float reduce_sum(v16f v) {
  v = v + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v = v + __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v = v + __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v = v + __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

}  // namespace sluiceway
