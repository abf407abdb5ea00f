// pagedserve's CPU kernels: paged decode attention that reads KV blocks in place, the KV-cache write, and the
// fused per-layer elementwise ops (residual add + RMSNorm, rotary embedding, SiLU-and-mul), and one token's
// linear layers. Each replaces several torch ops (and as many passes over memory) with one, or a slower library
// call; every one has a torch reference in Python.
// fp32 takes a vector path as wide as the build target's registers (16 lanes with AVX-512, 8 with AVX2, 4
// otherwise); other dtypes a scalar one.
#include <immintrin.h>
#include <torch/extension.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// One hardware register: a wider generic vector than the target has is expanded piecewise, several times slower.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#elif defined(__AVX__)
constexpr int64_t kLanes = 8;
#else
constexpr int64_t kLanes = 4;
#endif
typedef float Lanes __attribute__((vector_size(kLanes * 4)));
typedef int32_t IntLanes __attribute__((vector_size(kLanes * 4)));
// Fewer elements than this per chunk run on one thread: waking the pool costs more than the work, and on a
// busy machine a descheduled pool thread stalls the whole region.
constexpr int64_t kMinParallelElements = 1 << 18;

inline int64_t grain_rows(int64_t elements_per_row) {
  return std::max<int64_t>(1, kMinParallelElements / std::max<int64_t>(1, elements_per_row));
}

// About this many elements of work make one claim: several microseconds, next to the atomic add that takes it.
constexpr int64_t kClaimElements = 1 << 19;

// One thread's share of a parallel_claims region: claims are taken from its front, by its owner first.
struct alignas(64) ClaimCursor {
  std::atomic<int64_t> next;
  int64_t end;
};

// fn(begin, end) over [0, num_items) on the pool threads. Each thread has a contiguous share, as with a static
// split (its memory streams stay sequential), and takes it a claim at a time; a thread done with its share goes on
// with the claims left in the others'. The serving processes share the machine's cores with the model (two, on the
// CI-class VM): a thread the OS preempts then leaves the rest of its share to the others, instead of holding the
// region at its end while they spin (a static split costs the step all the time a thread loses; claims, that time
// shared out). Claims hold at least `min_per_claim` items and, where that allows, a share is eight claims or more,
// so whichever thread ends last waits at most one claim. Work below kMinParallelElements per thread stays on the
// calling thread.
template <typename Fn>
void parallel_claims(int64_t num_items, int64_t elements_per_item, int64_t min_per_claim, const Fn& fn) {
  if (num_items <= 0) {
    return;
  }
  const int64_t per_item = std::max<int64_t>(1, elements_per_item);
  const int64_t useful_threads = (num_items * per_item + kMinParallelElements - 1) / kMinParallelElements;
  const int64_t num_threads = std::min<int64_t>({at::get_num_threads(), useful_threads, num_items});
  if (num_threads <= 1 || at::in_parallel_region()) {
    fn(0, num_items);
    return;
  }
  const int64_t eighth_of_a_share = (num_items + 8 * num_threads - 1) / (8 * num_threads);
  const int64_t per_claim = std::max(min_per_claim, std::min(kClaimElements / per_item, eighth_of_a_share));
  std::unique_ptr<ClaimCursor[]> shares(new ClaimCursor[num_threads]);
  for (int64_t thread = 0; thread < num_threads; ++thread) {
    shares[thread].next.store(num_items * thread / num_threads, std::memory_order_relaxed);
    shares[thread].end = num_items * (thread + 1) / num_threads;
  }
  at::parallel_for(0, num_threads, 1, [&](int64_t first_thread, int64_t last_thread) {
    for (int64_t thread = first_thread; thread < last_thread; ++thread) {
      for (int64_t offset = 0; offset < num_threads; ++offset) {
        ClaimCursor& share = shares[(thread + offset) % num_threads];
        for (int64_t begin = share.next.fetch_add(per_claim, std::memory_order_relaxed); begin < share.end;
             begin = share.next.fetch_add(per_claim, std::memory_order_relaxed)) {
          fn(begin, std::min(share.end, begin + per_claim));
        }
      }
    }
  });
}

inline Lanes load_lanes(const float* source) {
  Lanes lanes;
  std::memcpy(&lanes, source, sizeof(lanes));
  return lanes;
}

inline void store_lanes(float* target, Lanes lanes) {
  std::memcpy(target, &lanes, sizeof(lanes));
}

// The ISA's splat, not `Lanes{} + value`: an add of +0 is no identity for -0.f, so the compiler must keep it (an
// xor, an add and a broadcast where one FMA with a broadcast memory operand would do).
inline Lanes broadcast(float value) {
#if defined(__AVX512F__)
  return _mm512_set1_ps(value);
#elif defined(__AVX__)
  return _mm256_set1_ps(value);
#elif defined(__SSE__)
  return _mm_set1_ps(value);
#else
  return Lanes{} + value;
#endif
}

// A shuffle tree, not a serial chain of lane adds (the compiler may not reorder float adds itself).
inline float sum_lanes(Lanes lanes) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(lanes);
#elif defined(__AVX__)
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
#else
  return (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
#endif
}

// exp(x) = 2^k * e^r with k = round(x / ln 2), |r| <= ln(2) / 2; e^r by its degree-6 Taylor polynomial
// (relative error below 2e-7). Inputs are clamped to the range where the result is a normal float.
inline Lanes exp_lanes(Lanes x) {
  const Lanes low = broadcast(-87.0f), high = broadcast(88.0f);
  x = x < low ? low : x;
  x = x > high ? high : x;
  const Lanes scaled = x * 1.44269504088896341f;
  const IntLanes k = __builtin_convertvector(scaled + (scaled >= 0.f ? broadcast(0.5f) : broadcast(-0.5f)), IntLanes);
  const Lanes kf = __builtin_convertvector(k, Lanes);
  const Lanes r = x - kf * 0.693145751953125f - kf * 1.428606765330187e-06f;
  Lanes p = broadcast(1.f / 720.f);
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const IntLanes bits = (k + 127) << 23;
  Lanes two_to_k;
  std::memcpy(&two_to_k, &bits, sizeof(two_to_k));
  return p * two_to_k;
}

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

constexpr int64_t kMaxHeadDim = 512;
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

// Steps through one request's cached rows of one KV head in token order, with no division per row.
struct CacheRowCursor {
  const float* cache;
  const int32_t* table;
  int64_t block_size;
  int64_t block_stride;
  int64_t token_stride;
  int64_t block;
  int64_t offset;

  const float* row() const {
    return cache + table[block] * block_stride + offset * token_stride;
  }
  void next() {
    if (++offset == block_size) {
      offset = 0;
      ++block;
    }
  }
};

// Rows a decode head asks memory for ahead of its dot products: a block's worth, into L2 (L1's few miss buffers
// held it to ~28 GB/s). A request's blocks lie anywhere in the cache, so the hardware prefetcher stops at each
// block's end; without this a head read its keys and values at ~25 GB/s on a machine that streams 41.
constexpr int64_t kPrefetchRows = 16;

// Asks L2 for one cache row of `row_bytes` (its 64-byte lines).
inline void prefetch_row(const float* row, int64_t row_bytes) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t line = 0; line < row_bytes; line += 64) {
    _mm_prefetch(bytes + line, _MM_HINT_T1);
  }
}

// The first `count` rows of a head's keys and values into L2: what the head after the current one reads first.
inline void prefetch_head_start(CacheRowCursor keys, CacheRowCursor values, int64_t count, int64_t row_bytes) {
  for (int64_t i = 0; i < count; ++i, keys.next(), values.next()) {
    prefetch_row(keys.row(), row_bytes);
    prefetch_row(values.row(), row_bytes);
  }
}

// Key rows asked of L2 one at a time, up to the last: a head's ahead of its dot products, or the next work item's
// during the current item's value pass. Default-constructed it asks for nothing.
struct KeyRowsAhead {
  CacheRowCursor cursor;
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

// One fp32 head of decode attention with head_dim = kChunks * kLanes: the query and the output accumulators
// live in registers, dot products go a tile of keys at a time. `scores` holds num_keys rounded up to a tile.
// `fetch_ahead`: the first head of its KV head's group, which reads the rows from memory (the others find them in
// cache); it asks for each key row kPrefetchRows ahead of its dot product and for each value row meanwhile.
// `next_item`: key rows to ask for during the value pass (the next group's, for a group's last head).
template <int64_t kChunks>
void attend_head_lanes(
    const float* query,
    float scale,
    CacheRowCursor keys,
    CacheRowCursor values,
    int64_t num_keys,
    float* scores,
    float* output,
    bool fetch_ahead,
    KeyRowsAhead next_item) {
  Lanes scaled_query[kChunks];
  for (int64_t c = 0; c < kChunks; ++c) {
    scaled_query[c] = load_lanes(query + c * kLanes) * scale;
  }
  constexpr int64_t kRowBytes = kChunks * kLanes * sizeof(float);
  KeyRowsAhead keys_ahead{keys, kRowBytes, num_keys};
  CacheRowCursor values_ahead = values;
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
      const float* row = keys.row();
      Lanes dot = scaled_query[0] * load_lanes(row);
      for (int64_t c = 1; c < kChunks; ++c) {
        dot += scaled_query[c] * load_lanes(row + c * kLanes);
      }
      partials[i] = dot;
    }
    sum_each_lanes(partials, scores + key);
    for (int64_t i = 0; i < count; ++i) {
      max_score = std::max(max_score, scores[key + i]);
    }
  }
  const float inverse_sum = 1.f / exp_and_sum(scores, num_keys, max_score);
  // Two sets of accumulators when they fit in registers: one FMA chain per set would wait on its latency.
  constexpr int64_t kStreams = kChunks <= 4 ? 2 : 1;
  Lanes accumulators[kStreams][kChunks] = {};
  int64_t key = 0;
  for (; key + kStreams <= num_keys; key += kStreams) {
    for (int64_t stream = 0; stream < kStreams; ++stream, values.next()) {
      next_item.ask_for_next();
      const float* row = values.row();
      const Lanes weight = broadcast(scores[key + stream]);
      for (int64_t c = 0; c < kChunks; ++c) {
        accumulators[stream][c] += weight * load_lanes(row + c * kLanes);
      }
    }
  }
  for (; key < num_keys; ++key, values.next()) {
    next_item.ask_for_next();
    const float* row = values.row();
    const Lanes weight = broadcast(scores[key]);
    for (int64_t c = 0; c < kChunks; ++c) {
      accumulators[0][c] += weight * load_lanes(row + c * kLanes);
    }
  }
  for (int64_t c = 0; c < kChunks; ++c) {
    Lanes total = accumulators[0][c];
    for (int64_t stream = 1; stream < kStreams; ++stream) {
      total += accumulators[stream][c];
    }
    store_lanes(output + c * kLanes, total * inverse_sum);
  }
}

using AttendHeadLanes = void (*)(const float*, float, CacheRowCursor, CacheRowCursor, int64_t, float*, float*, bool,
                                 KeyRowsAhead);

// The register-resident fp32 path for this head_dim, or nullptr (the general loop runs instead).
inline AttendHeadLanes attend_head_lanes_for(int64_t head_dim) {
  if (head_dim % kLanes != 0) {
    return nullptr;
  }
  switch (head_dim / kLanes) {
    case 4:
      return attend_head_lanes<4>;
    case 8:
      return attend_head_lanes<8>;
    case 16:
      return attend_head_lanes<16>;
    default:
      return nullptr;
  }
}

// The `kGroup` query heads that share one KV head, in one pass over its rows: a tile of key rows comes from memory
// for the first head and from L1 for the others, each value row is loaded once for all of them (one head per work
// item reread the rows from L2 per head; 30 layers of one request's 1000 keys took 2.4-2.6 ms against 1.75 now,
// 64 requests x 80 keys 9.1-9.3 against 8.7-9.1). Per head, the same arithmetic in the same order as
// attend_head_lanes (bit for bit the same output). `scores` holds kGroup rows of num_keys rounded up to a tile;
// query and output are the group's heads, contiguous. Asks for each key row kPrefetchRows ahead and each value row
// meanwhile, and for `next_item`'s key rows during the value pass.
template <int64_t kChunks, int64_t kGroup>
void attend_group_lanes(const float* query, float scale, CacheRowCursor keys, CacheRowCursor values,
                        int64_t num_keys, float* scores, float* output, KeyRowsAhead next_item) {
  constexpr int64_t kHeadDim = kChunks * kLanes;
  Lanes scaled_query[kGroup][kChunks];
  for (int64_t h = 0; h < kGroup; ++h) {
    for (int64_t c = 0; c < kChunks; ++c) {
      scaled_query[h][c] = load_lanes(query + h * kHeadDim + c * kLanes) * scale;
    }
  }
  const int64_t score_stride = num_keys + kKeyTile;
  constexpr int64_t kRowBytes = kHeadDim * sizeof(float);
  KeyRowsAhead keys_ahead{keys, kRowBytes, num_keys};
  CacheRowCursor values_ahead = values;
  for (int64_t i = 0; i < kPrefetchRows; ++i) {
    keys_ahead.ask_for_next();
  }
  float max_score[kGroup];
  std::fill(max_score, max_score + kGroup, -std::numeric_limits<float>::infinity());
  for (int64_t key = 0; key < num_keys; key += kKeyTile) {
    const int64_t count = std::min(kKeyTile, num_keys - key);
    for (int64_t i = 0; i < count; ++i, values_ahead.next()) {
      keys_ahead.ask_for_next();
      prefetch_row(values_ahead.row(), kRowBytes);
    }
    // The tile's rows come from memory for the first head and from L1 for the others.
    const float* rows[kKeyTile];
    for (int64_t i = 0; i < count; ++i, keys.next()) {
      rows[i] = keys.row();
    }
    for (int64_t h = 0; h < kGroup; ++h) {
      Lanes partials[kKeyTile] = {};
      for (int64_t i = 0; i < count; ++i) {
        Lanes dot = scaled_query[h][0] * load_lanes(rows[i]);
        for (int64_t c = 1; c < kChunks; ++c) {
          dot += scaled_query[h][c] * load_lanes(rows[i] + c * kLanes);
        }
        partials[i] = dot;
      }
      float* head_scores = scores + h * score_stride;
      sum_each_lanes(partials, head_scores + key);
      for (int64_t i = 0; i < count; ++i) {
        max_score[h] = std::max(max_score[h], head_scores[key + i]);
      }
    }
  }
  float inverse_sum[kGroup];
  for (int64_t h = 0; h < kGroup; ++h) {
    inverse_sum[h] = 1.f / exp_and_sum(scores + h * score_stride, num_keys, max_score[h]);
  }
  constexpr int64_t kStreams = kChunks <= 4 ? 2 : 1;
  Lanes accumulators[kGroup][kStreams][kChunks] = {};
  int64_t key = 0;
  for (; key + kStreams <= num_keys; key += kStreams) {
    for (int64_t stream = 0; stream < kStreams; ++stream, values.next()) {
      next_item.ask_for_next();
      const float* row = values.row();
      for (int64_t c = 0; c < kChunks; ++c) {
        const Lanes chunk = load_lanes(row + c * kLanes);
        for (int64_t h = 0; h < kGroup; ++h) {
          accumulators[h][stream][c] += broadcast(scores[h * score_stride + key + stream]) * chunk;
        }
      }
    }
  }
  for (; key < num_keys; ++key, values.next()) {
    next_item.ask_for_next();
    const float* row = values.row();
    for (int64_t c = 0; c < kChunks; ++c) {
      const Lanes chunk = load_lanes(row + c * kLanes);
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
      store_lanes(output + h * kHeadDim + c * kLanes, total * inverse_sum[h]);
    }
  }
}

using AttendGroupLanes = void (*)(const float*, float, CacheRowCursor, CacheRowCursor, int64_t, float*, float*,
                                  KeyRowsAhead);

template <int64_t kChunks>
inline AttendGroupLanes attend_group_lanes_of(int64_t group) {
  switch (group) {
    case 1:
      return attend_group_lanes<kChunks, 1>;
    case 2:
      return attend_group_lanes<kChunks, 2>;
    case 3:
      return attend_group_lanes<kChunks, 3>;
    case 4:
      return attend_group_lanes<kChunks, 4>;
    default:
      return nullptr;
  }
}

// The one-pass fp32 path for this head_dim and group size, or nullptr: query heads and accumulators of the whole
// group must fit the registers (kChunks * group up to 16 vectors).
inline AttendGroupLanes attend_group_lanes_for(int64_t head_dim, int64_t group) {
  if (head_dim % kLanes != 0) {
    return nullptr;
  }
  switch (head_dim / kLanes) {
    case 4:
      return attend_group_lanes_of<4>(group);
    case 8:
      return group <= 2 ? attend_group_lanes_of<8>(group) : nullptr;
    case 16:
      return group == 1 ? attend_group_lanes_of<16>(group) : nullptr;
    default:
      return nullptr;
  }
}

// Where a paged KV cache keeps each request's token rows: key and value caches [blocks, block_size, kv_heads,
// head_dim] with the same strides, and block_tables [requests, max_blocks].
template <typename scalar_t>
struct PagedCache {
  const scalar_t* keys;
  const scalar_t* values;
  const int32_t* block_tables;
  int64_t max_blocks;
  int64_t block_size;
  int64_t block_stride;
  int64_t token_stride;
};

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
    int64_t sliding_window) {
  const int64_t group = num_heads / num_kv_heads;
  // Items rather than requests, so one long request still spreads over the threads: (request, KV head) on the
  // query-group path, else (request, head) with a request's heads next to each other (the keys and values come
  // from memory for a group's first head and from L2 for the others).
  const int64_t work_per_head = cache.max_blocks * cache.block_size * head_dim * 2;
  // A request's first key in attention: the window's start, or its first token.
  const auto first_key = [sliding_window](int64_t seq_len) {
    return sliding_window > 0 ? std::max<int64_t>(0, seq_len - sliding_window) : 0;
  };
  // Request `seq`'s rows of one KV head in `base` (the fp32 key or value cache), from key `first` on.
  const auto kv_rows = [&](int64_t seq, int64_t kv_head, int64_t first, const auto* base) {
    return CacheRowCursor{base + kv_head * head_dim,
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
                        head_dim * static_cast<int64_t>(sizeof(float)));
  };
  // The key rows of request `seq`'s KV head `kv_head`, for the item before it to ask for during its value pass
  // (its own rows come from L2 by then), so memory stays busy in both passes. Bit for bit the same output. 30
  // layers of 64 requests x 96 keys (SmolLM2's heads): 8.9-9.1 ms against 10.1-10.2 without; 32 requests x 200 keys
  // with head_dim 128, group 4 (the per-head path): 61.7-62.9 against 63.7-64.5.
  const auto next_item_rows = [&](int64_t seq, int64_t kv_head, const auto* keys) {
    const int64_t seq_first = first_key(seq_lens[seq]);
    return KeyRowsAhead{kv_rows(seq, kv_head, seq_first, keys), head_dim * static_cast<int64_t>(sizeof(float)),
                        seq_lens[seq] - seq_first};
  };
  AttendHeadLanes attend_lanes = nullptr;
  if constexpr (std::is_same_v<scalar_t, float>) {
    attend_lanes = attend_head_lanes_for(head_dim);
    if (const AttendGroupLanes attend_group = attend_group_lanes_for(head_dim, group); attend_group != nullptr) {
      // One work item per (request, KV head): its group of query heads in one pass over the rows.
      parallel_claims(num_seqs * num_kv_heads, work_per_head * group, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores;
        for (int64_t item = begin; item < end; ++item) {
          const int64_t seq = item / num_kv_heads;
          const int64_t kv_head = item % num_kv_heads;
          const int64_t first = first_key(seq_lens[seq]);
          const int64_t num_keys = seq_lens[seq] - first;
          scores.resize(group * (num_keys + kKeyTile));
          KeyRowsAhead next_item{};
          if (item + 1 < end) {
            prefetch_start_of((item + 1) / num_kv_heads, (item + 1) % num_kv_heads, cache.keys, cache.values);
            next_item = next_item_rows((item + 1) / num_kv_heads, (item + 1) % num_kv_heads, cache.keys);
          }
          const int64_t first_head = kv_head * group;
          attend_group(query + seq * query_stride + first_head * head_dim, scale,
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
      if constexpr (std::is_same_v<scalar_t, float>) {
        if (attend_lanes != nullptr) {
          const CacheRowCursor keys = kv_rows(seq, head / group, first, cache.keys);
          const CacheRowCursor values = kv_rows(seq, head / group, first, cache.values);
          const bool group_leader = head % group == 0;
          if (group_leader && item + group < end) {
            // The next group's first rows come in while this group's heads compute.
            const int64_t next = item + group;
            prefetch_start_of(next / num_heads, (next % num_heads) / group, cache.keys, cache.values);
          }
          // The group's last head reads the rows from L2: memory meanwhile brings the next group's keys.
          KeyRowsAhead next_item{};
          if (head % group == group - 1 && item + 1 < end) {
            next_item = next_item_rows((item + 1) / num_heads, ((item + 1) % num_heads) / group, cache.keys);
          }
          attend_lanes(head_query, scale, keys, values, num_keys, scores.data(),
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

// Query tokens per prefill work item: with GQA their query heads make group * kPrefillTile rows that share every
// key and value row read (the decode kernel reads a request's keys once per query head).
constexpr int64_t kPrefillTile = 16;
// Query rows scored and accumulated together: each key or value vector is loaded once for all of them.
constexpr int64_t kRowBlock = 4;

inline float max_lanes(Lanes lanes) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(lanes);
#else
  float max = lanes[0];
  for (int64_t i = 1; i < kLanes; ++i) {
    max = std::max(max, lanes[i]);
  }
  return max;
#endif
}

// Prefill chunks (fp32, head_dim a multiple of kLanes) over the paged cache, their own new keys included (written
// first): flash-style, a tile of kLanes keys at a time with an online softmax, so no score matrix, gathered copy
// of the cache or mask tensor is ever built. One work item per (request, tile of query tokens, KV head).
void prefill_attention_kernel(
    const float* query,
    const PagedCache<float>& cache,
    float* output,
    const int32_t* query_starts,
    const int32_t* seq_lens,
    int64_t num_seqs,
    int64_t num_heads,
    int64_t num_kv_heads,
    int64_t head_dim,
    int64_t query_stride,
    int64_t output_stride,
    float scale,
    int64_t sliding_window) {
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
    const float* value_rows[kLanes];
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
        query_rows[row] = query + token * query_stride + (kv_head * group + row % group) * head_dim;
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
#if defined(__AVX512F__)
        // One gather per dimension transposes the tile: kLanes rows, each in its own cache block.
        const __m512i gather_offsets = _mm512_load_si512(row_offsets);
        for (int64_t d = 0; d < head_dim; ++d) {
          _mm512_storeu_ps(keys_t.data() + d * kLanes, _mm512_i32gather_ps(gather_offsets, cache.keys + d, 4));
        }
#else
        for (int64_t i = 0; i < kLanes; ++i) {
          const float* key_row = cache.keys + row_offsets[i];
          for (int64_t d = 0; d < head_dim; ++d) {
            keys_t[d * kLanes + i] = key_row[d];
          }
        }
#endif
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
            const Lanes masked = valid ? scores[b] * scale : minus_infinity;
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
              const Lanes value = load_lanes(value_rows[i] + d);
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
        float* out = output + token * output_stride + (kv_head * group + row % group) * head_dim;
        const float* accumulator = accumulators.data() + row * head_dim;
        const Lanes inverse_sum = broadcast(1.f / row_sum[row]);
        for (int64_t d = 0; d < head_dim; d += kLanes) {
          store_lanes(out + d, load_lanes(accumulator + d) * inverse_sum);
        }
      }
    }
  });
}

template <typename scalar_t>
inline void silu_and_mul_row(scalar_t* out, const scalar_t* gate, const scalar_t* up, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const float g = static_cast<float>(gate[i]);
    out[i] = static_cast<scalar_t>(g / (1.f + std::exp(-g)) * static_cast<float>(up[i]));
  }
}

template <>
inline void silu_and_mul_row<float>(float* out, const float* gate, const float* up, int64_t count) {
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    const Lanes g = load_lanes(gate + i);
    store_lanes(out + i, g / (1.f + exp_lanes(-g)) * load_lanes(up + i));
  }
  for (; i < count; ++i) {
    out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
  }
}

// The fp32 row of fused_add_rms_norm in vector lanes; false (nothing done) for other dtypes and widths.
template <typename scalar_t>
inline bool add_rms_norm_row_lanes(scalar_t*, scalar_t*, const scalar_t*, int64_t, float) {
  return false;
}

template <>
inline bool add_rms_norm_row_lanes<float>(
    float* x, float* residual, const float* weight, int64_t hidden, float eps) {
  if (hidden % kLanes != 0) {
    return false;
  }
  Lanes squares = {};
  for (int64_t i = 0; i < hidden; i += kLanes) {
    const Lanes sum = load_lanes(x + i) + load_lanes(residual + i);
    store_lanes(residual + i, sum);
    squares += sum * sum;
  }
  const float inverse_rms = 1.f / std::sqrt(sum_lanes(squares) / hidden + eps);
  for (int64_t i = 0; i < hidden; i += kLanes) {
    store_lanes(x + i, load_lanes(weight + i) * (load_lanes(residual + i) * inverse_rms));
  }
  return true;
}

// y = x W^T for fp32 tokens, register-blocked: kBlockRows weight rows x kBlockTokens tokens of dot products in
// registers, so each load of a weight vector feeds kBlockTokens FMAs and each load of x feeds kBlockRows. A group
// of weight rows streams from memory once (the next group is prefetched while this one computes) and is reread
// from L1 for the step's later tokens; oneDNN's GEMM stalls on that stream when the weight is not in cache.
constexpr int64_t kBlockRows = 4;
#if defined(__AVX512F__)
constexpr int64_t kBlockTokens = 6;  // 24 sums + 4 weight vectors + x: 29 of 32 registers
#else
constexpr int64_t kBlockTokens = 2;  // 16 registers: 8 sums + 4 weight vectors + x
#endif

// target[0..3] = the lane sums of a, b, c and d.
inline void store_four_sums(float* target, Lanes a, Lanes b, Lanes c, Lanes d) {
#if defined(__AVX512F__)
  // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3], then [a, b, c, d] partial sums; then the four lanes added.
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
  const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), upper);
  _mm_storeu_ps(target, _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
#elif defined(__AVX__)
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  _mm_storeu_ps(target, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
#else
  target[0] = sum_lanes(a);
  target[1] = sum_lanes(b);
  target[2] = sum_lanes(c);
  target[3] = sum_lanes(d);
#endif
}

// kTokens tokens x kBlockRows rows over the vector part of the columns, asking L2 for the `num_prefetch` rows at
// `prefetch` meanwhile (the next group's, so its stream from memory overlaps this group's arithmetic).
template <int64_t kTokens>
inline void dot_block(const float* x, int64_t x_stride, const float* w, int64_t row_stride, int64_t vector_columns,
                      float* out, int64_t out_stride, const float* const* prefetch, int64_t num_prefetch) {
  Lanes sums[kTokens][kBlockRows] = {};
  for (int64_t i = 0; i < vector_columns; i += kLanes) {
    Lanes rows[kBlockRows];
#pragma GCC unroll 4
    for (int64_t r = 0; r < kBlockRows; ++r) {
      rows[r] = load_lanes(w + r * row_stride + i);
    }
    for (int64_t p = 0; p < num_prefetch; ++p) {
      _mm_prefetch(reinterpret_cast<const char*>(prefetch[p] + i), _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int64_t t = 0; t < kTokens; ++t) {
      Lanes xs = load_lanes(x + t * x_stride + i);
      // One load of x for the block's four rows: left to itself GCC folds it into each FMA as a memory operand (28
      // loads per 24 FMAs), which a core with one 512-bit load a cycle (Zen 4) cannot feed.
      asm("" : "+v"(xs));
#pragma GCC unroll 4
      for (int64_t r = 0; r < kBlockRows; ++r) {
        sums[t][r] += rows[r] * xs;
      }
    }
  }
#pragma GCC unroll 8
  for (int64_t t = 0; t < kTokens; ++t) {
    store_four_sums(out + t * out_stride, sums[t][0], sums[t][1], sums[t][2], sums[t][3]);
  }
}

using DotBlock = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t, const float* const*,
                         int64_t);

template <int64_t... kCounts>
constexpr std::array<DotBlock, sizeof...(kCounts)> dot_blocks_by_count(std::integer_sequence<int64_t, kCounts...>) {
  return {&dot_block<kCounts + 1>...};
}

// dot_block for 1 .. kBlockTokens tokens: a block of the last, shorter run of tokens takes its own count.
constexpr auto kDotBlocks = dot_blocks_by_count(std::make_integer_sequence<int64_t, kBlockTokens>{});

// All tokens against the kBlockRows weight rows at w, in blocks of kBlockTokens. `next` (or null): the next
// group's first row; its rows are prefetched one block after another, spread over the group's whole run.
inline void dot_row_group(const float* x, int64_t x_stride, int64_t num_tokens, const float* w, int64_t row_stride,
                          int64_t vector_columns, float* out, int64_t out_stride, const float* next) {
  const int64_t num_blocks = (num_tokens + kBlockTokens - 1) / kBlockTokens;
  for (int64_t block = 0; block < num_blocks; ++block) {
    const float* prefetch[kBlockRows];
    int64_t num_prefetch = 0;
    for (int64_t r = block; next != nullptr && r < kBlockRows; r += num_blocks) {
      prefetch[num_prefetch++] = next + r * row_stride;
    }
    const int64_t token = block * kBlockTokens;
    const float* block_x = x + token * x_stride;
    float* block_out = out + token * out_stride;
    kDotBlocks[std::min(kBlockTokens, num_tokens - token) - 1](block_x, x_stride, w, row_stride, vector_columns,
                                                                block_out, out_stride, prefetch, num_prefetch);
  }
}

// Row groups a claim holds at least: the next group's prefetch works within a claim.
constexpr int64_t kClaimGroupsMin = 4;

void linear_tokens_kernel(const float* x, int64_t x_stride, int64_t num_tokens, const float* weight,
                          int64_t row_stride, float* out, int64_t out_stride, int64_t rows, int64_t columns) {
  const int64_t vector_columns = columns - columns % kLanes;
  const int64_t num_groups = (rows + kBlockRows - 1) / kBlockRows;
  const int64_t full_groups = rows / kBlockRows;
  // Columns past the last full vector, and rows past the last full group, one scalar dot product each.
  const auto scalar_dots = [&](int64_t first_row, int64_t last_row, int64_t first_column, bool accumulate) {
    for (int64_t token = 0; token < num_tokens; ++token) {
      const float* token_x = x + token * x_stride;
      for (int64_t r = first_row; r < last_row; ++r) {
        const float* row = weight + r * row_stride;
        float total = accumulate ? out[token * out_stride + r] : 0.f;
        for (int64_t i = first_column; i < columns; ++i) {
          total += row[i] * token_x[i];
        }
        out[token * out_stride + r] = total;
      }
    }
  };
  parallel_claims(num_groups, kBlockRows * columns * num_tokens, kClaimGroupsMin, [&](int64_t begin, int64_t end) {
    for (int64_t group = begin; group < end; ++group) {
      const int64_t first = group * kBlockRows;
      if (group >= full_groups) {
        scalar_dots(first, rows, 0, false);
        continue;
      }
      const float* w = weight + first * row_stride;
      // Past the claim too: the next group is most often this thread's next claim (its share is contiguous).
      const float* next = group + 1 < full_groups ? w + kBlockRows * row_stride : nullptr;
      dot_row_group(x, x_stride, num_tokens, w, row_stride, vector_columns, out + first, out_stride, next);
      if (vector_columns < columns) {
        scalar_dots(first, first + kBlockRows, vector_columns, true);
      }
    }
  });
}

// y = x W^T for fp32 tokens on a panel-packed weight: panels of kPanelWidth output rows, each stored column by
// column ([panels, columns, kPanelWidth], zero past the last row), so a microkernel keeps a tile of kPanelTokens
// tokens x kPanelWidth outputs in registers and, per column, loads the panel's kPanelWidth weights once (an
// outer product: each weight feeds kPanelTokens FMAs, each broadcast x value kPanelWidth / kLanes). A panel streams
// from memory once and is reread from L2 for the tiles after the first; the next panel is asked for meanwhile,
// spread evenly over the panel's tiles. The dot-product kernel above (linear_tokens_kernel) keeps a horizontal sum
// per output and rereads x per group of four rows; this one beats it and oneDNN's packed GEMM at every row count
// measured on Zen 5 (1 to 512 tokens).
#if defined(__AVX512F__)
constexpr int64_t kPanelVectors = 3;  // 8 tokens x 3 vectors: 24 sums + 3 weight vectors + a broadcast
constexpr int64_t kPanelTokens = 8;
#else
constexpr int64_t kPanelVectors = 2;  // 16 registers: 6 tokens x 2 vectors, 12 sums + 2 weight vectors + a broadcast
constexpr int64_t kPanelTokens = 6;
#endif
constexpr int64_t kPanelWidth = kPanelVectors * kLanes;
constexpr int64_t kCacheLine = 64;

// Cache lines of one panel column: what a tile asks for per column at most.
constexpr int64_t kPanelColumnLines = (kPanelWidth * int64_t{sizeof(float)} + kCacheLine - 1) / kCacheLine;

// Where and how fast a tile asks for the next panel: at column c, kPanelColumnLines lines from `start` plus
// (c * bytes_per_column_fp) >> 16 bytes.
struct PanelPrefetch {
  const char* start;
  int64_t bytes_per_column_fp;
};

template <int64_t kTokens>
void panel_tile(const float* x, int64_t x_stride, const float* panel, int64_t columns, float* out, int64_t out_stride,
                int64_t valid_width, PanelPrefetch prefetch) {
  Lanes sums[kTokens][kPanelVectors] = {};
  for (int64_t column = 0; column < columns; ++column) {
    const float* weights = panel + column * kPanelWidth;
    Lanes w[kPanelVectors];
#pragma GCC unroll 4
    for (int64_t v = 0; v < kPanelVectors; ++v) {
      w[v] = load_lanes(weights + v * kLanes);
    }
    const char* line = prefetch.start + ((column * prefetch.bytes_per_column_fp) >> 16);
#pragma GCC unroll 4
    for (int64_t i = 0; i < kPanelColumnLines; ++i) {
      _mm_prefetch(line + i * kCacheLine, _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int64_t t = 0; t < kTokens; ++t) {
      const Lanes xs = broadcast(x[t * x_stride + column]);
#pragma GCC unroll 4
      for (int64_t v = 0; v < kPanelVectors; ++v) {
        sums[t][v] += xs * w[v];
      }
    }
  }
  if (valid_width == kPanelWidth) {
#pragma GCC unroll 8
    for (int64_t t = 0; t < kTokens; ++t) {
#pragma GCC unroll 4
      for (int64_t v = 0; v < kPanelVectors; ++v) {
        store_lanes(out + t * out_stride + v * kLanes, sums[t][v]);
      }
    }
    return;
  }
  // The last panel of a weight whose rows are not a multiple of kPanelWidth: only its real outputs.
  for (int64_t t = 0; t < kTokens; ++t) {
    float row[kPanelWidth];
    for (int64_t v = 0; v < kPanelVectors; ++v) {
      store_lanes(row + v * kLanes, sums[t][v]);
    }
    std::memcpy(out + t * out_stride, row, valid_width * sizeof(float));
  }
}

using PanelTile = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, PanelPrefetch);

template <int64_t... kCounts>
constexpr std::array<PanelTile, sizeof...(kCounts)> panel_tiles_by_count(std::integer_sequence<int64_t, kCounts...>) {
  return {&panel_tile<kCounts + 1>...};
}

// panel_tile for 1 .. kPanelTokens tokens: the last, shorter tile of a step's tokens takes its own count.
constexpr auto kPanelTiles = panel_tiles_by_count(std::make_integer_sequence<int64_t, kPanelTokens>{});

int64_t num_panels(int64_t rows) {
  return (rows + kPanelWidth - 1) / kPanelWidth;
}

// Panels a claim holds at least: the next panel's prefetch works within a claim.
constexpr int64_t kClaimPanelsMin = 2;

void panel_linear_kernel(const float* x, int64_t x_stride, int64_t num_tokens, const float* packed, int64_t rows,
                         int64_t columns, float* out, int64_t out_stride) {
  if (num_tokens == 0) {
    return;  // a step whose rows all skip this projection (nothing to sample)
  }
  const int64_t panels = num_panels(rows);
  const int64_t panel_floats = columns * kPanelWidth;
  const int64_t num_tiles = (num_tokens + kPanelTokens - 1) / kPanelTokens;
  // Each tile asks for an equal part of the next panel, spread over its columns.
  const int64_t bytes_per_tile = (panel_floats * int64_t{sizeof(float)} + num_tiles - 1) / num_tiles;
  const int64_t bytes_per_column_fp = (bytes_per_tile << 16) / std::max<int64_t>(1, columns);
  parallel_claims(panels, panel_floats * num_tokens, kClaimPanelsMin, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = packed + p * panel_floats;
      // Past the claim too: the next panel is most often this thread's next claim (its share is contiguous). The
      // last panel asks for its own lines again (a prefetch costs less than a branch per column).
      const char* next = reinterpret_cast<const char*>(p + 1 < panels ? panel + panel_floats : panel);
      const int64_t valid_width = std::min(kPanelWidth, rows - p * kPanelWidth);
      for (int64_t tile = 0; tile < num_tiles; ++tile) {
        const int64_t token = tile * kPanelTokens;
        const PanelPrefetch prefetch{next + tile * bytes_per_tile, bytes_per_column_fp};
        kPanelTiles[std::min(kPanelTokens, num_tokens - token) - 1](x + token * x_stride, x_stride, panel, columns,
                                                                    out + token * out_stride + p * kPanelWidth,
                                                                    out_stride, valid_width, prefetch);
      }
    }
  });
}

// In place: residual += x; x = weight * residual / rms(residual), for one row of `hidden` values.
template <typename scalar_t>
void add_rms_norm_row(scalar_t* x, scalar_t* residual, const scalar_t* weight, int64_t hidden, float eps) {
  if (add_rms_norm_row_lanes(x, residual, weight, hidden, eps)) {
    return;
  }
  float squares = 0.f;
  for (int64_t i = 0; i < hidden; ++i) {
    const float sum = static_cast<float>(x[i]) + static_cast<float>(residual[i]);
    residual[i] = static_cast<scalar_t>(sum);
    const float stored = static_cast<float>(residual[i]);
    squares += stored * stored;
  }
  const float inverse_rms = 1.f / std::sqrt(squares / hidden + eps);
  for (int64_t i = 0; i < hidden; ++i) {
    const scalar_t normed = static_cast<scalar_t>(static_cast<float>(residual[i]) * inverse_rms);
    x[i] = static_cast<scalar_t>(static_cast<float>(weight[i]) * static_cast<float>(normed));
  }
}

// One token's `num_heads` heads, `head_stride` apart, rotated in place (NeoX halves) by fp32 cos/sin rows.
template <typename scalar_t>
void rotate_heads(scalar_t* heads, int64_t num_heads, int64_t head_stride, int64_t half, const float* cos_row,
                  const float* sin_row) {
  for (int64_t head = 0; head < num_heads; ++head) {
    scalar_t* first = heads + head * head_stride;
    scalar_t* second = first + half;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = static_cast<float>(first[i]);
      const float x2 = static_cast<float>(second[i]);
      first[i] = static_cast<scalar_t>(x1 * cos_row[i] - x2 * sin_row[i]);
      second[i] = static_cast<scalar_t>(x2 * cos_row[i] + x1 * sin_row[i]);
    }
  }
}

void check_rows(const torch::Tensor& tensor, const char* name) {
  TORCH_CHECK(tensor.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(tensor.stride(-1) == 1, name, " must have contiguous rows");
}

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

// query [seqs, heads, head_dim] -> output [seqs, heads, head_dim]; caches [blocks, block_size, kv_heads, head_dim];
// block_tables [seqs, max_blocks] int32; seq_lens [seqs] int32 (>= 1); sliding_window <= 0 means none.
void paged_decode_attention(
    torch::Tensor& output,
    const torch::Tensor& query,
    const torch::Tensor& key_cache,
    const torch::Tensor& value_cache,
    const torch::Tensor& block_tables,
    const torch::Tensor& seq_lens,
    double scale,
    int64_t sliding_window) {
  check_paged_attention_inputs(output, query, key_cache, value_cache, block_tables, seq_lens);
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
        sliding_window);
  });
}

// Prefill chunks over the paged cache, fp32 with head_dim a multiple of vector_lanes. query and output
// [tokens, heads, head_dim]: the chunks' tokens, request i's at rows query_starts[i] .. query_starts[i + 1];
// block_tables [seqs, max_blocks] int32; seq_lens [seqs] int32: cached keys plus the chunk's own, whose keys and
// values must be in the cache already (reshape_and_cache first).
void paged_prefill_attention(
    torch::Tensor& output,
    const torch::Tensor& query,
    const torch::Tensor& key_cache,
    const torch::Tensor& value_cache,
    const torch::Tensor& block_tables,
    const torch::Tensor& query_starts,
    const torch::Tensor& seq_lens,
    double scale,
    int64_t sliding_window) {
  check_paged_attention_inputs(output, query, key_cache, value_cache, block_tables, seq_lens);
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && output.scalar_type() == torch::kFloat32, "fp32 only");
  TORCH_CHECK(query.size(2) % kLanes == 0, "head_dim must be a multiple of ", kLanes);
  // Row offsets within a cache are 32-bit (one gather transposes a tile of keys).
  TORCH_CHECK(key_cache.size(0) * key_cache.stride(0) <= std::numeric_limits<int32_t>::max(), "cache above 2^31 floats");
  TORCH_CHECK(query_starts.scalar_type() == torch::kInt32 && query_starts.is_contiguous(), "query_starts int32");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(block_tables.size(0) == num_seqs && query_starts.size(0) == num_seqs + 1, "one table per request");
  const int32_t* starts = query_starts.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == query.size(0), "query_starts must cover the query rows");
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t query_len = starts[seq + 1] - starts[seq];
    TORCH_CHECK(query_len >= 1 && query_len <= lens[seq], "each request needs 1 .. seq_len query tokens");
    TORCH_CHECK(lens[seq] <= block_tables.size(1) * key_cache.size(1), "a block table is too short");
  }
  prefill_attention_kernel(
      query.data_ptr<float>(),
      paged_cache<float>(key_cache, value_cache, block_tables),
      output.data_ptr<float>(),
      starts,
      lens,
      num_seqs,
      query.size(1),
      key_cache.size(2),
      query.size(2),
      query.stride(0),
      output.stride(0),
      static_cast<float>(scale),
      sliding_window);
}

// key/value [tokens, kv_heads, head_dim] into caches [blocks, block_size, kv_heads, head_dim] at flat slots;
// slot -1 (a padding row) is skipped.
void reshape_and_cache(
    const torch::Tensor& key,
    const torch::Tensor& value,
    torch::Tensor& key_cache,
    torch::Tensor& value_cache,
    const torch::Tensor& slot_mapping) {
  check_rows(key, "key");
  check_rows(value, "value");
  TORCH_CHECK(key.stride(1) == key.size(2) && value.stride(1) == value.size(2), "kv heads must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() || key_cache.stride(1) == key.size(1) * key.size(2), "cache layout");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous(), "slot_mapping int64");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type(), "key and cache dtypes differ");
  const int64_t num_tokens = key.size(0);
  const int64_t row = key.size(1) * key.size(2);
  const int64_t token_stride = key_cache.stride(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "reshape_and_cache", [&] {
    const scalar_t* key_data = key.data_ptr<scalar_t>();
    const scalar_t* value_data = value.data_ptr<scalar_t>();
    scalar_t* key_cache_data = key_cache.data_ptr<scalar_t>();
    scalar_t* value_cache_data = value_cache.data_ptr<scalar_t>();
    for (int64_t token = 0; token < num_tokens; ++token) {
      const int64_t slot = slots[token];
      if (slot < 0) {
        continue;
      }
      TORCH_CHECK(slot < num_slots, "slot ", slot, " is outside the cache");
      std::memcpy(key_cache_data + slot * token_stride, key_data + token * key.stride(0), row * sizeof(scalar_t));
      std::memcpy(
          value_cache_data + slot * token_stride, value_data + token * value.stride(0), row * sizeof(scalar_t));
    }
  });
}

// In place: residual += x; x = weight * residual / rms(residual). Rows of `hidden` floats, fp32 math.
void fused_add_rms_norm(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes(), "x and residual must be [tokens, hidden]");
  TORCH_CHECK(weight.is_contiguous() && weight.size(0) == x.size(1), "weight must be [hidden]");
  const int64_t hidden = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm", [&] {
    scalar_t* x_data = x.data_ptr<scalar_t>();
    scalar_t* residual_data = residual.data_ptr<scalar_t>();
    const scalar_t* weight_data = weight.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), grain_rows(hidden * 2), [&](int64_t begin, int64_t end) {
      for (int64_t token = begin; token < end; ++token) {
        scalar_t* x_row = x_data + token * x.stride(0);
        scalar_t* residual_row = residual_data + token * residual.stride(0);
        add_rms_norm_row(x_row, residual_row, weight_data, hidden, static_cast<float>(eps));
      }
    });
  });
}

// query [tokens, heads, head_dim], key [tokens, kv_heads, head_dim], rotated in place (NeoX halves) by
// cos/sin [tokens, ..., head_dim / 2] fp32 rows.
void rotary_embedding(torch::Tensor& query, torch::Tensor& key, const torch::Tensor& cos, const torch::Tensor& sin) {
  check_rows(query, "query");
  check_rows(key, "key");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32, "cos/sin fp32");
  TORCH_CHECK(cos.stride(-1) == 1 && sin.stride(-1) == 1 && cos.strides() == sin.strides(), "cos/sin rows");
  const int64_t num_tokens = query.size(0);
  const int64_t head_dim = query.size(2);
  const int64_t half = head_dim / 2;
  TORCH_CHECK(cos.size(0) == num_tokens && cos.size(-1) == half, "cos/sin must be [tokens, head_dim / 2]");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "rotary_embedding", [&] {
    const int64_t per_token = (query.size(1) + key.size(1)) * head_dim;
    at::parallel_for(0, num_tokens, grain_rows(per_token), [&](int64_t begin, int64_t end) {
      for (int64_t token = begin; token < end; ++token) {
        const float* cos_row = cos.data_ptr<float>() + token * cos.stride(0);
        const float* sin_row = sin.data_ptr<float>() + token * sin.stride(0);
        for (torch::Tensor* tensor : {&query, &key}) {
          rotate_heads(
              tensor->data_ptr<scalar_t>() + token * tensor->stride(0), tensor->size(1), tensor->stride(1), half,
              cos_row, sin_row);
        }
      }
    });
  });
}

// out [tokens, inter] = silu(x[:, :inter]) * x[:, inter:], x [tokens, 2 * inter].
void silu_and_mul(torch::Tensor& out, const torch::Tensor& x) {
  check_rows(x, "x");
  check_rows(out, "out");
  const int64_t inter = out.size(1);
  TORCH_CHECK(x.size(1) == 2 * inter && x.size(0) == out.size(0), "x must be [tokens, 2 * out columns]");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* x_data = x.data_ptr<scalar_t>();
    scalar_t* out_data = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), grain_rows(inter * 4), [&](int64_t begin, int64_t end) {
      for (int64_t token = begin; token < end; ++token) {
        const scalar_t* gate = x_data + token * x.stride(0);
        const scalar_t* up = gate + inter;
        scalar_t* out_row = out_data + token * out.stride(0);
        silu_and_mul_row<scalar_t>(out_row, gate, up, inter);
      }
    });
  });
}

// out [tokens, rows] = x [tokens, columns] @ weight [rows, columns]^T, fp32: a few tokens through a linear layer.
void linear_tokens(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight) {
  check_rows(weight, "weight");
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), "x and out must be CPU tensors");
  TORCH_CHECK(weight.dim() == 2 && x.dim() == 2 && out.dim() == 2, "weight, x and out must be 2-d");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "x and out must have contiguous rows");
  TORCH_CHECK(
      weight.scalar_type() == torch::kFloat32 && x.scalar_type() == torch::kFloat32 &&
          out.scalar_type() == torch::kFloat32,
      "linear_tokens is fp32");
  TORCH_CHECK(x.size(1) == weight.size(1) && out.size(1) == weight.size(0) && out.size(0) == x.size(0),
              "shapes do not match");
  linear_tokens_kernel(
      x.data_ptr<float>(), x.stride(0), x.size(0), weight.data_ptr<float>(), weight.stride(0), out.data_ptr<float>(),
      out.stride(0), weight.size(0), weight.size(1));
}

// weight [rows, columns] fp32 -> [panels, columns, kPanelWidth]: panel p holds rows p * kPanelWidth on, column by
// column, zero past the last row (what panel_linear_kernel reads).
torch::Tensor pack_panels(const torch::Tensor& weight) {
  check_rows(weight, "weight");
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.scalar_type() == torch::kFloat32,
              "weight must be a 2-d CPU fp32 tensor");
  const int64_t rows = weight.size(0), columns = weight.size(1), panels = num_panels(rows);
  torch::Tensor packed = torch::zeros({panels, columns, kPanelWidth}, weight.options());
  const float* source = weight.data_ptr<float>();
  float* target = packed.data_ptr<float>();
  const int64_t row_stride = weight.stride(0);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < std::min(kPanelWidth, rows - p * kPanelWidth); ++j) {
        const float* row = source + (p * kPanelWidth + j) * row_stride;
        float* column_j = target + p * columns * kPanelWidth + j;
        for (int64_t column = 0; column < columns; ++column) {
          column_j[column * kPanelWidth] = row[column];
        }
      }
    }
  });
  return packed;
}

void check_panels(const torch::Tensor& packed, int64_t rows, int64_t columns, const char* name) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kFloat32 && packed.is_contiguous() &&
                  packed.dim() == 3,
              name, " must be a contiguous 3-d CPU fp32 tensor from pack_panels");
  TORCH_CHECK(packed.size(0) == num_panels(rows) && packed.size(1) == columns && packed.size(2) == kPanelWidth, name,
              " must be pack_panels of a [", rows, ", ", columns, "] weight");
}

// out = x @ weight^T for fp32 tokens, the weight given as pack_panels(weight) (out's width is its row count).
void panel_linear(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& packed) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), "x and out must be CPU tensors");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "x and out must be 2-d");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "x and out must have contiguous rows");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32, "panel_linear is fp32");
  TORCH_CHECK(out.size(0) == x.size(0), "x and out must have one row per token");
  check_panels(packed, out.size(1), x.size(1), "packed");
  panel_linear_kernel(x.data_ptr<float>(), x.stride(0), x.size(0), packed.data_ptr<float>(), out.size(1), x.size(1),
                      out.data_ptr<float>(), out.stride(0));
}

// Greedy next tokens from bf16 logits, exactly: row r's token is the argmax of its fp32 logits x[r] . weight[i]
// (linear_tokens_kernel's sums), computed only for the tokens whose bf16 logit may still be the best. A bf16 logit
// a(i) differs from the fp32 one by at most input_rounding * |x[r]| * |weight[i]| (both operands rounded to bf16;
// Cauchy-Schwarz bounds sum |x w|) plus output_rounding * |a(i)| (the result rounded to bf16) plus slack;
// a token whose a(i) + error(i) falls below the largest a(j) - error(j) cannot be the argmax. Candidates are kept
// in token order, so equal maxima resolve to the first, as argmax does. A row with more than max_candidates
// candidates, or a non-finite bf16 logit, gets -1: its caller computes that row's fp32 logits in full.
torch::Tensor screened_greedy(const torch::Tensor& approx_logits, const torch::Tensor& x, const torch::Tensor& weight,
                              const torch::Tensor& row_norms, double input_rounding, double output_rounding,
                              double slack, int64_t max_candidates) {
  check_rows(weight, "weight");
  TORCH_CHECK(approx_logits.scalar_type() == torch::kBFloat16 && approx_logits.is_contiguous() &&
                  approx_logits.dim() == 2,
              "approx_logits must be contiguous 2-d bf16");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1, "x must be fp32 rows");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32, "weight must be fp32");
  TORCH_CHECK(row_norms.scalar_type() == torch::kFloat32 && row_norms.is_contiguous(), "row_norms must be fp32");
  const int64_t num_rows = x.size(0), vocab = weight.size(0), columns = weight.size(1);
  TORCH_CHECK(approx_logits.size(0) == num_rows && approx_logits.size(1) == vocab && row_norms.numel() == vocab &&
                  x.size(1) == columns,
              "shapes do not match");
  TORCH_CHECK(max_candidates >= 1, "max_candidates must be positive");
  auto tokens = torch::full({num_rows}, -1, torch::kInt64);
  const uint16_t* approx = reinterpret_cast<const uint16_t*>(approx_logits.data_ptr<at::BFloat16>());
  const float* norms = row_norms.data_ptr<float>();
  const float* x_data = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  int64_t* out_tokens = tokens.data_ptr<int64_t>();
  const float out_rounding = static_cast<float>(output_rounding), error_slack = static_cast<float>(slack);
  const auto bf16_value = [](uint16_t bits) {
    const uint32_t widened = static_cast<uint32_t>(bits) << 16;
    float value;
    std::memcpy(&value, &widened, sizeof(value));
    return value;
  };
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> candidates;
    std::vector<float> gathered, exact;
    for (int64_t row = begin; row < end; ++row) {
      const float* row_x = x_data + row * x.stride(0);
      double squares = 0.0;
      for (int64_t i = 0; i < columns; ++i) {
        squares += static_cast<double>(row_x[i]) * row_x[i];
      }
      const float input_bound = static_cast<float>(input_rounding * std::sqrt(squares));
      const uint16_t* row_logits = approx + row * vocab;
      float best_lower = -std::numeric_limits<float>::infinity();
      bool finite = std::isfinite(input_bound);
      const auto error_of = [&](float value, int64_t i) {
        return input_bound * norms[i] + out_rounding * std::fabs(value) + error_slack;
      };
      int64_t vector_end = 0;
#if defined(__AVX512F__)
      vector_end = vocab - vocab % 16;
      const __m512 bound_lanes = _mm512_set1_ps(input_bound), rounding_lanes = _mm512_set1_ps(out_rounding),
                   slack_lanes = _mm512_set1_ps(error_slack);
      // 16 bf16 logits widened to fp32 (a bf16 is the top half of an fp32), and their error bounds.
      const auto load_logits = [&](int64_t i) {
        const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row_logits + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
      };
      const auto errors_of = [&](__m512 values, int64_t i) {
        return _mm512_fmadd_ps(bound_lanes, _mm512_loadu_ps(norms + i),
                               _mm512_fmadd_ps(rounding_lanes, _mm512_abs_ps(values), slack_lanes));
      };
      __m512 best_lanes = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      // Stays zero unless a logit is infinite or NaN (x - x is NaN for those).
      __m512 poison = _mm512_setzero_ps();
      for (int64_t i = 0; i < vector_end; i += 16) {
        const __m512 values = load_logits(i);
        best_lanes = _mm512_max_ps(best_lanes, _mm512_sub_ps(values, errors_of(values, i)));
        poison = _mm512_add_ps(poison, _mm512_sub_ps(values, values));
      }
      best_lower = _mm512_reduce_max_ps(best_lanes);
      finite = finite && _mm512_reduce_add_ps(poison) == 0.f;
#endif
      for (int64_t i = vector_end; i < vocab; ++i) {
        const float value = bf16_value(row_logits[i]);
        finite = finite && std::isfinite(value);
        best_lower = std::max(best_lower, value - error_of(value, i));
      }
      if (!finite) {
        continue;
      }
      candidates.clear();
#if defined(__AVX512F__)
      const __m512 threshold = _mm512_set1_ps(best_lower);
      for (int64_t i = 0; i < vector_end && static_cast<int64_t>(candidates.size()) <= max_candidates; i += 16) {
        const __m512 values = load_logits(i);
        for (__mmask16 hits = _mm512_cmp_ps_mask(_mm512_add_ps(values, errors_of(values, i)), threshold, _CMP_GE_OQ);
             hits != 0; hits &= hits - 1) {
          candidates.push_back(i + __builtin_ctz(hits));
        }
      }
#endif
      for (int64_t i = vector_end; i < vocab && static_cast<int64_t>(candidates.size()) <= max_candidates; ++i) {
        const float value = bf16_value(row_logits[i]);
        if (value + error_of(value, i) >= best_lower) {
          candidates.push_back(i);
        }
      }
      const int64_t count = static_cast<int64_t>(candidates.size());
      if (count > max_candidates) {
        continue;
      }
      // Whole groups of kBlockRows rows (the last candidate repeated) take the kernel's vector path, whose sums
      // are those of the full LM head's.
      const int64_t padded = (count + kBlockRows - 1) / kBlockRows * kBlockRows;
      gathered.resize(padded * columns);
      exact.resize(padded);
      for (int64_t k = 0; k < padded; ++k) {
        const float* source = w + candidates[std::min(k, count - 1)] * weight.stride(0);
        std::memcpy(gathered.data() + k * columns, source, columns * sizeof(float));
      }
      linear_tokens_kernel(row_x, columns, 1, gathered.data(), columns, exact.data(), padded, padded, columns);
      int64_t best = 0;
      for (int64_t k = 1; k < count; ++k) {
        if (exact[k] > exact[best]) {
          best = k;
        }
      }
      out_tokens[row] = candidates[best];
    }
  });
  return tokens;
}

// fp32 decode tokens through a stack of Llama decoder layers in one call: per layer the residual add and RMSNorm,
// the fused QKV projection, rotary, the KV-cache write, paged attention, the output projection, the second norm
// and the SwiGLU MLP. A step is ~30 small ops per layer, whose Python and dispatch overhead cost 2-2.5 ms a step
// (a fifth of a one-token step). Projections run panel_linear_kernel on the layer's panel-packed weights, or
// linear_tokens_kernel on the plain weights where a layer has none. With 16 tokens or more per thread, each thread
// takes its own tokens through every layer (see forward); with fewer, every kernel spreads over the threads.
class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
              int64_t sliding_window)
      : num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        eps_(static_cast<float>(eps)),
        scale_(static_cast<float>(scale)),
        sliding_window_(sliding_window) {
    TORCH_CHECK(num_heads % num_kv_heads == 0, "heads must be a multiple of kv heads");
    TORCH_CHECK(head_dim % 2 == 0 && head_dim <= kMaxHeadDim, "head_dim must be even and at most ", kMaxHeadDim);
  }

  // Biases and panel weights may be None. Weights are the model's own tensors (no copy): [out, in] fp32 with
  // contiguous rows; a panel weight is the same weight as pack_panels lays it out.
  void add_layer(const torch::Tensor& input_norm, const torch::Tensor& qkv, const std::optional<torch::Tensor>& qkv_bias,
                 const torch::Tensor& o, const std::optional<torch::Tensor>& o_bias, const torch::Tensor& post_norm,
                 const torch::Tensor& gate_up, const std::optional<torch::Tensor>& gate_up_bias,
                 const torch::Tensor& down, const std::optional<torch::Tensor>& down_bias,
                 const std::optional<torch::Tensor>& qkv_panels, const std::optional<torch::Tensor>& o_panels,
                 const std::optional<torch::Tensor>& gate_up_panels,
                 const std::optional<torch::Tensor>& down_panels) {
    const int64_t hidden = input_norm.size(0);
    const int64_t q_size = num_heads_ * head_dim_;
    const int64_t qkv_rows = q_size + 2 * num_kv_heads_ * head_dim_;
    const int64_t inter = gate_up.size(0) / 2;
    check_matrix(qkv, qkv_rows, hidden, "qkv");
    check_matrix(o, hidden, q_size, "o");
    check_matrix(gate_up, 2 * inter, hidden, "gate_up");
    check_matrix(down, hidden, inter, "down");
    check_vector(input_norm, hidden, "input_norm");
    check_vector(post_norm, hidden, "post_norm");
    TORCH_CHECK(layers_.empty() || (hidden == hidden_ && inter == inter_), "every layer must have the same sizes");
    layers_.push_back(
        Layer{input_norm,
              Linear{qkv, bias_or_empty(qkv_bias, qkv_rows, "qkv bias"), panels_or_empty(qkv_panels, qkv, "qkv panels")},
              Linear{o, bias_or_empty(o_bias, hidden, "o bias"), panels_or_empty(o_panels, o, "o panels")},
              post_norm,
              Linear{gate_up, bias_or_empty(gate_up_bias, 2 * inter, "gate_up bias"),
                     panels_or_empty(gate_up_panels, gate_up, "gate_up panels")},
              Linear{down, bias_or_empty(down_bias, hidden, "down bias"),
                     panels_or_empty(down_panels, down, "down panels")}});
    hidden_ = hidden;
    inter_ = inter;
  }

  // hidden and residual [tokens, hidden_size], in place: in, the stack's input (residual unread without
  // has_residual); out, the last layer's MLP output and the residual stream. kv_caches: one [2, blocks,
  // block_size, kv_heads, head_dim] per layer; per token, its block table row [tokens, width] int32, seq_len with
  // the new token [tokens] int32, KV slot [tokens] int64 (-1: padding) and cos/sin rows [tokens, head_dim / 2] fp32.
  void forward(torch::Tensor& hidden, torch::Tensor& residual, bool has_residual,
               const std::vector<torch::Tensor>& kv_caches, const torch::Tensor& block_tables,
               const torch::Tensor& seq_lens, const torch::Tensor& slots, const torch::Tensor& cos,
               const torch::Tensor& sin, bool rows_share_sequences) {
    TORCH_CHECK(!layers_.empty(), "the stack has no layers");
    const int64_t num_tokens = hidden.size(0);
    check_rows_of(hidden, num_tokens, hidden_, "hidden");
    check_rows_of(residual, num_tokens, hidden_, "residual");
    const int64_t half = head_dim_ / 2;
    check_rows_of(cos, num_tokens, half, "cos");
    check_rows_of(sin, num_tokens, half, "sin");
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV cache per layer");
    TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.is_contiguous() &&
                    block_tables.dim() == 2 && block_tables.size(0) == num_tokens,
                "block_tables must be contiguous int32 [tokens, width]");
    TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous() && seq_lens.numel() == num_tokens,
                "seq_lens must be int32 [tokens]");
    TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == num_tokens,
                "slots must be int64 [tokens]");
    const int32_t* lens = seq_lens.data_ptr<int32_t>();
    const int64_t* slot_of = slots.data_ptr<int64_t>();
    const int64_t width = block_tables.size(1);
    const int64_t block_size = kv_caches[0].dim() == 5 ? kv_caches[0].size(2) : 0;
    int64_t num_slots = std::numeric_limits<int64_t>::max();  // of the smallest cache
    for (const torch::Tensor& cache : kv_caches) {
      TORCH_CHECK(cache.scalar_type() == torch::kFloat32 && cache.is_contiguous() && cache.dim() == 5 &&
                      cache.size(2) == block_size && cache.size(3) == num_kv_heads_ && cache.size(4) == head_dim_,
                  "KV caches must be contiguous fp32 [2, blocks, block_size, kv_heads, head_dim]");
      num_slots = std::min(num_slots, cache.size(1) * block_size);
    }
    for (int64_t token = 0; token < num_tokens; ++token) {
      TORCH_CHECK(lens[token] >= 1 && (lens[token] + block_size - 1) / std::max<int64_t>(1, block_size) <= width,
                  "seq_len ", lens[token], " needs more blocks than its table holds");
      TORCH_CHECK(slot_of[token] < num_slots, "slot ", slot_of[token], " is outside the cache");
    }
    const int64_t q_size = num_heads_ * head_dim_;
    const int64_t qkv_rows = q_size + 2 * num_kv_heads_ * head_dim_;
    qkv_.resize(num_tokens * qkv_rows);
    attended_.resize(num_tokens * q_size);
    gate_up_.resize(num_tokens * 2 * inter_);
    activated_.resize(num_tokens * inter_);
    if (!has_residual) {
      // x + 0 is x exactly: the first layer's plain RMSNorm through the same add-and-norm row.
      std::fill(residual.data_ptr<float>(), residual.data_ptr<float>() + num_tokens * hidden_, 0.f);
    }
    const Step step{hidden.data_ptr<float>(), residual.data_ptr<float>(), &kv_caches, block_tables.data_ptr<int32_t>(),
                    width, block_size, lens, slot_of, cos.data_ptr<float>(), sin.data_ptr<float>()};
    const int64_t num_threads = at::get_num_threads();
    last_step_handoffs_ = 0;
    // Rows of one sequence (speculative drafts) read each other's keys: only rows that go through each stage
    // together have every row's keys written before any row attends.
    if (rows_share_sequences || num_threads < 2 || num_tokens < kMinRowsPerThread * num_threads ||
        at::in_parallel_region()) {
      run_rows(step, Rows{0, num_tokens, 0, 0}, nullptr);  // every kernel spreads its own work over the threads
      return;
    }
    // Each thread takes its share of the tokens through every layer on its own, its kernels single-threaded (they
    // are inside a parallel region): no barrier between a step's ~150 kernels, and the norms, rotary and SiLU
    // run on every thread. A thread done early takes half of what another has left at its next stage. 64 tokens
    // of SmolLM2: 40.4-41.7 ms a step against 42.2-44.5; 32 tokens 22.4-22.6 against 24.6-25.1. Below 16 tokens
    // per thread each thread streaming every weight costs more: 24 tokens 20.4-20.9 against 18.6-19.5.
    RowShare share(num_tokens, num_threads);
    at::parallel_for(0, num_threads, 1, [&](int64_t, int64_t) {
      while (const std::optional<Rows> rows = share.next()) {
        share.finished(run_rows(step, *rows, &share));
      }
    });
    last_step_handoffs_ = share.num_handoffs();
  }

  // Token ranges one thread handed to another in the last forward (0 unless the grouped path ran).
  int64_t last_step_handoffs() const {
    return last_step_handoffs_;
  }

 private:
  // A step's tensors, as pointers: row `token` of each is that token's.
  struct Step {
    float* hidden;
    float* residual;
    const std::vector<torch::Tensor>* kv_caches;
    const int32_t* block_tables;
    int64_t width, block_size;
    const int32_t* seq_lens;
    const int64_t* slots;
    const float* cos;
    const float* sin;
  };

  // A layer's stages, in order; between two, a token's state is its rows of hidden, residual and the scratch.
  enum Stage : int64_t {
    kNormAndQkv,          // input add + RMSNorm, QKV projection
    kRotaryAndAttention,  // rotary, the KV-cache write, paged attention
    kOutputAndNorm,       // output projection, post-attention add + RMSNorm
    kGateUp,              // gate/up projection, SiLU-and-mul
    kDown,                // down projection
    kNumStages,
  };

  // Tokens [begin, end) of a step, about to run stage `stage` of layer `layer`.
  struct Rows {
    int64_t begin, end, layer, stage;
  };
  // A thread's share must be this many tokens or the grouped path is not taken: fewer rows per weight read and
  // the projections, each thread streaming every weight, fall off the compute peak.
  static constexpr int64_t kMinRowsPerThread = 16;
  // Rows handed over hold at least this many tokens, and so does what the giving thread keeps.
  static constexpr int64_t kMinSplitRows = 4;

  // The token ranges of one grouped step: at first one per thread; a busy thread splits off the back half of
  // its rows for a thread that waits for work. Whichever threads run the region, every range gets taken.
  class RowShare {
   public:
    RowShare(int64_t num_tokens, int64_t num_ranges) : unfinished_(num_tokens), num_pending_(num_ranges) {
      for (int64_t range = num_ranges - 1; range >= 0; --range) {
        pending_.push_back(Rows{num_tokens * range / num_ranges, num_tokens * (range + 1) / num_ranges, 0, 0});
      }
    }

    // A busy thread, between two stages: while a thread waits with nothing to take, gives it the back half of
    // `rows` (`rows` keeps the front half).
    void give_back_half(Rows& rows) {
      if (waiting_.load(std::memory_order_relaxed) <= num_pending_.load(std::memory_order_relaxed) ||
          rows.end - rows.begin < 2 * kMinSplitRows) {
        return;
      }
      const int64_t middle = rows.begin + (rows.end - rows.begin) / 2;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        pending_.push_back(Rows{middle, rows.end, rows.layer, rows.stage});
        num_pending_.fetch_add(1, std::memory_order_relaxed);
        ++num_handoffs_;
      }
      rows.end = middle;
    }

    void finished(int64_t num_rows) {
      unfinished_.fetch_sub(num_rows, std::memory_order_release);
    }

    // After the region (its end is the barrier that makes the count visible).
    int64_t num_handoffs() const {
      return num_handoffs_;
    }

    // The next range to run, waiting for one while other threads still run theirs; nothing once every token went
    // through the last layer.
    std::optional<Rows> next() {
      bool waiting = false;
      while (true) {
        // The lock only when a range is there to take: a waiting thread must not slow the givers down.
        if (num_pending_.load(std::memory_order_relaxed) > 0) {
          std::lock_guard<std::mutex> lock(mutex_);
          if (!pending_.empty()) {
            const Rows rows = pending_.back();
            pending_.pop_back();
            num_pending_.fetch_sub(1, std::memory_order_relaxed);
            if (waiting) {
              waiting_.fetch_sub(1, std::memory_order_relaxed);
            }
            return rows;
          }
        }
        if (unfinished_.load(std::memory_order_acquire) == 0) {
          if (waiting) {
            waiting_.fetch_sub(1, std::memory_order_relaxed);
          }
          return std::nullopt;
        }
        if (!waiting) {
          waiting_.fetch_add(1, std::memory_order_relaxed);
          waiting = true;
        }
        _mm_pause();
      }
    }

   private:
    std::atomic<int64_t> unfinished_;
    std::atomic<int64_t> num_pending_;
    std::atomic<int64_t> waiting_{0};
    std::mutex mutex_;
    std::vector<Rows> pending_;
    int64_t num_handoffs_ = 0;  // under mutex_
  };

  // Runs `rows` from their layer and stage through the last layer; returns how many it ran to the end. With a
  // share, it may give half of them to an idle thread before a stage: each token's state between stages lives in
  // its own rows of the step's scratch, wherever it runs next.
  int64_t run_rows(const Step& step, Rows rows, RowShare* share) {
    const int64_t half = head_dim_ / 2;
    const int64_t q_size = num_heads_ * head_dim_;
    const int64_t kv_size = num_kv_heads_ * head_dim_;
    const int64_t qkv_rows = q_size + 2 * kv_size;
    for (; rows.layer < static_cast<int64_t>(layers_.size()); ++rows.layer, rows.stage = 0) {
      const Layer& layer = layers_[rows.layer];
      const torch::Tensor& cache = (*step.kv_caches)[rows.layer];
      for (; rows.stage < kNumStages; ++rows.stage) {
        if (share != nullptr) {
          share->give_back_half(rows);
        }
        const int64_t begin = rows.begin;
        const int64_t count = rows.end - rows.begin;
        float* const x = step.hidden + begin * hidden_;
        float* const stream = step.residual + begin * hidden_;
        float* const qkv = qkv_.data() + begin * qkv_rows;
        float* const attended = attended_.data() + begin * q_size;
        float* const gate_up = gate_up_.data() + begin * 2 * inter_;
        float* const activated = activated_.data() + begin * inter_;
        switch (rows.stage) {
          case kNormAndQkv:
            for (int64_t token = 0; token < count; ++token) {
              add_rms_norm_row<float>(x + token * hidden_, stream + token * hidden_,
                                      layer.input_norm.data_ptr<float>(), hidden_, eps_);
            }
            project(layer.qkv, x, hidden_, count, qkv);
            break;
          case kRotaryAndAttention: {
            float* key_cache = cache.data_ptr<float>();
            float* value_cache = key_cache + cache.stride(0);
            for (int64_t token = 0; token < count; ++token) {
              float* token_qkv = qkv + token * qkv_rows;
              const float* cos_row = step.cos + (begin + token) * half;
              const float* sin_row = step.sin + (begin + token) * half;
              rotate_heads<float>(token_qkv, num_heads_, head_dim_, half, cos_row, sin_row);
              rotate_heads<float>(token_qkv + q_size, num_kv_heads_, head_dim_, half, cos_row, sin_row);
              const int64_t slot = step.slots[begin + token];
              if (slot >= 0) {  // -1: a padding row of a bucketed step, which writes nothing
                std::memcpy(key_cache + slot * cache.stride(2), token_qkv + q_size, kv_size * sizeof(float));
                std::memcpy(value_cache + slot * cache.stride(2), token_qkv + q_size + kv_size,
                            kv_size * sizeof(float));
              }
            }
            const PagedCache<float> paged{key_cache, value_cache, step.block_tables + begin * step.width,
                                          step.width, step.block_size, cache.stride(1), cache.stride(2)};
            decode_attention_kernel<float>(qkv, paged, attended, step.seq_lens + begin, count, num_heads_,
                                           num_kv_heads_, head_dim_, qkv_rows, q_size, scale_, sliding_window_);
            break;
          }
          case kOutputAndNorm:
            project(layer.o, attended, q_size, count, x);
            for (int64_t token = 0; token < count; ++token) {
              add_rms_norm_row<float>(x + token * hidden_, stream + token * hidden_,
                                      layer.post_norm.data_ptr<float>(), hidden_, eps_);
            }
            break;
          case kGateUp:
            project(layer.gate_up, x, hidden_, count, gate_up);
            for (int64_t token = 0; token < count; ++token) {
              const float* gate = gate_up + token * 2 * inter_;
              silu_and_mul_row<float>(activated + token * inter_, gate, gate + inter_, inter_);
            }
            break;
          case kDown:
            project(layer.down, activated, inter_, count, x);
        }
      }
    }
    return rows.end - rows.begin;
  }

  struct Linear {
    torch::Tensor weight, bias, panels;  // bias and panels may be undefined
  };
  struct Layer {
    torch::Tensor input_norm;
    Linear qkv, o;
    torch::Tensor post_norm;
    Linear gate_up, down;
  };

  static void check_matrix(const torch::Tensor& weight, int64_t rows, int64_t columns, const char* name) {
    TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == torch::kFloat32, name, " must be CPU fp32");
    TORCH_CHECK(weight.dim() == 2 && weight.size(0) == rows && weight.size(1) == columns && weight.stride(1) == 1,
                name, " must be [", rows, ", ", columns, "] with contiguous rows");
  }

  static void check_vector(const torch::Tensor& vector, int64_t size, const char* name) {
    TORCH_CHECK(vector.device().is_cpu() && vector.scalar_type() == torch::kFloat32 && vector.is_contiguous(),
                name, " must be a contiguous CPU fp32 tensor");
    TORCH_CHECK(vector.numel() == size, name, " must have ", size, " elements");
  }

  static void check_rows_of(const torch::Tensor& tensor, int64_t rows, int64_t columns, const char* name) {
    check_vector(tensor, rows * columns, name);
    TORCH_CHECK(tensor.size(0) == rows, name, " must have one row per token");
  }

  static torch::Tensor bias_or_empty(const std::optional<torch::Tensor>& bias, int64_t size, const char* name) {
    if (!bias.has_value() || !bias->defined()) {
      return torch::Tensor();
    }
    check_vector(*bias, size, name);
    return *bias;
  }

  static torch::Tensor panels_or_empty(const std::optional<torch::Tensor>& panels, const torch::Tensor& weight,
                                       const char* name) {
    if (!panels.has_value() || !panels->defined()) {
      return torch::Tensor();
    }
    check_panels(*panels, weight.size(0), weight.size(1), name);
    return *panels;
  }

  // out [tokens, the weight's out size] = x [tokens, columns] (contiguous rows) W^T + bias.
  void project(const Linear& linear, const float* x, int64_t columns, int64_t num_tokens, float* out) const {
    const int64_t rows = linear.weight.size(0);
    if (linear.panels.defined()) {
      panel_linear_kernel(x, columns, num_tokens, linear.panels.data_ptr<float>(), rows, columns, out, rows);
    } else {
      linear_tokens_kernel(x, columns, num_tokens, linear.weight.data_ptr<float>(), linear.weight.stride(0), out, rows,
                           rows, linear.weight.size(1));
    }
    if (linear.bias.defined()) {
      const float* bias_data = linear.bias.data_ptr<float>();
      for (int64_t token = 0; token < num_tokens; ++token) {
        for (int64_t i = 0; i < rows; ++i) {
          out[token * rows + i] += bias_data[i];
        }
      }
    }
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  float eps_, scale_;
  int64_t sliding_window_;
  int64_t hidden_ = 0;
  int64_t inter_ = 0;
  std::vector<Layer> layers_;
  int64_t last_step_handoffs_ = 0;
  // Scratch for a step's tokens, reused every step.
  std::vector<float> qkv_, attended_, gate_up_, activated_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention over the KV cache");
  // Without the GIL: the worker's other threads (Ray's RPC) go on meanwhile.
  module.def("paged_prefill_attention", &paged_prefill_attention, "Paged prefill attention over the KV cache",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("reshape_and_cache", &reshape_and_cache, "Write new keys and values into the paged cache");
  module.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = RMSNorm(residual), in place");
  module.def("rotary_embedding", &rotary_embedding, "NeoX rotary embedding of query and key, in place");
  module.def("silu_and_mul", &silu_and_mul, "silu(first half) * second half");
  module.def("linear_tokens", &linear_tokens, "x @ weight^T for fp32 tokens, each weight streamed from memory once");
  module.def("pack_panels", &pack_panels, "an fp32 weight in the panel layout panel_linear reads");
  module.def("panel_linear", &panel_linear, "x @ weight^T for fp32 tokens on a pack_panels weight");
  module.def("screened_greedy", &screened_greedy, "exact greedy tokens from bf16 logits and fp32 candidates",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  // fp32 lanes per vector register of this build: how far linear_tokens beats a GEMM library depends on it.
  module.attr("vector_lanes") = kLanes;
  module.attr("panel_width") = kPanelWidth;
  pybind11::class_<DecodeStack>(module, "DecodeStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, int64_t>(), pybind11::arg("num_heads"),
           pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"), pybind11::arg("eps"), pybind11::arg("scale"),
           pybind11::arg("sliding_window"))
      .def("add_layer", &DecodeStack::add_layer)
      // The whole stack runs without the GIL: the actor's other threads (Ray's RPC, the next step's plan) go on.
      .def("forward", &DecodeStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_property_readonly("last_step_handoffs", &DecodeStack::last_step_handoffs);
}
