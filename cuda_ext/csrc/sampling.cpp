// One random draw per row from logits (sampling.h): a pass for the row's max, one for each block's mass, and one over
// the chosen block's tokens; a thread per row.
#include "sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "bf16_lanes.h"
#include "checks.h"
#include "parallel.h"
#include "simd.h"

namespace pagedserve {
namespace {

template <typename scalar_t>
float row_max(const scalar_t* row, int64_t vocab) {
  Lanes best = broadcast(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kLanes <= vocab; i += kLanes) {
    const Lanes values = load_row_lanes(row + i);
    best = values > best ? values : best;
  }
  float max = max_lanes(best);
  for (; i < vocab; ++i) {
    max = std::max(max, static_cast<float>(row[i]));
  }
  return max;
}

// Below this exp's result is no normal float (exp_lanes would clamp it there): the token weighs nothing, as a
// masked (-inf) logit does.
constexpr float kLowestExponent = -87.f;

// The unnormalised probabilities exp((logit - max) / temperature) of `count` tokens (the top token's exactly 1; a
// NaN weighs nothing) into `weights`; returns their float32 sum.
template <typename scalar_t>
float block_weights(const scalar_t* logits, int64_t count, float max, float temperature, float* weights) {
  const Lanes row_max_lanes = broadcast(max), temperature_lanes = broadcast(temperature);
  const Lanes lowest = broadcast(kLowestExponent);
  Lanes sum = {};
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    const Lanes exponent = (load_row_lanes(logits + i) - row_max_lanes) / temperature_lanes;
    // NaN compares false: it weighs nothing too.
    const Lanes weight = exponent >= lowest ? exp_lanes(exponent) : Lanes{};
    store_lanes(weights + i, weight);
    sum += weight;
  }
  float total = sum_lanes(sum);
  for (; i < count; ++i) {
    const float exponent = (static_cast<float>(logits[i]) - max) / temperature;
    weights[i] = exponent >= kLowestExponent ? std::exp(exponent) : 0.f;
    total += weights[i];
  }
  return total;
}

// The first index whose value exceeds `value` in a nondecreasing run (searchsorted, right=True), at most `last`.
inline int64_t first_above(const std::vector<double>& cumulative, int64_t count, double value, int64_t last) {
  const int64_t index = std::upper_bound(cumulative.begin(), cumulative.begin() + count, value) - cumulative.begin();
  return std::min(index, last);
}

// The first index whose cumulative mass reaches the total: the last with mass.
inline int64_t last_with_mass(const std::vector<double>& cumulative, int64_t count) {
  return std::lower_bound(cumulative.begin(), cumulative.begin() + count, cumulative[count - 1]) - cumulative.begin();
}

template <typename scalar_t>
int64_t draw_row(const scalar_t* row, int64_t vocab, float temperature, double uniform, std::vector<double>& masses,
                 std::vector<double>& inner) {
  const float max = row_max(row, vocab);
  const int64_t num_blocks = (vocab + kDrawBlock - 1) / kDrawBlock;
  alignas(64) float weights[kDrawBlock];
  double running = 0.0;
  for (int64_t block = 0; block < num_blocks; ++block) {
    const int64_t count = std::min(kDrawBlock, vocab - block * kDrawBlock);
    running += static_cast<double>(block_weights(row + block * kDrawBlock, count, max, temperature, weights));
    masses[block] = running;
  }
  const double total = running;
  if (!(total > 0.0) || !std::isfinite(total)) {
    return 0;
  }
  const double target = uniform * total;
  const int64_t block = first_above(masses, num_blocks, target, last_with_mass(masses, num_blocks));
  const double before = block > 0 ? masses[block - 1] : 0.0;
  const int64_t count = std::min(kDrawBlock, vocab - block * kDrawBlock);
  block_weights(row + block * kDrawBlock, count, max, temperature, weights);
  double inner_running = 0.0;
  for (int64_t i = 0; i < count; ++i) {
    inner_running += static_cast<double>(weights[i]);
    inner[i] = inner_running;
  }
  const double inner_total = inner_running;
  if (!(inner_total > 0.0)) {
    return block * kDrawBlock;
  }
  // The block's float64 mass can differ from its float32 sum by rounding: the draw's position as a fraction of it.
  const double fraction = std::clamp((target - before) / inner_total, 0.0, 1.0);
  return block * kDrawBlock + first_above(inner, count, fraction * inner_total, last_with_mass(inner, count));
}

}  // namespace

torch::Tensor sample_from_logits(const torch::Tensor& logits, const torch::Tensor& temperatures,
                                 const torch::Tensor& uniforms) {
  check_rows(logits, "logits");
  const bool bf16_or_fp32 = logits.scalar_type() == torch::kBFloat16 || logits.scalar_type() == torch::kFloat32;
  TORCH_CHECK(logits.dim() == 2 && bf16_or_fp32, "logits must be a 2-d bf16 or fp32 tensor");
  const int64_t num_rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "logits must have at least one column");
  TORCH_CHECK(temperatures.device().is_cpu() && temperatures.scalar_type() == torch::kFloat32 &&
                  temperatures.is_contiguous() && temperatures.numel() == num_rows,
              "temperatures must be a contiguous CPU fp32 tensor of one value per row");
  TORCH_CHECK(uniforms.device().is_cpu() && uniforms.scalar_type() == torch::kFloat64 && uniforms.is_contiguous() &&
                  uniforms.numel() == num_rows,
              "uniforms must be a contiguous CPU float64 tensor of one value per row");
  const float* temperature = temperatures.data_ptr<float>();
  const double* uniform = uniforms.data_ptr<double>();
  for (int64_t row = 0; row < num_rows; ++row) {
    TORCH_CHECK(temperature[row] > 0.f && std::isfinite(temperature[row]), "temperatures must be positive");
  }
  torch::Tensor tokens = torch::empty({num_rows}, torch::kInt64);
  int64_t* token = tokens.data_ptr<int64_t>();
  const int64_t row_stride = logits.stride(0);
  const auto draw_rows = [&](const auto* rows) {
    parallel_claims(num_rows, vocab, 1, [&](int64_t begin, int64_t end) {
      std::vector<double> masses((vocab + kDrawBlock - 1) / kDrawBlock), inner(kDrawBlock);
      for (int64_t row = begin; row < end; ++row) {
        token[row] = draw_row(rows + row * row_stride, vocab, temperature[row], uniform[row], masses, inner);
      }
    });
  };
  if (logits.scalar_type() == torch::kFloat32) {
    draw_rows(logits.data_ptr<float>());
  } else {
    draw_rows(logits.data_ptr<c10::BFloat16>());
  }
  return tokens;
}

}  // namespace pagedserve
