// The Python module: every kernel's torch entry point and DecodeStack, registered in one place.
#include <torch/python.h>

#include "attention.h"
#include "decode_stack.h"
#include "elementwise.h"
#include "gemm_amx.h"
#include "gemm_panels.h"
#include "greedy_screen.h"
#include "sampling.h"
#include "simd.h"

using namespace pagedserve;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  // soft_cap: a keyword with a default, so callers that predate it keep working.
  module.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention over the KV cache",
             pybind11::arg("output"), pybind11::arg("query"), pybind11::arg("key_cache"),
             pybind11::arg("value_cache"), pybind11::arg("block_tables"), pybind11::arg("seq_lens"),
             pybind11::arg("scale"), pybind11::arg("sliding_window"), pybind11::arg("soft_cap") = 0.0);
  // Without the GIL: the worker's other threads (Ray's RPC) go on meanwhile.
  module.def("paged_prefill_attention", &paged_prefill_attention, "Paged prefill attention over the KV cache",
             pybind11::arg("output"), pybind11::arg("query"), pybind11::arg("key_cache"),
             pybind11::arg("value_cache"), pybind11::arg("block_tables"), pybind11::arg("query_starts"),
             pybind11::arg("seq_lens"), pybind11::arg("scale"), pybind11::arg("sliding_window"),
             pybind11::arg("soft_cap") = 0.0, pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("reshape_and_cache", &reshape_and_cache, "Write new keys and values into the paged cache");
  module.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = RMSNorm(residual), in place");
  module.def("rotary_embedding", &rotary_embedding, "NeoX rotary embedding of query and key, in place");
  module.def("silu_and_mul", &silu_and_mul, "silu(first half) * second half");
  module.def("linear_tokens", &linear_tokens, "x @ weight^T for fp32 tokens, each weight streamed from memory once");
  module.def("pack_panels", &pack_panels, "an fp32 weight in the panel layout panel_linear reads");
  module.def("panel_linear", &panel_linear, "x @ weight^T for fp32 tokens on a pack_panels weight");
  module.def("sample_from_logits", &sample_from_logits,
             "one draw per row: temperature, softmax and the sampler's two-level inverse CDF on bf16 or fp32 logits",
             pybind11::arg("logits"), pybind11::arg("temperatures"), pybind11::arg("uniforms"),
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("screened_greedy", &screened_greedy, "exact greedy tokens from bf16 logits and fp32 candidates",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  // fp32 lanes per vector register of this build: how far linear_tokens beats a GEMM library depends on it.
  module.attr("vector_lanes") = kLanes;
  module.attr("panel_width") = kPanelWidth;
#if defined(__AVX512BF16__)
  module.def("pack_bf16_panels", &pack_bf16_panels, "a bf16 (or fp32) weight in the bf16 panel layout");
  module.def("bf16_panel_linear", &bf16_panel_linear,
             "x @ weight^T on a pack_bf16_panels weight: bf16 products, fp32 sums, bf16 or fp32 x and out");
  module.attr("bf16_panel_width") = kBf16PanelWidth;
  module.attr("has_bf16_panels") = true;
#else
  // No AVX512-BF16 on the build target: bf16 weights stay on oneDNN.
  module.attr("has_bf16_panels") = false;
#endif
#if defined(PAGEDSERVE_HAS_AMX)
  module.def("amx_usable", &amx_usable, "whether this process can run AMX tiles (the CPU has them, Linux allows)");
  module.def("pack_amx_weight", &pack_amx_weight, "a bf16 (or fp32) weight in the tile layout amx_linear reads");
  // Without the GIL, as the decode stack: a large prefill GEMM lets the worker's RPC threads run.
  module.def("amx_linear", &amx_linear, "x @ weight^T (+ bias) on AMX tiles: bf16 products, fp32 sums",
             pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias") = pybind11::none(),
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("amx_gate_up_silu", &amx_gate_up_silu,
             "silu(gate) * up of x under a packed fused gate_up weight, rounded to bf16, as the next projection's "
             "tiles [token blocks, depth blocks, 16, 32]",
             pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("inter"),
             pybind11::arg("bias") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("amx_greedy_tokens", &amx_greedy_tokens,
             "greedy tokens of x under a packed LM head: the argmax of its bf16-rounded logits, without the logits",
             pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("weight_rows"), pybind11::arg("vocab_size"),
             pybind11::arg("bitmask") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>());
  module.attr("has_amx") = true;
#else
  // Built for a CPU without AMX-BF16: bf16 weights run on the bf16 panels or oneDNN.
  module.attr("has_amx") = false;
#endif
  pybind11::class_<DecodeStack>(module, "DecodeStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, int64_t>(), pybind11::arg("num_heads"),
           pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"), pybind11::arg("eps"), pybind11::arg("scale"),
           pybind11::arg("sliding_window"))
      // Positional as before up to down_panels; the later arguments by keyword only, with defaults.
      .def("add_layer", &DecodeStack::add_layer, pybind11::arg("input_norm"), pybind11::arg("qkv"),
           pybind11::arg("qkv_bias"), pybind11::arg("o"), pybind11::arg("o_bias"), pybind11::arg("post_norm"),
           pybind11::arg("gate_up"), pybind11::arg("gate_up_bias"), pybind11::arg("down"),
           pybind11::arg("down_bias"), pybind11::arg("qkv_panels"), pybind11::arg("o_panels"),
           pybind11::arg("gate_up_panels"), pybind11::arg("down_panels"), pybind11::kw_only(),
           pybind11::arg("sliding_window") = -1, pybind11::arg("q_norm_weight") = pybind11::none(),
           pybind11::arg("k_norm_weight") = pybind11::none(), pybind11::arg("qkv_amx") = pybind11::none(),
           pybind11::arg("o_amx") = pybind11::none(), pybind11::arg("gate_up_amx") = pybind11::none(),
           pybind11::arg("down_amx") = pybind11::none(), pybind11::arg("qkv_bf16_panels") = pybind11::none(),
           pybind11::arg("o_bf16_panels") = pybind11::none(), pybind11::arg("gate_up_bf16_panels") = pybind11::none(),
           pybind11::arg("down_bf16_panels") = pybind11::none())
      // The whole stack runs without the GIL: the actor's other threads (Ray's RPC, the next step's plan) go on.
      .def("forward", &DecodeStack::forward, pybind11::arg("hidden"), pybind11::arg("residual"),
           pybind11::arg("has_residual"), pybind11::arg("kv_caches"), pybind11::arg("block_tables"),
           pybind11::arg("seq_lens"), pybind11::arg("slots"), pybind11::arg("cos"), pybind11::arg("sin"),
           pybind11::arg("rows_share_sequences"), pybind11::kw_only(),
           pybind11::arg("prefill_block_tables") = pybind11::none(),
           pybind11::arg("prefill_query_starts") = pybind11::none(),
           pybind11::arg("prefill_seq_lens") = pybind11::none(), pybind11::arg("output_rows") = pybind11::none(),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_property_readonly("last_step_handoffs", &DecodeStack::last_step_handoffs)
      .def_property_readonly("last_step_lockstep", &DecodeStack::last_step_lockstep);
}
