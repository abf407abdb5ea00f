// fp32 linear layers for a step's tokens, y = x W^T: the dot-product kernel on a plain weight and the panel kernel
// on a pack_panels weight, and their torch entry points.
#pragma once

#include <torch/types.h>

#include <cstdint>

#include "simd.h"

namespace pagedserve {

// Weight rows per register block of linear_tokens_kernel: a multiple of it takes the vector path for every row.
constexpr int64_t kBlockRows = 4;

#if defined(__AVX512F__)
constexpr int64_t kPanelVectors = 3;  // 8 tokens x 3 vectors: 24 sums + 3 weight vectors + a broadcast
constexpr int64_t kPanelTokens = 8;
#else
constexpr int64_t kPanelVectors = 2;  // 16 registers: 6 tokens x 2 vectors, 12 sums + 2 weight vectors + a broadcast
constexpr int64_t kPanelTokens = 6;
#endif
// Output rows per panel of a pack_panels weight.
constexpr int64_t kPanelWidth = kPanelVectors * kLanes;

inline int64_t num_panels(int64_t rows) {
  return (rows + kPanelWidth - 1) / kPanelWidth;
}

// out [num_tokens, rows] (out_stride apart) = x [num_tokens, columns] (x_stride apart) @ weight [rows, columns]^T.
void linear_tokens_kernel(const float* x, int64_t x_stride, int64_t num_tokens, const float* weight,
                          int64_t row_stride, float* out, int64_t out_stride, int64_t rows, int64_t columns);

// The same product on `packed`, the weight as pack_panels lays it out.
void panel_linear_kernel(const float* x, int64_t x_stride, int64_t num_tokens, const float* packed, int64_t rows,
                         int64_t columns, float* out, int64_t out_stride);

// Fails unless `packed` is pack_panels of a [rows, columns] weight.
void check_panels(const torch::Tensor& packed, int64_t rows, int64_t columns, const char* name);

// out [tokens, rows] = x [tokens, columns] @ weight [rows, columns]^T, fp32: a few tokens through a linear layer.
void linear_tokens(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight);

// weight [rows, columns] fp32 -> [panels, columns, kPanelWidth]: panel p holds rows p * kPanelWidth on, column by
// column, zero past the last row (what panel_linear_kernel reads).
torch::Tensor pack_panels(const torch::Tensor& weight);

// out = x @ weight^T for fp32 tokens, the weight given as pack_panels(weight) (out's width is its row count).
void panel_linear(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& packed);

#if defined(__AVX512BF16__)
// bf16 linear layers with fp32 sums (VDPBF16PS: per fp32 lane, the products of one pair of bf16 values along the
// columns). Absent where the build target lacks AVX512-BF16: Python then keeps bf16 weights on oneDNN.
constexpr int64_t kBf16PanelVectors = 3;  // 8 tokens x 3 vectors: 24 sums + 3 weight vectors, x broadcast from memory
constexpr int64_t kBf16PanelTokens = 8;
// Output rows per panel of a pack_bf16_panels weight.
constexpr int64_t kBf16PanelWidth = kBf16PanelVectors * 16;

inline int64_t num_bf16_panels(int64_t rows) {
  return (rows + kBf16PanelWidth - 1) / kBf16PanelWidth;
}

// out [num_tokens, rows] (out_stride apart) = x [num_tokens, columns] (x_stride apart) @ weight^T, the weight given
// as pack_bf16_panels lays it out, x and the weight bf16 (bit patterns), sums fp32; out fp32 or rounded to bf16.
void bf16_panel_linear_kernel(const uint16_t* x, int64_t x_stride, int64_t num_tokens, const uint16_t* packed,
                              int64_t rows, int64_t columns, float* out, int64_t out_stride);
void bf16_panel_linear_kernel(const uint16_t* x, int64_t x_stride, int64_t num_tokens, const uint16_t* packed,
                              int64_t rows, int64_t columns, uint16_t* out, int64_t out_stride);

// Fails unless `packed` is pack_bf16_panels of a [rows, columns] weight.
void check_bf16_panels(const torch::Tensor& packed, int64_t rows, int64_t columns, const char* name);

// weight [rows, columns] bf16 (or fp32, rounded to bf16) -> bf16 [panels, (columns + 1) / 2, kBf16PanelWidth, 2]:
// packed[p, c, j, h] = weight[p * kBf16PanelWidth + j, 2 * c + h], zero past the last row and column (what
// bf16_panel_linear_kernel reads: one 512-bit load is 16 outputs x a pair of columns).
torch::Tensor pack_bf16_panels(const torch::Tensor& weight);

// out = x @ weight^T on pack_bf16_panels(weight): x bf16 or fp32 (rounded to bf16 once per call), out bf16 or fp32.
void bf16_panel_linear(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& packed);
#endif

}  // namespace pagedserve
