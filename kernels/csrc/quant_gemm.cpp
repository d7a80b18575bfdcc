// The GEMM of GGUF-quantized weights with bfloat16 activations: out[M, N] = x[M, K] @ W[N, K]^T
// (+ bias), W kept in the bits of its GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K) and
// dequantized per work item (row block x 64-column tile) and per K block into a thread's
// buffer of bfloat16 pairs, which bf16_tile.h's micro-kernel (bf16_gemm's) runs over the rows
// (for M <= 6, one row group, dequantized pair by pair in registers as the micro-kernel loads
// them: the same values in the same order).
// The weights are gguf.quants.dequantize's float32 values (w = fma(a, u, b) or a * q, a * u
// exact in float32, as gguf computes them), rounded to bfloat16 to nearest even (vcvtne2ps2bf16:
// torch's .to(torch.bfloat16) for every finite value; no dequantized weight is a float32
// denormal: they are multiples of 2^-24), so the result is bitwise bf16_gemm's on those
// weights, whatever M (batch invariance).
//
// Layout: quant_layout.h.
#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "bf16_tile.h"
#include "quant_layout.h"

namespace sluiceway {
namespace {

using namespace quant_layout;

// Row blocks of at least this many rows (bf16_gemm's hold 256 KiB of x: 60 rows at K 2048),
// over which a tile's dequantization is amortized. 1 thread, M 2048, min rows 0 / 120 / 192 /
// 240 / 384 vs bf16_linear, us: Q6_K 640 x 2048 14456 / 13972 / 13650 / 13612 / 13489 vs
// 13212; Q4_K 640 x 2048 14698 / 13738 / 13507 / 13555 / 13784 vs 13573; Q4_1 576 x 1536
// 9282 / 9115 / 8851 / 8981 / 8806 vs 8627 (K 576: 222 rows already, no change).
constexpr int64_t kMinRowBlock = 192;

// Row n's K values as float32 (gguf's values bitwise): out[32 s + i] for each sub-block s.
template <int Q>
void dequant_row(const uint8_t* data, int64_t subs, int64_t n, float* out) {
  const int c = static_cast<int>(n % 16);
  const uint8_t* group = data + (n / 16) * subs * chunk_bytes(Q);
  for (int64_t s = 0; s < subs; ++s) {
    const uint8_t* chunk = group + s * chunk_bytes(Q);
    for (int i = 0; i < 32; ++i) {
      const int p = i / 2, j = 2 * (c % 8) + i % 2 + 16 * (c / 8);
      const float a = load_scale(Q, chunk, Q == kQ6_K ? p / 8 : 0, c);
      float w;
      if constexpr (is_bytes(Q)) {
        w = a * static_cast<float>(static_cast<int8_t>(chunk[p * 32 + j]));
      } else {
        int u = (chunk[p * 16 + j % 16] >> (j < 16 ? 0 : 4)) & 15;
        if constexpr (Q == kQ5_0) {
          uint32_t bits;
          std::memcpy(&bits, chunk + 256 + 4 * p, sizeof(bits));
          u |= static_cast<int>((bits >> j) & 1) << 4;
        }
        if constexpr (has_b(Q))
          w = std::fma(a, static_cast<float>(u), load_scale(Q, chunk, 1, c));
        else
          w = a * static_cast<float>(u - offset(Q));
      }
      out[32 * s + i] = w;
    }
  }
}

#if SLUICEWAY_HAVE_AVX512BF16
// Pair p (0..15) of a chunk: 16 columns' bfloat16 pairs.
template <int Q>
inline __m512i dequant_pair(const uint8_t* chunk, const Scales<Q>& sc, int p) {
  __m512 w[2];
  dequant_pair_f32<Q>(chunk, sc, p, w);
  return (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]);
}

// One thread's weight source for bf16_tile::tile_rows: a tile's K block dequantized into
// `buf` ([kColVecs][kPairBlock][16] pairs, 37 KiB: it stays in L1 across the row groups).
template <int Q>
struct Buffered {
  static_assert(bf16_tile::kPairBlock % 16 == 0, "K blocks are whole sub-blocks");
  const uint8_t* data;
  int64_t subs;
  std::vector<__m512i> buf;

  template <int C>
  bf16_tile::WeightView view(int64_t col, int64_t p0, int64_t p1) {
    auto* out = reinterpret_cast<uint32_t*>(buf.data());
    for (int c = 0; c < C; ++c) {
      const uint8_t* group = data + (col / 16 + c) * subs * chunk_bytes(Q);
      for (int64_t p = p0; p < p1; p += 16) {
        const uint8_t* chunk = group + (p / 16) * chunk_bytes(Q);
        prefetch_ahead<Q>(chunk);
        const Scales<Q> sc = load_scales<Q>(chunk);
        uint32_t* dst = out + (c * bf16_tile::kPairBlock + p - p0) * 16;
        for (int i = 0; i < 16; ++i)
          _mm512_storeu_si512(dst + 16 * i, dequant_pair<Q>(chunk, sc, i));
      }
    }
    return {out, bf16_tile::kPairBlock, p0};
  }
};

// The view of few rows (one row group): each pair dequantized in registers as the
// micro-kernel loads it (no buffer), a chunk's scales loaded at its first pair.
template <int Q, int C>
struct FusedView {
  static constexpr int64_t kSpan = 16;
  const uint8_t* group;  // the tile's first 16 columns
  int64_t group_bytes;
  const uint8_t* chunk[C];
  Scales<Q> sc[C];

  void begin(int64_t p) {
    for (int c = 0; c < C; ++c) {
      chunk[c] = group + c * group_bytes + (p / 16) * chunk_bytes(Q);
      prefetch_ahead<Q>(chunk[c]);
      sc[c] = load_scales<Q>(chunk[c]);
    }
  }
  __m512i load(int c, int64_t p) const { return dequant_pair<Q>(chunk[c], sc[c], p % 16); }
};

template <int Q>
struct Fused {
  const uint8_t* data;
  int64_t subs;
  template <int C>
  FusedView<Q, C> view(int64_t col, int64_t, int64_t) const {
    return {data + (col / 16) * subs * chunk_bytes(Q), subs * chunk_bytes(Q), {}, {}};
  }
};

template <int Q>
void run(const bf16_tile::Output& o, const uint16_t* x, int64_t ldx, int64_t m, int64_t n,
         int64_t k, const uint8_t* data) {
  const int64_t subs = k / 32;
  // Up to one row group the weights are dequantized in registers, not into a buffer: the
  // dequantization overlaps the loads and the sums' latency (576 x 576 at M 1, weights from
  // DRAM, 1 thread: Q4_1 28 -> 22 us, Q8_0 39 -> 21; in cache the same).
  if (m <= bf16_tile::kRows) {
    bf16_tile::gemm(o, x, ldx, m, n, k, k / 2, [data, subs] { return Fused<Q>{data, subs}; });
    return;
  }
  const auto buffered = [data, subs] {
    return Buffered<Q>{data, subs,
                       std::vector<__m512i>(bf16_tile::kColVecs * bf16_tile::kPairBlock)};
  };
  const int64_t row_block_bytes = std::max(bf16_tile::kRowBlockBytes, 2 * k * kMinRowBlock);
  bf16_tile::gemm(o, x, ldx, m, n, k, k / 2, buffered, row_block_bytes);
}
#endif

}  // namespace

void quant_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t qtype,
                const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), "quant_gemm runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be bfloat16 or float32 [M, K] with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.stride(1) == 1 &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "out must be float32 or bfloat16 [M, N] with contiguous rows");
  const int64_t n = out.size(1);
  check_packed(packed, qtype, n, k);
  at::assert_no_overlap(out, x);
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "bias must be a contiguous float32 [N]");
  if (x.scalar_type() == at::kFloat)
    return quant_gemm_f32(out, x, packed.data_ptr<uint8_t>(), qtype,
                          bias.has_value() ? bias->data_ptr<float>() : nullptr);
#if SLUICEWAY_HAVE_AVX512BF16
  if (m == 0 || n == 0) return;
  const bf16_tile::Output o{out.data_ptr(), out.scalar_type() == at::kBFloat16, out.stride(0),
                            bias.has_value() ? bias->data_ptr<float>() : nullptr};
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint8_t* data = packed.data_ptr<uint8_t>();
  const int64_t ldx = x.stride(0);
  with_qtype(qtype, [&](auto q) { run<decltype(q)::value>(o, xp, ldx, m, n, k, data); });
#else
  TORCH_CHECK(false, "quant_gemm needs AVX512-BF16, which this build's CPU lacks");
#endif
}

void quant_rows(at::Tensor& out, const at::Tensor& packed, const at::Tensor& ids,
                int64_t qtype, int64_t n) {
  gather_rows(
      out, packed, ids, qtype, n, [&](int64_t k) { check_packed(packed, qtype, n, k); },
      [](auto q, const uint8_t* data, int64_t subs, int64_t id, float* dst) {
        dequant_row<decltype(q)::value>(data, subs, id, dst);
      });
}

}  // namespace sluiceway
