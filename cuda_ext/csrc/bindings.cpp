// The Python module: every kernel's torch entry point and DecodeStack, registered in one place.
#include <torch/python.h>

#include "attention.h"
#include "decode_stack.h"
#include "elementwise.h"
#include "gemm_panels.h"
#include "greedy_screen.h"
#include "simd.h"

using namespace pagedserve;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention over the KV cache");
  // Without the GIL: the worker's other threads (Ray's RPC) go on meanwhile.
  module.def("paged_prefill_attention", &paged_prefill_attention, "Paged prefill attention over the KV cache",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("reshape_and_cache", &reshape_and_cache, "Write new keys and values into the paged cache");
  module.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = RMSNorm(residual), in place");
  module.def("rotary_embedding", &rotary_embedding, "NeoX rotary embedding of query and key, in place");
  module.def("silu_and_mul", &silu_and_mul, "silu(first half) * second half");
  module.def("linear_tokens", &linear_tokens, "x @ weight^T for fp32 tokens, each weight streamed from memory once");
  module.def("pack_panels", &pack_panels, "an fp32 weight in the panel layout panel_linear reads");
  module.def("panel_linear", &panel_linear, "x @ weight^T for fp32 tokens on a pack_panels weight");
  module.def("screened_greedy", &screened_greedy, "exact greedy tokens from bf16 logits and fp32 candidates",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  // fp32 lanes per vector register of this build: how far linear_tokens beats a GEMM library depends on it.
  module.attr("vector_lanes") = kLanes;
  module.attr("panel_width") = kPanelWidth;
  pybind11::class_<DecodeStack>(module, "DecodeStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, int64_t>(), pybind11::arg("num_heads"),
           pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"), pybind11::arg("eps"), pybind11::arg("scale"),
           pybind11::arg("sliding_window"))
      .def("add_layer", &DecodeStack::add_layer)
      // The whole stack runs without the GIL: the actor's other threads (Ray's RPC, the next step's plan) go on.
      .def("forward", &DecodeStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_property_readonly("last_step_handoffs", &DecodeStack::last_step_handoffs);
}
