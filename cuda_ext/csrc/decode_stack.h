// DecodeStack: decode tokens through a stack of Llama decoder layers in one call (fp32, or bf16 on AMX tiles).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace pagedserve {

// fp32 decode tokens through a stack of Llama decoder layers in one call: per layer the residual add and RMSNorm,
// the fused QKV projection (with or without bias), an optional RMSNorm of each query and key head (Qwen 3), rotary,
// the KV-cache write, paged attention within the layer's own sliding window, the output projection, the second
// norm and the SwiGLU MLP, without the Python and dispatch overhead of a step's ~30 small ops per layer. Projections
// run panel_linear_kernel on the layer's panel-packed weights, or linear_tokens_kernel on the plain weights where a
// layer has none. With 16 tokens or more per thread, each thread takes its own tokens through every layer (see
// forward), or, where every linear is on AMX tiles, the threads go through each stage together (run_lockstep);
// with fewer, every kernel spreads over the threads. Prefill chunks after the decodes (a mixed step) run
// the prefill attention kernel over their rows once every row's keys are written, each kernel over all rows.
//
// bf16 models (where the build has AVX512-BF16): bf16 weights run on their AMX tiles (pack_amx_weight) or else on
// their bf16 panels (pack_bf16_panels), the KV cache is bf16, and between the kernels a token's hidden state,
// residual stream and MLP sums stay fp32 (each projection rounds its input to bf16 once, as the layer-by-layer
// path's bf16 activations are); the query and the attention output are bf16, as the bf16 attention kernel takes
// them.
class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
              int64_t sliding_window);

  // Biases and panel weights may be None. Weights are the model's own tensors (no copy): [out, in] fp32 with
  // contiguous rows; a panel weight is the same weight as pack_panels lays it out. sliding_window: this layer's
  // (-1: the stack's, 0: none). q_norm / k_norm: [head_dim] weights of an RMSNorm (the stack's eps) of each query
  // / key head after the projection and before rotary, or None. *_amx / *_bf16_panels: the weights as
  // pack_amx_weight / pack_bf16_panels lay them out, one of them required for bf16 weights (norm weights and biases
  // may then be bf16 too: the stack keeps fp32 copies).
  void add_layer(const torch::Tensor& input_norm, const torch::Tensor& qkv, const std::optional<torch::Tensor>& qkv_bias,
                 const torch::Tensor& o, const std::optional<torch::Tensor>& o_bias, const torch::Tensor& post_norm,
                 const torch::Tensor& gate_up, const std::optional<torch::Tensor>& gate_up_bias,
                 const torch::Tensor& down, const std::optional<torch::Tensor>& down_bias,
                 const std::optional<torch::Tensor>& qkv_panels, const std::optional<torch::Tensor>& o_panels,
                 const std::optional<torch::Tensor>& gate_up_panels, const std::optional<torch::Tensor>& down_panels,
                 int64_t sliding_window, const std::optional<torch::Tensor>& q_norm,
                 const std::optional<torch::Tensor>& k_norm, const std::optional<torch::Tensor>& qkv_amx,
                 const std::optional<torch::Tensor>& o_amx, const std::optional<torch::Tensor>& gate_up_amx,
                 const std::optional<torch::Tensor>& down_amx, const std::optional<torch::Tensor>& qkv_bf16_panels,
                 const std::optional<torch::Tensor>& o_bf16_panels,
                 const std::optional<torch::Tensor>& gate_up_bf16_panels,
                 const std::optional<torch::Tensor>& down_bf16_panels);

  // hidden and residual [tokens, hidden_size], fp32 or (both) bf16, in place: in, the stack's input (residual
  // unread without has_residual); out, the last layer's MLP output and the residual stream. kv_caches: one [2, blocks,
  // block_size, kv_heads, head_dim] per layer; per token, its KV slot [tokens] int64 (-1: padding) and cos/sin rows
  // [tokens, head_dim / 2] fp32. The first rows are decodes, each with its block table row [decodes, width] int32
  // and seq_len with the new token [decodes] int32 (None: no decodes). The rows after them, if any, are prefill
  // chunks: chunk i's tokens are rows decodes + prefill_query_starts[i] .. decodes + prefill_query_starts[i + 1]
  // ([chunks + 1] int32), its table prefill_block_tables[i] ([chunks, width] int32) and prefill_seq_lens[i] its
  // cached keys plus its own ([chunks] int32). A step with chunks runs each kernel over all rows at once.
  // output_rows (int64 [outputs], ascending; None: every row): the rows whose last-layer output the caller reads.
  // The last layer then writes every row's keys and values but attends, projects and runs its MLP on those rows
  // alone, and leaves row i's output (hidden and residual) in row i, i < outputs.
  void forward(torch::Tensor& hidden, torch::Tensor& residual, bool has_residual,
               const std::vector<torch::Tensor>& kv_caches, const std::optional<torch::Tensor>& block_tables,
               const std::optional<torch::Tensor>& seq_lens, const torch::Tensor& slots, const torch::Tensor& cos,
               const torch::Tensor& sin, bool rows_share_sequences,
               const std::optional<torch::Tensor>& prefill_block_tables,
               const std::optional<torch::Tensor>& prefill_query_starts,
               const std::optional<torch::Tensor>& prefill_seq_lens,
               const std::optional<torch::Tensor>& output_rows);

  // Token ranges one thread handed to another in the last forward (0 unless the grouped path ran).
  int64_t last_step_handoffs() const {
    return last_step_handoffs_;
  }
  // Whether the last forward ran in lockstep (run_lockstep).
  bool last_step_lockstep() const {
    return last_step_lockstep_;
  }

 private:
  // A step's tensors, as pointers: row `token` of each is that token's.
  struct Step;
  // Tokens [begin, end) of a step, about to run stage `stage` of layer `layer`.
  struct Rows;
  // The token ranges of one grouped step, shared out between the threads.
  class RowShare;

  struct Linear {
    torch::Tensor weight, bias, panels, amx, bf16_panels;  // all but the weight may be undefined; bias fp32
  };
  struct Layer {
    torch::Tensor input_norm;
    Linear qkv, o;
    torch::Tensor post_norm;
    Linear gate_up, down;
    int64_t sliding_window;  // <= 0: none
    torch::Tensor q_norm, k_norm;  // may be undefined
  };

  // The work items of a lockstep step's stages, claimed by whichever threads run it.
  class StageClaims;

  // The last layer for a step whose caller reads `num_outputs` of its rows (output_rows, ascending): every row's
  // norm, QKV projection and KV-cache write; then the output rows, moved to the front, alone attend (each as one
  // query against its sequence's keys so far) and run the rest of the layer.
  void run_last_layer_on_rows(const Step& step, int64_t num_tokens, const int64_t* output_rows,
                              int64_t num_outputs);
  // Every token of the step through layers [0, step.num_layers), on one thread's rows or on each thread's share.
  void run_step(const Step& step, int64_t num_tokens, bool rows_share_sequences);
  // A decode step of AMX linears with every thread on each stage: a projection's weight pairs are shared out
  // among the threads (each weight streams from memory once a step, not once per thread), the row-wise work
  // row by row; a stage starts once the one before it is done.
  void run_lockstep(const Step& step, int64_t num_tokens);
  // Stage `stage` of a lockstep step: out = tiles (x_tiles_ or act_tiles_, columns wide) @ the linear's
  // weight^T (+ bias).
  void project_pairs(const Linear& linear, int64_t columns, int64_t num_tokens, const uint16_t* tiles, float* out,
                     StageClaims& claims, int64_t stage) const;
  // Stage `stage` of a lockstep step: act_tiles_ = silu(gate) * up of x_tiles_ (hidden_ wide) under gate_up.
  void gate_up_silu_pairs(const Linear& gate_up, int64_t num_tokens, StageClaims& claims, int64_t stage);
  // Whether run_rows takes the layer's gate_up, SiLU-and-mul and down through act_tiles_ (AMX weights, inter a
  // multiple of 16, every row of the step in this run).
  bool fuses_mlp(const Layer& layer, const RowShare* share) const;
  // Runs `rows` from their layer and stage through the last layer; returns how many it ran to the end. With a
  // share, it may give half of them to an idle thread before a stage: each token's state between stages lives in
  // its own rows of the step's scratch, wherever it runs next.
  int64_t run_rows(const Step& step, Rows rows, RowShare* share);

  // out [tokens, the weight's out size] = x [tokens, columns] (contiguous rows) W^T + bias; x may be bf16 bits
  // (a bf16 weight's input only).
  void project(const Linear& linear, const float* x, int64_t columns, int64_t num_tokens, float* out) const;
  void project(const Linear& linear, const uint16_t* x, int64_t columns, int64_t num_tokens, float* out) const;
  // project for a bf16 weight (AMX tiles, else bf16 panels), x fp32 or bf16 bits.
  template <typename In>
  void project_bf16_weight(const Linear& linear, const In* x, int64_t columns, int64_t num_tokens, float* out) const;
  // out [tokens, the weight's out size] += the linear's bias, if it has one.
  void add_bias(const Linear& linear, int64_t num_tokens, float* out) const;

  // Stage kNormAndQkv for `count` rows: x = RMSNorm(x + stream) with stream updated in place, qkv = its projection.
  void norm_and_project_qkv(const Layer& layer, float* x, float* stream, int64_t count, float* qkv) const;
  // Row `row` of the step's q and k heads in `token_qkv` (fp32), in place: the per-head norms, then rotary.
  void norm_and_rotate(const Layer& layer, const Step& step, int64_t row, float* token_qkv) const;

  // Rotary and the KV-cache write for tokens [begin, begin + count) of the step, qkv their fp32 projections; bf16
  // also rounds each query into `query` unless it is nullptr.
  template <typename scalar_t>
  void rotate_and_cache(const Layer& layer, const Step& step, const torch::Tensor& cache, int64_t begin,
                        int64_t count, float* qkv, scalar_t* query) const;
  // Rotary, the KV-cache write and attention for tokens [begin, begin + count) of the step: qkv their fp32
  // projections, attended their outputs. scalar_t is the cache's: bf16 rounds each query into `query` first (fp32
  // attends straight from qkv, `query` unused).
  template <typename scalar_t>
  void attend(const Layer& layer, const Step& step, const torch::Tensor& cache, int64_t begin, int64_t count,
              float* qkv, scalar_t* query, scalar_t* attended) const;

  int64_t num_heads_, num_kv_heads_, head_dim_;
  float eps_, scale_;
  int64_t sliding_window_;
  int64_t hidden_ = 0;
  int64_t inter_ = 0;
  std::vector<Layer> layers_;
  int64_t last_step_handoffs_ = 0;
  bool last_step_lockstep_ = false;
  bool bf16_weights_ = false;  // every layer's (a stack holds one dtype)
  bool all_amx_ = true;  // every linear of every layer has its AMX weight (the lockstep's condition)
  // Scratch for a step's tokens, reused every step.
  std::vector<float> qkv_, attended_, gate_up_, activated_;
  // bf16 models: the fp32 hidden state and residual stream, and the bf16 query and attention output.
  std::vector<float> hidden_fp32_, residual_fp32_;
  std::vector<c10::BFloat16> query_bf16_, attended_bf16_;
  // A lockstep step's projection input, in the AMX tiles' order (the stage before each projection writes it), and
  // the down projection's where the gate_up projection's epilogue writes it (fuses_mlp).
  std::vector<uint16_t> x_tiles_, act_tiles_;
};

}  // namespace pagedserve
