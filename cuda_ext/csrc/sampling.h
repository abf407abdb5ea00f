// One random draw per row from logits: temperature, softmax and the two-level inverse CDF of model_executor/sampler.py
// in one kernel, without the float copies and full-vocabulary passes of the torch composition.
#pragma once

#include <torch/types.h>

#include <cstdint>

namespace pagedserve {

// Tokens of a block of the two-level draw (model_executor/sampler.py _BLOCK).
constexpr int64_t kDrawBlock = 256;

// int64 [rows]: row r's token drawn from exp((logits[r] - max) / temperatures[r]) with uniforms[r] in [0, 1): the
// first block of kDrawBlock tokens whose float64 cumulative mass exceeds uniforms[r] * total (at most the last block
// with mass), then the first token inside it whose cumulative mass exceeds the rest of the draw (at most its last
// with mass), as sampler._inverse_cdf_sample draws. logits: bf16 or fp32 [rows, vocab] with contiguous rows;
// temperatures: fp32 [rows], each > 0; uniforms: float64 [rows]. A row without mass (no finite logit) gets 0.
torch::Tensor sample_from_logits(const torch::Tensor& logits, const torch::Tensor& temperatures,
                                 const torch::Tensor& uniforms);

}  // namespace pagedserve
