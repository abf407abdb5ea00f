// Paged attention kernels: decode (one query token per request, a request's heads over threads) and prefill
// chunks (flash-style over key tiles), both reading the KV blocks in place.
#include "attention.h"

#include <ATen/Dispatch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "bf16_lanes.h"
#include "checks.h"
#include "parallel.h"
#include "simd.h"

namespace pagedserve {
namespace {

template <typename scalar_t>
inline float dot_row(const float* query, const scalar_t* key, int64_t head_dim) {
  float dot = 0.f;
  for (int64_t d = 0; d < head_dim; ++d) {
    dot += query[d] * static_cast<float>(key[d]);
  }
  return dot;
}

template <>
inline float dot_row<float>(const float* query, const float* key, int64_t head_dim) {
  if (head_dim % kLanes != 0) {
    float dot = 0.f;
    for (int64_t d = 0; d < head_dim; ++d) {
      dot += query[d] * key[d];
    }
    return dot;
  }
  Lanes sum = {};
  for (int64_t d = 0; d < head_dim; d += kLanes) {
    sum += load_lanes(query + d) * load_lanes(key + d);
  }
  return sum_lanes(sum);
}

// bf16 keys widened to fp32 lanes where head_dim allows; the same sums as the fp32 row.
template <>
inline float dot_row<c10::BFloat16>(const float* query, const c10::BFloat16* key, int64_t head_dim) {
  if (head_dim % kLanes != 0) {
    float dot = 0.f;
    for (int64_t d = 0; d < head_dim; ++d) {
      dot += query[d] * static_cast<float>(key[d]);
    }
    return dot;
  }
  Lanes sum = {};
  for (int64_t d = 0; d < head_dim; d += kLanes) {
    sum += load_lanes(query + d) * widen_bf16_lanes(key + d);
  }
  return sum_lanes(sum);
}

template <typename scalar_t>
inline void add_scaled_row(float* accumulator, float weight, const scalar_t* value, int64_t head_dim) {
  for (int64_t d = 0; d < head_dim; ++d) {
    accumulator[d] += weight * static_cast<float>(value[d]);
  }
}

template <>
inline void add_scaled_row<float>(float* accumulator, float weight, const float* value, int64_t head_dim) {
  if (head_dim % kLanes != 0) {
    for (int64_t d = 0; d < head_dim; ++d) {
      accumulator[d] += weight * value[d];
    }
    return;
  }
  for (int64_t d = 0; d < head_dim; d += kLanes) {
    store_lanes(accumulator + d, load_lanes(accumulator + d) + weight * load_lanes(value + d));
  }
}

template <>
inline void add_scaled_row<c10::BFloat16>(float* accumulator, float weight, const c10::BFloat16* value,
                                          int64_t head_dim) {
  if (head_dim % kLanes != 0) {
    for (int64_t d = 0; d < head_dim; ++d) {
      accumulator[d] += weight * static_cast<float>(value[d]);
    }
    return;
  }
  for (int64_t d = 0; d < head_dim; d += kLanes) {
    store_lanes(accumulator + d, load_lanes(accumulator + d) + weight * widen_bf16_lanes(value + d));
  }
}

// row[i] = exp(row[i] - max); returns the sum.
inline float exp_and_sum(float* row, int64_t count, float max) {
  float total = 0.f;
  int64_t i = 0;
  Lanes sum = {};
  for (; i + kLanes <= count; i += kLanes) {
    const Lanes values = exp_lanes(load_lanes(row + i) - max);
    store_lanes(row + i, values);
    sum += values;
  }
  total = sum_lanes(sum);
  for (; i < count; ++i) {
    row[i] = std::exp(row[i] - max);
    total += row[i];
  }
  return total;
}

// tanh within a few ulp: below |x| = 1/4 its odd Taylor polynomial to x^9 (the next term is under 1e-8 of x),
// above it 1 - 2 / (e^(2|x|) + 1), which no longer cancels there and saturates to 1 (exp_lanes clamps, no inf).
inline Lanes tanh_lanes(Lanes x) {
  const Lanes magnitude = x < 0.f ? -x : x;
  const Lanes square = x * x;
  Lanes series = broadcast(62.f / 2835.f);
  series = series * square - 17.f / 315.f;
  series = series * square + 2.f / 15.f;
  series = series * square - 1.f / 3.f;
  const Lanes small = x + x * square * series;
  const Lanes large = 1.f - 2.f / (exp_lanes(2.f * magnitude) + 1.f);
  return magnitude < 0.25f ? small : (x < 0.f ? -large : large);
}

// Gemma 2's logit soft-capping of scaled scores: cap * tanh(score / cap).
inline Lanes soft_cap_lanes(Lanes scores, float cap) {
  return cap * tanh_lanes(scores / cap);
}

// row[i] = cap * tanh(row[i] / cap) for `count` scores; returns their max. The tail goes through the same vector
// code as the rest, so a key's capped score does not depend on where it falls.
inline float soft_cap_row(float* row, int64_t count, float cap) {
  Lanes highest = broadcast(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    const Lanes capped = soft_cap_lanes(load_lanes(row + i), cap);
    store_lanes(row + i, capped);
    highest = capped > highest ? capped : highest;
  }
  if (i < count) {
    alignas(64) float tail[kLanes] = {};
    std::copy(row + i, row + count, tail);
    const Lanes capped = soft_cap_lanes(load_lanes(tail), cap);
    store_lanes(tail, capped);
    std::copy(tail, tail + (count - i), row + i);
    for (int64_t j = 0; j < count - i; ++j) {
      highest[0] = std::max(highest[0], tail[j]);
    }
  }
  return max_lanes(highest);
}

// Keys per dot-product tile: their lane sums are folded together, not one horizontal sum per key.
constexpr int64_t kKeyTile = 8;

// sums[i] = the lanes of partials[i] added, for a tile of kKeyTile partial dot products.
inline void sum_each_lanes(const Lanes* partials, float* sums) {
#if defined(__AVX__)
  __m256 eight[kKeyTile];
  for (int64_t i = 0; i < kKeyTile; ++i) {
#if defined(__AVX512F__)
    const __m512 wide = partials[i];
    eight[i] = _mm256_add_ps(
        _mm512_castps512_ps256(wide), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(wide), 1)));
#else
    eight[i] = partials[i];
#endif
  }
  // Two rounds of pairwise adds leave, per 128-bit half, the four partial sums of four rows; one swap of
  // halves and an add finish all eight.
  const __m256 first = _mm256_hadd_ps(_mm256_hadd_ps(eight[0], eight[1]), _mm256_hadd_ps(eight[2], eight[3]));
  const __m256 second = _mm256_hadd_ps(_mm256_hadd_ps(eight[4], eight[5]), _mm256_hadd_ps(eight[6], eight[7]));
  _mm256_storeu_ps(
      sums,
      _mm256_add_ps(_mm256_permute2f128_ps(first, second, 0x20), _mm256_permute2f128_ps(first, second, 0x31)));
#else
  for (int64_t i = 0; i < kKeyTile; ++i) {
    sums[i] = sum_lanes(partials[i]);
  }
#endif
}

// The largest of a tile's `count` scores: a full tile pairwise (three dependent maxes, not eight).
inline float max_of_tile(const float* tile, int64_t count) {
  if (count == kKeyTile) {
    const float low = std::max(std::max(tile[0], tile[1]), std::max(tile[2], tile[3]));
    const float high = std::max(std::max(tile[4], tile[5]), std::max(tile[6], tile[7]));
    return std::max(low, high);
  }
  float largest = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < count; ++i) {
    largest = std::max(largest, tile[i]);
  }
  return largest;
}

// Steps through one request's cached rows of one KV head in token order, with no division per row.
template <typename scalar_t>
struct CacheRowCursor {
  const scalar_t* cache;
  const int32_t* table;
  int64_t block_size;
  int64_t block_stride;
  int64_t token_stride;
  int64_t block;
  int64_t offset;

  const scalar_t* row() const {
    return cache + table[block] * block_stride + offset * token_stride;
  }
  void next() {
    if (++offset == block_size) {
      offset = 0;
      ++block;
    }
  }
};

// Rows a decode head asks memory for ahead of its dot products: a block's worth, into L2 (L1 has too few miss
// buffers). A request's blocks lie anywhere in the cache, so the hardware prefetcher stops at each block's end.
constexpr int64_t kPrefetchRows = 16;

// Asks L2 for one cache row of `row_bytes` (its 64-byte lines).
inline void prefetch_row(const void* row, int64_t row_bytes) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t line = 0; line < row_bytes; line += 64) {
    _mm_prefetch(bytes + line, _MM_HINT_T1);
  }
}

// The first `count` rows of a head's keys and values into L2: what the head after the current one reads first.
template <typename scalar_t>
inline void prefetch_head_start(CacheRowCursor<scalar_t> keys, CacheRowCursor<scalar_t> values, int64_t count,
                                int64_t row_bytes) {
  for (int64_t i = 0; i < count; ++i, keys.next(), values.next()) {
    prefetch_row(keys.row(), row_bytes);
    prefetch_row(values.row(), row_bytes);
  }
}

// Key rows asked of L2 one at a time, up to the last: a head's ahead of its dot products, or the next work item's
// during the current item's value pass. Default-constructed it asks for nothing.
template <typename scalar_t>
struct KeyRowsAhead {
  CacheRowCursor<scalar_t> cursor;
  int64_t row_bytes;
  int64_t left;  // 0: nothing (more) to ask for

  void ask_for_next() {
    if (left > 0) {
      prefetch_row(cursor.row(), row_bytes);
      cursor.next();
      --left;
    }
  }
};

// One head of decode attention with head_dim = kChunks * kLanes, fp32 or bf16 (widened on load, fp32 math, the
// output rounded once): the query and the output accumulators live in registers, dot products go a tile of keys at
// a time. `scores` holds num_keys rounded up to a tile.
// `fetch_ahead`: the first head of its KV head's group, which reads the rows from memory (the others find them in
// cache); it asks for each key row kPrefetchRows ahead of its dot product and for each value row meanwhile.
// `next_item`: key rows to ask for during the value pass (the next group's, for a group's last head). soft_cap > 0
// caps the scores once all are in.
template <int64_t kChunks, typename scalar_t>
void attend_head_lanes(
    const scalar_t* query,
    float scale,
    float soft_cap,
    CacheRowCursor<scalar_t> keys,
    CacheRowCursor<scalar_t> values,
    int64_t num_keys,
    float* scores,
    scalar_t* output,
    bool fetch_ahead,
    KeyRowsAhead<scalar_t> next_item) {
  Lanes scaled_query[kChunks];
  for (int64_t c = 0; c < kChunks; ++c) {
    scaled_query[c] = load_row_lanes(query + c * kLanes) * scale;
  }
  constexpr int64_t kRowBytes = kChunks * kLanes * sizeof(scalar_t);
  KeyRowsAhead<scalar_t> keys_ahead{keys, kRowBytes, num_keys};
  CacheRowCursor<scalar_t> values_ahead = values;
  if (fetch_ahead) {
    for (int64_t i = 0; i < kPrefetchRows; ++i) {
      keys_ahead.ask_for_next();
    }
  }
  float max_score = -std::numeric_limits<float>::infinity();
  for (int64_t key = 0; key < num_keys; key += kKeyTile) {
    const int64_t count = std::min(kKeyTile, num_keys - key);
    Lanes partials[kKeyTile] = {};
    if (fetch_ahead) {
      for (int64_t i = 0; i < count; ++i, values_ahead.next()) {
        keys_ahead.ask_for_next();
        prefetch_row(values_ahead.row(), kRowBytes);
      }
    }
    for (int64_t i = 0; i < count; ++i, keys.next()) {
      const scalar_t* row = keys.row();
      Lanes dot = scaled_query[0] * load_row_lanes(row);
      for (int64_t c = 1; c < kChunks; ++c) {
        dot += scaled_query[c] * load_row_lanes(row + c * kLanes);
      }
      partials[i] = dot;
    }
    sum_each_lanes(partials, scores + key);
    for (int64_t i = 0; i < count; ++i) {
      max_score = std::max(max_score, scores[key + i]);
    }
  }
  if (soft_cap > 0.f) {
    max_score = soft_cap_row(scores, num_keys, soft_cap);
  }
  const float inverse_sum = 1.f / exp_and_sum(scores, num_keys, max_score);
  // Two sets of accumulators when they fit in registers: one FMA chain per set would wait on its latency.
  constexpr int64_t kStreams = kChunks <= 4 ? 2 : 1;
  Lanes accumulators[kStreams][kChunks] = {};
  int64_t key = 0;
  for (; key + kStreams <= num_keys; key += kStreams) {
    for (int64_t stream = 0; stream < kStreams; ++stream, values.next()) {
      next_item.ask_for_next();
      const scalar_t* row = values.row();
      const Lanes weight = broadcast(scores[key + stream]);
      for (int64_t c = 0; c < kChunks; ++c) {
        accumulators[stream][c] += weight * load_row_lanes(row + c * kLanes);
      }
    }
  }
  for (; key < num_keys; ++key, values.next()) {
    next_item.ask_for_next();
    const scalar_t* row = values.row();
    const Lanes weight = broadcast(scores[key]);
    for (int64_t c = 0; c < kChunks; ++c) {
      accumulators[0][c] += weight * load_row_lanes(row + c * kLanes);
    }
  }
  for (int64_t c = 0; c < kChunks; ++c) {
    Lanes total = accumulators[0][c];
    for (int64_t stream = 1; stream < kStreams; ++stream) {
      total += accumulators[stream][c];
    }
    store_row_lanes(output + c * kLanes, total * inverse_sum);
  }
}

template <typename scalar_t>
using AttendHeadLanes = void (*)(const scalar_t*, float, float, CacheRowCursor<scalar_t>, CacheRowCursor<scalar_t>,
                                 int64_t, float*, scalar_t*, bool, KeyRowsAhead<scalar_t>);

// The register-resident path for this head_dim, or nullptr (the general loop runs instead).
template <typename scalar_t>
inline AttendHeadLanes<scalar_t> attend_head_lanes_for(int64_t head_dim) {
  if (head_dim % kLanes != 0) {
    return nullptr;
  }
  switch (head_dim / kLanes) {
    case 4:
      return attend_head_lanes<4, scalar_t>;
    case 8:
      return attend_head_lanes<8, scalar_t>;
    case 16:
      return attend_head_lanes<16, scalar_t>;
    default:
      return nullptr;
  }
}

// The `kGroup` query heads that share one KV head, in one pass over its rows: a tile of key rows comes from memory
// for the first head and from L1 for the others, each value row is loaded once for all of them (rather than reread
// from L2 per head). Per head, the same arithmetic in the same order as attend_head_lanes (bit for bit the same
// output). `scores` holds kGroup rows of num_keys rounded up to a tile; query and output are the group's heads,
// contiguous. Asks for each key row kPrefetchRows ahead and each value row meanwhile, and for `next_item`'s key
// rows during the value pass.
template <int64_t kChunks, int64_t kGroup, typename scalar_t>
void attend_group_lanes(const scalar_t* query, float scale, float soft_cap, CacheRowCursor<scalar_t> keys,
                        CacheRowCursor<scalar_t> values, int64_t num_keys, float* scores, scalar_t* output,
                        KeyRowsAhead<scalar_t> next_item) {
  constexpr int64_t kHeadDim = kChunks * kLanes;
  Lanes scaled_query[kGroup][kChunks];
  for (int64_t h = 0; h < kGroup; ++h) {
    for (int64_t c = 0; c < kChunks; ++c) {
      scaled_query[h][c] = load_row_lanes(query + h * kHeadDim + c * kLanes) * scale;
    }
  }
  const int64_t score_stride = num_keys + kKeyTile;
  constexpr int64_t kRowBytes = kHeadDim * sizeof(scalar_t);
  KeyRowsAhead<scalar_t> keys_ahead{keys, kRowBytes, num_keys};
  CacheRowCursor<scalar_t> values_ahead = values;
  for (int64_t i = 0; i < kPrefetchRows; ++i) {
    keys_ahead.ask_for_next();
  }
  float max_score[kGroup];
  std::fill(max_score, max_score + kGroup, -std::numeric_limits<float>::infinity());
  alignas(64) float widened[std::is_same_v<scalar_t, float> ? 1 : kKeyTile * kHeadDim];
  for (int64_t key = 0; key < num_keys; key += kKeyTile) {
    const int64_t count = std::min(kKeyTile, num_keys - key);
    for (int64_t i = 0; i < count; ++i, values_ahead.next()) {
      keys_ahead.ask_for_next();
      prefetch_row(values_ahead.row(), kRowBytes);
    }
    // The tile's rows come from memory once: fp32 rows are read in place by every head, bf16 rows widened once
    // into `widened` (L1) for all of them.
    const float* rows[kKeyTile];
    for (int64_t i = 0; i < count; ++i, keys.next()) {
      if constexpr (std::is_same_v<scalar_t, float>) {
        rows[i] = keys.row();
      } else {
        const scalar_t* row = keys.row();
#pragma GCC unroll 16
        for (int64_t c = 0; c < kChunks; ++c) {
          store_lanes(widened + i * kHeadDim + c * kLanes, load_row_lanes(row + c * kLanes));
        }
        rows[i] = widened + i * kHeadDim;
      }
    }
    for (int64_t h = 0; h < kGroup; ++h) {
      Lanes partials[kKeyTile];
      for (int64_t i = 0; i < count; ++i) {
        Lanes dot = scaled_query[h][0] * load_lanes(rows[i]);
#pragma GCC unroll 16
        for (int64_t c = 1; c < kChunks; ++c) {
          dot += scaled_query[h][c] * load_lanes(rows[i] + c * kLanes);
        }
        partials[i] = dot;
      }
      // Only a last, partial tile has lanes past its keys (their sums land past num_keys, never read).
      for (int64_t i = count; i < kKeyTile; ++i) {
        partials[i] = Lanes{};
      }
      float* head_scores = scores + h * score_stride;
      sum_each_lanes(partials, head_scores + key);
      max_score[h] = std::max(max_score[h], max_of_tile(head_scores + key, count));
    }
  }
  float inverse_sum[kGroup];
  for (int64_t h = 0; h < kGroup; ++h) {
    if (soft_cap > 0.f) {
      max_score[h] = soft_cap_row(scores + h * score_stride, num_keys, soft_cap);
    }
    inverse_sum[h] = 1.f / exp_and_sum(scores + h * score_stride, num_keys, max_score[h]);
  }
  // Two sets of accumulators only where both fit the registers with a chunk and the group's weights: spilled, each
  // FMA would wait on a store and a load (the group's heads already give kGroup * kChunks independent chains).
  constexpr int64_t kRegisters = kLanes == 16 ? 32 : 16;  // AVX-512 has 32 vector registers, AVX2 16
  constexpr int64_t kStreams = 2 * kGroup * kChunks + kGroup + 1 <= kRegisters - kGroup ? 2 : 1;
  Lanes accumulators[kGroup][kStreams][kChunks] = {};
  int64_t key = 0;
  for (; key + kStreams <= num_keys; key += kStreams) {
#pragma GCC unroll 4
    for (int64_t stream = 0; stream < kStreams; ++stream, values.next()) {
      next_item.ask_for_next();
      const scalar_t* row = values.row();
      Lanes weights[kGroup];
#pragma GCC unroll 8
      for (int64_t h = 0; h < kGroup; ++h) {
        weights[h] = broadcast(scores[h * score_stride + key + stream]);
      }
#pragma GCC unroll 16
      for (int64_t c = 0; c < kChunks; ++c) {
        const Lanes chunk = load_row_lanes(row + c * kLanes);
#pragma GCC unroll 8
        for (int64_t h = 0; h < kGroup; ++h) {
          accumulators[h][stream][c] += weights[h] * chunk;
        }
      }
    }
  }
  for (; key < num_keys; ++key, values.next()) {
    next_item.ask_for_next();
    const scalar_t* row = values.row();
#pragma GCC unroll 16
    for (int64_t c = 0; c < kChunks; ++c) {
      const Lanes chunk = load_row_lanes(row + c * kLanes);
#pragma GCC unroll 8
      for (int64_t h = 0; h < kGroup; ++h) {
        accumulators[h][0][c] += broadcast(scores[h * score_stride + key]) * chunk;
      }
    }
  }
  for (int64_t h = 0; h < kGroup; ++h) {
    for (int64_t c = 0; c < kChunks; ++c) {
      Lanes total = accumulators[h][0][c];
      for (int64_t stream = 1; stream < kStreams; ++stream) {
        total += accumulators[h][stream][c];
      }
      store_row_lanes(output + h * kHeadDim + c * kLanes, total * inverse_sum[h]);
    }
  }
}

template <typename scalar_t>
using AttendGroupLanes = void (*)(const scalar_t*, float, float, CacheRowCursor<scalar_t>, CacheRowCursor<scalar_t>,
                                  int64_t, float*, scalar_t*, KeyRowsAhead<scalar_t>);

template <int64_t kChunks, typename scalar_t>
inline AttendGroupLanes<scalar_t> attend_group_lanes_of(int64_t group) {
  switch (group) {
    case 1:
      return attend_group_lanes<kChunks, 1, scalar_t>;
    case 2:
      return attend_group_lanes<kChunks, 2, scalar_t>;
    case 3:
      return attend_group_lanes<kChunks, 3, scalar_t>;
    case 4:
      return attend_group_lanes<kChunks, 4, scalar_t>;
    default:
      return nullptr;
  }
}

// The one-pass path for this head_dim and group size, or nullptr: query heads and accumulators of the whole group
// must fit the registers (kChunks * group up to 16 vectors).
template <typename scalar_t>
inline AttendGroupLanes<scalar_t> attend_group_lanes_for(int64_t head_dim, int64_t group) {
  if (head_dim % kLanes != 0) {
    return nullptr;
  }
  switch (head_dim / kLanes) {
    case 4:
      return attend_group_lanes_of<4, scalar_t>(group);
    case 8:
      return group <= 2 ? attend_group_lanes_of<8, scalar_t>(group) : nullptr;
    case 16:
      return group == 1 ? attend_group_lanes_of<16, scalar_t>(group) : nullptr;
    default:
      return nullptr;
  }
}

}  // namespace

template <typename scalar_t>
void decode_attention_kernel(
    const scalar_t* query,
    const PagedCache<scalar_t>& cache,
    scalar_t* output,
    const int32_t* seq_lens,
    int64_t num_seqs,
    int64_t num_heads,
    int64_t num_kv_heads,
    int64_t head_dim,
    int64_t query_stride,
    int64_t output_stride,
    float scale,
    int64_t sliding_window,
    float soft_cap) {
  const int64_t group = num_heads / num_kv_heads;
  // Items rather than requests, so one long request still spreads over the threads: (request, KV head) on the
  // query-group path, else (request, head) with a request's heads next to each other (the keys and values come
  // from memory for a group's first head and from L2 for the others).
  const int64_t work_per_head = cache.max_blocks * cache.block_size * head_dim * 2;
  // A request's first key in attention: the window's start, or its first token.
  const auto first_key = [sliding_window](int64_t seq_len) {
    return sliding_window > 0 ? std::max<int64_t>(0, seq_len - sliding_window) : 0;
  };
  // Request `seq`'s rows of one KV head in `base` (the key or value cache), from key `first` on.
  const auto kv_rows = [&](int64_t seq, int64_t kv_head, int64_t first, const scalar_t* base) {
    return CacheRowCursor<scalar_t>{base + kv_head * head_dim,
                          cache.block_tables + seq * cache.max_blocks,
                          cache.block_size,
                          cache.block_stride,
                          cache.token_stride,
                          first / cache.block_size,
                          first % cache.block_size};
  };
  // The first rows of another request's KV head into L2 while the current item computes.
  const auto prefetch_start_of = [&](int64_t seq, int64_t kv_head, const auto* keys, const auto* values) {
    const int64_t seq_first = first_key(seq_lens[seq]);
    prefetch_head_start(kv_rows(seq, kv_head, seq_first, keys), kv_rows(seq, kv_head, seq_first, values),
                        std::min(kPrefetchRows, seq_lens[seq] - seq_first),
                        head_dim * static_cast<int64_t>(sizeof(scalar_t)));
  };
  // The key rows of request `seq`'s KV head `kv_head`, for the item before it to ask for during its value pass
  // (its own rows come from L2 by then), so memory stays busy in both passes.
  const auto next_item_rows = [&](int64_t seq, int64_t kv_head, const auto* keys) {
    const int64_t seq_first = first_key(seq_lens[seq]);
    return KeyRowsAhead<scalar_t>{kv_rows(seq, kv_head, seq_first, keys),
                                  head_dim * static_cast<int64_t>(sizeof(scalar_t)), seq_lens[seq] - seq_first};
  };
  AttendHeadLanes<scalar_t> attend_lanes = nullptr;
  if constexpr (kRowLanes<scalar_t>) {
    attend_lanes = attend_head_lanes_for<scalar_t>(head_dim);
    if (const AttendGroupLanes<scalar_t> attend_group = attend_group_lanes_for<scalar_t>(head_dim, group);
        attend_group != nullptr) {
      // One work item per (request, KV head): its group of query heads in one pass over the rows.
      parallel_claims(num_seqs * num_kv_heads, work_per_head * group, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores;
        for (int64_t item = begin; item < end; ++item) {
          const int64_t seq = item / num_kv_heads;
          const int64_t kv_head = item % num_kv_heads;
          const int64_t first = first_key(seq_lens[seq]);
          const int64_t num_keys = seq_lens[seq] - first;
          scores.resize(group * (num_keys + kKeyTile));
          KeyRowsAhead<scalar_t> next_item{};
          if (item + 1 < end) {
            prefetch_start_of((item + 1) / num_kv_heads, (item + 1) % num_kv_heads, cache.keys, cache.values);
            next_item = next_item_rows((item + 1) / num_kv_heads, (item + 1) % num_kv_heads, cache.keys);
          }
          const int64_t first_head = kv_head * group;
          attend_group(query + seq * query_stride + first_head * head_dim, scale, soft_cap,
                       kv_rows(seq, kv_head, first, cache.keys), kv_rows(seq, kv_head, first, cache.values), num_keys,
                       scores.data(), output + seq * output_stride + first_head * head_dim, next_item);
        }
      });
      return;
    }
  }
  parallel_claims(num_seqs * num_heads, work_per_head, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float scaled_query[kMaxHeadDim];
    alignas(64) float accumulator[kMaxHeadDim];
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_heads;
      const int64_t head = item % num_heads;
      const int64_t seq_len = seq_lens[seq];
      const int64_t first = first_key(seq_len);
      const int64_t num_keys = seq_len - first;
      const int32_t* table = cache.block_tables + seq * cache.max_blocks;
      scores.resize(num_keys + kKeyTile);
      const int64_t kv_offset = (head / group) * head_dim;
      const scalar_t* head_query = query + seq * query_stride + head * head_dim;
      if constexpr (kRowLanes<scalar_t>) {
        if (attend_lanes != nullptr) {
          const CacheRowCursor<scalar_t> keys = kv_rows(seq, head / group, first, cache.keys);
          const CacheRowCursor<scalar_t> values = kv_rows(seq, head / group, first, cache.values);
          const bool group_leader = head % group == 0;
          if (group_leader && item + group < end) {
            // The next group's first rows come in while this group's heads compute.
            const int64_t next = item + group;
            prefetch_start_of(next / num_heads, (next % num_heads) / group, cache.keys, cache.values);
          }
          // The group's last head reads the rows from L2: memory meanwhile brings the next group's keys.
          KeyRowsAhead<scalar_t> next_item{};
          if (head % group == group - 1 && item + 1 < end) {
            next_item = next_item_rows((item + 1) / num_heads, ((item + 1) % num_heads) / group, cache.keys);
          }
          attend_lanes(head_query, scale, soft_cap, keys, values, num_keys, scores.data(),
                       output + seq * output_stride + head * head_dim, group_leader, next_item);
          continue;
        }
      }
      for (int64_t d = 0; d < head_dim; ++d) {
        scaled_query[d] = static_cast<float>(head_query[d]) * scale;
      }
      float max_score = -std::numeric_limits<float>::infinity();
      // Walk block by block: no integer division per key.
      for (int64_t block = first / cache.block_size, key = 0; key < num_keys; ++block) {
        const int64_t offset = key == 0 ? first % cache.block_size : 0;
        const int64_t count = std::min<int64_t>(cache.block_size - offset, num_keys - key);
        const scalar_t* key_row =
            cache.keys + table[block] * cache.block_stride + offset * cache.token_stride + kv_offset;
        for (int64_t i = 0; i < count; ++i, ++key, key_row += cache.token_stride) {
          const float dot = dot_row<scalar_t>(scaled_query, key_row, head_dim);
          scores[key] = dot;
          max_score = std::max(max_score, dot);
        }
      }
      if (soft_cap > 0.f) {
        max_score = soft_cap_row(scores.data(), num_keys, soft_cap);
      }
      const float inverse_sum = 1.f / exp_and_sum(scores.data(), num_keys, max_score);
      std::fill(accumulator, accumulator + head_dim, 0.f);
      for (int64_t block = first / cache.block_size, key = 0; key < num_keys; ++block) {
        const int64_t offset = key == 0 ? first % cache.block_size : 0;
        const int64_t count = std::min<int64_t>(cache.block_size - offset, num_keys - key);
        const scalar_t* value_row =
            cache.values + table[block] * cache.block_stride + offset * cache.token_stride + kv_offset;
        for (int64_t i = 0; i < count; ++i, ++key, value_row += cache.token_stride) {
          add_scaled_row<scalar_t>(accumulator, scores[key], value_row, head_dim);
        }
      }
      scalar_t* head_output = output + seq * output_stride + head * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) {
        head_output[d] = static_cast<scalar_t>(accumulator[d] * inverse_sum);
      }
    }
  });
}

// DecodeStack's instance: decode_stack.cpp sees only the declaration.
template void decode_attention_kernel<float>(const float*, const PagedCache<float>&, float*, const int32_t*, int64_t,
                                              int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t, float);
template void decode_attention_kernel<c10::BFloat16>(const c10::BFloat16*, const PagedCache<c10::BFloat16>&,
                                                       c10::BFloat16*, const int32_t*, int64_t, int64_t, int64_t,
                                                       int64_t, int64_t, int64_t, float, int64_t, float);

namespace {

// Query tokens per prefill work item: with GQA their query heads make group * kPrefillTile rows that share every
// key and value row read (the decode kernel reads a request's keys once per query head).
constexpr int64_t kPrefillTile = 16;
// Query rows scored and accumulated together: each key or value vector is loaded once for all of them.
constexpr int64_t kRowBlock = 4;

// The kLanes keys at `row_offsets` (elements into `keys`) transposed into `keys_t`: a row of kLanes keys per
// dimension, as fp32.
inline void transpose_key_tile(const float* keys, const int32_t* row_offsets, int64_t head_dim, float* keys_t) {
#if defined(__AVX512F__)
  // One gather per dimension: kLanes rows, each in its own cache block.
  const __m512i gather_offsets = _mm512_load_si512(row_offsets);
  for (int64_t d = 0; d < head_dim; ++d) {
    _mm512_storeu_ps(keys_t + d * kLanes, _mm512_i32gather_ps(gather_offsets, keys + d, 4));
  }
#else
  for (int64_t i = 0; i < kLanes; ++i) {
    const float* key_row = keys + row_offsets[i];
    for (int64_t d = 0; d < head_dim; ++d) {
      keys_t[d * kLanes + i] = key_row[d];
    }
  }
#endif
}

// bf16 keys (head_dim even): one 32-bit gather per pair of dimensions, the low half of each word the first
// dimension's bf16 and the high half the second's, each widened to fp32 by a shift or a mask.
inline void transpose_key_tile(const c10::BFloat16* keys, const int32_t* row_offsets, int64_t head_dim,
                               float* keys_t) {
#if defined(__AVX512F__)
  const __m512i gather_offsets = _mm512_load_si512(row_offsets);
  const __m512i high_halves = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t d = 0; d < head_dim; d += 2) {
    const __m512i pairs = _mm512_i32gather_epi32(gather_offsets, keys + d, 2);
    _mm512_storeu_ps(keys_t + d * kLanes, _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)));
    _mm512_storeu_ps(keys_t + (d + 1) * kLanes, _mm512_castsi512_ps(_mm512_and_si512(pairs, high_halves)));
  }
#else
  for (int64_t i = 0; i < kLanes; ++i) {
    const c10::BFloat16* key_row = keys + row_offsets[i];
    for (int64_t d = 0; d < head_dim; ++d) {
      keys_t[d * kLanes + i] = static_cast<float>(key_row[d]);
    }
  }
#endif
}

}  // namespace

// Prefill chunks (fp32 or bf16, head_dim a multiple of kLanes) over the paged cache, their own new keys included
// (written first): flash-style, a tile of kLanes keys at a time with an online softmax, so no score matrix, gathered
// copy of the cache or mask tensor is ever built. bf16 is widened on load and the math is fp32, the output rounded
// once. One work item per (request, tile of query tokens, KV head).
template <typename scalar_t>
void prefill_attention_kernel(
    const scalar_t* query,
    const PagedCache<scalar_t>& cache,
    scalar_t* output,
    const int32_t* query_starts,
    const int32_t* seq_lens,
    int64_t num_seqs,
    int64_t num_heads,
    int64_t num_kv_heads,
    int64_t head_dim,
    int64_t query_stride,
    int64_t output_stride,
    float scale,
    int64_t sliding_window,
    float soft_cap) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_rows = kPrefillTile * group;
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (request, its first query token in the tile)
  int64_t total_work = 0;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t query_len = query_starts[seq + 1] - query_starts[seq];
    const int64_t context = seq_lens[seq] - query_len;
    for (int64_t first = 0; first < query_len; first += kPrefillTile) {
      tiles.emplace_back(seq, first);
      const int64_t keys = context + std::min(query_len, first + kPrefillTile);
      total_work += std::min(kPrefillTile, query_len - first) * group * keys * head_dim * 2;
    }
  }
  const int64_t num_items = static_cast<int64_t>(tiles.size()) * num_kv_heads;
  if (num_items == 0) {
    return;
  }
  const IntLanes lane_index = [] {
    IntLanes lanes;
    for (int64_t i = 0; i < kLanes; ++i) {
      lanes[i] = static_cast<int32_t>(i);
    }
    return lanes;
  }();
  const Lanes minus_infinity = broadcast(-std::numeric_limits<float>::infinity());
  parallel_claims(num_items, total_work / num_items, 1, [&](int64_t begin, int64_t end) {
    // Keys of the current tile transposed (a row of kLanes keys per dimension); each row's probabilities; the
    // running softmax max, sum and output of every query row of the item.
    // Room for a whole kRowBlock past an item's last row: row blocks run whole, the extra rows scored and
    // accumulated but never read.
    const int64_t padded_rows = max_rows + kRowBlock;
    std::vector<float> keys_t(head_dim * kLanes), probabilities(padded_rows * kLanes, 0.f);
    std::vector<float> row_max(max_rows), row_sum(max_rows), accumulators(padded_rows * head_dim, 0.f);
    std::vector<const float*> query_rows(padded_rows);
    // bf16 query rows widened once per item: the score loop reads each of them once per key tile.
    std::vector<float> widened_queries(std::is_same_v<scalar_t, float> ? 0 : max_rows * head_dim);
    const scalar_t* value_rows[kLanes];
    for (int64_t item = begin; item < end; ++item) {
      const auto [seq, tile_first] = tiles[item / num_kv_heads];
      const int64_t kv_head = item % num_kv_heads;
      const int64_t query_len = query_starts[seq + 1] - query_starts[seq];
      const int64_t num_tokens = std::min(kPrefillTile, query_len - tile_first);
      const int64_t num_rows = num_tokens * group;
      const int64_t first_position = seq_lens[seq] - query_len + tile_first;
      const int64_t last_position = first_position + num_tokens - 1;
      const int64_t lowest_key = sliding_window > 0 ? std::max<int64_t>(0, first_position - sliding_window + 1) : 0;
      const int32_t* table = cache.block_tables + seq * cache.max_blocks;
      const int64_t kv_offset = kv_head * head_dim;
      // Row r: token r / group of the tile, query head kv_head * group + r % group.
      for (int64_t row = 0; row < num_rows; ++row) {
        const int64_t token = query_starts[seq] + tile_first + row / group;
        const scalar_t* query_row = query + token * query_stride + (kv_head * group + row % group) * head_dim;
        if constexpr (std::is_same_v<scalar_t, float>) {
          query_rows[row] = query_row;
        } else {
          float* widened = widened_queries.data() + row * head_dim;
          for (int64_t d = 0; d < head_dim; d += kLanes) {
            store_lanes(widened + d, load_row_lanes(query_row + d));
          }
          query_rows[row] = widened;
        }
      }
      for (int64_t row = num_rows; row < num_rows + kRowBlock; ++row) {
        query_rows[row] = query_rows[0];
      }
      std::fill(row_max.begin(), row_max.begin() + num_rows, -std::numeric_limits<float>::infinity());
      std::fill(row_sum.begin(), row_sum.begin() + num_rows, 0.f);
      std::fill(accumulators.begin(), accumulators.begin() + num_rows * head_dim, 0.f);
      for (int64_t first_key = lowest_key; first_key <= last_position; first_key += kLanes) {
        const int64_t count = std::min<int64_t>(kLanes, last_position + 1 - first_key);
        alignas(64) int32_t row_offsets[kLanes];
        for (int64_t i = 0; i < kLanes; ++i) {
          // Lanes past the last key read the first one again; their scores are masked.
          const int64_t key = first_key + (i < count ? i : 0);
          const int64_t row_offset = table[key / cache.block_size] * cache.block_stride +
                                     (key % cache.block_size) * cache.token_stride + kv_offset;
          row_offsets[i] = static_cast<int32_t>(row_offset);
          value_rows[i] = cache.values + row_offset;
        }
        transpose_key_tile(cache.keys, row_offsets, head_dim, keys_t.data());
        const IntLanes key_index = lane_index + static_cast<int32_t>(first_key);
        for (int64_t row0 = 0; row0 < num_rows; row0 += kRowBlock) {
          const float* const* rows = query_rows.data() + row0;
          Lanes scores[kRowBlock] = {};
          for (int64_t d = 0; d < head_dim; ++d) {
            const Lanes keys_d = load_lanes(keys_t.data() + d * kLanes);
            for (int64_t b = 0; b < kRowBlock; ++b) {
              scores[b] += broadcast(rows[b][d]) * keys_d;
            }
          }
          for (int64_t b = 0; b < kRowBlock && row0 + b < num_rows; ++b) {
            const int64_t row = row0 + b;
            const int32_t position = static_cast<int32_t>(first_position + row / group);
            const int32_t lowest = sliding_window > 0 ? position - static_cast<int32_t>(sliding_window) + 1 : 0;
            const IntLanes valid =
                (key_index <= position) & (key_index >= lowest) & (lane_index < static_cast<int32_t>(count));
            const Lanes scaled = soft_cap > 0.f ? soft_cap_lanes(scores[b] * scale, soft_cap) : scores[b] * scale;
            const Lanes masked = valid ? scaled : minus_infinity;
            const float tile_max = max_lanes(masked);
            float* row_probabilities = probabilities.data() + row * kLanes;
            if (tile_max == -std::numeric_limits<float>::infinity()) {
              store_lanes(row_probabilities, Lanes{});  // every key of the tile is after this query (or out of window)
              continue;
            }
            const float new_max = std::max(row_max[row], tile_max);
            const float correction = std::exp(row_max[row] - new_max);
            const Lanes weights = valid ? exp_lanes(masked - new_max) : Lanes{};
            store_lanes(row_probabilities, weights);
            row_sum[row] = row_sum[row] * correction + sum_lanes(weights);
            row_max[row] = new_max;
            if (correction != 1.f) {
              float* accumulator = accumulators.data() + row * head_dim;
              for (int64_t d = 0; d < head_dim; d += kLanes) {
                store_lanes(accumulator + d, load_lanes(accumulator + d) * correction);
              }
            }
          }
        }
        for (int64_t row0 = 0; row0 < num_rows; row0 += kRowBlock) {
          const float* weights = probabilities.data() + row0 * kLanes;
          float* block_accumulators = accumulators.data() + row0 * head_dim;
          for (int64_t d = 0; d < head_dim; d += kLanes) {
            Lanes sums[kRowBlock];
            for (int64_t b = 0; b < kRowBlock; ++b) {
              sums[b] = load_lanes(block_accumulators + b * head_dim + d);
            }
            for (int64_t i = 0; i < count; ++i) {
              const Lanes value = load_row_lanes(value_rows[i] + d);
              for (int64_t b = 0; b < kRowBlock; ++b) {
                sums[b] += broadcast(weights[b * kLanes + i]) * value;
              }
            }
            for (int64_t b = 0; b < kRowBlock; ++b) {
              store_lanes(block_accumulators + b * head_dim + d, sums[b]);
            }
          }
        }
      }
      for (int64_t row = 0; row < num_rows; ++row) {
        const int64_t token = query_starts[seq] + tile_first + row / group;
        scalar_t* out = output + token * output_stride + (kv_head * group + row % group) * head_dim;
        const float* accumulator = accumulators.data() + row * head_dim;
        const Lanes inverse_sum = broadcast(1.f / row_sum[row]);
        for (int64_t d = 0; d < head_dim; d += kLanes) {
          store_row_lanes(out + d, load_lanes(accumulator + d) * inverse_sum);
        }
      }
    }
  });
}

void check_prefill_chunks(const torch::Tensor& block_tables, const torch::Tensor& query_starts,
                          const torch::Tensor& seq_lens, int64_t num_rows, const char* rows_name, int64_t block_size,
                          int64_t cache_elements, int64_t head_dim) {
  TORCH_CHECK(head_dim % kLanes == 0, "head_dim must be a multiple of ", kLanes);
  // Row offsets within a cache are 32-bit (one gather transposes a tile of keys).
  TORCH_CHECK(cache_elements <= std::numeric_limits<int32_t>::max(), "cache above 2^31 elements");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.is_contiguous() && block_tables.dim() == 2,
              "block_tables must be contiguous int32 [chunks, width]");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous(), "seq_lens int32");
  TORCH_CHECK(query_starts.scalar_type() == torch::kInt32 && query_starts.is_contiguous(), "query_starts int32");
  const int64_t num_chunks = seq_lens.numel();
  TORCH_CHECK(block_tables.size(0) == num_chunks && query_starts.numel() == num_chunks + 1, "one table per request");
  const int32_t* starts = query_starts.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_chunks] == num_rows, "query_starts must cover ", rows_name);
  for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
    const int64_t query_len = starts[chunk + 1] - starts[chunk];
    TORCH_CHECK(query_len >= 1 && query_len <= lens[chunk], "each request needs 1 .. seq_len query tokens");
    TORCH_CHECK(lens[chunk] <= block_tables.size(1) * block_size, "a block table is too short: seq_len ", lens[chunk],
                " needs more blocks than its table holds");
  }
}

// DecodeStack's instances: decode_stack.cpp sees only the declaration.
template void prefill_attention_kernel<float>(const float*, const PagedCache<float>&, float*, const int32_t*,
                                              const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                              float, int64_t, float);
template void prefill_attention_kernel<c10::BFloat16>(const c10::BFloat16*, const PagedCache<c10::BFloat16>&,
                                                       c10::BFloat16*, const int32_t*, const int32_t*, int64_t,
                                                       int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t,
                                                       float);

namespace {

// What both paged attention entry points read: query and output [rows, heads, head_dim] with contiguous heads,
// matching paged caches of the query's dtype, int32 block tables and sequence lengths.
void check_paged_attention_inputs(
    const torch::Tensor& output,
    const torch::Tensor& query,
    const torch::Tensor& key_cache,
    const torch::Tensor& value_cache,
    const torch::Tensor& block_tables,
    const torch::Tensor& seq_lens) {
  check_rows(query, "query");
  check_rows(output, "output");
  TORCH_CHECK(query.dim() == 3 && output.sizes() == query.sizes(), "query and output must be [rows, heads, dim]");
  TORCH_CHECK(query.stride(1) == query.size(2) && output.stride(1) == output.size(2), "heads must be contiguous");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.strides() == value_cache.strides(), "caches must match");
  TORCH_CHECK(key_cache.stride(3) == 1 && key_cache.stride(2) == key_cache.size(3), "cache rows must be contiguous");
  TORCH_CHECK(key_cache.scalar_type() == query.scalar_type(), "cache and query dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.is_contiguous(), "block_tables int32");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous(), "seq_lens int32");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(query.size(2) <= kMaxHeadDim, "head_dim above ", kMaxHeadDim);
}

template <typename scalar_t>
PagedCache<scalar_t> paged_cache(
    const torch::Tensor& key_cache, const torch::Tensor& value_cache, const torch::Tensor& block_tables) {
  return {key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int32_t>(),
          block_tables.size(1), key_cache.size(1), key_cache.stride(0), key_cache.stride(1)};
}

}  // namespace

void paged_decode_attention(
    torch::Tensor& output,
    const torch::Tensor& query,
    const torch::Tensor& key_cache,
    const torch::Tensor& value_cache,
    const torch::Tensor& block_tables,
    const torch::Tensor& seq_lens,
    double scale,
    int64_t sliding_window,
    double soft_cap) {
  check_paged_attention_inputs(output, query, key_cache, value_cache, block_tables, seq_lens);
  TORCH_CHECK(soft_cap >= 0.0, "soft_cap must be 0 (off) or positive");
  const int64_t num_seqs = query.size(0);
  TORCH_CHECK(block_tables.size(0) == num_seqs && seq_lens.size(0) == num_seqs, "one table and length per seq");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_kernel<scalar_t>(
        query.data_ptr<scalar_t>(),
        paged_cache<scalar_t>(key_cache, value_cache, block_tables),
        output.data_ptr<scalar_t>(),
        seq_lens.data_ptr<int32_t>(),
        num_seqs,
        query.size(1),
        key_cache.size(2),
        query.size(2),
        query.stride(0),
        output.stride(0),
        static_cast<float>(scale),
        sliding_window,
        static_cast<float>(soft_cap));
  });
}

void paged_prefill_attention(
    torch::Tensor& output,
    const torch::Tensor& query,
    const torch::Tensor& key_cache,
    const torch::Tensor& value_cache,
    const torch::Tensor& block_tables,
    const torch::Tensor& query_starts,
    const torch::Tensor& seq_lens,
    double scale,
    int64_t sliding_window,
    double soft_cap) {
  check_paged_attention_inputs(output, query, key_cache, value_cache, block_tables, seq_lens);
  TORCH_CHECK(soft_cap >= 0.0, "soft_cap must be 0 (off) or positive");
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 || query.scalar_type() == torch::kBFloat16, "fp32 or bf16 only");
  TORCH_CHECK(output.scalar_type() == query.scalar_type(), "output and query dtypes differ");
  check_prefill_chunks(block_tables, query_starts, seq_lens, query.size(0), "the query rows", key_cache.size(1),
                       key_cache.size(0) * key_cache.stride(0), query.size(2));
  const int64_t num_seqs = seq_lens.size(0);
  const int32_t* starts = query_starts.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, query.scalar_type(), "paged_prefill_attention", [&] {
    if constexpr (kRowLanes<scalar_t>) {
      prefill_attention_kernel<scalar_t>(
          query.data_ptr<scalar_t>(),
          paged_cache<scalar_t>(key_cache, value_cache, block_tables),
          output.data_ptr<scalar_t>(),
          starts,
          lens,
          num_seqs,
          query.size(1),
          key_cache.size(2),
          query.size(2),
          query.stride(0),
          output.stride(0),
          static_cast<float>(scale),
          sliding_window,
          static_cast<float>(soft_cap));
    }
  });
}

}  // namespace pagedserve
