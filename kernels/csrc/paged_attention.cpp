// Paged attention over the KV pool on the CPU: prefill chunks and decode tokens of one step,
// in one kernel.
//
// Layout (kernels/paged_attention.py): kv_cache [2, num_blocks, Hkv, block_size * D]; a K block
// of one head is stored transposed, [D, block_size], a V block as is, [block_size, D].
//
// One work item is (sequence, KV head, tile of up to kRowTile query rows of its chunk): the G
// query heads of that KV head (grouped-query attention) go through each K and V block
// together, so a block is read from memory once per KV head per tile, and the next blocks are
// prefetched. Each row keeps an online softmax (Milakov & Gimelshein 2018, as in
// FlashAttention) over the blocks in order: for every block its scores (a dot product per key,
// vectorized over the block's keys), the new running max, and the rescaled sum and output
// (vectorized over D). A row reads only the blocks up to its own position, and its arithmetic
// is the same whatever the tile, the chunking of its prompt or the other rows of the step.
// Work items are claimed from a shared counter, the costliest first.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_math.h"

namespace sluiceway {

namespace {

constexpr int kRowTile = 16;
constexpr int kPrefetchBlocks = 2;  // how many blocks ahead a work item prefetches

struct WorkItem {
  int32_t seq;
  int32_t kv_head;
  int32_t row_begin;  // rows of the flattened batch
  int32_t row_end;
  int64_t cost;  // rows x blocks read: the order items are claimed in
};

// ---- the vectorized path: block_size a multiple of 16, D = 16 * ND -----------------------

// NL query lanes (query heads of one row that share a KV head) against the keys of one block
// the row sees (`valid` of them), 16 keys (a "key tile") at a time: scores q . k (two partial
// sums, even and odd dimensions, added at the end: independent FMA chains), an online-softmax
// step per tile, and the rescaled output. Per lane the operations and their order are fixed.
template <typename T, int ND, int NL>
inline void attend_block(const float* __restrict__ q, float* __restrict__ acc,
                         float* __restrict__ run_max, float* __restrict__ run_sum,
                         const T* __restrict__ kb, const T* __restrict__ vb, int bs, int valid) {
  constexpr int D = 16 * ND;
  v16i iota;
  for (int t = 0; t < 16; ++t) iota[t] = t;
  for (int kt = 0; kt * 16 < valid; ++kt) {
    const int tile_valid = std::min(16, valid - kt * 16);
    v16f even[NL], odd[NL];
    for (int l = 0; l < NL; ++l) even[l] = odd[l] = splat(0.0f);
    for (int i = 0; i < D; i += 2) {
      const v16f k0 = load16(kb + i * bs + kt * 16);
      const v16f k1 = load16(kb + (i + 1) * bs + kt * 16);
      for (int l = 0; l < NL; ++l) {
        even[l] += q[l * D + i] * k0;
        odd[l] += q[l * D + i + 1] * k1;
      }
    }
    const v16i seen = iota < tile_valid;
    const v16f neg_inf = splat(-std::numeric_limits<float>::infinity());
    v16f prob[NL];
    float alpha[NL];
    for (int l = 0; l < NL; ++l) {
      const v16f scores = even[l] + odd[l];
      const float mx = std::max(run_max[l], reduce_max(seen ? scores : neg_inf));
      alpha[l] = fast_exp(run_max[l] - mx);
      prob[l] = seen ? fast_exp16(scores - mx) : splat(0.0f);
      run_sum[l] = run_sum[l] * alpha[l] + reduce_sum(prob[l]);
      run_max[l] = mx;
    }
    v16f o[NL][ND];
    for (int l = 0; l < NL; ++l)
      for (int j = 0; j < ND; ++j) o[l][j] = load16(acc + l * D + 16 * j) * alpha[l];
    for (int t = 0; t < tile_valid; ++t) {
      const T* vrow = vb + (kt * 16 + t) * D;
      v16f v[ND];
      for (int j = 0; j < ND; ++j) v[j] = load16(vrow + 16 * j);
      for (int l = 0; l < NL; ++l) {
        const float pt = prob[l][t];
        for (int j = 0; j < ND; ++j) o[l][j] += pt * v[j];
      }
    }
    for (int l = 0; l < NL; ++l)
      for (int j = 0; j < ND; ++j) store16(acc + l * D + 16 * j, o[l][j]);
  }
}

// ---- the generic path: any block size and head dimension (scalar loops) -----------------

template <typename T>
void attend_block_generic(const float* q, float* acc, float* run_max, float* run_sum,
                          const T* kb, const T* vb, int bs, int d, int valid, float* s) {
  for (int t = 0; t < valid; ++t) {
    float dot = 0.0f;
    for (int i = 0; i < d; ++i) dot += q[i] * to_float(kb[i * bs + t]);
    s[t] = dot;
  }
  float mx = *run_max;
  for (int t = 0; t < valid; ++t) mx = std::max(mx, s[t]);
  const float alpha = fast_exp(*run_max - mx);
  float sum = 0.0f;
  for (int t = 0; t < valid; ++t) {
    s[t] = fast_exp(s[t] - mx);
    sum += s[t];
  }
  *run_sum = *run_sum * alpha + sum;
  *run_max = mx;
  for (int i = 0; i < d; ++i) acc[i] *= alpha;
  for (int t = 0; t < valid; ++t)
    for (int i = 0; i < d; ++i) acc[i] += s[t] * to_float(vb[t * d + i]);
}

// One work item: rows [row_begin, row_end) of a sequence's chunk against its blocks, for the
// query heads of one KV head. ND > 0: the vectorized path with D = 16 * ND; 0: generic.
template <typename T, int ND>
void attend_item(const WorkItem& item, const T* query, int64_t query_row_stride,
                 const T* key_cache, const T* value_cache, int64_t cache_block_stride,
                 const int32_t* block_table, int32_t context_len, int32_t chunk_start,
                 int32_t chunk_len, int num_heads, int num_kv_heads, int head_dim,
                 int block_size, float scale, T* out, std::vector<float>& scratch) {
  const int d = ND ? 16 * ND : head_dim;
  const int bs = block_size;
  const int group = num_heads / num_kv_heads;
  const int rows = item.row_end - item.row_begin;
  const int lanes = rows * group;  // (row, query head of the group) pairs
  scratch.resize(static_cast<size_t>(lanes) * (2 * d + 2) + bs);
  float* q = scratch.data();         // [lanes, D], scaled
  float* acc = q + lanes * d;        // [lanes, D]
  float* run_max = acc + lanes * d;  // [lanes]
  float* run_sum = run_max + lanes;  // [lanes]
  float* s = run_sum + lanes;        // [bs], generic path's scores

  const int first_pos = context_len - chunk_len;  // position of the chunk's first row
  for (int r = 0; r < rows; ++r) {
    const T* qrow = query + static_cast<int64_t>(item.row_begin + r) * query_row_stride +
                    static_cast<int64_t>(item.kv_head) * group * d;
    for (int i = 0; i < group * d; ++i) q[r * group * d + i] = to_float(qrow[i]) * scale;
  }
  std::fill(acc, acc + lanes * d, 0.0f);
  std::fill(run_max, run_max + lanes, -std::numeric_limits<float>::infinity());
  std::fill(run_sum, run_sum + lanes, 0.0f);

  const int last_pos = first_pos + (item.row_end - 1 - chunk_start);
  const int num_blocks = last_pos / bs + 1;
  const int64_t head_offset = static_cast<int64_t>(item.kv_head) * bs * d;
  const int block_bytes = static_cast<int>(bs * d * sizeof(T));
  for (int b = 0; b < num_blocks; ++b) {
    const int64_t block = block_table[b];
    const T* kb = key_cache + block * cache_block_stride + head_offset;
    const T* vb = value_cache + block * cache_block_stride + head_offset;
    if (b + kPrefetchBlocks < num_blocks) {
      // Blocks are scattered runs of bs * D elements: the hardware prefetchers do not see the
      // next one coming, so ask for it a few blocks ahead (memory latency, not bandwidth,
      // bounds this loop otherwise).
      const int64_t ahead = block_table[b + kPrefetchBlocks] * cache_block_stride + head_offset;
      const char* kn = reinterpret_cast<const char*>(key_cache + ahead);
      const char* vn = reinterpret_cast<const char*>(value_cache + ahead);
      for (int line = 0; line < block_bytes; line += 64) {
        __builtin_prefetch(kn + line);
        __builtin_prefetch(vn + line);
      }
    }
    for (int r = 0; r < rows; ++r) {
      const int pos = first_pos + (item.row_begin + r - chunk_start);
      const int valid = std::min(bs, pos - b * bs + 1);  // keys of this block the row sees
      if (valid <= 0) continue;
      if constexpr (ND == 0) {
        for (int g = 0; g < group; ++g) {
          const int lane = r * group + g;
          attend_block_generic(q + lane * d, acc + lane * d, run_max + lane, run_sum + lane,
                               kb, vb, bs, d, valid, s);
        }
      } else {
        for (int g = 0; g < group; g += 4) {
          const int lane = r * group + g;
          float *ql = q + lane * d, *al = acc + lane * d;
          float *mx = run_max + lane, *sm = run_sum + lane;
          switch (std::min(4, group - g)) {
            case 4: attend_block<T, ND, 4>(ql, al, mx, sm, kb, vb, bs, valid); break;
            case 3: attend_block<T, ND, 3>(ql, al, mx, sm, kb, vb, bs, valid); break;
            case 2: attend_block<T, ND, 2>(ql, al, mx, sm, kb, vb, bs, valid); break;
            default: attend_block<T, ND, 1>(ql, al, mx, sm, kb, vb, bs, valid);
          }
        }
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    T* orow = out + (static_cast<int64_t>(item.row_begin + r) * num_heads +
                     static_cast<int64_t>(item.kv_head) * group) * d;
    for (int g = 0; g < group; ++g) {
      const int lane = r * group + g;
      const float inv = 1.0f / run_sum[lane];
      const float* al = acc + lane * d;
      for (int i = 0; i < d; ++i) orow[g * d + i] = from_float<T>(al[i] * inv);
    }
  }
}

template <typename T>
void paged_attention_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                          const at::Tensor& block_tables, const at::Tensor& context_lens,
                          const at::Tensor& query_start_loc, double scale) {
  const int num_seqs = static_cast<int>(context_lens.size(0));
  const int num_heads = static_cast<int>(query.size(1));
  const int head_dim = static_cast<int>(query.size(2));
  const int num_kv_heads = static_cast<int>(kv_cache.size(2));
  const int block_size = static_cast<int>(kv_cache.size(3) / head_dim);
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.size(1);

  const int64_t pool_blocks = kv_cache.size(1);
  TORCH_CHECK(query_start_loc.numel() == num_seqs + 1 && block_tables.size(0) == num_seqs &&
                  qsl[0] == 0 && qsl[num_seqs] == query.size(0),
              "query_start_loc must be [S + 1] from 0 to T, block_tables [S, max_blocks]");
  std::vector<WorkItem> items;
  for (int s = 0; s < num_seqs; ++s) {
    const int chunk_len = qsl[s + 1] - qsl[s];
    TORCH_CHECK(chunk_len >= 1 && ctx[s] >= chunk_len, "sequence ", s, ": a chunk of ",
                chunk_len, " rows with context ", ctx[s]);
    const int64_t used = (ctx[s] + block_size - 1) / block_size;
    TORCH_CHECK(used <= table_stride, "sequence ", s, ": ", ctx[s], " tokens need ", used,
                " blocks, its table has ", table_stride);
    for (int64_t b = 0; b < used; ++b) {
      const int32_t block = tables[s * table_stride + b];
      TORCH_CHECK(block >= 0 && block < pool_blocks, "sequence ", s, ": block ", block,
                  " outside the pool of ", pool_blocks);
    }
    for (int r = qsl[s]; r < qsl[s + 1]; r += kRowTile) {
      const int end = std::min(r + kRowTile, qsl[s + 1]);
      const int last_pos = ctx[s] - chunk_len + (end - 1 - qsl[s]);
      const int64_t cost = static_cast<int64_t>(end - r) * (last_pos / block_size + 1);
      for (int h = 0; h < num_kv_heads; ++h) items.push_back({s, h, r, end, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });

  const T* q = query.data_ptr<T>();
  const int64_t q_stride = query.stride(0);
  const T* key_cache = kv_cache.data_ptr<T>();
  const T* value_cache = key_cache + kv_cache.stride(0);
  const int64_t block_stride = kv_cache.stride(1);
  T* o = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(items.size());
  using Attend = void (*)(const WorkItem&, const T*, int64_t, const T*, const T*, int64_t,
                          const int32_t*, int32_t, int32_t, int32_t, int, int, int, int, float,
                          T*, std::vector<float>&);
  Attend attend = attend_item<T, 0>;
  if (block_size % 16 == 0) {
    switch (head_dim) {
      case 32: attend = attend_item<T, 2>; break;
      case 64: attend = attend_item<T, 4>; break;
      case 96: attend = attend_item<T, 6>; break;
      case 128: attend = attend_item<T, 8>; break;
      default: break;
    }
  }
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      const WorkItem& it = items[i];
      attend(it, q, q_stride, key_cache, value_cache, block_stride,
             tables + it.seq * table_stride, ctx[it.seq], qsl[it.seq],
             qsl[it.seq + 1] - qsl[it.seq], num_heads, num_kv_heads, head_dim, block_size,
             fscale, o, scratch);
    }
  });
}

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& block_tables, const at::Tensor& context_lens,
                     const at::Tensor& query_start_loc, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [T, Hq, D] with contiguous heads");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes(), "out must be [T, Hq, D]");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, num_blocks, Hkv, block_size * D]");
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "query, out and kv_cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "block_tables, context_lens and query_start_loc must be int32");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.dim() == 2, "block_tables [S, max_blocks]");
  TORCH_CHECK(context_lens.is_contiguous() && query_start_loc.is_contiguous(),
              "context_lens and query_start_loc must be contiguous");
  TORCH_CHECK(kv_cache.size(2) > 0 && query.size(2) > 0 && query.size(1) % kv_cache.size(2) == 0,
              "Hq must be a positive multiple of Hkv");
  TORCH_CHECK(kv_cache.size(3) >= query.size(2) && kv_cache.size(3) % query.size(2) == 0,
              "kv_cache width must be block_size * D");
  SLUICEWAY_DISPATCH(query.scalar_type(), "paged_attention",
                     paged_attention_impl<scalar_t>(out, query, kv_cache, block_tables,
                                                    context_lens, query_start_loc, scale));
}

}  // namespace sluiceway
