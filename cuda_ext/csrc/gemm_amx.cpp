// bf16 linears on AMX tiles: x is copied once into zero-padded bf16 rows, each thread takes pairs of 16-output
// weight blocks (per panel of x's tokens), and per pair runs each 32-token block of the panel through TDPBF16PS
// into four 16 x 16 fp32 tiles. A fused gate_up weight pairs each gate block with its up block instead, and the
// epilogue writes silu(gate) * up straight into the down projection's input tiles.
#include "gemm_amx.h"

#if defined(PAGEDSERVE_HAS_AMX)

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "elementwise.h"
#include "parallel.h"
#include "simd.h"

namespace pagedserve {
namespace {

// Linux keeps the 8 KiB tile state off until a process asks for it (arch_prctl ARCH_REQ_XCOMP_PERM).
constexpr int kArchGetXcompPerm = 0x1022;
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

constexpr int64_t kTileElements = kAmxRows * kAmxColumns;  // bf16 values in one 1 KiB tile
// fp32 sums of a block: 32 tokens x 32 outputs, four tiles stored side by side.
constexpr int64_t kBlockSpan = 2 * kAmxRows;
// Weight tiles are asked for this many depth steps ahead: a tile load waits for memory otherwise.
constexpr int64_t kPrefetchDepth = 4;
constexpr int64_t kCacheLine = 64;

// The elements of one 16-row block of x or of a weight, `columns` wide, in tile order: its depth tiles one after
// another.
inline int64_t row_block_elements(int64_t columns) {
  return amx_blocks(columns, kAmxColumns) * kTileElements;
}
// x is run in panels of about this many bytes (whole pairs of token blocks): a panel stays in the core's L2 while
// every weight pair passes over it, where a whole prefill chunk's x would stream from L3 once per pair.
constexpr int64_t kPanelBytes = 1 << 20;

inline void prefetch_tile(const uint16_t* tile) {
  const char* bytes = reinterpret_cast<const char*>(tile);
#pragma GCC unroll 16
  for (int64_t line = 0; line < kTileElements * 2 / kCacheLine; ++line) {
    _mm_prefetch(bytes + line * kCacheLine, _MM_HINT_T0);
  }
}

// ldtilecfg's 64-byte operand: palette 1, every tile 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

constexpr TileConfig amx_tile_config() {
  TileConfig config{};
  config.palette = 1;
  for (int tile = 0; tile < 8; ++tile) {
    config.bytes_per_row[tile] = 64;
    config.rows[tile] = kAmxRows;
  }
  return config;
}

// In read-only memory: ldtilecfg's read of a stack copy is invisible to the compiler, which may drop its stores.
constexpr TileConfig kTileConfig = amx_tile_config();

}  // namespace

void amx_load_tile_config() {
  _tile_loadconfig(&kTileConfig);
}

namespace {

// Tiles: 0-3 the sums (token block 0 or 1 x output block 0 or 1), 4-5 x's two token blocks, 6-7 the two weight
// blocks. kTokenBlocks and kOutputBlocks (1 or 2) say which of them a block at the edge uses. The sums go to `sums`,
// token rows `sum_stride` floats apart.
template <int kTokenBlocks, int kOutputBlocks>
void run_tile_block(const uint16_t* x_tiles, const uint16_t* weight_0, const uint16_t* weight_1, int64_t depth_blocks,
                    float* sums, int64_t sum_stride) {
  _tile_zero(0);
  if constexpr (kOutputBlocks == 2) _tile_zero(1);
  if constexpr (kTokenBlocks == 2) {
    _tile_zero(2);
    if constexpr (kOutputBlocks == 2) _tile_zero(3);
  }
  const uint16_t* x_second = x_tiles + depth_blocks * kTileElements;
  for (int64_t depth = 0; depth < depth_blocks; ++depth) {
    // Past the block's end this runs into the next block: the one read next.
    prefetch_tile(weight_0 + (depth + kPrefetchDepth) * kTileElements);
    if constexpr (kOutputBlocks == 2) prefetch_tile(weight_1 + (depth + kPrefetchDepth) * kTileElements);
    // Loads in the order the previous step's products free their tiles (x 0 after product 1, weight 0 after 2),
    // each just before its own first product: the first loads overlap the previous step's last products.
    _tile_loadd(4, x_tiles + depth * kTileElements, 64);
    _tile_loadd(6, weight_0 + depth * kTileElements, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kOutputBlocks == 2) {
      _tile_loadd(7, weight_1 + depth * kTileElements, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (kTokenBlocks == 2) {
      _tile_loadd(5, x_second + depth * kTileElements, 64);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (kOutputBlocks == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  const int64_t sum_row_bytes = sum_stride * static_cast<int64_t>(sizeof(float));
  _tile_stored(0, sums, sum_row_bytes);
  if constexpr (kOutputBlocks == 2) _tile_stored(1, sums + kAmxRows, sum_row_bytes);
  if constexpr (kTokenBlocks == 2) {
    _tile_stored(2, sums + kAmxRows * sum_stride, sum_row_bytes);
    if constexpr (kOutputBlocks == 2) _tile_stored(3, sums + kAmxRows * sum_stride + kAmxRows, sum_row_bytes);
  }
}

using TileBlock = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, int64_t, float*, int64_t);
// [token blocks - 1][output blocks - 1]
constexpr TileBlock kTileBlocks[2][2] = {{&run_tile_block<1, 1>, &run_tile_block<1, 2>},
                                         {&run_tile_block<2, 1>, &run_tile_block<2, 2>}};

inline void store_row(float* target, const float* sums, const float* bias, __mmask16 mask) {
  __m512 row = _mm512_maskz_loadu_ps(mask, sums);
  if (bias != nullptr) {
    row = _mm512_add_ps(row, _mm512_maskz_loadu_ps(mask, bias));
  }
  _mm512_mask_storeu_ps(target, mask, row);
}

inline void store_row(uint16_t* target, const float* sums, const float* bias, __mmask16 mask) {
  __m512 row = _mm512_maskz_loadu_ps(mask, sums);
  if (bias != nullptr) {
    row = _mm512_add_ps(row, _mm512_maskz_loadu_ps(mask, bias));
  }
  const __m256bh rounded = _mm512_cvtneps_pbh(row);
  _mm256_mask_storeu_epi16(target, mask, reinterpret_cast<const __m256i&>(rounded));
}

// One x row's 32 columns at `first_column` into its tile row: rounded to bf16, zero past the row's last column.
inline void copy_tile_row(uint16_t* target, const float* row, int64_t first_column, int64_t columns) {
  const int64_t count = std::min(kAmxColumns, columns - first_column);
  floats_to_bf16(target, row + first_column, count);
  std::fill(target + count, target + kAmxColumns, uint16_t{0});
}

inline void copy_tile_row(uint16_t* target, const uint16_t* row, int64_t first_column, int64_t columns) {
  const int64_t count = std::min(kAmxColumns, columns - first_column);
  std::memcpy(target, row + first_column, count * sizeof(uint16_t));
  std::fill(target + count, target + kAmxColumns, uint16_t{0});
}

// One x row into its row of each depth tile (`tile_row`: its row of the first one), zero past the last column.
template <typename In>
void copy_row_tiles(uint16_t* tile_row, const In* row, int64_t columns) {
  for (int64_t depth = 0; depth < amx_blocks(columns, kAmxColumns); ++depth) {
    copy_tile_row(tile_row + depth * kTileElements, row, depth * kAmxColumns, columns);
  }
}

// One token block's tiles (its depth tiles one after another, 16 rows each): num_rows rows of x, zero after.
template <typename In>
void copy_token_block(const In* rows, int64_t x_stride, int64_t num_rows, int64_t columns, uint16_t* block_tiles) {
  const int64_t depth_blocks = amx_blocks(columns, kAmxColumns);
  for (int64_t row = 0; row < kAmxRows; ++row) {
    uint16_t* tile_row = block_tiles + row * kAmxColumns;
    if (row < num_rows) {
      copy_row_tiles(tile_row, rows + row * x_stride, columns);
    } else {
      for (int64_t depth = 0; depth < depth_blocks; ++depth) {
        std::fill_n(tile_row + depth * kTileElements, kAmxColumns, uint16_t{0});
      }
    }
  }
}

const uint16_t* bf16_bits(const torch::Tensor& tensor) {
  return reinterpret_cast<const uint16_t*>(tensor.data_ptr<at::BFloat16>());
}

}  // namespace

bool amx_usable() {
  static const bool usable = [] {
    if (!__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("amx-tile")) {
      return false;
    }
    unsigned long features = 0;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0 ||
        syscall(SYS_arch_prctl, kArchGetXcompPerm, &features) != 0) {
      return false;
    }
    return (features & (1ul << kXfeatureXtiledata)) != 0;
  }();
  return usable;
}

namespace {

// The two 16-output weight blocks a pair runs, whose sums are a block's columns [0, 16) and [16, 32)
// (num_blocks 1: `first` alone, a weight's last block), and the outputs they stand for.
struct WeightPair {
  const uint16_t* first;
  const uint16_t* second;
  int64_t num_blocks;
  int64_t first_output;
  int64_t num_outputs;
};

// A linear's pair `pair`: its output blocks 2 pair and 2 pair + 1, outputs 32 pair onwards.
inline WeightPair linear_pair(const uint16_t* packed, int64_t rows, int64_t block_elements, int64_t pair) {
  const int64_t first_block = 2 * pair;
  const uint16_t* first = packed + first_block * block_elements;
  return {first, first + block_elements, std::min<int64_t>(2, amx_blocks(rows, kAmxRows) - first_block),
          first_block * kAmxRows, std::min(kBlockSpan, rows - first_block * kAmxRows)};
}

// A fused gate_up weight's (inter gate rows, then inter up rows; inter a multiple of 16) gate block `block` and the
// up block of the same outputs: a block's sum columns [0, 16) are gates, [16, 32) ups, of outputs 16 block onwards.
inline WeightPair gate_up_pair(const uint16_t* packed, int64_t inter, int64_t block_elements, int64_t block) {
  return {packed + block * block_elements, packed + (block + inter / kAmxRows) * block_elements, 2, block * kAmxRows,
          kBlockSpan};
}

// Where a linear's fp32 sums may be stored straight from the tiles: its output rows (`stride` floats apart), when
// nothing is added to them and they stay fp32. nullptr: every block goes through on_block.
struct PlainFloatOut {
  float* data = nullptr;
  int64_t stride = 0;
};

// A linear's fp32 output as a PlainFloatOut: its rows where it has no bias, none otherwise.
inline PlainFloatOut plain_unless_bias(float* out, int64_t out_stride, const float* bias) {
  return bias == nullptr ? PlainFloatOut{out, out_stride} : PlainFloatOut{};
}

// A weight pair against token blocks [first_token_block, end_token_block) of x in tile order, two token blocks at a
// time: each 32 x 32 block's fp32 sums to on_block (as for_each_tile_block hands them), or, where the block is
// whole, straight into `plain_out` when it has one (no copy through `sums`; a partial block's tiles would store
// past its rows). The calling thread's tile config must be loaded.
template <typename OnBlock>
void run_pair(const uint16_t* x_tiles, int64_t num_tokens, int64_t depth_blocks, const WeightPair& weights,
              int64_t first_token_block, int64_t end_token_block, PlainFloatOut plain_out, float* sums,
              const OnBlock& on_block) {
  const int64_t block_elements = depth_blocks * kTileElements;
  const bool whole_outputs = weights.num_outputs == weights.num_blocks * kAmxRows;
  for (int64_t token_block = first_token_block; token_block < end_token_block; token_block += 2) {
    const int64_t num_token_blocks = std::min<int64_t>(2, end_token_block - token_block);
    const TileBlock tile_block = kTileBlocks[num_token_blocks - 1][weights.num_blocks - 1];
    const int64_t first_token = token_block * kAmxRows;
    const int64_t block_tokens = std::min(kBlockSpan, num_tokens - first_token);
    const uint16_t* block_x = x_tiles + token_block * block_elements;
    if (plain_out.data != nullptr && whole_outputs && block_tokens == num_token_blocks * kAmxRows) {
      tile_block(block_x, weights.first, weights.second, depth_blocks,
                 plain_out.data + first_token * plain_out.stride + weights.first_output, plain_out.stride);
      continue;
    }
    tile_block(block_x, weights.first, weights.second, depth_blocks, sums, kBlockSpan);
    on_block(sums, first_token, block_tokens, weights.first_output, weights.num_outputs);
  }
}

// x [num_tokens, columns] rounded into `x_tiles` in the tiles' order (token block, depth block, 16 rows of 32
// columns), zero-padded, on the pool threads: each tile is 1 KiB in one page, where rows a whole x row apart would
// span several pages per tile; and a prefill chunk's copy (rounding fp32 rows) would be a serial stretch between
// two regions on the calling thread alone.
template <typename In>
void copy_to_tiles(const In* x, int64_t x_stride, int64_t num_tokens, int64_t columns, uint16_t* x_tiles) {
  const int64_t block_elements = row_block_elements(columns);
  parallel_claims(amx_blocks(num_tokens, kAmxRows), block_elements, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      copy_token_block(x + block * kAmxRows * x_stride, x_stride, std::min(kAmxRows, num_tokens - block * kAmxRows),
                       columns, x_tiles + block * block_elements);
    }
  });
}

// Runs x (num_tokens rows of `columns`, in tile order) against `num_pairs` weight pairs (pair_of(pair) ->
// WeightPair) in 32 x 32 blocks and hands each block's fp32 sums to on_block(sums, first_token, block_tokens,
// first_output, num_outputs): sums row r (kBlockSpan apart) holds token first_token + r's sums of the pair's
// outputs. Whole blocks go straight to plain_out where it has rows (see run_pair). Blocks run on the pool threads.
template <typename PairOf, typename OnBlock>
void for_each_tile_block(const uint16_t* x_tiles, int64_t num_tokens, int64_t columns, int64_t num_pairs,
                         const PairOf& pair_of, PlainFloatOut plain_out, const OnBlock& on_block) {
  if (num_tokens == 0 || num_pairs == 0) {
    return;
  }
  const int64_t token_blocks = amx_blocks(num_tokens, kAmxRows);
  const int64_t depth_blocks = amx_blocks(columns, kAmxColumns);
  // A 16-row block of x or of the weight: its depth_blocks tiles one after another.
  const int64_t block_elements = depth_blocks * kTileElements;
  // block_elements * 2 bytes a token block: whole pairs of them up to kPanelBytes.
  const int64_t panel_blocks = std::max<int64_t>(2, kPanelBytes / (block_elements * 2 * 2) * 2);
  const int64_t num_panels = amx_blocks(token_blocks, panel_blocks);
  // Items panel by panel: a thread's contiguous share runs each of its panels past consecutive weight pairs.
  const int64_t work_per_item = 2 * block_elements * std::min(panel_blocks, token_blocks);
  parallel_claims(num_panels * num_pairs, work_per_item, 1, [&](int64_t begin, int64_t end) {
    // Per call: another library (oneDNN) may have loaded its own shapes on this thread since.
    amx_load_tile_config();
    alignas(64) float sums[kBlockSpan * kBlockSpan];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t first_token_block = item / num_pairs * panel_blocks;
      run_pair(x_tiles, num_tokens, depth_blocks, pair_of(item % num_pairs), first_token_block,
               std::min(token_blocks, first_token_block + panel_blocks), plain_out, sums, on_block);
    }
  });
}

// for_each_tile_block over x [num_tokens, columns] in rows (x_stride apart), copied into tile order first.
template <typename In, typename PairOf, typename OnBlock>
void for_each_amx_block(const In* x, int64_t x_stride, int64_t num_tokens, int64_t columns, int64_t num_pairs,
                        const PairOf& pair_of, PlainFloatOut plain_out, const OnBlock& on_block) {
  if (num_tokens == 0 || num_pairs == 0) {
    return;
  }
  thread_local std::vector<uint16_t> x_copy;
  x_copy.resize(amx_x_tile_elements(num_tokens, columns));
  copy_to_tiles(x, x_stride, num_tokens, columns, x_copy.data());
  for_each_tile_block(x_copy.data(), num_tokens, columns, num_pairs, pair_of, plain_out, on_block);
}

inline __mmask16 lanes_mask(int64_t width) {
  return static_cast<__mmask16>((1u << width) - 1);
}

// A 32 x 32 block of sums (+ bias) into out's rows, each rounded once where Out is bf16.
template <typename Out>
void store_linear_block(Out* out, int64_t out_stride, const float* bias, const float* sums, int64_t first_token,
                        int64_t block_tokens, int64_t first_output, int64_t num_outputs) {
  for (int64_t half = 0; half * kAmxRows < num_outputs; ++half) {
    const __mmask16 mask = lanes_mask(std::min(kAmxRows, num_outputs - half * kAmxRows));
    const int64_t output = first_output + half * kAmxRows;
    const float* half_bias = bias == nullptr ? nullptr : bias + output;
    for (int64_t row = 0; row < block_tokens; ++row) {
      store_row(out + (first_token + row) * out_stride + output, sums + row * kBlockSpan + half * kAmxRows, half_bias,
                mask);
    }
  }
}

// A gate_up pair's block of sums (gates in columns [0, 16), ups in [16, 32), each + its bias): silu(gate) * up of
// each token, rounded to bf16, into the 16 columns of the activation's tiles that output block `block` owns, the
// bits silu_and_mul_row and then amx_copy_token_row give. Rows of a partial token block past the step's tokens get
// zeros, and so do the other 16 columns of the last depth tile when the last block fills only half of it (the down
// projection's tile loads read both).
void store_silu_block(uint16_t* act_tiles, int64_t inter, const float* bias, const float* sums, int64_t first_token,
                      int64_t block_tokens, int64_t block) {
  const int64_t column = block * kAmxRows;
  const int64_t act_block_elements = row_block_elements(inter);
  const int64_t within = column % kAmxColumns;
  const bool fills_half_tile = within == 0 && column + kAmxRows >= inter;
  uint16_t* tile = act_tiles + first_token / kAmxRows * act_block_elements + column / kAmxColumns * kTileElements;
  alignas(64) float gate_up[kBlockSpan];
  alignas(64) float activated[kAmxRows];
  const int64_t padded_tokens = amx_blocks(block_tokens, kAmxRows) * kAmxRows;
  for (int64_t row = 0; row < padded_tokens; ++row) {
    // Row `row` of the block: token block row / 16, its tile row row % 16.
    uint16_t* tile_row = tile + row / kAmxRows * act_block_elements + row % kAmxRows * kAmxColumns;
    if (row < block_tokens) {
      store_row(gate_up, sums + row * kBlockSpan, bias == nullptr ? nullptr : bias + column, lanes_mask(kAmxRows));
      store_row(gate_up + kAmxRows, sums + row * kBlockSpan + kAmxRows,
                bias == nullptr ? nullptr : bias + inter + column, lanes_mask(kAmxRows));
      silu_and_mul_row<float>(activated, gate_up, gate_up + kAmxRows, kAmxRows);
      floats_to_bf16(tile_row + within, activated, kAmxRows);
    } else {
      std::fill_n(tile_row + within, kAmxRows, uint16_t{0});
    }
    if (fills_half_tile) {
      std::fill_n(tile_row + kAmxRows, kAmxRows, uint16_t{0});
    }
  }
}

}  // namespace

template <typename In, typename Out>
void amx_linear_kernel(const In* x, int64_t x_stride, int64_t num_tokens, const uint16_t* packed, int64_t rows,
                       int64_t columns, const float* bias, Out* out, int64_t out_stride) {
  // fp32 sums with nothing added are the output as they are.
  PlainFloatOut plain_out;
  if constexpr (std::is_same_v<Out, float>) {
    plain_out = plain_unless_bias(out, out_stride, bias);
  }
  const int64_t block_elements = row_block_elements(columns);
  for_each_amx_block(x, x_stride, num_tokens, columns, amx_output_pairs(rows),
                     [&](int64_t pair) { return linear_pair(packed, rows, block_elements, pair); }, plain_out,
                     [&](const float* sums, int64_t first_token, int64_t block_tokens, int64_t first_output,
                         int64_t num_outputs) {
                       store_linear_block(out, out_stride, bias, sums, first_token, block_tokens, first_output,
                                          num_outputs);
                     });
}

int64_t amx_x_tile_elements(int64_t num_tokens, int64_t columns) {
  return amx_blocks(num_tokens, kAmxRows) * row_block_elements(columns);
}

int64_t amx_output_pairs(int64_t rows) {
  return (amx_blocks(rows, kAmxRows) + 1) / 2;
}

template <typename In>
void amx_copy_token_row(const In* row, int64_t columns, int64_t token, uint16_t* x_tiles) {
  const int64_t block_elements = row_block_elements(columns);
  copy_row_tiles(x_tiles + token / kAmxRows * block_elements + token % kAmxRows * kAmxColumns, row, columns);
}

template void amx_copy_token_row<float>(const float*, int64_t, int64_t, uint16_t*);
template void amx_copy_token_row<uint16_t>(const uint16_t*, int64_t, int64_t, uint16_t*);

void amx_linear_pair(const uint16_t* x_tiles, int64_t num_tokens, const uint16_t* packed, int64_t rows,
                     int64_t columns, const float* bias, float* out, int64_t out_stride, int64_t pair,
                     int64_t first_token_block, int64_t end_token_block) {
  alignas(64) float sums[kBlockSpan * kBlockSpan];
  run_pair(x_tiles, num_tokens, amx_blocks(columns, kAmxColumns),
           linear_pair(packed, rows, row_block_elements(columns), pair), first_token_block, end_token_block,
           plain_unless_bias(out, out_stride, bias), sums,
           [&](const float* block_sums, int64_t first_token, int64_t block_tokens, int64_t first_output,
               int64_t num_outputs) {
             store_linear_block(out, out_stride, bias, block_sums, first_token, block_tokens, first_output,
                                num_outputs);
           });
}

void amx_linear_of_tiles(const uint16_t* x_tiles, int64_t num_tokens, const uint16_t* packed, int64_t rows,
                        int64_t columns, const float* bias, float* out, int64_t out_stride) {
  const int64_t block_elements = row_block_elements(columns);
  for_each_tile_block(x_tiles, num_tokens, columns, amx_output_pairs(rows),
                      [&](int64_t pair) { return linear_pair(packed, rows, block_elements, pair); },
                      plain_unless_bias(out, out_stride, bias),
                      [&](const float* sums, int64_t first_token, int64_t block_tokens, int64_t first_output,
                          int64_t num_outputs) {
                        store_linear_block(out, out_stride, bias, sums, first_token, block_tokens, first_output,
                                           num_outputs);
                      });
}

bool amx_gate_up_fuses(int64_t inter) {
  return inter % kAmxRows == 0;
}

template <typename In>
void amx_gate_up_silu_kernel(const In* x, int64_t x_stride, int64_t num_tokens, const uint16_t* packed, int64_t inter,
                             int64_t columns, const float* bias, uint16_t* act_tiles) {
  const int64_t block_elements = row_block_elements(columns);
  for_each_amx_block(x, x_stride, num_tokens, columns, inter / kAmxRows,
                     [&](int64_t block) { return gate_up_pair(packed, inter, block_elements, block); }, PlainFloatOut{},
                     [&](const float* sums, int64_t first_token, int64_t block_tokens, int64_t first_output, int64_t) {
                       store_silu_block(act_tiles, inter, bias, sums, first_token, block_tokens,
                                        first_output / kAmxRows);
                     });
}

template void amx_gate_up_silu_kernel<float>(const float*, int64_t, int64_t, const uint16_t*, int64_t, int64_t,
                                             const float*, uint16_t*);
template void amx_gate_up_silu_kernel<uint16_t>(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t,
                                                const float*, uint16_t*);

void amx_gate_up_silu_pair(const uint16_t* x_tiles, int64_t num_tokens, const uint16_t* packed, int64_t inter,
                           int64_t columns, const float* bias, uint16_t* act_tiles, int64_t block,
                           int64_t first_token_block, int64_t end_token_block) {
  alignas(64) float sums[kBlockSpan * kBlockSpan];
  run_pair(x_tiles, num_tokens, amx_blocks(columns, kAmxColumns),
           gate_up_pair(packed, inter, row_block_elements(columns), block), first_token_block, end_token_block,
           PlainFloatOut{}, sums,
           [&](const float* block_sums, int64_t first_token, int64_t block_tokens, int64_t, int64_t) {
             store_silu_block(act_tiles, inter, bias, block_sums, first_token, block_tokens, block);
           });
}

template void amx_linear_kernel<float, float>(const float*, int64_t, int64_t, const uint16_t*, int64_t, int64_t,
                                              const float*, float*, int64_t);
template void amx_linear_kernel<float, uint16_t>(const float*, int64_t, int64_t, const uint16_t*, int64_t, int64_t,
                                                 const float*, uint16_t*, int64_t);
template void amx_linear_kernel<uint16_t, float>(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t,
                                                 int64_t, const float*, float*, int64_t);
template void amx_linear_kernel<uint16_t, uint16_t>(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t,
                                                    int64_t, const float*, uint16_t*, int64_t);

namespace {

// fp32 values rounded to bf16 (to nearest even, as the linear's bf16 output is) and widened back, exactly.
inline __m512 rounded_to_bf16(__m512 values) {
  const __m256bh rounded = _mm512_cvtneps_pbh(values);
  const __m512i widened = _mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(rounded));
  return _mm512_castsi512_ps(_mm512_slli_epi32(widened, 16));
}

// Integer keys in the floats' order, with torch's max's ties and NaN: -0 equals +0 and NaN ranks above every number.
inline __m512i ordered_keys(__m512 values) {
  values = _mm512_add_ps(values, _mm512_setzero_ps());  // -0 + 0 is +0
  const __m512i bits = _mm512_castps_si512(values);
  const __m512i negative_flip = _mm512_and_si512(_mm512_srai_epi32(bits, 31), _mm512_set1_epi32(INT32_MAX));
  const __mmask16 nan = _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(_mm512_xor_si512(bits, negative_flip), nan, _mm512_set1_epi32(INT32_MAX));
}

// One token's best logit so far in each of 16 lanes (lane l sees the outputs 16 k + l): its key and output index.
struct alignas(64) LaneBest {
  __m512i keys;
  __m512i outputs;
};

constexpr int32_t kNoOutput = INT32_MAX;

// A lane's candidate wins over its best with a greater key, or an equal key and a lower index (the first of equal
// maxima, whichever order the threads ran the blocks in).
inline __mmask16 wins(__m512i keys, __m512i outputs, const LaneBest& best) {
  const __mmask16 greater = _mm512_cmpgt_epi32_mask(keys, best.keys);
  const __mmask16 earlier_tie =
      _mm512_cmpeq_epi32_mask(keys, best.keys) & _mm512_cmplt_epi32_mask(outputs, best.outputs);
  return greater | earlier_tie;
}

template <typename In>
void amx_greedy_kernel(const In* x, int64_t x_stride, int64_t num_tokens, const uint16_t* packed, int64_t columns,
                       int64_t vocab_size, const int32_t* bitmask, int64_t bitmask_words, int64_t* token_ids) {
  const int64_t num_threads = at::get_num_threads();
  std::vector<LaneBest> lane_best(num_threads * num_tokens,
                                  LaneBest{_mm512_set1_epi32(INT32_MIN), _mm512_set1_epi32(kNoOutput)});
  const __m512i lane_offsets = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int64_t block_elements = row_block_elements(columns);
  for_each_amx_block(x, x_stride, num_tokens, columns, amx_output_pairs(vocab_size),
                     [&](int64_t pair) { return linear_pair(packed, vocab_size, block_elements, pair); },
                     PlainFloatOut{},
                     [&](const float* sums, int64_t first_token, int64_t block_tokens, int64_t first_output,
                         int64_t num_outputs) {
                       LaneBest* best = lane_best.data() + at::get_thread_num() * num_tokens + first_token;
                       for (int64_t half = 0; half * kAmxRows < num_outputs; ++half) {
                         const __mmask16 valid = lanes_mask(std::min(kAmxRows, num_outputs - half * kAmxRows));
                         const int64_t output = first_output + half * kAmxRows;
                         const __m512i outputs = _mm512_add_epi32(_mm512_set1_epi32(output), lane_offsets);
                         for (int64_t row = 0; row < block_tokens; ++row) {
                           __mmask16 allowed = valid;
                           if (bitmask != nullptr) {
                             const auto word = static_cast<uint32_t>(
                                 bitmask[(first_token + row) * bitmask_words + output / 32]);
                             allowed &= static_cast<__mmask16>(word >> (output % 32));
                           }
                           const __m512i keys = ordered_keys(
                               rounded_to_bf16(_mm512_loadu_ps(sums + row * kBlockSpan + half * kAmxRows)));
                           const __mmask16 better = wins(keys, outputs, best[row]) & allowed;
                           best[row].keys = _mm512_mask_mov_epi32(best[row].keys, better, keys);
                           best[row].outputs = _mm512_mask_mov_epi32(best[row].outputs, better, outputs);
                         }
                       }
                     });
  // The same rule across threads, then lanes. A lane that saw no allowed output still holds (INT32_MIN, kNoOutput),
  // which every scored output beats: no key reaches INT32_MIN (its bits are a NaN's, keyed INT32_MAX).
  for (int64_t token = 0; token < num_tokens; ++token) {
    LaneBest merged = lane_best[token];
    for (int64_t thread = 1; thread < num_threads; ++thread) {
      const LaneBest& other = lane_best[thread * num_tokens + token];
      const __mmask16 better = wins(other.keys, other.outputs, merged);
      merged.keys = _mm512_mask_mov_epi32(merged.keys, better, other.keys);
      merged.outputs = _mm512_mask_mov_epi32(merged.outputs, better, other.outputs);
    }
    alignas(64) int32_t keys[16], outputs[16];
    _mm512_store_si512(keys, merged.keys);
    _mm512_store_si512(outputs, merged.outputs);
    int64_t best = 0;
    for (int64_t lane = 1; lane < 16; ++lane) {
      if (keys[lane] > keys[best] || (keys[lane] == keys[best] && outputs[lane] < outputs[best])) {
        best = lane;
      }
    }
    token_ids[token] = outputs[best] == kNoOutput ? -1 : outputs[best];
  }
}

}  // namespace

torch::Tensor amx_greedy_tokens(const torch::Tensor& x, const torch::Tensor& packed, int64_t weight_rows,
                                int64_t vocab_size, const std::optional<torch::Tensor>& bitmask) {
  TORCH_CHECK(amx_usable(), "this CPU (or process) cannot use AMX tiles");
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32),
              "x must be a 2-d bf16 or fp32 tensor");
  TORCH_CHECK(0 < vocab_size && vocab_size <= weight_rows, "vocab_size must be in [1, weight_rows]");
  const int64_t num_tokens = x.size(0), columns = x.size(1);
  check_amx_weight(packed, weight_rows, columns, "packed");
  const int32_t* bitmask_data = nullptr;
  int64_t bitmask_words = 0;
  if (bitmask.has_value() && bitmask->defined()) {
    TORCH_CHECK(bitmask->device().is_cpu() && bitmask->scalar_type() == torch::kInt32 && bitmask->is_contiguous() &&
                    bitmask->dim() == 2 && bitmask->size(0) == num_tokens &&
                    bitmask->size(1) >= amx_blocks(vocab_size, 32),
                "bitmask must be a contiguous CPU int32 tensor of [num_tokens, ceil(vocab_size / 32)] words");
    bitmask_data = bitmask->data_ptr<int32_t>();
    bitmask_words = bitmask->size(1);
  }
  torch::Tensor token_ids = torch::empty({num_tokens}, torch::kInt64);
  if (num_tokens == 0) {
    return token_ids;
  }
  const uint16_t* packed_bits = bf16_bits(packed);
  if (x.scalar_type() == torch::kFloat32) {
    amx_greedy_kernel(x.data_ptr<float>(), x.stride(0), num_tokens, packed_bits, columns, vocab_size, bitmask_data,
                      bitmask_words, token_ids.data_ptr<int64_t>());
  } else {
    amx_greedy_kernel(bf16_bits(x), x.stride(0), num_tokens, packed_bits, columns, vocab_size, bitmask_data,
                      bitmask_words, token_ids.data_ptr<int64_t>());
  }
  return token_ids;
}

torch::Tensor amx_gate_up_silu(const torch::Tensor& x, const torch::Tensor& packed, int64_t inter,
                               const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(amx_usable(), "this CPU (or process) cannot use AMX tiles");
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32),
              "x must be a 2-d bf16 or fp32 tensor");
  TORCH_CHECK(inter > 0 && amx_gate_up_fuses(inter), "inter must be a positive multiple of ", kAmxRows);
  const int64_t num_tokens = x.size(0), columns = x.size(1);
  check_amx_weight(packed, 2 * inter, columns, "packed");
  const float* bias_data = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                    bias->numel() == 2 * inter,
                "bias must be a contiguous CPU fp32 tensor of ", 2 * inter, " elements");
    bias_data = bias->data_ptr<float>();
  }
  // Filled with NaN: every element the kernel owns (padding included) must be written.
  torch::Tensor act_tiles = torch::full({amx_blocks(num_tokens, kAmxRows), amx_blocks(inter, kAmxColumns), kAmxRows,
                                         kAmxColumns},
                                        std::numeric_limits<float>::quiet_NaN(), torch::kBFloat16);
  uint16_t* tiles = reinterpret_cast<uint16_t*>(act_tiles.data_ptr<at::BFloat16>());
  if (x.scalar_type() == torch::kFloat32) {
    amx_gate_up_silu_kernel(x.data_ptr<float>(), x.stride(0), num_tokens, bf16_bits(packed), inter, columns,
                            bias_data, tiles);
  } else {
    amx_gate_up_silu_kernel(bf16_bits(x), x.stride(0), num_tokens, bf16_bits(packed), inter, columns, bias_data,
                            tiles);
  }
  return act_tiles;
}

torch::Tensor pack_amx_weight(const torch::Tensor& weight) {
  check_rows(weight, "weight");
  const bool bf16_or_fp32 = weight.scalar_type() == torch::kBFloat16 || weight.scalar_type() == torch::kFloat32;
  TORCH_CHECK(weight.dim() == 2 && bf16_or_fp32, "weight must be a 2-d bf16 or fp32 tensor");
  // An fp32 weight rounded to bf16 as torch rounds (to nearest even); a bf16 one is read in place.
  const torch::Tensor source = weight.scalar_type() == torch::kBFloat16 ? weight : weight.to(torch::kBFloat16);
  check_rows(source, "weight");
  const int64_t rows = source.size(0), columns = source.size(1);
  const int64_t output_blocks = amx_blocks(rows, kAmxRows), depth_blocks = amx_blocks(columns, kAmxColumns);
  torch::Tensor packed = torch::zeros({output_blocks, depth_blocks, kAmxRows, kAmxRows, 2}, source.options());
  const uint16_t* bits = bf16_bits(source);
  uint16_t* target = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t row_stride = source.stride(0);
  at::parallel_for(0, output_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      for (int64_t j = 0; j < std::min(kAmxRows, rows - block * kAmxRows); ++j) {
        const uint16_t* row = bits + (block * kAmxRows + j) * row_stride;
        for (int64_t column = 0; column < columns; ++column) {
          const int64_t depth = column / kAmxColumns, within = column % kAmxColumns;
          target[((block * depth_blocks + depth) * kAmxRows + within / 2) * kAmxRows * 2 + j * 2 + within % 2] =
              row[column];
        }
      }
    }
  });
  return packed;
}

void check_amx_weight(const torch::Tensor& packed, int64_t rows, int64_t columns, const char* name) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() &&
                  packed.dim() == 5,
              name, " must be a contiguous 5-d CPU bf16 tensor from pack_amx_weight");
  TORCH_CHECK(packed.size(0) == amx_blocks(rows, kAmxRows) && packed.size(1) == amx_blocks(columns, kAmxColumns) &&
                  packed.size(2) == kAmxRows && packed.size(3) == kAmxRows && packed.size(4) == 2,
              name, " must be pack_amx_weight of a [", rows, ", ", columns, "] weight");
}

void amx_linear(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& packed,
                const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(amx_usable(), "this CPU (or process) cannot use AMX tiles");
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "x and out must be 2-d");
  const auto is_bf16_or_fp32 = [](const torch::Tensor& tensor) {
    return tensor.scalar_type() == torch::kBFloat16 || tensor.scalar_type() == torch::kFloat32;
  };
  TORCH_CHECK(is_bf16_or_fp32(x) && is_bf16_or_fp32(out), "amx_linear takes bf16 or fp32 x and out");
  TORCH_CHECK(out.size(0) == x.size(0), "x and out must have one row per token");
  const int64_t num_tokens = x.size(0), columns = x.size(1), rows = out.size(1);
  check_amx_weight(packed, rows, columns, "packed");
  const float* bias_data = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                    bias->numel() == rows,
                "bias must be a contiguous CPU fp32 tensor of ", rows, " elements");
    bias_data = bias->data_ptr<float>();
  }
  const uint16_t* packed_bits = bf16_bits(packed);
  const auto run = [&](const auto* x_data) {
    if (out.scalar_type() == torch::kFloat32) {
      amx_linear_kernel(x_data, x.stride(0), num_tokens, packed_bits, rows, columns, bias_data,
                        out.data_ptr<float>(), out.stride(0));
    } else {
      amx_linear_kernel(x_data, x.stride(0), num_tokens, packed_bits, rows, columns, bias_data,
                        reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), out.stride(0));
    }
  };
  if (x.scalar_type() == torch::kFloat32) {
    run(x.data_ptr<float>());
  } else {
    run(bf16_bits(x));
  }
}

}  // namespace pagedserve

#endif
