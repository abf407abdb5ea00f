// Exact greedy sampling from bf16 logits: fp32 dot products only for the tokens that may still be the argmax.
#include "greedy_screen.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "checks.h"
#include "gemm_panels.h"
#include "simd.h"

namespace pagedserve {

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

}  // namespace pagedserve
