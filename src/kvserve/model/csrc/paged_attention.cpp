// Paged attention on the CPU, reading K and V in place through block tables.
//
// Cache layout per layer (K and V alike): [num_blocks, block_size, num_kv_heads, head_dim],
// contiguous. A query head h reads kv head h / (num_heads / num_kv_heads).
//
// Decode: one work item per request (all its kv heads), or per (request, kv head) when there
// are too few requests to keep the threads busy. Each kv head's query heads (the GQA group)
// share every K and V row loaded. Keys are visited one tile (64 keys, whole blocks) at a time:
// scores for the tile, an online-softmax update (running max m, running sum l, accumulator
// rescaled by exp(m_old - m_new)), and the tile's V rows accumulated. Memory, not arithmetic,
// bounds decode on a big batch, so while a tile computes, the next keys of the thread's stream
// (this item's, then its next item's) are prefetched into L2, a few lines per key visited
// (see decode_item).
// Arithmetic is float32; bfloat16 caches are widened on load. A step's queries are read in
// place (a view into qkv) and scaled per work item, and the output written in their dtype.
// With AVX-512 (and head_dim a multiple of 16) the dot products and the V accumulation use
// intrinsics; with AVX512-BF16, a bf16 model's dot products multiply bf16 pairs directly (see
// Bf16Dot); otherwise plain loops that the compiler vectorises. Which of these the build has
// is what compiled_isa() reports.
//
// Prefill: one chunk of n queries at positions context_len - n + i (causal). One work item per
// (kv head, tile of 16 queries); each query row runs the same online softmax over its visible
// keys. Each tile of keys is repacked once for all the item's rows where the build has a way
// to (attention_gemm.h): for a bf16 model on AVX512-BF16 (keys in pairs order, values
// widened), and on AVX2 (keys transposed to float32); otherwise, and under --batch-invariant
// (match_decode: a row's scores summed exactly as a decode step sums them), each query's rows
// use the decode's per-key dot products.
//
// Work items are handed out dynamically (an atomic counter, longest first) inside one
// at::parallel_for region with one task per thread, since contexts are ragged; each thread
// keeps one WorkState for all its items, prefill's as decode's.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "attention_amx.h"
#include "attention_gemm.h"
#include "attention_softmax.h"
#include "fast_math.h"
#include "int8_linear.h"
#include "panel_linear.h"
#include "invariant_linear.h"
#include "layer_ops.h"
#include "ops.h"
#include "layer_stack.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

using kvserve::Ahead;
using kvserve::accumulate_values;
using kvserve::bf16_dots_compiled;
using kvserve::dispatch_dtype;
using kvserve::dots;
using kvserve::softmax_step;
using kvserve::with_head_dim;

std::atomic<unsigned> g_touch_sink{0};  // keeps touch_rows' loads
constexpr int kTileTokens = 64;  // keys per online-softmax step (rounded to whole blocks)
constexpr int kQueryTile = 16;   // prefill queries per work item

struct Geometry {
  int64_t block_size, num_kv_heads, head_dim, num_heads, group;
  int64_t token_stride, block_stride;  // elements
  int tile;                            // keys per online-softmax step: whole blocks
  bool exact_bf16_queries = false;     // the scaled float32 queries round to bf16 exactly
  bool match_decode = false;  // prefill: no repacked tiles, each row's sums as decode's
};

// ---------------------------------------------------------------------------------------------
// The state a thread keeps across its work items (the online-softmax step itself is in
// attention_softmax.h).

// A thread's buffers, reused from one work item (decode or prefill) to the next.
template <typename T>
struct WorkState {
  std::vector<float> scratch;
  std::vector<const T*> rows;         // the tile's key rows (decode: and the next tile's)
  std::vector<int> visible;           // per query row: how many of the tile's keys it sees
  std::vector<float> q_scaled;        // decode: the item's query rows, scaled, float32
  std::vector<c10::BFloat16> q_bf16;  // the query rows rounded to bf16, for Bf16Dot
  std::vector<uint32_t> packed_keys;  // prefill's tile of keys in pairs order (attention_gemm.h)
  std::vector<uint32_t> value_pairs;  // prefill's tile of values in pairs-of-keys order
  std::vector<uint32_t> probability_pairs;  // prefill's probabilities in bf16, by pairs
  std::vector<float> keys_t;          // prefill's tile of keys transposed (AVX2)
  int prefetched = 0;  // decode: how many of this item's first keys the last item prefetched
  // Views into scratch, laid out by start(): [nrows][stride] scores (then probabilities),
  // [nrows][dim] accumulators, [nrows][extra] for the caller, the running max m and sum l.
  float *scores = nullptr, *acc = nullptr, *extra = nullptr, *m = nullptr, *l = nullptr;
  int stride = 0;  // scores per row: the tile rounded up to 16 (whole registers)

  void start(const Geometry& geo, int nrows, int extra_per_row) {
    const size_t n = static_cast<size_t>(nrows);
    const size_t dim = static_cast<size_t>(geo.head_dim);
    stride = (geo.tile + 15) / 16 * 16;
    scratch.assign(n * (stride + dim + extra_per_row) + 2 * n, 0.0f);
    scores = scratch.data();
    acc = scores + n * stride;
    extra = acc + n * dim;
    m = extra + n * extra_per_row;
    l = m + n;
    std::fill(m, m + n, -std::numeric_limits<float>::infinity());
    visible.resize(n);
    // decode: this tile's rows, the next's, the prefetch window's and the following item's
    rows.resize(4 * static_cast<size_t>(geo.tile));
  }

  // The nrows query rows at src (contiguous, in the model's dtype Q) times scale, in float32:
  // the same values a step's (q.to(float32) * scale) gives, made per item inside the kernel's
  // threads instead of by three torch ops per layer.
  template <typename Q>
  const float* scaled_queries(const Q* src, int nrows, int dim, float scale) {
    const size_t n = static_cast<size_t>(nrows) * static_cast<size_t>(dim);
    q_scaled.resize(n);
    for (size_t i = 0; i < n; ++i) q_scaled[i] = kvserve::to_float(src[i]) * scale;
    return q_scaled.data();
  }

  // The nrows query rows q (float32, scaled) rounded to bf16 when the bf16 dot products apply
  // to this call, else null.
  template <int D>
  const c10::BFloat16* bf16_queries(const Geometry& geo, const float* q, int nrows) {
    if (!bf16_dots_compiled<T, D>() || !geo.exact_bf16_queries) return nullptr;
    const int64_t n = static_cast<int64_t>(nrows) * geo.head_dim;
    q_bf16.resize(n);
    for (int64_t i = 0; i < n; ++i) q_bf16[i] = kvserve::from_float<c10::BFloat16>(q[i]);
    return q_bf16.data();
  }

  // dst = acc[r] / l[r]: row r's attention output (rounded to nearest even for bf16 O).
  template <typename O>
  void finish_row(int r, int dim, O* dst) const {
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    const float* a = acc + static_cast<size_t>(r) * dim;
    for (int d = 0; d < dim; ++d) dst[d] = kvserve::from_float<O>(a[d] * inv);
  }
};

// The row pointers (kv head 0) of keys start .. start + tile, clipped to end; returns how many.
template <typename T>
inline int tile_rows(const Geometry& geo, const T* k_cache, const int64_t* table,
                     int64_t start, int64_t end, const T** rows) {
  const int count = static_cast<int>(std::clamp<int64_t>(end - start, 0, geo.tile));
  const int64_t bs = geo.block_size;
  int64_t block = start / bs, offset = start % bs;
  for (int t = 0; t < count; ++t) {
    rows[t] = k_cache + table[block] * geo.block_stride + offset * geo.token_stride;
    if (++offset == bs) {
      offset = 0;
      ++block;
    }
  }
  return count;
}

// Loads one byte from every cache line of the tile's K and V rows (bytes [0, row_bytes) of
// each) before any compute reads them: independent loads in address order, which the core
// keeps many of in flight, where the compute's own loads come a few at a time. Measured on
// the W1-like batch (one thread, 128 requests, 4 KiB pages): 1.4-1.5x faster decode overall.
// Now only for a tile nothing prefetched (a thread's first); the prefetches spread through
// the tile before beat it by 1.14-1.3x (docs/kernels.md).
template <typename T>
inline void touch_rows(const T* const* rows, int count, size_t row_bytes, std::ptrdiff_t to_v) {
  unsigned s0 = 0, s1 = 0, s2 = 0, s3 = 0;  // four chains in registers: loads not serialised
  for (int t = 0; t < count; ++t) {
    const unsigned char* k = reinterpret_cast<const unsigned char*>(rows[t]);
    const unsigned char* v = reinterpret_cast<const unsigned char*>(rows[t] + to_v);
    size_t off = 0;
    for (; off + 64 < row_bytes; off += 128) {
      s0 ^= k[off];
      s1 ^= k[off + 64];
      s2 ^= v[off];
      s3 ^= v[off + 64];
    }
    if (off < row_bytes) {
      s0 ^= k[off];
      s2 ^= v[off];
    }
  }
  g_touch_sink.store(s0 ^ s1 ^ s2 ^ s3, std::memory_order_relaxed);
}

// Runs fn(item, following, thread-local state) over items in the given order, dynamically
// scheduled. following is the item this thread runs next (-1: none), claimed as item starts, so
// that fn can fetch ahead into it.
template <typename State, typename Fn>
void run_items(const std::vector<int64_t>& order, Fn fn) {
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(order.size());
  const int64_t tasks = std::min<int64_t>(at::get_num_threads(), total);
  if (tasks <= 0) return;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    State state;
    for (int64_t task = begin; task < end; ++task) {
      for (int64_t i = next.fetch_add(1); i < total;) {
        const int64_t j = next.fetch_add(1);
        fn(order[i], j < total ? order[j] : -1, state);
        i = j;
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Decode.

// Where a decode work item's keys lie: its request's block table and context length, and the
// first of its kv heads.
struct ItemKeys {
  const int64_t* table;
  int64_t context_len;
  int64_t h0;
};

// The row pointers (kv head h0) of the item's keys start .. start + tile; returns how many.
template <typename T>
inline int item_rows(const Geometry& geo, const T* k_cache, const ItemKeys& keys, int64_t start,
                     const T** rows) {
  const int count = tile_rows(geo, k_cache, keys.table, start, keys.context_len, rows);
  for (int t = 0; t < count; ++t) rows[t] += keys.h0 * geo.head_dim;
  return count;
}

// Query heads of kv heads [keys.h0, h1) of one request: rows r = (kv head - h0) * group + g
// are the request's query heads h0 * group + r, contiguous in q and out.
//
// The keys a thread visits form one stream, item after item. While a tile of n keys computes,
// the next n keys of that stream not yet fetched (the window: this item's next tile, then the
// following item's first tile, whose first rows its own start needs) are
// prefetched into L2 (Ahead, a head-sized piece per key visited): the fetch, which bounds
// decode on a big batch, runs under the arithmetic about one tile ahead. So a short last tile
// (context_len % 64 keys) does not leave the next item's first tile to be fetched while
// nothing computes: the tile before it already fetched most of it. What no window reached
// (a thread's first item; after items shorter than a tile) is pulled in at the item's start
// (touch_rows).
template <typename T, int D, typename Q>
void decode_item(const Geometry& geo, const Q* q /*request's [heads, dim], unscaled*/,
                 float scale, const T* k_cache, const T* v_cache, const ItemKeys& keys,
                 int64_t h1, Q* out, const ItemKeys* following, WorkState<T>& state) {
  const int group = static_cast<int>(geo.group);
  const int dim = static_cast<int>(geo.head_dim);
  const int tile = geo.tile;
  const int nheads = static_cast<int>(h1 - keys.h0);
  const int nrows = nheads * group;
  const int already = state.prefetched;  // (start() below keeps it)
  state.start(geo, nrows, 0);
  out += keys.h0 * group * dim;
  const float* qf = state.scaled_queries(q + keys.h0 * group * dim, nrows, dim, scale);
  const std::ptrdiff_t to_v = v_cache - k_cache;
  const c10::BFloat16* q_bf16 = state.template bf16_queries<D>(geo, qf, nrows);
  const int lines = (static_cast<int>(sizeof(T)) * dim + 63) / 64;  // per head-sized piece
  const T** cur = state.rows.data();
  const T** next = cur + tile;
  const T** window = next + tile;
  const T** follow = window + tile;  // the following item's first tile
  const int follow_count = following ? item_rows(geo, k_cache, *following, 0, follow) : 0;
  int follow_done = 0;  // rows of follow prefetched so far
  int count = item_rows(geo, k_cache, keys, 0, cur);
  const int fetched = std::min(already, count);
  if (fetched < count) {
    touch_rows(cur + fetched, count - fetched, sizeof(T) * nheads * dim, to_v);
  }
  for (int64_t start = 0; start < keys.context_len; start += tile) {
    const bool last = start + tile >= keys.context_len;
    const int upcoming = last ? 0 : item_rows(geo, k_cache, keys, start + tile, next);
    // The window: the next tile (every tile but the last has `tile` keys, so it has calls for
    // all of it), then as much of the following item's first tile as calls are left for.
    const T* const* ahead_rows = next;
    int size = upcoming;
    const int more = std::min(count - upcoming, follow_count - follow_done);
    if (more > 0) {
      std::copy(next, next + upcoming, window);
      std::copy(follow + follow_done, follow + follow_done + more, window + upcoming);
      follow_done += more;
      size += more;
      ahead_rows = window;
    }
    // The window's pieces over the calls: head h's dot products (and value sums) over the
    // tile's count keys take pieces h * count onwards; the window has at most count rows, so
    // nheads * count calls cover its pieces.
    const Ahead<T> k_ahead{ahead_rows, size, 0, nheads, dim, lines};
    Ahead<T> v_ahead = k_ahead;
    v_ahead.offset = to_v;
    const int stride = state.stride;
    for (int h = 0; h < nheads; ++h) {
      dots<T, D>(qf + h * group * dim, q_bf16 ? q_bf16 + h * group * dim : nullptr, group, dim,
                 cur, h * dim, count, state.scores + h * group * stride, stride,
                 k_ahead.from(h * count));
    }
    std::fill(state.visible.begin(), state.visible.end(), count);
    softmax_step<D>(state.scores, nrows, stride, state.visible.data(), state.m, state.l,
                    state.acc, dim);
    for (int t = 0; t < count; ++t) cur[t] += to_v;
    for (int h = 0; h < nheads; ++h) {
      accumulate_values<T, D>(state.acc + h * group * dim, group, dim, cur, h * dim, count,
                              state.scores + h * group * stride, stride,
                              v_ahead.from(h * count));
    }
    std::swap(cur, next);
    count = upcoming;
  }
  for (int r = 0; r < nrows; ++r) state.finish_row(r, dim, out + r * dim);
  state.prefetched = follow_done;
}

// q: request r's query rows [heads, dim] at q + r * q_stride (Q: the model's dtype, or float32);
// out: [num_decodes, heads, dim], contiguous, of the same type.
template <typename T, int D, typename Q>
void decode_impl(const Geometry& geo, const Q* q, int64_t q_stride, float scale,
                 const T* k_cache, const T* v_cache, const int64_t* tables,
                 int64_t table_stride, const int64_t* lens, int64_t num_decodes, Q* out) {
  // A work item is a request's kv heads [h0, h1): all of them (one pass over each token's
  // contiguous K and V rows) when there are enough requests to keep the threads busy, else one.
  const int64_t kvh = geo.num_kv_heads;
  const int64_t split = num_decodes >= 4 * at::get_num_threads() ? 1 : kvh;
  std::vector<int64_t> order(num_decodes * split);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),  // longest first
                   [&](int64_t a, int64_t b) { return lens[a / split] > lens[b / split]; });
  const int64_t request_elems = geo.num_heads * geo.head_dim;
  const auto keys_of = [&](int64_t item) {
    const int64_t req = item / split;
    return ItemKeys{tables + req * table_stride, lens[req], item % split * kvh / split};
  };
  run_items<WorkState<T>>(order, [&](int64_t item, int64_t following, WorkState<T>& state) {
    const int64_t req = item / split;
    const int64_t h1 = (item % split + 1) * kvh / split;
    const ItemKeys keys = keys_of(item), after = keys_of(std::max<int64_t>(following, 0));
    decode_item<T, D>(geo, q + req * q_stride, scale, k_cache, v_cache, keys, h1,
                      out + req * request_elems, following >= 0 ? &after : nullptr, state);
  });
}

// ---------------------------------------------------------------------------------------------
// Prefill (one chunk).

// Whether prefill's tiles run as two small matrix products (attention_gemm.h): a bf16 model
// whose queries round to bf16 exactly (q_bf16 set), on a build with AVX512-BF16.
template <typename T, int D>
inline bool packed_tile(const Geometry& geo, const c10::BFloat16* q_bf16) {
  return bf16_dots_compiled<T, D>() && q_bf16 != nullptr && !geo.match_decode;
}

// Whether they run with the keys transposed to float32 (attention_gemm.h): a build whose best
// tier is AVX2, head_dim compiled in. (The AVX-512 float32 tier keeps the per-query products:
// the transposed tile is written for AVX2's registers and measured only there.)
template <int D>
inline bool transposed_tile(const Geometry& geo) {
#if defined(KVSERVE_AVX2_TILES)
  return D > 0 && !geo.match_decode;
#else
  (void)geo;
  return false;
#endif
}

// One key tile for all nrows query rows of a prefill work item (state.visible set): the keys
// packed and the values widened once, the scores of every row, the online-softmax step, the
// value pass.
template <typename T, int D>
void prefill_tile_packed(const c10::BFloat16* q_bf16, int nrows, const T* const* rows,
                         std::ptrdiff_t to_v, int count, WorkState<T>& state) {
#if defined(__AVX512BF16__)
  if constexpr (bf16_dots_compiled<T, D>()) {
    const int stride = state.stride;
    state.packed_keys.resize(static_cast<size_t>(D / 2) * stride);
    kvserve::pack_keys<D>(rows, 0, count, state.packed_keys.data(), stride);
    kvserve::scores_packed<D>(q_bf16, nrows, state.packed_keys.data(), stride, count,
                              state.scores, stride);
    softmax_step<D>(state.scores, nrows, stride, state.visible.data(), state.m, state.l,
                    state.acc, D);
    const int pair_stride = stride / 2;
    state.value_pairs.resize(static_cast<size_t>(pair_stride) * D);
    state.probability_pairs.resize(static_cast<size_t>(nrows) * pair_stride);
    kvserve::pack_value_pairs<D>(rows, to_v, count, state.value_pairs.data());
    kvserve::probability_pairs(state.scores, nrows, stride, count,
                               state.probability_pairs.data(), pair_stride);
    kvserve::accumulate_pairs<D>(state.acc, nrows, state.value_pairs.data(),
                                 state.visible.data(), state.probability_pairs.data(),
                                 pair_stride);
    return;
  }
#endif
  (void)q_bf16, (void)nrows, (void)rows, (void)to_v, (void)count, (void)state;
}

// The same on AVX2 for float32 query rows (qrows: [nrows][D], row r = query r / group, head
// r % group): the keys transposed once, the scores of every row, the online-softmax step, then
// the values per query as the per-query path adds them.
template <typename T, int D>
void prefill_tile_transposed(const float* qrows, int nrows, int group, const T* const* rows,
                             std::ptrdiff_t to_v, int count, WorkState<T>& state) {
#if defined(KVSERVE_AVX2_TILES)
  if constexpr (D > 0) {
    const int stride = state.stride;
    state.keys_t.resize(static_cast<size_t>(D) * stride);
    kvserve::transpose_keys<D>(rows, count, state.keys_t.data(), stride);
    kvserve::scores_transposed<D>(qrows, nrows, state.keys_t.data(), count, state.scores,
                                  stride);
    softmax_step<D>(state.scores, nrows, stride, state.visible.data(), state.m, state.l,
                    state.acc, D);
    for (int r0 = 0; r0 < nrows; r0 += group) {
      accumulate_values<T, D>(state.acc + static_cast<size_t>(r0) * D, group, D, rows, to_v,
                              state.visible[r0], state.scores + static_cast<size_t>(r0) * stride,
                              stride);
    }
    return;
  }
#endif
  (void)qrows, (void)nrows, (void)group, (void)rows, (void)to_v, (void)count, (void)state;
}

template <typename T, int D>
void prefill_item(const Geometry& geo, const float* q /*[n, heads, dim] scaled*/,
                  const T* k_cache, const T* v_cache, const int64_t* table, int64_t context_len,
                  int64_t num_queries, int64_t kv_head, int64_t q_begin, int64_t q_end,
                  float* out, WorkState<T>& state) {
  const int group = static_cast<int>(geo.group);
  const int dim = static_cast<int>(geo.head_dim);
  const int tile = geo.tile;
  const int nq = static_cast<int>(q_end - q_begin);
  const int nrows = nq * group;  // row r = query (r / group), head (r % group)
  state.start(geo, nrows, dim);
  // The tile's query rows, contiguous: [query][group][dim].
  float* qrows = state.extra;
  for (int i = 0; i < nq; ++i) {
    const float* src = q + ((q_begin + i) * geo.num_heads + kv_head * geo.group) * dim;
    std::memcpy(qrows + static_cast<size_t>(i) * group * dim, src, sizeof(float) * group * dim);
  }
  const c10::BFloat16* q_bf16 = state.template bf16_queries<D>(geo, qrows, nrows);
  const int64_t first = context_len - num_queries;  // position of query 0
  const int64_t last_visible = first + q_end - 1;   // the tile's last query sees keys <= this
  const T** rows = state.rows.data();
  int* visible = state.visible.data();
  const int64_t head_offset = kv_head * geo.head_dim;
  const std::ptrdiff_t to_v = v_cache - k_cache;
  const int stride = state.stride;
  for (int64_t start = 0; start <= last_visible; start += tile) {
    const int count = tile_rows(geo, k_cache, table, start, last_visible + 1, rows);
    for (int t = 0; t < count; ++t) rows[t] += head_offset;
    for (int i = 0; i < nq; ++i) {
      const int64_t sees = first + q_begin + i + 1 - start;  // keys of this tile it sees
      const int n = static_cast<int>(std::clamp<int64_t>(sees, 0, count));
      for (int g = 0; g < group; ++g) visible[i * group + g] = n;
    }
    if (packed_tile<T, D>(geo, q_bf16)) {
      prefill_tile_packed<T, D>(q_bf16, nrows, rows, to_v, count, state);
      continue;
    }
    if (transposed_tile<D>(geo)) {
      prefill_tile_transposed<T, D>(qrows, nrows, group, rows, to_v, count, state);
      continue;
    }
    for (int i = 0; i < nq; ++i) {
      const size_t row0 = static_cast<size_t>(i) * group;
      dots<T, D>(qrows + row0 * dim, q_bf16 ? q_bf16 + row0 * dim : nullptr, group, dim, rows,
                 0, visible[row0], state.scores + row0 * stride, stride);
    }
    softmax_step<D>(state.scores, nrows, stride, visible, state.m, state.l, state.acc, dim);
    for (int i = 0; i < nq; ++i) {
      const size_t row0 = static_cast<size_t>(i) * group;
      accumulate_values<T, D>(state.acc + row0 * dim, group, dim, rows, to_v, visible[row0],
                              state.scores + row0 * stride, stride);
    }
  }
  for (int i = 0; i < nq; ++i) {
    for (int g = 0; g < group; ++g) {
      float* dst = out + ((q_begin + i) * geo.num_heads + kv_head * geo.group + g) * dim;
      state.finish_row(i * group + g, dim, dst);
    }
  }
}

template <typename T, int D>
void prefill_impl(const Geometry& geo, const float* q, const T* k_cache, const T* v_cache,
                  const int64_t* table, int64_t context_len, int64_t num_queries, float* out) {
  const int64_t kvh = geo.num_kv_heads;
  const int64_t tiles = (num_queries + kQueryTile - 1) / kQueryTile;
  // Later query tiles see more keys: hand them out first.
  std::vector<int64_t> order;
  order.reserve(tiles * kvh);
  for (int64_t tile = tiles - 1; tile >= 0; --tile)
    for (int64_t head = 0; head < kvh; ++head) order.push_back(tile * kvh + head);
  run_items<WorkState<T>>(order, [&](int64_t item, int64_t, WorkState<T>& state) {
    const int64_t tile = item / kvh, head = item % kvh;
    const int64_t begin = tile * kQueryTile;
    const int64_t end = std::min<int64_t>(begin + kQueryTile, num_queries);
    prefill_item<T, D>(geo, q, k_cache, v_cache, table, context_len, num_queries, head, begin,
                       end, out, state);
  });
}

// ---------------------------------------------------------------------------------------------
// Entry points: checks, then the kernel for the cache's element type and head_dim.

inline bool is_power_of_two(double x) {
  int exponent;
  return x > 0.0 && std::frexp(x, &exponent) == 0.5;
}

// The blocks holding a context's first context_len tokens must exist (no out-of-bounds reads).
void check_blocks(const int64_t* table, int64_t context_len, int64_t block_size,
                  int64_t num_blocks) {
  const int64_t used = (context_len + block_size - 1) / block_size;
  for (int64_t b = 0; b < used; ++b) {
    TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "block id ", table[b],
                " out of range [0, ", num_blocks, ")");
  }
}

// Checks the caches and q ([tokens, num_heads, head_dim], `q_shape` names it) and describes
// the call.
Geometry geometry(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  double scale, const char* q_shape) {
  TORCH_CHECK(k_cache.dim() == 4, "k_cache must be [num_blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k/v cache dtypes differ");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16,
              "caches must be float32 or bfloat16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.device().is_cpu(), "caches must be on the CPU");
  TORCH_CHECK(q.dim() == 3, "q must be ", q_shape);
  TORCH_CHECK(q.size(2) == k_cache.size(3), "q head_dim differs from the cache's");
  Geometry geo;
  geo.block_size = k_cache.size(1);
  geo.num_kv_heads = k_cache.size(2);
  geo.head_dim = k_cache.size(3);
  geo.num_heads = q.size(1);
  TORCH_CHECK(geo.num_heads % geo.num_kv_heads == 0, "num_heads must be a multiple of kv heads");
  geo.group = geo.num_heads / geo.num_kv_heads;
  geo.token_stride = geo.num_kv_heads * geo.head_dim;
  geo.block_stride = geo.block_size * geo.token_stride;
  geo.tile = static_cast<int>(
      std::max<int64_t>(geo.block_size, (kTileTokens / geo.block_size) * geo.block_size));
  geo.exact_bf16_queries = q.scalar_type() == at::kBFloat16 && is_power_of_two(scale) &&
                           (geo.head_dim == 64 || geo.head_dim == 128);
  return geo;
}

// Scales q to float32, runs kernel(T{}, Int<D>{}, q, out) for the cache's element type T and
// head_dim D (see with_head_dim), and returns out ([tokens, num_heads, head_dim]) in q's dtype.
template <typename Kernel>
at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const Geometry& geo,
                  double scale, const char* name, Kernel kernel) {
  const at::Tensor qf = (q.to(at::kFloat) * scale).contiguous();
  at::Tensor out = at::empty({q.size(0), geo.num_heads, geo.head_dim}, qf.options());
  if (q.size(0) > 0) {
    dispatch_dtype(k_cache.scalar_type(), name, [&](auto zero) {
      with_head_dim(geo.head_dim, [&](auto dim) {
        kernel(zero, dim, qf.data_ptr<float>(), out.data_ptr<float>());
      });
    });
  }
  return out.scalar_type() == q.scalar_type() ? out : out.to(q.scalar_type());
}

}  // namespace

namespace kvserve::ops {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale) {
  const Geometry geo =
      geometry(q, k_cache, v_cache, scale, "[num_decodes, num_heads, head_dim]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0),
              "block_tables must be [num_decodes, max_blocks]");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == q.size(0),
              "context_lens must be [num_decodes]");
  const int64_t num_decodes = q.size(0);
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens = context_lens.to(at::kLong).contiguous();
  const int64_t* lens_ptr = lens.data_ptr<int64_t>();
  const int64_t table_stride = tables.size(1);
  const int64_t* tables_ptr = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_decodes; ++i) {
    TORCH_CHECK(lens_ptr[i] >= 0 && lens_ptr[i] <= table_stride * geo.block_size,
                "context length ", lens_ptr[i], " does not fit the block table");
    check_blocks(tables_ptr + i * table_stride, lens_ptr[i], geo.block_size, k_cache.size(0));
  }
  // The kernel scales q and rounds its output itself where q has the caches' dtype (a model's
  // own steps), reading q's rows in place (a view into qkv: rows apart, heads contiguous);
  // other queries go through float32.
  const bool in_place = q.scalar_type() == k_cache.scalar_type() && q.stride(2) == 1 &&
                        q.stride(1) == geo.head_dim;
  const at::Tensor qs = in_place ? q : q.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({num_decodes, geo.num_heads, geo.head_dim}, qs.options());
  if (num_decodes > 0) {
    dispatch_dtype(k_cache.scalar_type(), "decode_attention", [&](auto zero) {
      using T = decltype(zero);
      with_head_dim(geo.head_dim, [&](auto dim) {
        constexpr int D = decltype(dim)::value;
        auto run = [&](auto* q_rows, auto* out_rows) {
          decode_impl<T, D>(geo, q_rows, qs.stride(0), static_cast<float>(scale),
                            k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), tables_ptr,
                            table_stride, lens_ptr, num_decodes, out_rows);
        };
        if (in_place) {
          run(qs.data_ptr<T>(), out.data_ptr<T>());
        } else {
          run(qs.data_ptr<float>(), out.data_ptr<float>());
        }
      });
    });
  }
  return out.scalar_type() == q.scalar_type() ? out : out.to(q.scalar_type());
}

}  // namespace kvserve::ops

namespace {

// One prefill chunk's block table, checked against its n queries, its context and the cache,
// as contiguous int64.
at::Tensor checked_chunk_table(const at::Tensor& block_table, int64_t n, int64_t context_len,
                               const Geometry& geo, const at::Tensor& k_cache) {
  TORCH_CHECK(block_table.dim() == 1, "block_table must be [num_blocks]");
  TORCH_CHECK(n <= context_len, "more queries than context");
  TORCH_CHECK(context_len >= 0, "negative context length");
  TORCH_CHECK(context_len <= block_table.size(0) * geo.block_size,
              "context length does not fit the block table");
  at::Tensor table = block_table.to(at::kLong).contiguous();
  check_blocks(table.data_ptr<int64_t>(), context_len, geo.block_size, k_cache.size(0));
  return table;
}

// Why this process cannot run the bf16 tile kernels (amx_prefill_attention, panel_linear_amx):
// "" where it can.
std::string amx_bf16_status() { return kvserve::amx_bf16_status(); }

}  // namespace

namespace kvserve::ops {

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_table,
                             int64_t context_len, double scale, bool match_decode) {
  Geometry geo = geometry(q, k_cache, v_cache, scale, "[num_tokens, num_heads, head_dim]");
  geo.match_decode = match_decode;
  const int64_t n = q.size(0);
  const at::Tensor table = checked_chunk_table(block_table, n, context_len, geo, k_cache);
  const int64_t* table_ptr = table.data_ptr<int64_t>();
  return attend(q, k_cache, geo, scale, "prefill_attention",
                [&](auto zero, auto dim, const float* qf, float* out) {
                  using T = decltype(zero);
                  prefill_impl<T, decltype(dim)::value>(geo, qf, k_cache.data_ptr<T>(),
                                                        v_cache.data_ptr<T>(), table_ptr,
                                                        context_len, n, out);
                });
}

// A prefill chunk's attention on AMX tiles (attention_amx.h): bfloat16, head_dim 64. Raises
// where this build or this process cannot run it (amx_bf16_status says why).
at::Tensor amx_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& block_table,
                                 int64_t context_len, double scale) {
  const std::string status = amx_bf16_status();
  TORCH_CHECK(status.empty(), "amx_prefill_attention: ", status);
#if defined(KVSERVE_AMX_BF16)
  namespace amx = kvserve::amx_attention;
  const Geometry geo = geometry(q, k_cache, v_cache, scale, "[num_tokens, num_heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16,
              "amx_prefill_attention takes bfloat16 q and caches");
  TORCH_CHECK(geo.head_dim == amx::kDim, "amx_prefill_attention takes head_dim ", amx::kDim);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == amx::kDim, "q's rows must be contiguous");
  const int64_t n = q.size(0);
  TORCH_CHECK(n >= 1, "amx_prefill_attention needs at least one query");
  const at::Tensor table = checked_chunk_table(block_table, n, context_len, geo, k_cache);
  const int64_t* table_ptr = table.data_ptr<int64_t>();
  const int64_t padded = (context_len + amx::kKeys - 1) / amx::kKeys * amx::kKeys;
  const int64_t kv_heads = geo.num_kv_heads, blocks = padded / amx::kKeys;
  const int64_t row_blocks = (n + amx::kRows - 1) / amx::kRows;
  const int64_t items = geo.num_heads * row_blocks;  // work items: 16 queries of one head
  at::Tensor keys = at::empty({kv_heads, amx::key_words(padded)}, q.options().dtype(at::kInt));
  at::Tensor values =
      at::empty({kv_heads, amx::value_halves(padded)}, q.options().dtype(at::kShort));
  at::Tensor queries = at::empty({items, amx::kQueryWords}, q.options().dtype(at::kInt));
  auto* key_words = reinterpret_cast<uint32_t*>(keys.data_ptr<int32_t>());
  auto* value_words = reinterpret_cast<uint16_t*>(values.data_ptr<int16_t>());
  auto* query_words = reinterpret_cast<uint32_t*>(queries.data_ptr<int32_t>());
  const auto* k_ptr = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* v_ptr = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  const auto* q_ptr = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  // packing: the context's keys and values per kv head and 32 keys, then the queries per item
  // (two passes, as a key block costs far more than a query block)
  at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t head = task / blocks, block = task % blocks;
      amx::pack_block(k_ptr, v_ptr, table_ptr, geo.block_size, geo.token_stride, head,
                      context_len, block * amx::kKeys, (block + 1) * amx::kKeys,
                      key_words + head * amx::key_words(padded),
                      value_words + head * amx::value_halves(padded));
    }
  });
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      amx::pack_queries(q_ptr + item / row_blocks * amx::kDim, q.stride(0), n,
                        item % row_blocks * amx::kRows, query_words + item * amx::kQueryWords);
    }
  });
  at::Tensor out = at::empty({n, geo.num_heads, amx::kDim}, q.options());
  auto* out_ptr = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  // An item's work grows with its queries' positions: the last queries first, the heads of a
  // kv head side by side (they read the same keys and values), taken by whichever thread is
  // free (a static split gave one thread the long half of a head).
  std::vector<int64_t> order(items);
  for (int64_t i = 0; i < items; ++i) {
    order[i] = (i % geo.num_heads) * row_blocks + (row_blocks - 1 - i / geo.num_heads);
  }
  struct Tiles {  // a thread's tile configuration, for the items it runs
    Tiles() {
      const kvserve::TileConfig config = kvserve::full_tile_config();
      KVSERVE_TILE_LOADCONFIG(&config);
    }
    ~Tiles() { KVSERVE_TILE_RELEASE(); }
  };
  run_items<Tiles>(order, [&](int64_t item, int64_t, Tiles&) {
    const int64_t head = item / row_blocks, kv_head = head / geo.group;
    amx::attend_rows(query_words + item * amx::kQueryWords,
                     key_words + kv_head * amx::key_words(padded),
                     value_words + kv_head * amx::value_halves(padded), n, context_len,
                     (item % row_blocks) * amx::kRows, static_cast<float>(scale),
                     out_ptr + head * amx::kDim, geo.num_heads * amx::kDim);
  });
  return out;
#else
  return at::Tensor();
#endif
}

void StepLayout::check(int64_t rows, const char* name) const {
  const size_t chunks = chunk_starts.size();
  TORCH_CHECK(chunk_rows.size() == chunks && chunk_contexts.size() == chunks &&
                  chunk_tables.size() == chunks,
              name, ": one start, row count, context and table per chunk");
  int64_t covered = num_decodes;
  for (size_t i = 0; i < chunks; ++i) {
    TORCH_CHECK(chunk_starts[i] == covered && chunk_rows[i] > 0, name,
                ": chunks must follow the decodes and each other");
    covered += chunk_rows[i];
  }
  TORCH_CHECK(num_decodes >= 0 && covered == rows, name,
              ": the decodes and chunks must cover the step's rows");
}

at::Tensor step_attention(const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const StepLayout& step, bool amx_prefill,
                          int64_t min_tile_rows, double scale, bool match_decode) {
  TORCH_CHECK(!(amx_prefill && match_decode),
              "step_attention: match_decode's rows run on the C++ kernel, not the tiles");
  const int64_t decodes = step.num_decodes;
  if (decodes == q.size(0) && step.chunk_starts.empty()) {  // most steps: no copy
    return decode_attention(q, k_cache, v_cache, step.block_tables, step.context_lens, scale);
  }
  step.check(q.size(0), "step_attention");
  at::Tensor out = at::empty_like(q);
  if (decodes > 0) {
    out.narrow(0, 0, decodes)
        .copy_(decode_attention(q.narrow(0, 0, decodes), k_cache, v_cache, step.block_tables,
                                step.context_lens, scale));
  }
  for (size_t i = 0; i < step.chunk_starts.size(); ++i) {
    const int64_t start = step.chunk_starts[i], rows = step.chunk_rows[i];
    const at::Tensor chunk = q.narrow(0, start, rows);
    const at::Tensor& table = step.chunk_tables[i];
    out.narrow(0, start, rows)
        .copy_(amx_prefill && rows >= min_tile_rows
                   ? amx_prefill_attention(chunk, k_cache, v_cache, table,
                                           step.chunk_contexts[i], scale)
                   : prefill_attention(chunk, k_cache, v_cache, table, step.chunk_contexts[i],
                                       scale, match_decode));
  }
  return out;
}

}  // namespace kvserve::ops

namespace {

// The instruction sets this build compiled paths for (-march=native on the building CPU).
std::vector<std::string> compiled_isa() {
  std::vector<std::string> isa;
#if defined(__AVX2__)
  isa.push_back("avx2");
#endif
#if defined(__FMA__)
  isa.push_back("fma");
#endif
#if defined(__AVX512F__)
  isa.push_back("avx512f");
#endif
#if defined(__AVX512BF16__)
  isa.push_back("avx512_bf16");
#endif
#if defined(__AMX_BF16__)
  isa.push_back("amx_bf16");
#endif
  return isa;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &kvserve::ops::decode_attention,
        "Paged decode attention: q [D, H, d], caches [blocks, block_size, kv_heads, d], "
        "block_tables [D, max_blocks] long, context_lens [D] long, scale",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"));
  m.def("prefill_attention", &kvserve::ops::prefill_attention,
        "Paged causal attention for one prefill chunk: q [n, H, d] at positions "
        "context_len - n + i; match_decode: each row's sums in decode's order (no repacked "
        "tiles), for --batch-invariant",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"),
        py::arg("context_len"), py::arg("scale"), py::arg("match_decode") = false);
  m.def("amx_prefill_attention", &kvserve::ops::amx_prefill_attention,
        "prefill_attention on AMX-BF16 tiles: bfloat16, head_dim 64 (csrc/attention_amx.h)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"),
        py::arg("context_len"), py::arg("scale"));
  m.def("step_attention",
        [](const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
           int64_t num_decodes, const at::Tensor& block_tables, const at::Tensor& context_lens,
           std::vector<int64_t> chunk_starts, std::vector<int64_t> chunk_rows,
           std::vector<int64_t> chunk_contexts, std::vector<at::Tensor> chunk_tables,
           bool amx_prefill, int64_t min_tile_rows, double scale, bool match_decode) {
          const kvserve::ops::StepLayout step{num_decodes, block_tables, context_lens,
                                              std::move(chunk_starts), std::move(chunk_rows),
                                              std::move(chunk_contexts),
                                              std::move(chunk_tables)};
          return kvserve::ops::step_attention(q, k_cache, v_cache, step, amx_prefill,
                                              min_tile_rows, scale, match_decode);
        },
        "One step's attention on the C++ kernels: decodes, then each prefill chunk (on the "
        "AMX tiles where amx_prefill and it has min_tile_rows rows)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("num_decodes"),
        py::arg("block_tables"), py::arg("context_lens"), py::arg("chunk_starts"),
        py::arg("chunk_rows"), py::arg("chunk_contexts"), py::arg("chunk_tables"),
        py::arg("amx_prefill"), py::arg("min_tile_rows"), py::arg("scale"),
        py::arg("match_decode"));
  m.def("amx_bf16_status", &amx_bf16_status,
        "why the bf16 AMX tile kernels (amx_prefill_attention, panel_linear_amx) cannot run "
        "here (empty where they can)");
  register_layer_ops(m);
  register_layer_stack(m);
  register_invariant_linear(m);
  register_panel_linear(m);
  register_int8_linear(m);
  m.def("compiled_isa", &compiled_isa,
        "The instruction sets the kernels were compiled for: avx2, fma, avx512f, avx512_bf16, "
        "amx_bf16");
}
