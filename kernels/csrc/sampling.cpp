// Greedy sampling's two reductions over the vocabulary, in one pass per row: the argmax (the
// first index of the largest logit, as torch.argmax) and the log-sum-exp minus the row's max,
// log(sum(exp(x - max))), so that a chosen token's logprob is (logit - max) - that, without
// the rounding of max + log(...) (a near-certain token's logprob would be quantized to the ulp
// of max). Rows in parallel; 16 lanes and a fixed combining order per row.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

#include "cpu_math.h"

namespace sluiceway {

namespace {

template <typename T>
void argmax_logsumexp_impl(at::Tensor& argmax, at::Tensor& logsumexp, const at::Tensor& logits) {
  const int64_t rows = logits.size(0), v = logits.size(1), stride = logits.stride(0);
  const T* base = logits.data_ptr<T>();
  int64_t* am = argmax.data_ptr<int64_t>();
  float* lse = logsumexp.data_ptr<float>();
  const v16f neg_inf = splat(-std::numeric_limits<float>::infinity());
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* x = base + r * stride;
      v16f best = neg_inf;
      v16i best_at{};
      v16i at_i;
      for (int j = 0; j < 16; ++j) at_i[j] = j;
      int64_t i = 0;
      for (; i + 16 <= v; i += 16, at_i += 16) {
        const v16f chunk = load16(x + i);
        const v16i better = chunk > best;  // strict: the first index wins a tie
        best = better ? chunk : best;
        best_at = better ? at_i : best_at;
      }
      float m = -std::numeric_limits<float>::infinity();
      int64_t m_at = 0;
      bool found = false;
      for (int j = 0; j < 16; ++j) {
        if (i > 0 && (!found || best[j] > m || (best[j] == m && best_at[j] < m_at))) {
          m = best[j];
          m_at = best_at[j];
          found = true;
        }
      }
      for (int64_t k = i; k < v; ++k) {
        const float xk = to_float(x[k]);
        if (!found || xk > m) {
          m = xk;
          m_at = k;
          found = true;
        }
      }
      am[r] = m_at;
      if (std::isinf(m)) {  // every logit -inf, or one of them +inf: log-sum-exp = m
        lse[r] = 0.0f;
        continue;
      }
      v16f sum = splat(0.0f);
      int64_t k = 0;
      for (; k + 16 <= v; k += 16) sum += fast_exp16(load16(x + k) - m);
      float total = reduce_sum(sum);
      for (; k < v; ++k) total += fast_exp(to_float(x[k]) - m);
      lse[r] = std::log(total);  // the max added by the caller: no rounding of m + log
    }
  });
}

}  // namespace

void argmax_logsumexp(at::Tensor& argmax, at::Tensor& logsumexp, const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "logits must be float32 or bfloat16 [R, V] with contiguous rows");
  TORCH_CHECK(argmax.scalar_type() == at::kLong && argmax.numel() == logits.size(0) &&
                  logsumexp.scalar_type() == at::kFloat && logsumexp.numel() == logits.size(0) &&
                  argmax.is_contiguous() && logsumexp.is_contiguous(),
              "argmax must be a contiguous int64 [R] and logsumexp float32 [R]");
  TORCH_CHECK(logits.size(1) > 0, "logits have no columns");
  if (logits.scalar_type() == at::kFloat) {
    argmax_logsumexp_impl<float>(argmax, logsumexp, logits);
  } else {
    argmax_logsumexp_impl<c10::BFloat16>(argmax, logsumexp, logits);
  }
}

// Structured outputs: logits[r, t] = -inf for each row r in `rows` and every token t whose bit
// (bit t % 32 of word t / 32 of bitmask[r], int32) is clear. A word that allows all 32 tokens
// is skipped; the others are a branch-free select the compiler vectorizes.
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.scalar_type() == at::kFloat,
              "logits must be float32 [R, V] with contiguous rows");
  const int64_t v = logits.size(1), words = (v + 31) / 32;
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.stride(1) == 1 &&
                  bitmask.size(0) == logits.size(0) && bitmask.size(1) >= words,
              "bitmask must be int32 [R, >= ceil(V / 32)] with contiguous rows");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "rows must be a contiguous int64 [N]");
  const int64_t n = rows.numel(), stride = logits.stride(0), bm_stride = bitmask.stride(0);
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < logits.size(0), "row ", row_ids[i], " out of range");
  }
  float* base = logits.data_ptr<float>();
  const uint32_t* masks = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* x = base + row_ids[i] * stride;
      const uint32_t* w = masks + row_ids[i] * bm_stride;
      for (int64_t k = 0; k < words; ++k) {
        const uint32_t m = w[k];
        if (m == 0xffffffffu) continue;
        float* xk = x + k * 32;
        if (k * 32 + 32 <= v) {
          for (int b = 0; b < 32; ++b) xk[b] = ((m >> b) & 1u) ? xk[b] : neg_inf;
        } else {
          for (int64_t b = 0; b < v - k * 32; ++b) xk[b] = ((m >> b) & 1u) ? xk[b] : neg_inf;
        }
      }
    }
  });
}

}  // namespace sluiceway
