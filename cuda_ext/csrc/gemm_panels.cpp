// fp32 linear layers for a step's few tokens: a register-blocked dot-product kernel on the plain weight and an
// outer-product kernel on a panel-packed copy, each streaming the weight from memory once.
#include "gemm_panels.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "checks.h"
#include "parallel.h"

namespace pagedserve {
namespace {

// y = x W^T for fp32 tokens, register-blocked: kBlockRows weight rows x kBlockTokens tokens of dot products in
// registers, so each load of a weight vector feeds kBlockTokens FMAs and each load of x feeds kBlockRows. A group
// of weight rows streams from memory once (the next group is prefetched while this one computes) and is reread
// from L1 for the step's later tokens; oneDNN's GEMM stalls on that stream when the weight is not in cache.
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
      // loads per 24 FMAs), more than a core with one 512-bit load a cycle can feed.
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

}  // namespace

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
// per output and rereads x per group of four rows; this one outruns both it and oneDNN's packed GEMM.

namespace {

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

// Panels a claim holds at least: the next panel's prefetch works within a claim.
constexpr int64_t kClaimPanelsMin = 2;

}  // namespace

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

#if defined(__AVX512BF16__)
// y = x W^T for bf16 tokens on a bf16 panel-packed weight, fp32 sums: the fp32 panel kernel's scheme with
// VDPBF16PS in place of the FMA. A panel stores its columns in pairs ([panels, column pairs, kBf16PanelWidth, 2]),
// so one 512-bit load holds 16 outputs' weights for two columns, and one instruction adds both columns' products
// for a token (its pair of x values broadcast to every lane) to 16 fp32 sums. The panel is half the bytes of the
// fp32 one: one token, which only streams the weight, runs at the memory's read rate on half the bytes.

namespace {

// Cache lines of one column pair of a bf16 panel: what a tile asks for per pair at most.
constexpr int64_t kBf16PairLines = (kBf16PanelWidth * 2 * int64_t{sizeof(uint16_t)} + kCacheLine - 1) / kCacheLine;

// x's bf16 values at `pair` and pair + 1 in every 32-bit lane (the lower address in the lower half, as the panel's).
inline __m512bh broadcast_pair(const uint16_t* pair) {
  int32_t bits;
  std::memcpy(&bits, pair, sizeof(bits));
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(bits));
}

inline void store_sums(float* target, __m512 sums) {
  _mm512_storeu_ps(target, sums);
}

inline void store_sums(uint16_t* target, __m512 sums) {
  const __m256bh rounded = _mm512_cvtneps_pbh(sums);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(target), reinterpret_cast<const __m256i&>(rounded));
}

template <int64_t kTokens, typename Out>
void bf16_panel_tile(const uint16_t* x, int64_t x_stride, const uint16_t* panel, int64_t columns, Out* out,
                     int64_t out_stride, int64_t valid_width, PanelPrefetch prefetch) {
  constexpr int64_t kPairElements = kBf16PanelWidth * 2;
  __m512 sums[kTokens][kBf16PanelVectors];
#pragma GCC unroll 8
  for (int64_t t = 0; t < kTokens; ++t) {
#pragma GCC unroll 4
    for (int64_t v = 0; v < kBf16PanelVectors; ++v) {
      sums[t][v] = _mm512_setzero_ps();
    }
  }
  const auto add_pair = [&](const uint16_t* weights, const auto& x_pair_of) {
    __m512bh w[kBf16PanelVectors];
#pragma GCC unroll 4
    for (int64_t v = 0; v < kBf16PanelVectors; ++v) {
      w[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(weights + v * 32));
    }
#pragma GCC unroll 8
    for (int64_t t = 0; t < kTokens; ++t) {
      const __m512bh xs = x_pair_of(t);
#pragma GCC unroll 4
      for (int64_t v = 0; v < kBf16PanelVectors; ++v) {
        sums[t][v] = _mm512_dpbf16_ps(sums[t][v], xs, w[v]);
      }
    }
  };
  const int64_t full_pairs = columns / 2;
  for (int64_t pair = 0; pair < full_pairs; ++pair) {
    const char* line = prefetch.start + ((pair * prefetch.bytes_per_column_fp) >> 16);
#pragma GCC unroll 4
    for (int64_t i = 0; i < kBf16PairLines; ++i) {
      _mm_prefetch(line + i * kCacheLine, _MM_HINT_T1);
    }
    add_pair(panel + pair * kPairElements, [&](int64_t t) { return broadcast_pair(x + t * x_stride + 2 * pair); });
  }
  if (columns % 2 != 0) {
    // The last column alone: the panel's second weight is zero, and x's second value must be too (past the row x
    // may hold anything, NaN included, and 0 * NaN is NaN).
    add_pair(panel + full_pairs * kPairElements, [&](int64_t t) {
      return reinterpret_cast<__m512bh>(_mm512_set1_epi32(x[t * x_stride + columns - 1]));
    });
  }
  if (valid_width == kBf16PanelWidth) {
#pragma GCC unroll 8
    for (int64_t t = 0; t < kTokens; ++t) {
#pragma GCC unroll 4
      for (int64_t v = 0; v < kBf16PanelVectors; ++v) {
        store_sums(out + t * out_stride + v * 16, sums[t][v]);
      }
    }
    return;
  }
  // The last panel of a weight whose rows are not a multiple of kBf16PanelWidth: only its real outputs.
  for (int64_t t = 0; t < kTokens; ++t) {
    Out row[kBf16PanelWidth];
    for (int64_t v = 0; v < kBf16PanelVectors; ++v) {
      store_sums(row + v * 16, sums[t][v]);
    }
    std::memcpy(out + t * out_stride, row, valid_width * sizeof(Out));
  }
}

template <typename Out>
using Bf16PanelTile = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, Out*, int64_t, int64_t,
                               PanelPrefetch);

template <typename Out, int64_t... kCounts>
constexpr std::array<Bf16PanelTile<Out>, sizeof...(kCounts)> bf16_panel_tiles_by_count(
    std::integer_sequence<int64_t, kCounts...>) {
  return {&bf16_panel_tile<kCounts + 1, Out>...};
}

// bf16_panel_tile for 1 .. kBf16PanelTokens tokens: the last, shorter tile of a step's tokens takes its own count.
template <typename Out>
constexpr auto kBf16PanelTiles =
    bf16_panel_tiles_by_count<Out>(std::make_integer_sequence<int64_t, kBf16PanelTokens>{});

template <typename Out>
void run_bf16_panels(const uint16_t* x, int64_t x_stride, int64_t num_tokens, const uint16_t* packed, int64_t rows,
                     int64_t columns, Out* out, int64_t out_stride) {
  if (num_tokens == 0) {
    return;  // a step whose rows all skip this projection (nothing to sample)
  }
  const int64_t panels = num_bf16_panels(rows);
  const int64_t column_pairs = (columns + 1) / 2;
  const int64_t panel_elements = column_pairs * kBf16PanelWidth * 2;
  const int64_t num_tiles = (num_tokens + kBf16PanelTokens - 1) / kBf16PanelTokens;
  // Each tile asks for an equal part of the next panel, spread over its column pairs.
  const int64_t bytes_per_tile = (panel_elements * int64_t{sizeof(uint16_t)} + num_tiles - 1) / num_tiles;
  const int64_t bytes_per_pair_fp = (bytes_per_tile << 16) / column_pairs;
  parallel_claims(panels, panel_elements * num_tokens, kClaimPanelsMin, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint16_t* panel = packed + p * panel_elements;
      // Past the claim too, as the fp32 kernel does: most often the next panel is this thread's next claim.
      const char* next = reinterpret_cast<const char*>(p + 1 < panels ? panel + panel_elements : panel);
      const int64_t valid_width = std::min(kBf16PanelWidth, rows - p * kBf16PanelWidth);
      for (int64_t tile = 0; tile < num_tiles; ++tile) {
        const int64_t token = tile * kBf16PanelTokens;
        const PanelPrefetch prefetch{next + tile * bytes_per_tile, bytes_per_pair_fp};
        kBf16PanelTiles<Out>[std::min(kBf16PanelTokens, num_tokens - token) - 1](
            x + token * x_stride, x_stride, panel, columns, out + token * out_stride + p * kBf16PanelWidth,
            out_stride, valid_width, prefetch);
      }
    }
  });
}

const uint16_t* bf16_bits(const torch::Tensor& tensor) {
  return reinterpret_cast<const uint16_t*>(tensor.data_ptr<at::BFloat16>());
}

}  // namespace

void bf16_panel_linear_kernel(const uint16_t* x, int64_t x_stride, int64_t num_tokens, const uint16_t* packed,
                              int64_t rows, int64_t columns, float* out, int64_t out_stride) {
  run_bf16_panels(x, x_stride, num_tokens, packed, rows, columns, out, out_stride);
}

void bf16_panel_linear_kernel(const uint16_t* x, int64_t x_stride, int64_t num_tokens, const uint16_t* packed,
                              int64_t rows, int64_t columns, uint16_t* out, int64_t out_stride) {
  run_bf16_panels(x, x_stride, num_tokens, packed, rows, columns, out, out_stride);
}

torch::Tensor pack_bf16_panels(const torch::Tensor& weight) {
  check_rows(weight, "weight");
  const bool bf16_or_fp32 = weight.scalar_type() == torch::kBFloat16 || weight.scalar_type() == torch::kFloat32;
  TORCH_CHECK(weight.dim() == 2 && bf16_or_fp32, "weight must be a 2-d bf16 or fp32 tensor");
  // An fp32 weight rounded to bf16 as torch rounds (to nearest even); a bf16 one is read in place.
  const torch::Tensor source = weight.scalar_type() == torch::kBFloat16 ? weight : weight.to(torch::kBFloat16);
  check_rows(source, "weight");
  const int64_t rows = source.size(0), columns = source.size(1), panels = num_bf16_panels(rows);
  const int64_t column_pairs = (columns + 1) / 2;
  torch::Tensor packed = torch::zeros({panels, column_pairs, kBf16PanelWidth, 2}, source.options());
  const uint16_t* bits = bf16_bits(source);
  uint16_t* target = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t row_stride = source.stride(0);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      uint16_t* panel = target + p * column_pairs * kBf16PanelWidth * 2;
      for (int64_t j = 0; j < std::min(kBf16PanelWidth, rows - p * kBf16PanelWidth); ++j) {
        const uint16_t* row = bits + (p * kBf16PanelWidth + j) * row_stride;
        for (int64_t column = 0; column < columns; ++column) {
          panel[(column / 2 * kBf16PanelWidth + j) * 2 + column % 2] = row[column];
        }
      }
    }
  });
  return packed;
}

void check_bf16_panels(const torch::Tensor& packed, int64_t rows, int64_t columns, const char* name) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() &&
                  packed.dim() == 4,
              name, " must be a contiguous 4-d CPU bf16 tensor from pack_bf16_panels");
  TORCH_CHECK(packed.size(0) == num_bf16_panels(rows) && packed.size(1) == (columns + 1) / 2 &&
                  packed.size(2) == kBf16PanelWidth && packed.size(3) == 2,
              name, " must be pack_bf16_panels of a [", rows, ", ", columns, "] weight");
}

void bf16_panel_linear(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& packed) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), "x and out must be CPU tensors");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "x and out must be 2-d");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "x and out must have contiguous rows");
  const auto is_bf16_or_fp32 = [](const torch::Tensor& tensor) {
    return tensor.scalar_type() == torch::kBFloat16 || tensor.scalar_type() == torch::kFloat32;
  };
  TORCH_CHECK(is_bf16_or_fp32(x) && is_bf16_or_fp32(out), "bf16_panel_linear takes bf16 or fp32 x and out");
  TORCH_CHECK(out.size(0) == x.size(0), "x and out must have one row per token");
  const int64_t num_tokens = x.size(0), columns = x.size(1), rows = out.size(1);
  check_bf16_panels(packed, rows, columns, "packed");
  torch::Tensor x_bf16 = x;
  if (x.scalar_type() == torch::kFloat32) {
    // Rounded once per call, not once per panel.
    x_bf16 = torch::empty({num_tokens, columns}, x.options().dtype(torch::kBFloat16));
    uint16_t* target = reinterpret_cast<uint16_t*>(x_bf16.data_ptr<at::BFloat16>());
    const float* source = x.data_ptr<float>();
    for (int64_t token = 0; token < num_tokens; ++token) {
      floats_to_bf16(target + token * columns, source + token * x.stride(0), columns);
    }
  }
  const uint16_t* x_bits = bf16_bits(x_bf16);
  const uint16_t* packed_bits = bf16_bits(packed);
  if (out.scalar_type() == torch::kFloat32) {
    run_bf16_panels(x_bits, x_bf16.stride(0), num_tokens, packed_bits, rows, columns, out.data_ptr<float>(),
                    out.stride(0));
  } else {
    run_bf16_panels(x_bits, x_bf16.stride(0), num_tokens, packed_bits, rows, columns,
                    reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), out.stride(0));
  }
}
#endif

}  // namespace pagedserve
