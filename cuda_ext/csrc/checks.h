// Argument checks the torch entry points share.
#pragma once

#include <torch/types.h>

namespace pagedserve {

inline void check_rows(const torch::Tensor& tensor, const char* name) {
  TORCH_CHECK(tensor.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(tensor.stride(-1) == 1, name, " must have contiguous rows");
}

}  // namespace pagedserve
