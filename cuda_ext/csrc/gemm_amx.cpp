// bf16 linears on AMX tiles: x is copied once into zero-padded bf16 rows, each thread takes pairs of 16-output
// weight blocks (per panel of x's tokens), and per pair runs each 32-token block of the panel through TDPBF16PS
// into four 16 x 16 fp32 tiles.
#include "gemm_amx.h"

#if defined(PAGEDSERVE_HAS_AMX)

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "checks.h"
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

// Per call and thread: another library (oneDNN) may have loaded its own shapes on this thread since.
void load_tile_config() {
  TileConfig config{};
  config.palette = 1;
  for (int tile = 0; tile < 8; ++tile) {
    config.bytes_per_row[tile] = 64;
    config.rows[tile] = kAmxRows;
  }
  _tile_loadconfig(&config);
}

// Tiles: 0-3 the sums (token block 0 or 1 x output block 0 or 1), 4-5 x's two token blocks, 6-7 the two weight
// blocks. kTokenBlocks and kOutputBlocks (1 or 2) say which of them a block at the edge uses.
template <int kTokenBlocks, int kOutputBlocks>
void run_tile_block(const uint16_t* x_rows, int64_t x_row_bytes, const uint16_t* weight_0, const uint16_t* weight_1,
                    int64_t depth_blocks, float* sums) {
  _tile_zero(0);
  if constexpr (kOutputBlocks == 2) _tile_zero(1);
  if constexpr (kTokenBlocks == 2) {
    _tile_zero(2);
    if constexpr (kOutputBlocks == 2) _tile_zero(3);
  }
  const uint16_t* x_second = x_rows + kAmxRows * (x_row_bytes / 2);
  for (int64_t depth = 0; depth < depth_blocks; ++depth) {
    // Past the block's end this runs into the next block: the one read next.
    prefetch_tile(weight_0 + (depth + kPrefetchDepth) * kTileElements);
    if constexpr (kOutputBlocks == 2) prefetch_tile(weight_1 + (depth + kPrefetchDepth) * kTileElements);
    // Loads in the order the previous step's products free their tiles (x 0 after product 1, weight 0 after 2),
    // each just before its own first product: the first loads overlap the previous step's last products.
    _tile_loadd(4, x_rows + depth * kAmxColumns, x_row_bytes);
    _tile_loadd(6, weight_0 + depth * kTileElements, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kOutputBlocks == 2) {
      _tile_loadd(7, weight_1 + depth * kTileElements, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (kTokenBlocks == 2) {
      _tile_loadd(5, x_second + depth * kAmxColumns, x_row_bytes);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (kOutputBlocks == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t kSumRowBytes = kBlockSpan * sizeof(float);
  _tile_stored(0, sums, kSumRowBytes);
  if constexpr (kOutputBlocks == 2) _tile_stored(1, sums + kAmxRows, kSumRowBytes);
  if constexpr (kTokenBlocks == 2) {
    _tile_stored(2, sums + kAmxRows * kBlockSpan, kSumRowBytes);
    if constexpr (kOutputBlocks == 2) _tile_stored(3, sums + kAmxRows * kBlockSpan + kAmxRows, kSumRowBytes);
  }
}

using TileBlock = void (*)(const uint16_t*, int64_t, const uint16_t*, const uint16_t*, int64_t, float*);
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

// One x row into the padded copy: rounded to bf16, zero past the row's last column.
inline void copy_row(uint16_t* target, const float* source, int64_t columns, int64_t padded_columns) {
  floats_to_bf16(target, source, columns);
  std::fill(target + columns, target + padded_columns, uint16_t{0});
}

inline void copy_row(uint16_t* target, const uint16_t* source, int64_t columns, int64_t padded_columns) {
  std::memcpy(target, source, columns * sizeof(uint16_t));
  std::fill(target + columns, target + padded_columns, uint16_t{0});
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

template <typename In, typename Out>
void amx_linear_kernel(const In* x, int64_t x_stride, int64_t num_tokens, const uint16_t* packed, int64_t rows,
                       int64_t columns, const float* bias, Out* out, int64_t out_stride) {
  if (num_tokens == 0 || rows == 0) {
    return;
  }
  const int64_t token_blocks = amx_blocks(num_tokens, kAmxRows);
  const int64_t depth_blocks = amx_blocks(columns, kAmxColumns);
  const int64_t padded_columns = depth_blocks * kAmxColumns;
  // Whole token blocks of zero-padded rows: the tiles read 16 rows of 32 columns at a time.
  thread_local std::vector<uint16_t> x_copy;
  x_copy.resize(token_blocks * kAmxRows * padded_columns);
  for (int64_t token = 0; token < num_tokens; ++token) {
    copy_row(x_copy.data() + token * padded_columns, x + token * x_stride, columns, padded_columns);
  }
  std::fill(x_copy.begin() + num_tokens * padded_columns, x_copy.end(), uint16_t{0});
  const uint16_t* x_rows = x_copy.data();
  const int64_t x_row_bytes = padded_columns * int64_t{sizeof(uint16_t)};
  const int64_t output_blocks = amx_blocks(rows, kAmxRows);
  const int64_t block_elements = depth_blocks * kTileElements;
  const int64_t output_pairs = (output_blocks + 1) / 2;
  const int64_t panel_blocks = std::max<int64_t>(2, kPanelBytes / (x_row_bytes * kBlockSpan) * 2);
  const int64_t num_panels = amx_blocks(token_blocks, panel_blocks);
  // Items panel by panel: a thread's contiguous share runs each of its panels past consecutive weight pairs.
  const int64_t work_per_item = 2 * block_elements * std::min(panel_blocks, token_blocks);
  parallel_claims(num_panels * output_pairs, work_per_item, 1, [&](int64_t begin, int64_t end) {
    load_tile_config();
    alignas(64) float sums[kBlockSpan * kBlockSpan];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t pair = item % output_pairs;
      const int64_t first_token_block = item / output_pairs * panel_blocks;
      const int64_t end_token_block = std::min(token_blocks, first_token_block + panel_blocks);
      const int64_t first_block = 2 * pair;
      const int64_t num_output_blocks = std::min<int64_t>(2, output_blocks - first_block);
      const uint16_t* weight_0 = packed + first_block * block_elements;
      const int64_t first_output = first_block * kAmxRows;
      const int64_t num_outputs = std::min(kBlockSpan, rows - first_output);
      for (int64_t token_block = first_token_block; token_block < end_token_block; token_block += 2) {
        const int64_t num_token_blocks = std::min<int64_t>(2, token_blocks - token_block);
        kTileBlocks[num_token_blocks - 1][num_output_blocks - 1](x_rows + token_block * kAmxRows * padded_columns,
                                                                 x_row_bytes, weight_0, weight_0 + block_elements,
                                                                 depth_blocks, sums);
        const int64_t first_token = token_block * kAmxRows;
        const int64_t block_tokens = std::min(kBlockSpan, num_tokens - first_token);
        for (int64_t half = 0; half * kAmxRows < num_outputs; ++half) {
          const int64_t width = std::min(kAmxRows, num_outputs - half * kAmxRows);
          const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1);
          const float* half_bias = bias == nullptr ? nullptr : bias + first_output + half * kAmxRows;
          for (int64_t row = 0; row < block_tokens; ++row) {
            store_row(out + (first_token + row) * out_stride + first_output + half * kAmxRows,
                      sums + row * kBlockSpan + half * kAmxRows, half_bias, mask);
          }
        }
      }
    }
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
