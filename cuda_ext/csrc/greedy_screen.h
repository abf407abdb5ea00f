// Exact greedy tokens from bf16 logits.
#pragma once

#include <torch/types.h>

#include <cstdint>

namespace pagedserve {

// Greedy next tokens from bf16 logits, exactly: row r's token is the argmax of its fp32 logits x[r] . weight[i]
// (linear_tokens_kernel's sums), computed only for the tokens whose bf16 logit may still be the best. A bf16 logit
// a(i) differs from the fp32 one by at most input_rounding * |x[r]| * |weight[i]| (both operands rounded to bf16;
// Cauchy-Schwarz bounds sum |x w|) plus output_rounding * |a(i)| (the result rounded to bf16) plus slack;
// a token whose a(i) + error(i) falls below the largest a(j) - error(j) cannot be the argmax. Candidates are kept
// in token order, so equal maxima resolve to the first, as argmax does. A row with more than max_candidates
// candidates, or a non-finite bf16 logit, gets -1: its caller computes that row's fp32 logits in full.
torch::Tensor screened_greedy(const torch::Tensor& approx_logits, const torch::Tensor& x, const torch::Tensor& weight,
                              const torch::Tensor& row_norms, double input_rounding, double output_rounding,
                              double slack, int64_t max_candidates);

}  // namespace pagedserve
