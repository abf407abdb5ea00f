// bf16 linear layers on AMX tiles (Intel Xeon from Sapphire Rapids on): y = x W^T with bf16 products and fp32
// sums, TDPBF16PS on 16 x 32 blocks of x against 32 x 16 blocks of a weight packed once as the tiles read it.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <optional>

namespace pagedserve {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGEDSERVE_HAS_AMX 1
// Tile shape: 16 rows (tokens, or column pairs of the weight) of 64 bytes (32 bf16 columns, or 16 outputs x 2).
constexpr int64_t kAmxRows = 16;
constexpr int64_t kAmxColumns = 32;

inline int64_t amx_blocks(int64_t size, int64_t block) {
  return (size + block - 1) / block;
}

// Whether this process may use the tiles: the CPU has them and Linux granted the tile state (asked once).
bool amx_usable();

// out [num_tokens, rows] (out_stride apart) = x [num_tokens, columns] (x_stride apart) @ weight^T (+ bias, fp32,
// or null), the weight as pack_amx_weight lays it out. In and Out: float, or uint16_t for bf16 bits (an fp32 x is
// rounded to bf16 once; an output, from the fp32 sums once). Call only where amx_usable().
template <typename In, typename Out>
void amx_linear_kernel(const In* x, int64_t x_stride, int64_t num_tokens, const uint16_t* packed, int64_t rows,
                       int64_t columns, const float* bias, Out* out, int64_t out_stride);

// The pieces of a GEMM whose x rows and weight outputs are shared out by the caller (the decoder stack's lockstep
// decode steps). x in tile order: token block b (16 rows), its depth blocks' 16 x 32 tiles one after another, at
// b * amx_blocks(columns, 32) tiles into a buffer of amx_x_tile_elements(num_tokens, columns) bf16 values.
int64_t amx_x_tile_elements(int64_t num_tokens, int64_t columns);
// Weight pairs (32 outputs each) of a [rows, columns] weight.
int64_t amx_output_pairs(int64_t rows);
// Row `token` of x rounded to bf16 into its place in x_tiles, zero past the last column. Rows past num_tokens in
// the last block are never written: their sums go nowhere. On the calling thread.
template <typename In>
void amx_copy_token_row(const In* row, int64_t columns, int64_t token, uint16_t* x_tiles);
// The tile shapes of amx_linear_pair and amx_gate_up_silu_pair, on the calling thread: once per parallel region
// before them (they do not load it per item; any other AMX user on the thread, oneDNN included, replaces it).
void amx_load_tile_config();
// out [num_tokens, rows] (out_stride apart) = x @ weight^T (+ bias) for weight pair `pair`'s outputs (32 from
// 32 * pair) and token blocks [first_token_block, end_token_block) only, x in tile order. On the calling thread,
// its tile config loaded (amx_load_tile_config).
void amx_linear_pair(const uint16_t* x_tiles, int64_t num_tokens, const uint16_t* packed, int64_t rows,
                     int64_t columns, const float* bias, float* out, int64_t out_stride, int64_t pair,
                     int64_t first_token_block, int64_t end_token_block);

// Fails unless `packed` is pack_amx_weight of a [rows, columns] weight.
// x [tokens, columns] already in tile order (as amx_copy_token_row leaves it) against the packed weight, on the
// pool threads: out = x W^T (+ bias).
void amx_linear_of_tiles(const uint16_t* x_tiles, int64_t num_tokens, const uint16_t* packed, int64_t rows,
                         int64_t columns, const float* bias, float* out, int64_t out_stride);
// Whether a fused gate_up weight of `inter` outputs each (gates, then ups) runs amx_gate_up_silu_*: its gate and
// up blocks must pair up (inter a multiple of 16).
bool amx_gate_up_fuses(int64_t inter);
// silu(x gate^T + b) * (x up^T + b) of each token, rounded to bf16, into act_tiles in tile order (the input of a
// projection of `inter` columns, amx_x_tile_elements(num_tokens, inter) elements): no fp32 gate_up rows written
// and read back. On the pool threads; x in rows.
template <typename In>
void amx_gate_up_silu_kernel(const In* x, int64_t x_stride, int64_t num_tokens, const uint16_t* packed, int64_t inter,
                             int64_t columns, const float* bias, uint16_t* act_tiles);
// The same for one gate block (outputs 16 block onwards) and token blocks [first, end) of x in tile order, on the
// calling thread (a lockstep stage's item), its tile config loaded (amx_load_tile_config).
void amx_gate_up_silu_pair(const uint16_t* x_tiles, int64_t num_tokens, const uint16_t* packed, int64_t inter,
                           int64_t columns, const float* bias, uint16_t* act_tiles, int64_t block,
                           int64_t first_token_block, int64_t end_token_block);

void check_amx_weight(const torch::Tensor& packed, int64_t rows, int64_t columns, const char* name);

// weight [rows, columns] bf16 (or fp32, rounded to bf16) -> bf16 [ceil(rows / 16), ceil(columns / 32), 16, 16, 2]:
// packed[n, k, r, j, h] = weight[16 n + j, 32 k + 2 r + h], zero past the last row and column: block (n, k) is the
// 1 KiB tile TDPBF16PS takes as its second operand.
torch::Tensor pack_amx_weight(const torch::Tensor& weight);

// out = x @ weight^T (+ bias) on pack_amx_weight(weight): x bf16 or fp32 (rounded to bf16), out bf16 or fp32.
void amx_linear(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& packed,
                const std::optional<torch::Tensor>& bias);

// The greedy token of each row of x under an LM head, without its logits: int64 [rows], row r's argmax over the
// first vocab_size outputs of x[r] @ weight^T rounded to bf16 (the first of equal maxima, NaN above all, as
// torch's argmax of amx_linear's bf16 logits), among the tokens its bitmask row allows (int32 words, bit t % 32 of
// word t / 32; optional); -1 for a row that allows none. packed is pack_amx_weight of a [weight_rows, columns]
// weight.
// amx_gate_up_silu_kernel for tests: the activation's tiles, [token blocks, depth blocks, 16, 32] bf16.
torch::Tensor amx_gate_up_silu(const torch::Tensor& x, const torch::Tensor& packed, int64_t inter,
                               const std::optional<torch::Tensor>& bias);

torch::Tensor amx_greedy_tokens(const torch::Tensor& x, const torch::Tensor& packed, int64_t weight_rows,
                                int64_t vocab_size, const std::optional<torch::Tensor>& bitmask);
#endif

}  // namespace pagedserve
