// The torch entry points of the fused elementwise kernels: each dispatches on dtype and spreads rows over threads.
#include "elementwise.h"

#include <ATen/Dispatch.h>

#include <cstring>

#include "checks.h"
#include "parallel.h"

namespace pagedserve {

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

}  // namespace pagedserve
