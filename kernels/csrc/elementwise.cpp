// The per-layer elementwise work of a Llama decoder, fused: one pass over memory each instead
// of a chain of aten ops (and their OpenMP start-ups). All arithmetic in float32, one rounding
// to the model dtype per output, rows independent (parallel over tokens).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "cpu_math.h"

namespace sluiceway {

namespace {

constexpr int kLanes = 16;  // partial sums of a row reduction: fixed order, vectorizable

// Rows per task: each thread gets at least this many elements, so that a decode step's few rows
// run on the calling thread rather than paying an OpenMP wake-up (tens of us) per layer.
constexpr int64_t kMinElementsPerTask = 65536;

inline int64_t grain_rows(int64_t elements_per_row) {
  return std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(1, elements_per_row));
}

template <typename T>
float inverse_rms(const T* x, int64_t n, float eps) {
  float part[kLanes] = {0.0f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float v = to_float(x[i + j]);
      part[j] += v * v;
    }
  }
  for (int j = 0; i < n; ++i, ++j) {
    const float v = to_float(x[i]);
    part[j] += v * v;
  }
  float sum = 0.0f;
  for (int j = 0; j < kLanes; ++j) sum += part[j];
  return 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
}

// weight * x * rsqrt(mean(x^2) + eps) in float32, rounded once (as torch's F.rms_norm; closer
// to float32 than HF's two roundings: mean |logit error| 0.091 vs 0.112 on 24 ShareGPT prompts).
// W is T, or float for Gemma's (1 + w) weights, which transformers keeps in float32. In place
// (out == x) is fine: the row is read whole before it is written.
template <typename T, typename W>
void normalize_row(const T* x, const W* weight, T* out, int64_t n, float eps) {
  const float inv = inverse_rms(x, n, eps);
  for (int64_t i = 0; i < n; ++i) out[i] = from_float<T>(to_float(weight[i]) * (to_float(x[i]) * inv));
}

template <typename T, typename W>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, float eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  const W* w = weight.data_ptr<W>();
  T* o = out.data_ptr<T>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) normalize_row(xp + r * xs, w, o + r * n, n, eps);
  });
}

template <typename T, typename W>
void add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, float eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const W* w = weight.data_ptr<W>();
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = xp + r * n;
      T* rr = rp + r * n;
      for (int64_t i = 0; i < n; ++i) rr[i] = from_float<T>(to_float(xr[i]) + to_float(rr[i]));
      normalize_row(rr, w, xr, n, eps);
    }
  });
}

template <typename T>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), n = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(8 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * 2 * n;
      const T* up = gate + n;
      T* orow = o + r * n;
      int64_t i = 0;
      for (; i + 16 <= n; i += 16) {
        const v16f g = load16(gate + i);
        store16(orow + i, g / (1.0f + fast_exp16(-g)) * load16(up + i));
      }
      for (; i < n; ++i) {
        const float g = to_float(gate[i]);
        orow[i] = from_float<T>(g / (1.0f + fast_exp(-g)) * to_float(up[i]));
      }
    }
  });
}

// gelu(gate, tanh approximation) * up (transformers' gelu_pytorch_tanh): 0.5 g (1 + tanh(y)),
// y = sqrt(2 / pi) (g + 0.044715 g^3), with tanh(y) = 1 - 2 / (exp(2 y) + 1).
inline v16f gelu_tanh16(v16f g) {
  const v16f y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  const v16f y2 = y + y;
  // exp overflows to inf past ~88: tanh is 1 there (2 / inf = 0); below -88 exp is 0: tanh -1
  return 0.5f * g * (2.0f - 2.0f / (fast_exp16(y2) + 1.0f));
}

template <typename T>
void gelu_tanh_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), n = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(8 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * 2 * n;
      const T* up = gate + n;
      T* orow = o + r * n;
      int64_t i = 0;
      for (; i + 16 <= n; i += 16) store16(orow + i, gelu_tanh16(load16(gate + i)) * load16(up + i));
      for (; i < n; ++i) {  // the same lane arithmetic as the vector body: one result per value
        orow[i] = from_float<T>(gelu_tanh16(splat(to_float(gate[i])))[0] * to_float(up[i]));
      }
    }
  });
}

// Rotate-half RoPE (HF/NeoX) of one head in place: cos/sin [D / 2] float32.
template <typename T>
void rotate(T* x, const float* cos, const float* sin, int half) {
  for (int i = 0; i < half; ++i) {
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    x[i] = from_float<T>(x1 * cos[i] - x2 * sin[i]);
    x[i + half] = from_float<T>(x2 * cos[i] + x1 * sin[i]);
  }
}

// One token's head `x` [D] into an int8 cache row (kernels/kv_quant.py's rule, the torch
// reference's bits): scale = amax(|x|) / 127, q = round-half-even(x / scale) in [-127, 127] (0
// when the scale is 0), written with stride `stride` from `q`, the scale to `*scale`.
// D a multiple of 16: 16 lanes at a time, rounding by adding and subtracting 1.5 * 2**23 (round
// to nearest, ties to even, exact for |y| < 2**22: here |y| <= 127), which is rint's value.
template <typename T>
void quantize_head(const T* x, int d, int8_t* q, int64_t stride, float* scale) {
  float amax = 0.0f;
  if (d % 16 == 0) {
    v16f m = splat(0.0f);
    for (int i = 0; i < d; i += 16) {
      const v16f a = reinterpret_cast<v16f>(reinterpret_cast<v16i>(load16(x + i)) & 0x7FFFFFFF);
      m = a > m ? a : m;
    }
    amax = reduce_max(m);
  } else {
    for (int i = 0; i < d; ++i) amax = std::max(amax, std::fabs(to_float(x[i])));
  }
  const float s = amax / 127.0f;
  *scale = s;
  if (d % 16 == 0 && s > 0.0f) {
    for (int i = 0; i < d; i += 16) {
      v16f r = (load16(x + i) / s + 12582912.0f) - 12582912.0f;
      r = r > 127.0f ? splat(127.0f) : r;
      r = r < -127.0f ? splat(-127.0f) : r;
      const v16i qi = __builtin_convertvector(r, v16i);
      for (int j = 0; j < 16; ++j) q[(i + j) * stride] = static_cast<int8_t>(qi[j]);
    }
    return;
  }
  for (int i = 0; i < d; ++i) {
    const float r = s > 0.0f ? std::nearbyint(to_float(x[i]) / s) : 0.0f;  // ties to even
    q[i * stride] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
  }
}

// The fp8 rule: scale = amax / 448, q = c10's float -> e4m3 cast of x / scale (torch's .to()).
template <typename T>
void quantize_head(const T* x, int d, c10::Float8_e4m3fn* q, int64_t stride, float* scale) {
  float amax = 0.0f;
  for (int i = 0; i < d; ++i) amax = std::max(amax, std::fabs(to_float(x[i])));
  const float s = amax / 448.0f;
  *scale = s;
  const float safe = s > 0.0f ? s : 1.0f;
  for (int i = 0; i < d; ++i) q[i * stride] = c10::Float8_e4m3fn(to_float(x[i]) / safe);
}

// C: the cache's element type, T (a copy) or int8_t (quantized, kernels/kv_quant.py layout).
template <typename T, typename C>
void rotary_write_kv_impl(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                          const at::Tensor& sin, at::Tensor& kv_cache,
                          const at::Tensor& slot_mapping, int num_heads, int num_kv_heads) {
  constexpr bool kQuant = is_quantized_kv<C>();
  const int64_t tokens = qkv.size(0);
  const int head_dim = static_cast<int>(cos.size(1)) * 2;
  const int half = head_dim / 2;
  const int block_size = static_cast<int>(kv_cache.size(3) / (head_dim + (kQuant ? 4 : 0)));
  T* base = qkv.data_ptr<T>();
  const int64_t row_stride = qkv.stride(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = kv_cache.size(1) * block_size;
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " outside the rotary ",
                "table of ", cos.size(0));
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " outside the pool of ", num_slots);
  }
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  C* key_cache = kv_cache.data_ptr<C>();
  C* value_cache = key_cache + kv_cache.stride(0);
  const int64_t block_stride = kv_cache.stride(1);
  const int64_t head_stride = kv_cache.stride(2);
  at::parallel_for(0, tokens, grain_rows(4 * row_stride), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = base + t * row_stride;
      const float* c = cp + pos[t] * half;
      const float* s = sp + pos[t] * half;
      for (int h = 0; h < num_heads + num_kv_heads; ++h) rotate(row + h * head_dim, c, s, half);
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // a padding row writes nothing
      const int64_t block = slot / block_size, offset = slot % block_size;
      for (int h = 0; h < num_kv_heads; ++h) {
        const T* k = row + (num_heads + h) * head_dim;
        const T* v = row + (num_heads + num_kv_heads + h) * head_dim;
        C* kb = key_cache + block * block_stride + h * head_stride;  // [D, block_size]
        C* vb = value_cache + block * block_stride + h * head_stride;  // [block_size, D]
        if constexpr (kQuant) {  // the scales follow the row's block_size * D values
          float* ks = reinterpret_cast<float*>(kb + block_size * head_dim);
          float* vs = reinterpret_cast<float*>(vb + block_size * head_dim);
          quantize_head(k, head_dim, kb + offset, block_size, ks + offset);
          quantize_head(v, head_dim, vb + offset * head_dim, 1, vs + offset);
        } else {
          for (int i = 0; i < head_dim; ++i) kb[i * block_size + offset] = k[i];
          for (int i = 0; i < head_dim; ++i) vb[offset * head_dim + i] = v[i];
        }
      }
    }
  });
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, what, " must be 2-D with contiguous rows");
}

void check_norm_weight(const at::Tensor& weight, const at::Tensor& x, int64_t n) {
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous() &&
                  (weight.scalar_type() == x.scalar_type() ||
                   weight.scalar_type() == at::kFloat),
              "weight must be a contiguous [", n, "] in x's dtype or float32");
}

template <typename T, typename W>
void qk_rms_norm_impl(at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight,
                      int num_heads, int num_kv_heads, float eps) {
  const int64_t tokens = qkv.size(0), d = q_weight.numel();
  T* base = qkv.data_ptr<T>();
  const int64_t row_stride = qkv.stride(0);
  const W* qw = q_weight.data_ptr<W>();
  const W* kw = k_weight.data_ptr<W>();
  at::parallel_for(0, tokens, grain_rows(2 * row_stride), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = base + t * row_stride;
      for (int h = 0; h < num_heads + num_kv_heads; ++h) {
        normalize_row(row + h * d, h < num_heads ? qw : kw, row + h * d, d, eps);
      }
    }
  });
}

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes(), "out must be contiguous like x");
  check_norm_weight(weight, x, x.size(1));
  const bool f32 = weight.scalar_type() == at::kFloat;
  SLUICEWAY_DISPATCH(x.scalar_type(), "rms_norm",
                     f32 ? rms_norm_impl<scalar_t, float>(out, x, weight, static_cast<float>(eps))
                         : rms_norm_impl<scalar_t, scalar_t>(out, x, weight,
                                                             static_cast<float>(eps)));
}

void qk_rms_norm(at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight,
                 int64_t num_heads, int64_t num_kv_heads, double eps) {
  check_rows(qkv, "qkv");
  const int64_t d = q_weight.numel();
  TORCH_CHECK(d > 0 && qkv.size(1) >= (num_heads + num_kv_heads) * d,
              "qkv must hold (Hq + Hkv) * D columns");
  TORCH_CHECK(q_weight.scalar_type() == at::kFloat && k_weight.scalar_type() == at::kFloat &&
                  q_weight.is_contiguous() && k_weight.is_contiguous() && k_weight.numel() == d,
              "q_weight and k_weight must be contiguous float32 [D]");
  SLUICEWAY_DISPATCH(qkv.scalar_type(), "qk_rms_norm",
                     qk_rms_norm_impl<scalar_t, float>(qkv, q_weight, k_weight,
                                                       static_cast<int>(num_heads),
                                                       static_cast<int>(num_kv_heads),
                                                       static_cast<float>(eps)));
}

void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && x.size(1) % 2 == 0, "x must be [T, 2 I]");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == x.size(0) && 2 * out.size(1) == x.size(1) &&
                  out.scalar_type() == x.scalar_type(),
              "out must be [T, I] in x's dtype");
  SLUICEWAY_DISPATCH(x.scalar_type(), "gelu_tanh_and_mul",
                     gelu_tanh_and_mul_impl<scalar_t>(out, x));
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.dim() == 2 &&
                  x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual must be contiguous [T, H] of one dtype");
  check_norm_weight(weight, x, x.size(1));
  const float e = static_cast<float>(eps);
  const bool f32 = weight.scalar_type() == at::kFloat;
  SLUICEWAY_DISPATCH(x.scalar_type(), "fused_add_rms_norm",
                     f32 ? add_rms_norm_impl<scalar_t, float>(x, residual, weight, e)
                         : add_rms_norm_impl<scalar_t, scalar_t>(x, residual, weight, e));
}

void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && x.size(1) % 2 == 0, "x must be [T, 2 I]");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == x.size(0) && 2 * out.size(1) == x.size(1) &&
                  out.scalar_type() == x.scalar_type(),
              "out must be [T, I] in x's dtype");
  SLUICEWAY_DISPATCH(x.scalar_type(), "silu_and_mul", silu_and_mul_impl<scalar_t>(out, x));
}

void rotary_embedding_write_kv(at::Tensor& qkv, const at::Tensor& positions,
                               const at::Tensor& cos, const at::Tensor& sin,
                               at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                               int64_t num_heads, int64_t num_kv_heads) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(),
              "cos and sin must be contiguous float32 [max_positions, D / 2]");
  const int64_t head_dim = 2 * cos.size(1);
  TORCH_CHECK(head_dim > 0, "cos and sin must have D / 2 > 0 columns");
  TORCH_CHECK(qkv.size(1) >= (num_heads + 2 * num_kv_heads) * head_dim,
              "qkv must hold (Hq + 2 Hkv) * D columns");
  const bool fp8 = kv_cache.scalar_type() == at::kFloat8_e4m3fn;
  const bool quant = kv_cache.scalar_type() == at::kChar || fp8;
  const int64_t row = head_dim + (quant ? 4 : 0);  // per token: D values (+ a float32 scale)
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_cache.size(2) == num_kv_heads && kv_cache.size(3) >= row &&
                  kv_cache.size(3) % row == 0 &&
                  (quant ? kv_cache.size(3) / row * head_dim % 4 == 0
                         : kv_cache.scalar_type() == qkv.scalar_type()),
              "kv_cache must be a contiguous [2, num_blocks, Hkv, block_size * D] in qkv's dtype "
              "or int8/fp8 [2, num_blocks, Hkv, block_size * (D + 4)]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.numel() == qkv.size(0) && slot_mapping.numel() == qkv.size(0) &&
                  positions.is_contiguous() && slot_mapping.is_contiguous(),
              "positions and slot_mapping must be contiguous int64 [T]");
  const int hq = static_cast<int>(num_heads), hkv = static_cast<int>(num_kv_heads);
  if (fp8) {
    SLUICEWAY_DISPATCH(qkv.scalar_type(), "rotary_embedding_write_kv",
                       rotary_write_kv_impl<scalar_t, c10::Float8_e4m3fn>(
                           qkv, positions, cos, sin, kv_cache, slot_mapping, hq, hkv));
  } else if (quant) {
    SLUICEWAY_DISPATCH(qkv.scalar_type(), "rotary_embedding_write_kv",
                       rotary_write_kv_impl<scalar_t, int8_t>(qkv, positions, cos, sin, kv_cache,
                                                              slot_mapping, hq, hkv));
  } else {
    SLUICEWAY_DISPATCH(qkv.scalar_type(), "rotary_embedding_write_kv",
                       rotary_write_kv_impl<scalar_t, scalar_t>(qkv, positions, cos, sin,
                                                                kv_cache, slot_mapping, hq, hkv));
  }
}

}  // namespace sluiceway
