// Paged attention over the KV cache: the decode kernel DecodeStack runs, and the torch entry points.
#pragma once

#include <torch/types.h>

#include <cstdint>

namespace pagedserve {

constexpr int64_t kMaxHeadDim = 512;

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

// One query token per request against its cached keys: query and output rows [num_heads, head_dim] at
// query_stride / output_stride apart; seq_lens count each request's keys; sliding_window <= 0 means none, soft_cap
// <= 0 no capping. fp32 and bf16 run vector paths (bf16 widened on load, fp32 math, the output rounded once). Other
// files get the fp32 instance.
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
    float soft_cap);

// Prefill chunks (fp32 or bf16, head_dim a multiple of the vector lanes) over the paged cache, their own keys and
// values already written: request i's query tokens are rows query_starts[i] .. query_starts[i + 1] (query_stride /
// output_stride apart), its table row i of cache.block_tables, seq_lens[i] its cached keys plus the chunk's own.
// Row offsets within the cache must fit in int32. Other files get the fp32 and bf16 instances.
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
    float soft_cap);

// What prefill_attention_kernel needs of a step's chunks beyond the query and caches: int32 query_starts [chunks +
// 1] covering its num_rows query rows (`rows_name` in the message), each chunk 1 .. seq_len query tokens, int32
// seq_lens [chunks] within their int32 block_tables [chunks, width] rows of `block_size`-token blocks, a cache of
// at most 2^31 elements (`cache_elements`: one of key or value) and head_dim a multiple of the vector lanes.
void check_prefill_chunks(const torch::Tensor& block_tables, const torch::Tensor& query_starts,
                          const torch::Tensor& seq_lens, int64_t num_rows, const char* rows_name, int64_t block_size,
                          int64_t cache_elements, int64_t head_dim);

// query [seqs, heads, head_dim] -> output [seqs, heads, head_dim]; caches [blocks, block_size, kv_heads, head_dim];
// block_tables [seqs, max_blocks] int32; seq_lens [seqs] int32 (>= 1); sliding_window <= 0 means none; soft_cap > 0
// caps each scaled score s to soft_cap * tanh(s / soft_cap) before the softmax (Gemma 2), 0 leaves it.
void paged_decode_attention(
    torch::Tensor& output,
    const torch::Tensor& query,
    const torch::Tensor& key_cache,
    const torch::Tensor& value_cache,
    const torch::Tensor& block_tables,
    const torch::Tensor& seq_lens,
    double scale,
    int64_t sliding_window,
    double soft_cap);

// Prefill chunks over the paged cache, fp32 or bf16 (fp32 math) with head_dim a multiple of vector_lanes. query and
// output [tokens, heads, head_dim]: the chunks' tokens, request i's at rows query_starts[i] .. query_starts[i + 1];
// block_tables [seqs, max_blocks] int32; seq_lens [seqs] int32: cached keys plus the chunk's own, whose keys and
// values must be in the cache already (reshape_and_cache first). sliding_window and soft_cap as in decode.
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
    double soft_cap);

}  // namespace pagedserve
