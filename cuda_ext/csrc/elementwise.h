// Fused per-token elementwise kernels: residual add + RMSNorm, per-head RMSNorm, NeoX rotary embedding,
// SiLU-and-mul, and the KV-cache write. The row helpers are inline: DecodeStack runs them per token, inside its own
// loops.
#pragma once

#include <torch/types.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "bf16_lanes.h"
#include "simd.h"

namespace pagedserve {

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

// bf16: widened to fp32 lanes, the product rounded once.
template <>
inline void silu_and_mul_row<c10::BFloat16>(
    c10::BFloat16* out, const c10::BFloat16* gate, const c10::BFloat16* up, int64_t count) {
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    const Lanes g = widen_bf16_lanes(gate + i);
    narrow_bf16_lanes(out + i, g / (1.f + exp_lanes(-g)) * widen_bf16_lanes(up + i));
  }
  for (; i < count; ++i) {
    const float g = static_cast<float>(gate[i]);
    out[i] = static_cast<c10::BFloat16>(g / (1.f + std::exp(-g)) * static_cast<float>(up[i]));
  }
}

// The fp32 or bf16 row of fused_add_rms_norm in vector lanes; false (nothing done) for other dtypes and widths.
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

// bf16 with the scalar bf16 row's rounding points (HF's): the sum stored as bf16 and squared as stored, the normed
// row rounded to bf16 before the weight multiplies it, the product rounded once more.
template <>
inline bool add_rms_norm_row_lanes<c10::BFloat16>(
    c10::BFloat16* x, c10::BFloat16* residual, const c10::BFloat16* weight, int64_t hidden, float eps) {
  if (hidden % kLanes != 0) {
    return false;
  }
  Lanes squares = {};
  for (int64_t i = 0; i < hidden; i += kLanes) {
    narrow_bf16_lanes(residual + i, widen_bf16_lanes(x + i) + widen_bf16_lanes(residual + i));
    const Lanes stored = widen_bf16_lanes(residual + i);
    squares += stored * stored;
  }
  const float inverse_rms = 1.f / std::sqrt(sum_lanes(squares) / hidden + eps);
  alignas(64) c10::BFloat16 normed[kLanes];
  for (int64_t i = 0; i < hidden; i += kLanes) {
    narrow_bf16_lanes(normed, widen_bf16_lanes(residual + i) * inverse_rms);
    narrow_bf16_lanes(x + i, widen_bf16_lanes(weight + i) * widen_bf16_lanes(normed));
  }
  return true;
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

// In place, each of one token's `num_heads` contiguous fp32 heads: x = weight * (x / rms(x)), Qwen 3's RMSNorm of
// every query and key head over head_dim (one weight for all heads).
inline void rms_norm_heads(float* heads, int64_t num_heads, int64_t head_dim, const float* weight, float eps) {
  const bool lanes = head_dim % kLanes == 0;
  for (int64_t head = 0; head < num_heads; ++head) {
    float* x = heads + head * head_dim;
    float squares = 0.f;
    if (lanes) {
      Lanes sum = {};
      for (int64_t i = 0; i < head_dim; i += kLanes) {
        const Lanes values = load_lanes(x + i);
        sum += values * values;
      }
      squares = sum_lanes(sum);
    } else {
      for (int64_t i = 0; i < head_dim; ++i) {
        squares += x[i] * x[i];
      }
    }
    const float inverse_rms = 1.f / std::sqrt(squares / head_dim + eps);
    for (int64_t i = 0; i < head_dim; ++i) {
      x[i] = weight[i] * (x[i] * inverse_rms);
    }
  }
}

// One token's `num_heads` heads, `head_stride` apart, rotated in place (NeoX halves) by fp32 cos/sin rows. The
// compiler vectorizes this loop for bf16 as well (explicit lanes were no faster).
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

// key/value [tokens, kv_heads, head_dim] into caches [blocks, block_size, kv_heads, head_dim] at flat slots;
// slot -1 (a padding row) is skipped.
void reshape_and_cache(
    const torch::Tensor& key,
    const torch::Tensor& value,
    torch::Tensor& key_cache,
    torch::Tensor& value_cache,
    const torch::Tensor& slot_mapping);

// In place: residual += x; x = weight * residual / rms(residual). Rows of `hidden` floats, fp32 math.
void fused_add_rms_norm(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight, double eps);

// query [tokens, heads, head_dim], key [tokens, kv_heads, head_dim], rotated in place (NeoX halves) by
// cos/sin [tokens, ..., head_dim / 2] fp32 rows.
void rotary_embedding(torch::Tensor& query, torch::Tensor& key, const torch::Tensor& cos, const torch::Tensor& sin);

// out [tokens, inter] = silu(x[:, :inter]) * x[:, inter:], x [tokens, 2 * inter].
void silu_and_mul(torch::Tensor& out, const torch::Tensor& x);

}  // namespace pagedserve
