// Paged attention over the KV pool on the CPU: prefill chunks and decode tokens of one step,
// in one kernel.
//
// Layout (kernels/paged_attention.py): kv_cache [2, num_blocks, Hkv, block_size * D]; a K block
// of one head is stored transposed, [D, block_size], a V block as is, [block_size, D]. An int8
// cache (kernels/kv_quant.py) has rows of block_size * (D + 4) bytes: the int8 values in that
// layout, then block_size float32 scales (one per token). Its scores are the float32 dot
// product of the query with the int8 key times the key's scale; its values are summed with
// weight probability * the value's scale: the same order for a row whatever the batch.
//
// One work item is (sequence, tile of up to kRowTile query rows of its chunk, its KV heads): the
// G query heads of a KV head (grouped-query attention) go through each K and V block together,
// so a block is read from memory once per KV head per tile. An item reads a block's KV heads
// one after the other (the pool keeps them adjacent: one run of memory per block for K and one
// for V, not one per head), and before each it prefetches the same head of its next block (into
// L2 when the step reads more than kL2PrefetchBytes, else L1), or, at its last block, of the
// next item's first (with many items each thread claims its next one before running the
// current one). When a step has fewer items than threads, its items are cut into
// one KV head each, then each item's G heads into smaller groups (a decode of one sequence on
// a model with one KV head), so every core works: a head's arithmetic is the same in any
// group. Each row keeps an online softmax
// (Milakov & Gimelshein 2018, as in FlashAttention) over the blocks in order: for every block
// its scores (a dot product per key, vectorized over the block's keys), the new running max,
// and the rescaled sum and output (vectorized over D). A row reads only the blocks up to its
// own position and, with a sliding window W, from the block of its position - W + 1 (it
// attends to keys p - W < k <= p, as transformers' sliding_window_overlay): where it starts is
// the row's own, so its arithmetic is the same whatever the tile, the chunking of its prompt
// or the other rows of the step. Work items are claimed from a shared counter, the costliest
// first.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_math.h"

namespace sluiceway {

namespace {

constexpr int kRowTile = 16;
// A step reading more K/V than this prefetches into L2, else into L1 (see prefetch_head): the
// L3 of the machines measured (32 MiB; glibc's sysconf reports the host's 320 MiB in this VM).
constexpr int64_t kL2PrefetchBytes = int64_t{32} << 20;

struct WorkItem {
  int32_t seq;
  int32_t kv_head_begin;  // KV heads [kv_head_begin, kv_head_end)
  int32_t kv_head_end;
  int32_t row_begin;  // rows of the flattened batch
  int32_t row_end;
  int32_t head_begin;  // query heads of the KV head's group: [head_begin, head_end)
  int32_t head_end;
  int64_t cost;  // rows x query heads x blocks read: the order items are claimed in
};

// Bytes of scale per token that follow a cache row's values: 4 for int8 (one float32), else 0.
template <typename C>
constexpr int kv_scale_bytes() {
  return is_quantized_kv<C>() ? 4 : 0;
}

// The first key position a row at `pos` attends to: pos - W + 1 with a window W > 0, else 0.
inline int window_start(int pos, int window) {
  return window > 0 ? std::max(0, pos - window + 1) : 0;
}

// ---- the vectorized path: block_size a multiple of 16, D = 16 * ND -----------------------

// NL query lanes (query heads of one row that share a KV head) against the keys [first, valid)
// of one block that the row sees, 16 keys (a "key tile") at a time, from the tile holding
// `first` (a window's start; earlier tiles are not read): scores q . k (two partial sums, even
// and odd dimensions, added at the end: independent FMA chains), an online-softmax step per
// tile, and the rescaled output. Per lane the operations and their order are fixed.
template <typename C, int ND, int NL>
inline void attend_block(const float* __restrict__ q, float* __restrict__ acc,
                         float* __restrict__ run_max, float* __restrict__ run_sum,
                         const C* __restrict__ kb, const C* __restrict__ vb,
                         const float* __restrict__ ks, const float* __restrict__ vs, int bs,
                         int first, int valid) {
  constexpr bool kQuant = is_quantized_kv<C>();
  constexpr int D = 16 * ND;
  // output columns per pass over a tile's keys: 8 registers per lane at most (D = 256 would
  // spill otherwise); every column's sum is in key order whatever the pass
  constexpr int JC = ND > 8 ? 8 : ND;
  v16i iota;
  for (int t = 0; t < 16; ++t) iota[t] = t;
  for (int kt = first / 16; kt * 16 < valid; ++kt) {
    const int tile_first = std::max(0, first - kt * 16);
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
    const v16i seen = (iota >= tile_first) & (iota < tile_valid);
    const v16f neg_inf = splat(-std::numeric_limits<float>::infinity());
    v16f prob[NL];
    float alpha[NL];
    v16f key_scale = splat(1.0f), value_scale = splat(1.0f);
    if constexpr (kQuant) {
      key_scale = load16(ks + kt * 16);
      value_scale = load16(vs + kt * 16);
    }
    // the lanes' rescale factors in one fast_exp16 (lane by lane, the same values as NL calls)
    v16f scores[NL];
    float mx[NL];
    v16f shift = splat(0.0f);
    for (int l = 0; l < NL; ++l) {
      scores[l] = even[l] + odd[l];
      if constexpr (kQuant) scores[l] *= key_scale;
      mx[l] = std::max(run_max[l], reduce_max(seen ? scores[l] : neg_inf));
      shift[l] = run_max[l] - mx[l];
    }
    const v16f alphas = fast_exp16(shift);
    for (int l = 0; l < NL; ++l) {
      alpha[l] = alphas[l];
      prob[l] = seen ? fast_exp16(scores[l] - mx[l]) : splat(0.0f);
      run_sum[l] = run_sum[l] * alpha[l] + reduce_sum(prob[l]);
      run_max[l] = mx[l];
      if constexpr (kQuant) prob[l] *= value_scale;  // the weight of an int8 value row
    }
    for (int j0 = 0; j0 < ND; j0 += JC) {
      v16f o[NL][JC];
      for (int l = 0; l < NL; ++l)
        for (int j = 0; j < JC; ++j) o[l][j] = load16(acc + l * D + 16 * (j0 + j)) * alpha[l];
      for (int t = tile_first; t < tile_valid; ++t) {
        const C* vrow = vb + (kt * 16 + t) * D + 16 * j0;
        v16f v[JC];
        for (int j = 0; j < JC; ++j) v[j] = load16(vrow + 16 * j);
        for (int l = 0; l < NL; ++l) {
          const float pt = prob[l][t];
          for (int j = 0; j < JC; ++j) o[l][j] += pt * v[j];
        }
      }
      for (int l = 0; l < NL; ++l)
        for (int j = 0; j < JC; ++j) store16(acc + l * D + 16 * (j0 + j), o[l][j]);
    }
  }
}

// ---- the generic path: any block size and head dimension (scalar loops) -----------------

template <typename C>
void attend_block_generic(const float* q, float* acc, float* run_max, float* run_sum,
                          const C* kb, const C* vb, const float* ks, const float* vs, int bs,
                          int d, int first, int valid, float* s) {
  constexpr bool kQuant = is_quantized_kv<C>();
  for (int t = first; t < valid; ++t) {
    float dot = 0.0f;
    for (int i = 0; i < d; ++i) dot += q[i] * to_float(kb[i * bs + t]);
    if constexpr (kQuant) dot *= ks[t];
    s[t] = dot;
  }
  float mx = *run_max;
  for (int t = first; t < valid; ++t) mx = std::max(mx, s[t]);
  const float alpha = fast_exp(*run_max - mx);
  float sum = 0.0f;
  for (int t = first; t < valid; ++t) {
    s[t] = fast_exp(s[t] - mx);
    sum += s[t];
  }
  *run_sum = *run_sum * alpha + sum;
  *run_max = mx;
  for (int i = 0; i < d; ++i) acc[i] *= alpha;
  for (int t = first; t < valid; ++t) {
    float w = s[t];
    if constexpr (kQuant) w *= vs[t];
    for (int i = 0; i < d; ++i) acc[i] += w * to_float(vb[t * d + i]);
  }
}

// What every work item of a step shares: the tensors' pointers and the geometry. T: the
// query's and output's dtype; C: the cache's (T, or int8_t with scales after each row's values).
template <typename T, typename C>
struct Step {
  const T* query;
  int64_t query_row_stride;
  const C* key_cache;
  const C* value_cache;
  int64_t cache_block_stride;
  int64_t cache_head_stride;  // elements of one (block, KV head) row, scales included
  const int32_t* tables;
  int64_t table_stride;
  const int32_t* context_lens;
  const int32_t* query_start_loc;
  int num_heads;
  int num_kv_heads;
  int head_dim;
  int block_size;
  int window;  // 0: full causal attention
  bool prefetch_to_l2;  // the step reads more K/V than kL2PrefetchBytes (see prefetch_head)
  float scale;
  T* out;
};

// The first block an item reads (its first row's window start) and one past its last.
template <typename T, typename C>
inline int first_block_of(const WorkItem& item, const Step<T, C>& st) {
  const int chunk_start = st.query_start_loc[item.seq];
  const int chunk_len = st.query_start_loc[item.seq + 1] - chunk_start;
  const int row0_pos = st.context_lens[item.seq] - chunk_len + (item.row_begin - chunk_start);
  return window_start(row0_pos, st.window) / st.block_size;
}

template <typename T, typename C>
inline int end_block_of(const WorkItem& item, const Step<T, C>& st) {
  const int chunk_start = st.query_start_loc[item.seq];
  const int chunk_len = st.query_start_loc[item.seq + 1] - chunk_start;
  const int last_pos = st.context_lens[item.seq] - chunk_len + (item.row_end - 1 - chunk_start);
  return last_pos / st.block_size + 1;
}

// Asks for the K and V of the item's h-th KV head in its `b`-th block (its table's), if the
// item reads it. Blocks are scattered runs of block_size * D elements that the hardware
// prefetchers do not see coming. Measured on an AMD EPYC (Zen 4, 2 cores;
// scripts/cpu_attention_bench.py --forward: batch 200, context 320, SmolLM2's heads over 30
// layers' pools): one head of the next block ahead did as well as 2 or 3 blocks, and into L2
// (prefetcht1) 1.4x faster than into L1 (prefetcht0, which holds one of a core's few
// outstanding L1 misses per line). A step whose K/V fits in the L3 keeps the earlier kernel's
// L1 hint (not measured to lose there).
// always_inline: GCC 12 counts a prefetch as no side effect, took a function holding only
// prefetches for a `const` one and deleted its calls (no prefetch left in the object).
template <typename T, typename C>
__attribute__((always_inline)) inline void prefetch_head(const Step<T, C>& st,
                                                        const WorkItem& item, int b, int h) {
  if (h >= item.kv_head_end - item.kv_head_begin || b >= end_block_of(item, st)) return;
  const int64_t at = st.tables[item.seq * st.table_stride + b] * st.cache_block_stride +
                     (item.kv_head_begin + h) * st.cache_head_stride;
  const char* kn = reinterpret_cast<const char*>(st.key_cache + at);
  const char* vn = reinterpret_cast<const char*>(st.value_cache + at);
  const int bytes = static_cast<int>(st.cache_head_stride * sizeof(C));
  if (st.prefetch_to_l2) {
    for (int line = 0; line < bytes; line += 64) {
      __builtin_prefetch(kn + line, 0, 2);
      __builtin_prefetch(vn + line, 0, 2);
    }
  } else {
    for (int line = 0; line < bytes; line += 64) {
      __builtin_prefetch(kn + line, 0, 3);
      __builtin_prefetch(vn + line, 0, 3);
    }
  }
}

// The rows of an item against one KV head's K and V in block b: lanes [lane0, lane0 + rows *
// heads) hold (row, query head) pairs of that KV head.
template <typename C, int ND>
inline void attend_head_block(const C* kb, const C* vb, int b, int bs, int d, int rows,
                              int heads, int row0_pos, int window, float* q, float* acc,
                              float* run_max, float* run_sum, float* s) {
  // an int8 row's scales follow its bs * d values (unused for a float cache)
  const float* ks = reinterpret_cast<const float*>(kb + bs * d);
  const float* vs = reinterpret_cast<const float*>(vb + bs * d);
  for (int r = 0; r < rows; ++r) {
    const int pos = row0_pos + r;
    const int valid = std::min(bs, pos - b * bs + 1);  // keys of this block the row sees
    const int first = std::max(0, window_start(pos, window) - b * bs);
    if (valid <= first) continue;  // past the row's position, or before its window
    if constexpr (ND == 0) {
      for (int g = 0; g < heads; ++g) {
        const int lane = r * heads + g;
        attend_block_generic(q + lane * d, acc + lane * d, run_max + lane, run_sum + lane, kb,
                             vb, ks, vs, bs, d, first, valid, s);
      }
    } else {
      for (int g = 0; g < heads; g += 4) {
        const int lane = r * heads + g;
        float *ql = q + lane * d, *al = acc + lane * d;
        float *mx = run_max + lane, *sm = run_sum + lane;
        switch (std::min(4, heads - g)) {
          case 4: attend_block<C, ND, 4>(ql, al, mx, sm, kb, vb, ks, vs, bs, first, valid); break;
          case 3: attend_block<C, ND, 3>(ql, al, mx, sm, kb, vb, ks, vs, bs, first, valid); break;
          case 2: attend_block<C, ND, 2>(ql, al, mx, sm, kb, vb, ks, vs, bs, first, valid); break;
          default: attend_block<C, ND, 1>(ql, al, mx, sm, kb, vb, ks, vs, bs, first, valid);
        }
      }
    }
  }
}

// One work item: rows [row_begin, row_end) of a sequence's chunk against its blocks, for query
// heads [head_begin, head_end) of the groups of KV heads [kv_head_begin, kv_head_end). ND > 0:
// the vectorized path with D = 16 * ND; 0: generic. Blocks run from the first one the item's
// first row needs (its window's start) to its last row's position; each row skips the blocks
// before its own. `next` (or null): the item this thread runs after this one.
template <typename T, typename C, int ND>
void attend_item(const WorkItem& item, const WorkItem* next, const Step<T, C>& st,
                 std::vector<float>& scratch) {
  const int d = ND ? 16 * ND : st.head_dim;
  const int bs = st.block_size;
  const int group = st.num_heads / st.num_kv_heads;
  const int heads = item.head_end - item.head_begin;
  const int kv_heads = item.kv_head_end - item.kv_head_begin;
  const int rows = item.row_end - item.row_begin;
  const int per_head = rows * heads;  // lanes of one KV head: (row, query head) pairs
  const int lanes = kv_heads * per_head;
  scratch.resize(static_cast<size_t>(lanes) * (2 * d + 2) + bs);
  float* q = scratch.data();         // [kv_heads, rows, heads, D], scaled
  float* acc = q + lanes * d;        // [lanes, D]
  float* run_max = acc + lanes * d;  // [lanes]
  float* run_sum = run_max + lanes;  // [lanes]
  float* s = run_sum + lanes;        // [bs], generic path's scores

  // the item's query heads of KV head h start at query head first_head(h)
  auto first_head = [&](int h) -> int64_t {
    return static_cast<int64_t>(item.kv_head_begin + h) * group + item.head_begin;
  };
  for (int h = 0; h < kv_heads; ++h) {
    for (int r = 0; r < rows; ++r) {
      const T* qrow = st.query + static_cast<int64_t>(item.row_begin + r) * st.query_row_stride +
                      first_head(h) * d;
      float* qd = q + static_cast<int64_t>(h * per_head + r * heads) * d;
      for (int i = 0; i < heads * d; ++i) qd[i] = to_float(qrow[i]) * st.scale;
    }
  }
  std::fill(acc, acc + lanes * d, 0.0f);
  std::fill(run_max, run_max + lanes, -std::numeric_limits<float>::infinity());
  std::fill(run_sum, run_sum + lanes, 0.0f);

  const int chunk_start = st.query_start_loc[item.seq];
  const int chunk_len = st.query_start_loc[item.seq + 1] - chunk_start;
  const int row0_pos = st.context_lens[item.seq] - chunk_len + (item.row_begin - chunk_start);
  const int first_block = first_block_of(item, st);
  const int num_blocks = end_block_of(item, st);
  const int next_first = next ? first_block_of(*next, st) : 0;
  const int32_t* table = st.tables + item.seq * st.table_stride;
  for (int b = first_block; b < num_blocks; ++b) {
    const int64_t block = table[b];
    for (int h = 0; h < kv_heads; ++h) {
      if (b + 1 < num_blocks) {
        prefetch_head(st, item, b + 1, h);
      } else if (next != nullptr) {
        prefetch_head(st, *next, next_first, h);
      }
      const int64_t at = block * st.cache_block_stride +
                         (item.kv_head_begin + h) * st.cache_head_stride;
      const int64_t lane = static_cast<int64_t>(h) * per_head;
      attend_head_block<C, ND>(st.key_cache + at, st.value_cache + at, b, bs, d, rows, heads,
                               row0_pos, st.window, q + lane * d, acc + lane * d,
                               run_max + lane, run_sum + lane, s);
    }
  }
  for (int h = 0; h < kv_heads; ++h) {
    for (int r = 0; r < rows; ++r) {
      T* orow =
          st.out + (static_cast<int64_t>(item.row_begin + r) * st.num_heads + first_head(h)) * d;
      for (int g = 0; g < heads; ++g) {
        const int lane = h * per_head + r * heads + g;
        const float inv = 1.0f / run_sum[lane];
        const float* al = acc + lane * d;
        for (int i = 0; i < d; ++i) orow[g * d + i] = from_float<T>(al[i] * inv);
      }
    }
  }
}

// The step's work items, costliest first: per sequence, per tile of kRowTile rows, per KV head
// (checking the tables on the way). With fewer items than `threads`, each item's group of query
// heads is cut into up to `threads / items` parts (a decode of one sequence on a one-KV-head
// model still keeps every core busy; the K/V blocks are then read once per part).
std::vector<WorkItem> plan_items(const int32_t* ctx, const int32_t* qsl, const int32_t* tables,
                                 int num_seqs, int64_t table_stride, int64_t pool_blocks,
                                 int block_size, int num_kv_heads, int group, int window,
                                 int threads) {
  std::vector<WorkItem> items;
  for (int s = 0; s < num_seqs; ++s) {
    const int chunk_len = qsl[s + 1] - qsl[s];
    TORCH_CHECK(chunk_len >= 1 && ctx[s] >= chunk_len, "sequence ", s, ": a chunk of ",
                chunk_len, " rows with context ", ctx[s]);
    const int64_t used = (ctx[s] + block_size - 1) / block_size;
    TORCH_CHECK(used <= table_stride, "sequence ", s, ": ", ctx[s], " tokens need ", used,
                " blocks, its table has ", table_stride);
    for (int64_t b = window_start(ctx[s] - chunk_len, window) / block_size; b < used; ++b) {
      const int32_t block = tables[s * table_stride + b];
      TORCH_CHECK(block >= 0 && block < pool_blocks, "sequence ", s, ": block ", block,
                  " outside the pool of ", pool_blocks);
    }
    for (int r = qsl[s]; r < qsl[s + 1]; r += kRowTile) {
      const int end = std::min(r + kRowTile, qsl[s + 1]);
      const int first_pos = ctx[s] - chunk_len + (r - qsl[s]);
      const int last_pos = ctx[s] - chunk_len + (end - 1 - qsl[s]);
      const int64_t blocks =
          last_pos / block_size - window_start(first_pos, window) / block_size + 1;
      const int64_t cost = static_cast<int64_t>(end - r) * group * blocks;
      items.push_back({s, 0, num_kv_heads, r, end, 0, group, cost * num_kv_heads});
    }
  }
  if (static_cast<int64_t>(items.size()) < threads && num_kv_heads > 1) {  // a KV head each
    std::vector<WorkItem> split;
    for (const WorkItem& it : items) {
      for (int h = 0; h < num_kv_heads; ++h) {
        WorkItem part = it;
        part.kv_head_begin = h;
        part.kv_head_end = h + 1;
        part.cost = it.cost / num_kv_heads;
        split.push_back(part);
      }
    }
    items.swap(split);
  }
  const int64_t parts =
      std::min<int64_t>(group, threads / std::max<int64_t>(static_cast<int64_t>(items.size()), 1));
  if (parts > 1) {
    std::vector<WorkItem> split;
    for (const WorkItem& it : items) {
      for (int64_t p = 0; p < parts; ++p) {
        WorkItem part = it;
        part.head_begin = static_cast<int32_t>(group * p / parts);
        part.head_end = static_cast<int32_t>(group * (p + 1) / parts);
        part.cost = it.cost / group * (part.head_end - part.head_begin);
        split.push_back(part);
      }
    }
    items.swap(split);
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

template <typename T, typename C>
void paged_attention_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                          const at::Tensor& block_tables, const at::Tensor& context_lens,
                          const at::Tensor& query_start_loc, double scale, int64_t window) {
  const int num_seqs = static_cast<int>(context_lens.size(0));
  Step<T, C> st;
  st.num_heads = static_cast<int>(query.size(1));
  st.head_dim = static_cast<int>(query.size(2));
  st.num_kv_heads = static_cast<int>(kv_cache.size(2));
  st.block_size = static_cast<int>(kv_cache.size(3) / (st.head_dim + kv_scale_bytes<C>()));
  st.context_lens = context_lens.data_ptr<int32_t>();
  st.query_start_loc = query_start_loc.data_ptr<int32_t>();
  st.tables = block_tables.data_ptr<int32_t>();
  st.table_stride = block_tables.size(1);
  st.window = static_cast<int>(std::min<int64_t>(window, std::numeric_limits<int>::max()));
  const int32_t* qsl = st.query_start_loc;
  TORCH_CHECK(query_start_loc.numel() == num_seqs + 1 && block_tables.size(0) == num_seqs &&
                  qsl[0] == 0 && qsl[num_seqs] == query.size(0),
              "query_start_loc must be [S + 1] from 0 to T, block_tables [S, max_blocks]");
  const int threads = at::get_num_threads();
  const std::vector<WorkItem> items = plan_items(
      st.context_lens, qsl, st.tables, num_seqs, st.table_stride, kv_cache.size(1),
      st.block_size, st.num_kv_heads, st.num_heads / st.num_kv_heads, st.window, threads);

  st.query = query.data_ptr<T>();
  st.query_row_stride = query.stride(0);
  st.key_cache = kv_cache.data_ptr<C>();
  st.value_cache = st.key_cache + kv_cache.stride(0);
  st.cache_block_stride = kv_cache.stride(1);
  st.cache_head_stride = kv_cache.stride(2);
  st.out = out.data_ptr<T>();
  st.scale = static_cast<float>(scale);
  int64_t step_bytes = 0;  // the K and V the step's items read
  for (const WorkItem& it : items)
    step_bytes += int64_t{2} * (end_block_of(it, st) - first_block_of(it, st)) *
                  (it.kv_head_end - it.kv_head_begin) * st.cache_head_stride * sizeof(C);
  st.prefetch_to_l2 = step_bytes > kL2PrefetchBytes;
  void (*attend)(const WorkItem&, const WorkItem*, const Step<T, C>&, std::vector<float>&) =
      attend_item<T, C, 0>;
  if (st.block_size % 16 == 0) {
    switch (st.head_dim) {
      case 32: attend = attend_item<T, C, 2>; break;
      case 64: attend = attend_item<T, C, 4>; break;
      case 96: attend = attend_item<T, C, 6>; break;
      case 128: attend = attend_item<T, C, 8>; break;
      case 256: attend = attend_item<T, C, 16>; break;
      default: break;
    }
  }
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(items.size());
  const bool claim_ahead = n >= 4 * static_cast<int64_t>(threads);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    // with many items a thread claims its next one before it runs the current one, to
    // prefetch its blocks (with few, claiming ahead would leave another thread idle)
    for (int64_t i = next.fetch_add(1); i < n;) {
      const int64_t after = claim_ahead ? next.fetch_add(1) : n;
      attend(items[i], after < n ? &items[after] : nullptr, st, scratch);
      i = claim_ahead ? after : next.fetch_add(1);
    }
  });
}

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& block_tables, const at::Tensor& context_lens,
                     const at::Tensor& query_start_loc, double scale, int64_t sliding_window) {
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be positive, or 0 for none");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [T, Hq, D] with contiguous heads");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes(), "out must be [T, Hq, D]");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, num_blocks, Hkv, block_size * D]");
  const bool fp8 = kv_cache.scalar_type() == at::kFloat8_e4m3fn;
  const bool quant = kv_cache.scalar_type() == at::kChar || fp8;
  TORCH_CHECK((quant || kv_cache.scalar_type() == query.scalar_type()) &&
                  out.scalar_type() == query.scalar_type(),
              "query, out and kv_cache must share a dtype (or kv_cache int8)");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "block_tables, context_lens and query_start_loc must be int32");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.dim() == 2, "block_tables [S, max_blocks]");
  TORCH_CHECK(context_lens.is_contiguous() && query_start_loc.is_contiguous(),
              "context_lens and query_start_loc must be contiguous");
  TORCH_CHECK(kv_cache.size(2) > 0 && query.size(2) > 0 && query.size(1) % kv_cache.size(2) == 0,
              "Hq must be a positive multiple of Hkv");
  const int64_t row = query.size(2) + (quant ? 4 : 0);  // per token: D values (+ a scale)
  TORCH_CHECK(kv_cache.size(3) >= row && kv_cache.size(3) % row == 0 &&
                  (!quant || kv_cache.size(3) / row * query.size(2) % 4 == 0),
              "kv_cache width must be block_size * D (int8: block_size * (D + 4), "
              "block_size * D a multiple of 4)");
  if (fp8) {
    SLUICEWAY_DISPATCH(query.scalar_type(), "paged_attention",
                       paged_attention_impl<scalar_t, c10::Float8_e4m3fn>(
                           out, query, kv_cache, block_tables, context_lens, query_start_loc,
                           scale, sliding_window));
  } else if (quant) {
    SLUICEWAY_DISPATCH(query.scalar_type(), "paged_attention",
                       paged_attention_impl<scalar_t, int8_t>(out, query, kv_cache, block_tables,
                                                              context_lens, query_start_loc,
                                                              scale, sliding_window));
  } else {
    SLUICEWAY_DISPATCH(query.scalar_type(), "paged_attention",
                       paged_attention_impl<scalar_t, scalar_t>(out, query, kv_cache,
                                                                block_tables, context_lens,
                                                                query_start_loc, scale,
                                                                sliding_window));
  }
}

}  // namespace sluiceway
