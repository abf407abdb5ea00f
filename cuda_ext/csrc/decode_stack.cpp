// DecodeStack: each layer's kernels run straight from C++ on the step's scratch, without the GIL.
#include "decode_stack.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>

#include "attention.h"
#include "elementwise.h"
#include "gemm_amx.h"
#include "gemm_panels.h"
#include "parallel.h"
#include "simd.h"

namespace pagedserve {
namespace {

// A layer's stages, in order; between two, a token's state is its rows of hidden, residual and the scratch.
enum Stage : int64_t {
  kNormAndQkv,          // input add + RMSNorm, QKV projection
  kRotaryAndAttention,  // q/k head norms, rotary, the KV-cache write, paged attention
  kOutputAndNorm,       // output projection, post-attention add + RMSNorm
  kGateUp,              // gate/up projection, SiLU-and-mul
  kDown,                // down projection
  kNumStages,
};

// A thread's share must be this many tokens or the grouped path is not taken: fewer rows per weight read and
// the projections, each thread streaming every weight, fall off the compute peak.
constexpr int64_t kMinRowsPerThread = 16;
// Rows handed over hold at least this many tokens, and so does what the giving thread keeps.
constexpr int64_t kMinSplitRows = 4;

void check_matrix(const torch::Tensor& weight, int64_t rows, int64_t columns, const char* name) {
  TORCH_CHECK(weight.device().is_cpu() &&
                  (weight.scalar_type() == torch::kFloat32 || weight.scalar_type() == torch::kBFloat16),
              name, " must be CPU fp32 or bf16");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == rows && weight.size(1) == columns && weight.stride(1) == 1,
              name, " must be [", rows, ", ", columns, "] with contiguous rows");
}

void check_vector(const torch::Tensor& vector, int64_t size, const char* name) {
  TORCH_CHECK(vector.device().is_cpu() && vector.scalar_type() == torch::kFloat32 && vector.is_contiguous(),
              name, " must be a contiguous CPU fp32 tensor");
  TORCH_CHECK(vector.numel() == size, name, " must have ", size, " elements");
}

void check_rows_of(const torch::Tensor& tensor, int64_t rows, int64_t columns, const char* name) {
  check_vector(tensor, rows * columns, name);
  TORCH_CHECK(tensor.size(0) == rows, name, " must have one row per token");
}

// A norm weight or bias as the stack reads it: fp32 (a bf16 model's, widened once).
torch::Tensor fp32_vector(const torch::Tensor& vector, int64_t size, const char* name) {
  const torch::Tensor widened =
      vector.scalar_type() == torch::kBFloat16 ? vector.to(torch::kFloat32).contiguous() : vector;
  check_vector(widened, size, name);
  return widened;
}

torch::Tensor vector_or_empty(const std::optional<torch::Tensor>& vector, int64_t size, const char* name) {
  if (!vector.has_value() || !vector->defined()) {
    return torch::Tensor();
  }
  return fp32_vector(*vector, size, name);
}

torch::Tensor panels_or_empty(const std::optional<torch::Tensor>& panels, const torch::Tensor& weight,
                              const char* name) {
  if (!panels.has_value() || !panels->defined()) {
    return torch::Tensor();
  }
  check_panels(*panels, weight.size(0), weight.size(1), name);
  return *panels;
}

torch::Tensor amx_or_empty(const std::optional<torch::Tensor>& amx, const torch::Tensor& weight, const char* name) {
  if (!amx.has_value() || !amx->defined()) {
    return torch::Tensor();
  }
#if defined(PAGEDSERVE_HAS_AMX)
  TORCH_CHECK(amx_usable(), "this CPU (or process) cannot use AMX tiles");
  check_amx_weight(*amx, weight.size(0), weight.size(1), name);
  return *amx;
#else
  TORCH_CHECK(false, name, ": this build has no AMX kernel");
#endif
}

torch::Tensor bf16_panels_or_empty(const std::optional<torch::Tensor>& panels, const torch::Tensor& weight,
                                   const char* name) {
  if (!panels.has_value() || !panels->defined()) {
    return torch::Tensor();
  }
#if defined(__AVX512BF16__)
  check_bf16_panels(*panels, weight.size(0), weight.size(1), name);
  return *panels;
#else
  TORCH_CHECK(false, name, ": this build has no bf16 panel kernel");
#endif
}

// bf16 bits of fp32 values, rounded to nearest even (as torch's conversion).
inline void round_to_bf16(c10::BFloat16* target, const float* source, int64_t count) {
#if defined(__AVX512BF16__)
  floats_to_bf16(reinterpret_cast<uint16_t*>(target), source, count);
#else
  for (int64_t i = 0; i < count; ++i) {
    target[i] = c10::BFloat16(source[i]);
  }
#endif
}

inline void widen_from_bf16(float* target, const c10::BFloat16* source, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    target[i] = static_cast<float>(source[i]);
  }
}

// fn(token) for each of `count` tokens: spread over the threads where a step runs all its rows together and they
// are many (a prefill chunk's); on the calling thread inside a thread's own rows.
template <typename Fn>
void for_each_token(int64_t count, int64_t elements_per_token, const Fn& fn) {
  parallel_claims(count, elements_per_token, 1, [&](int64_t begin, int64_t end) {
    for (int64_t token = begin; token < end; ++token) {
      fn(token);
    }
  });
}

// A linear's packed AMX weight as the kernels read it (bf16 bits).
inline const uint16_t* amx_bits(const torch::Tensor& amx) {
  return reinterpret_cast<const uint16_t*>(amx.data_ptr<at::BFloat16>());
}

// A linear's fp32 bias, or nullptr where it has none.
inline const float* bias_or_null(const torch::Tensor& bias) {
  return bias.defined() ? bias.data_ptr<float>() : nullptr;
}

}  // namespace

// A step's tensors, as pointers: row `token` of each is that token's.
struct DecodeStack::Step {
  float* hidden;
  float* residual;
  const std::vector<torch::Tensor>* kv_caches;
  const int32_t* block_tables;  // the decode rows'
  int64_t width, block_size;
  const int32_t* seq_lens;  // the decode rows'
  const int64_t* slots;
  const float* cos;
  const float* sin;
  int64_t num_decodes;  // rows before the prefill chunks'
  // The prefill chunks after the decodes (num_chunks 0: none); query starts count from the first chunk row.
  const int32_t* prefill_block_tables;
  int64_t prefill_width;
  const int32_t* prefill_query_starts;
  const int32_t* prefill_seq_lens;
  int64_t num_chunks;
  int64_t num_layers;  // run_step takes the rows through layers [0, num_layers)
};

struct DecodeStack::Rows {
  int64_t begin, end, layer, stage;
};

// At first one range per thread; a busy thread splits off the back half of its rows for a thread that waits for
// work. Whichever threads run the region, every range gets taken.
class DecodeStack::RowShare {
 public:
  RowShare(int64_t num_tokens, int64_t num_ranges) : unfinished_(num_tokens), num_pending_(num_ranges) {
    for (int64_t range = num_ranges - 1; range >= 0; --range) {
      pending_.push_back(Rows{num_tokens * range / num_ranges, num_tokens * (range + 1) / num_ranges, 0, 0});
    }
  }

  // A busy thread, between two stages: while a thread waits with nothing to take, gives it the back half of
  // `rows` (`rows` keeps the front half).
  void give_back_half(Rows& rows) {
    if (waiting_.load(std::memory_order_relaxed) <= num_pending_.load(std::memory_order_relaxed) ||
        rows.end - rows.begin < 2 * kMinSplitRows) {
      return;
    }
    const int64_t middle = rows.begin + (rows.end - rows.begin) / 2;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      pending_.push_back(Rows{middle, rows.end, rows.layer, rows.stage});
      num_pending_.fetch_add(1, std::memory_order_relaxed);
      ++num_handoffs_;
    }
    rows.end = middle;
  }

  void finished(int64_t num_rows) {
    unfinished_.fetch_sub(num_rows, std::memory_order_release);
  }

  // After the region (its end is the barrier that makes the count visible).
  int64_t num_handoffs() const {
    return num_handoffs_;
  }

  // The next range to run, waiting for one while other threads still run theirs; nothing once every token went
  // through the last layer.
  std::optional<Rows> next() {
    bool waiting = false;
    while (true) {
      // The lock only when a range is there to take: a waiting thread must not slow the givers down.
      if (num_pending_.load(std::memory_order_relaxed) > 0) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!pending_.empty()) {
          const Rows rows = pending_.back();
          pending_.pop_back();
          num_pending_.fetch_sub(1, std::memory_order_relaxed);
          if (waiting) {
            waiting_.fetch_sub(1, std::memory_order_relaxed);
          }
          return rows;
        }
      }
      if (unfinished_.load(std::memory_order_acquire) == 0) {
        if (waiting) {
          waiting_.fetch_sub(1, std::memory_order_relaxed);
        }
        return std::nullopt;
      }
      if (!waiting) {
        waiting_.fetch_add(1, std::memory_order_relaxed);
        waiting = true;
      }
      _mm_pause();
    }
  }

 private:
  std::atomic<int64_t> unfinished_;
  std::atomic<int64_t> num_pending_;
  std::atomic<int64_t> waiting_{0};
  std::mutex mutex_;
  std::vector<Rows> pending_;
  int64_t num_handoffs_ = 0;  // under mutex_
};

// A lockstep step's stages in order, each a number of work items. Each thread has a contiguous share of a stage's
// items and claims them from its front (its weight pairs stream in order), then takes what is left in the other
// shares; it starts its next stage once every item of this one is done. A thread the OS preempts holds up at most
// the item it runs, and a region with fewer threads than shares still runs every item.
class DecodeStack::StageClaims {
 public:
  StageClaims(int64_t num_stages, int64_t num_shares)
      : num_shares_(num_shares), cursors_(new Cursor[num_stages * num_shares]), done_(new Cursor[num_stages]) {
    for (int64_t stage = 0; stage < num_stages; ++stage) {
      done_[stage].next.store(0, std::memory_order_relaxed);
      for (int64_t share = 0; share < num_shares; ++share) {
        cursors_[stage * num_shares + share].next.store(-1, std::memory_order_relaxed);  // -1: not opened yet
      }
    }
  }

  // fn(item) for the items of `stage` this thread claims, then the wait for the rest.
  template <typename Fn>
  void run(int64_t stage, int64_t num_items, const Fn& fn) {
    Cursor* cursors = cursors_.get() + stage * num_shares_;
    const int64_t own = std::min<int64_t>(at::get_thread_num(), num_shares_ - 1);
    int64_t num_done = 0;  // told once, when this thread has nothing left to claim: no line shared per item
    for (int64_t offset = 0; offset < num_shares_; ++offset) {
      const int64_t share = (own + offset) % num_shares_;
      const int64_t begin = num_items * share / num_shares_, end = num_items * (share + 1) / num_shares_;
      int64_t expected = -1;  // the first thread at a share opens it at its front
      cursors[share].next.compare_exchange_strong(expected, begin, std::memory_order_relaxed);
      for (int64_t item = cursors[share].next.fetch_add(1, std::memory_order_relaxed); item < end;
           item = cursors[share].next.fetch_add(1, std::memory_order_relaxed)) {
        fn(item);
        ++num_done;
      }
    }
    done_[stage].next.fetch_add(num_done, std::memory_order_release);
    for (int64_t spins = 0; done_[stage].next.load(std::memory_order_acquire) < num_items; ++spins) {
      // Spinning keeps the wait short; past a while the other thread is likely preempted: give it the core.
      if (spins < kSpinsBeforeYield) {
        _mm_pause();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  static constexpr int64_t kSpinsBeforeYield = 1 << 14;
  struct alignas(64) Cursor {
    std::atomic<int64_t> next;
  };
  int64_t num_shares_;
  std::unique_ptr<Cursor[]> cursors_, done_;
};

DecodeStack::DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                         int64_t sliding_window)
    : num_heads_(num_heads),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      eps_(static_cast<float>(eps)),
      scale_(static_cast<float>(scale)),
      sliding_window_(sliding_window) {
  TORCH_CHECK(num_heads % num_kv_heads == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(head_dim % 2 == 0 && head_dim <= kMaxHeadDim, "head_dim must be even and at most ", kMaxHeadDim);
}

void DecodeStack::add_layer(const torch::Tensor& input_norm, const torch::Tensor& qkv,
                            const std::optional<torch::Tensor>& qkv_bias, const torch::Tensor& o,
                            const std::optional<torch::Tensor>& o_bias, const torch::Tensor& post_norm,
                            const torch::Tensor& gate_up, const std::optional<torch::Tensor>& gate_up_bias,
                            const torch::Tensor& down, const std::optional<torch::Tensor>& down_bias,
                            const std::optional<torch::Tensor>& qkv_panels,
                            const std::optional<torch::Tensor>& o_panels,
                            const std::optional<torch::Tensor>& gate_up_panels,
                            const std::optional<torch::Tensor>& down_panels, int64_t sliding_window,
                            const std::optional<torch::Tensor>& q_norm,
                            const std::optional<torch::Tensor>& k_norm,
                            const std::optional<torch::Tensor>& qkv_amx, const std::optional<torch::Tensor>& o_amx,
                            const std::optional<torch::Tensor>& gate_up_amx,
                            const std::optional<torch::Tensor>& down_amx,
                            const std::optional<torch::Tensor>& qkv_bf16_panels,
                            const std::optional<torch::Tensor>& o_bf16_panels,
                            const std::optional<torch::Tensor>& gate_up_bf16_panels,
                            const std::optional<torch::Tensor>& down_bf16_panels) {
  const int64_t hidden = input_norm.size(0);
  const int64_t q_size = num_heads_ * head_dim_;
  const int64_t qkv_rows = q_size + 2 * num_kv_heads_ * head_dim_;
  const int64_t inter = gate_up.size(0) / 2;
  check_matrix(qkv, qkv_rows, hidden, "qkv");
  check_matrix(o, hidden, q_size, "o");
  check_matrix(gate_up, 2 * inter, hidden, "gate_up");
  check_matrix(down, hidden, inter, "down");
  const bool bf16_weights = qkv.scalar_type() == torch::kBFloat16;
  for (const torch::Tensor* weight : {&o, &gate_up, &down}) {
    TORCH_CHECK(weight->scalar_type() == qkv.scalar_type(), "a layer's weights must share one dtype");
  }
  TORCH_CHECK(layers_.empty() || (hidden == hidden_ && inter == inter_), "every layer must have the same sizes");
  TORCH_CHECK(layers_.empty() || bf16_weights == bf16_weights_, "every layer must have the same dtype");
  TORCH_CHECK(sliding_window >= -1, "a layer's sliding_window is -1 (the stack's), 0 (none) or a window");
  layers_.push_back(
      Layer{fp32_vector(input_norm, hidden, "input_norm"),
            Linear{qkv, vector_or_empty(qkv_bias, qkv_rows, "qkv bias"),
                   panels_or_empty(qkv_panels, qkv, "qkv panels"), amx_or_empty(qkv_amx, qkv, "qkv amx"),
                   bf16_panels_or_empty(qkv_bf16_panels, qkv, "qkv bf16 panels")},
            Linear{o, vector_or_empty(o_bias, hidden, "o bias"), panels_or_empty(o_panels, o, "o panels"),
                   amx_or_empty(o_amx, o, "o amx"), bf16_panels_or_empty(o_bf16_panels, o, "o bf16 panels")},
            fp32_vector(post_norm, hidden, "post_norm"),
            Linear{gate_up, vector_or_empty(gate_up_bias, 2 * inter, "gate_up bias"),
                   panels_or_empty(gate_up_panels, gate_up, "gate_up panels"),
                   amx_or_empty(gate_up_amx, gate_up, "gate_up amx"),
                   bf16_panels_or_empty(gate_up_bf16_panels, gate_up, "gate_up bf16 panels")},
            Linear{down, vector_or_empty(down_bias, hidden, "down bias"),
                   panels_or_empty(down_panels, down, "down panels"), amx_or_empty(down_amx, down, "down amx"),
                   bf16_panels_or_empty(down_bf16_panels, down, "down bf16 panels")},
            sliding_window == -1 ? sliding_window_ : sliding_window,
            vector_or_empty(q_norm, head_dim_, "q_norm"),
            vector_or_empty(k_norm, head_dim_, "k_norm")});
  const Layer& added = layers_.back();
  for (const Linear* linear : {&added.qkv, &added.o, &added.gate_up, &added.down}) {
    TORCH_CHECK(!bf16_weights || linear->amx.defined() || linear->bf16_panels.defined(),
                "a bf16 weight runs on its AMX tiles or bf16 panels, neither given");
    all_amx_ = all_amx_ && linear->amx.defined();
  }
  hidden_ = hidden;
  inter_ = inter;
  bf16_weights_ = bf16_weights;
}

void DecodeStack::forward(torch::Tensor& hidden, torch::Tensor& residual, bool has_residual,
                          const std::vector<torch::Tensor>& kv_caches, const std::optional<torch::Tensor>& block_tables,
                          const std::optional<torch::Tensor>& seq_lens, const torch::Tensor& slots,
                          const torch::Tensor& cos, const torch::Tensor& sin, bool rows_share_sequences,
                          const std::optional<torch::Tensor>& prefill_block_tables,
                          const std::optional<torch::Tensor>& prefill_query_starts,
                          const std::optional<torch::Tensor>& prefill_seq_lens,
                          const std::optional<torch::Tensor>& output_rows) {
  TORCH_CHECK(!layers_.empty(), "the stack has no layers");
  const int64_t num_tokens = hidden.size(0);
  const torch::ScalarType dtype = bf16_weights_ ? torch::kBFloat16 : torch::kFloat32;
  TORCH_CHECK(hidden.scalar_type() == dtype && residual.scalar_type() == dtype,
              "hidden and residual must have the weights' dtype");
  const auto check_rows_in = [&](const torch::Tensor& tensor, const char* name) {
    TORCH_CHECK(tensor.device().is_cpu() && tensor.is_contiguous() && tensor.dim() == 2 &&
                    tensor.size(0) == num_tokens && tensor.size(1) == hidden_,
                name, " must be a contiguous CPU tensor [tokens, ", hidden_, "]");
  };
  check_rows_in(hidden, "hidden");
  check_rows_in(residual, "residual");
  const int64_t half = head_dim_ / 2;
  check_rows_of(cos, num_tokens, half, "cos");
  check_rows_of(sin, num_tokens, half, "sin");
  TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV cache per layer");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == num_tokens,
              "slots must be int64 [tokens]");
  const int64_t* slot_of = slots.data_ptr<int64_t>();
  const int64_t block_size = kv_caches[0].dim() == 5 ? kv_caches[0].size(2) : 0;
  int64_t num_slots = std::numeric_limits<int64_t>::max();  // of the smallest cache
  for (const torch::Tensor& cache : kv_caches) {
    TORCH_CHECK(cache.scalar_type() == dtype && cache.is_contiguous() && cache.dim() == 5 &&
                    cache.size(2) == block_size && cache.size(3) == num_kv_heads_ && cache.size(4) == head_dim_,
                "KV caches must be contiguous [2, blocks, block_size, kv_heads, head_dim] of the weights' dtype");
    num_slots = std::min(num_slots, cache.size(1) * block_size);
  }
  for (int64_t token = 0; token < num_tokens; ++token) {
    TORCH_CHECK(slot_of[token] < num_slots, "slot ", slot_of[token], " is outside the cache");
  }
  const bool has_decodes = block_tables.has_value() && block_tables->defined();
  TORCH_CHECK(has_decodes == (seq_lens.has_value() && seq_lens->defined()), "block_tables and seq_lens go together");
  const int64_t num_decodes = has_decodes ? seq_lens->numel() : 0;
  const int64_t width = has_decodes ? block_tables->size(1) : 0;
  if (has_decodes) {
    TORCH_CHECK(block_tables->scalar_type() == torch::kInt32 && block_tables->is_contiguous() &&
                    block_tables->dim() == 2 && block_tables->size(0) == num_decodes,
                "block_tables must be contiguous int32 [decodes, width]");
    TORCH_CHECK(seq_lens->scalar_type() == torch::kInt32 && seq_lens->is_contiguous(), "seq_lens must be int32");
    const int32_t* lens = seq_lens->data_ptr<int32_t>();
    for (int64_t row = 0; row < num_decodes; ++row) {
      TORCH_CHECK(lens[row] >= 1 && (lens[row] + block_size - 1) / std::max<int64_t>(1, block_size) <= width,
                  "seq_len ", lens[row], " needs more blocks than its table holds");
    }
  }
  const bool has_chunks = prefill_query_starts.has_value() && prefill_query_starts->defined();
  TORCH_CHECK(has_chunks == (prefill_block_tables.has_value() && prefill_block_tables->defined()) &&
                  has_chunks == (prefill_seq_lens.has_value() && prefill_seq_lens->defined()),
              "prefill_block_tables, prefill_query_starts and prefill_seq_lens go together");
  if (has_chunks) {
    int64_t cache_elements = 0;  // of the largest cache's key (or value) half
    for (const torch::Tensor& cache : kv_caches) {
      cache_elements = std::max(cache_elements, cache.stride(0));
    }
    check_prefill_chunks(*prefill_block_tables, *prefill_query_starts, *prefill_seq_lens, num_tokens - num_decodes,
                         "the rows after the decodes", block_size, cache_elements, head_dim_);
  } else {
    TORCH_CHECK(num_decodes == num_tokens, "without prefill chunks every row is a decode");
  }
  const int64_t* output_row_of = nullptr;
  int64_t num_outputs = num_tokens;
  if (output_rows.has_value() && output_rows->defined()) {
    TORCH_CHECK(output_rows->scalar_type() == torch::kInt64 && output_rows->is_contiguous() && output_rows->dim() == 1,
                "output_rows must be contiguous int64 [outputs]");
    const int64_t* rows = output_rows->data_ptr<int64_t>();
    for (int64_t i = 0; i < output_rows->numel(); ++i) {
      TORCH_CHECK(rows[i] >= 0 && rows[i] < num_tokens && (i == 0 || rows[i] > rows[i - 1]),
                  "output_rows must be ascending rows of the step");
    }
    if (output_rows->numel() < num_tokens) {  // every row asked for: the plain step
      output_row_of = rows;
      num_outputs = output_rows->numel();
    }
  }
  const int64_t q_size = num_heads_ * head_dim_;
  const int64_t qkv_rows = q_size + 2 * num_kv_heads_ * head_dim_;
  qkv_.resize(num_tokens * qkv_rows);
  attended_.resize(num_tokens * q_size);
  gate_up_.resize(num_tokens * 2 * inter_);
  activated_.resize(num_tokens * inter_);
  float* hidden_rows = nullptr;
  float* residual_rows = nullptr;
  if (bf16_weights_) {
    hidden_fp32_.resize(num_tokens * hidden_);
    residual_fp32_.resize(num_tokens * hidden_);
    query_bf16_.resize(num_tokens * q_size);
    attended_bf16_.resize(num_tokens * q_size);
    hidden_rows = hidden_fp32_.data();
    residual_rows = residual_fp32_.data();
    widen_from_bf16(hidden_rows, hidden.data_ptr<c10::BFloat16>(), num_tokens * hidden_);
    if (has_residual) {
      widen_from_bf16(residual_rows, residual.data_ptr<c10::BFloat16>(), num_tokens * hidden_);
    }
  } else {
    hidden_rows = hidden.data_ptr<float>();
    residual_rows = residual.data_ptr<float>();
  }
  if (!has_residual) {
    // x + 0 is x exactly: the first layer's plain RMSNorm through the same add-and-norm row.
    std::fill(residual_rows, residual_rows + num_tokens * hidden_, 0.f);
  }
  const Step step{hidden_rows,
                  residual_rows,
                  &kv_caches,
                  has_decodes ? block_tables->data_ptr<int32_t>() : nullptr,
                  width,
                  block_size,
                  has_decodes ? seq_lens->data_ptr<int32_t>() : nullptr,
                  slot_of,
                  cos.data_ptr<float>(),
                  sin.data_ptr<float>(),
                  num_decodes,
                  has_chunks ? prefill_block_tables->data_ptr<int32_t>() : nullptr,
                  has_chunks ? prefill_block_tables->size(1) : 0,
                  has_chunks ? prefill_query_starts->data_ptr<int32_t>() : nullptr,
                  has_chunks ? prefill_seq_lens->data_ptr<int32_t>() : nullptr,
                  has_chunks ? prefill_seq_lens->numel() : 0,
                  static_cast<int64_t>(layers_.size()) - (output_row_of != nullptr ? 1 : 0)};
  if (step.num_layers > 0) {
    // A chunk's rows read each other's keys, as drafts of one sequence do.
    run_step(step, num_tokens, rows_share_sequences || has_chunks);
  }
  if (output_row_of != nullptr) {
    run_last_layer_on_rows(step, num_tokens, output_row_of, num_outputs);
  }
  if (bf16_weights_) {
    // One rounding of each into the caller's bf16 tensors, after the last layer.
    round_to_bf16(hidden.data_ptr<c10::BFloat16>(), hidden_rows, num_outputs * hidden_);
    round_to_bf16(residual.data_ptr<c10::BFloat16>(), residual_rows, num_outputs * hidden_);
  }
}

void DecodeStack::run_last_layer_on_rows(const Step& step, int64_t num_tokens, const int64_t* output_rows,
                                         int64_t num_outputs) {
  const int64_t last = static_cast<int64_t>(layers_.size()) - 1;
  const Layer& layer = layers_[last];
  const torch::Tensor& cache = (*step.kv_caches)[last];
  const int64_t q_size = num_heads_ * head_dim_;
  const int64_t qkv_rows = q_size + 2 * num_kv_heads_ * head_dim_;
  float* const qkv = qkv_.data();
  norm_and_project_qkv(layer, step.hidden, step.residual, num_tokens, qkv);
  if (bf16_weights_) {
    rotate_and_cache<c10::BFloat16>(layer, step, cache, 0, num_tokens, qkv, nullptr);
  } else {
    rotate_and_cache<float>(layer, step, cache, 0, num_tokens, qkv, nullptr);
  }
  if (num_outputs == 0) {
    return;  // nothing reads this step's output: its keys and values were all it had to leave
  }
  // Each output row attends as one query at its own position: a decode over its sequence's keys so far, whose
  // block table and key count come from its decode row or its chunk.
  const int64_t width = std::max(step.width, step.prefill_width);
  std::vector<int32_t> tables(num_outputs * width, 0), seq_lens(num_outputs);
  int64_t chunk = 0;
  for (int64_t i = 0; i < num_outputs; ++i) {
    const int64_t row = output_rows[i];
    if (row < step.num_decodes) {
      std::copy_n(step.block_tables + row * step.width, step.width, tables.data() + i * width);
      seq_lens[i] = step.seq_lens[row];
      continue;
    }
    const int64_t chunk_row = row - step.num_decodes;
    while (step.prefill_query_starts[chunk + 1] <= chunk_row) {
      ++chunk;
    }
    std::copy_n(step.prefill_block_tables + chunk * step.prefill_width, step.prefill_width,
                tables.data() + i * width);
    const int64_t later_rows = step.prefill_query_starts[chunk + 1] - 1 - chunk_row;  // the chunk's keys after it
    seq_lens[i] = static_cast<int32_t>(step.prefill_seq_lens[chunk] - later_rows);
  }
  // Output row i to row i: rows only move forward (output_rows ascend), so no row is overwritten before it moves.
  for (int64_t i = 0; i < num_outputs; ++i) {
    if (output_rows[i] != i) {
      std::memcpy(qkv + i * qkv_rows, qkv + output_rows[i] * qkv_rows, q_size * sizeof(float));
      std::memcpy(step.residual + i * hidden_, step.residual + output_rows[i] * hidden_, hidden_ * sizeof(float));
    }
  }
  if (bf16_weights_) {
    using bf16 = c10::BFloat16;
    for (int64_t i = 0; i < num_outputs; ++i) {
      round_to_bf16(query_bf16_.data() + i * q_size, qkv + i * qkv_rows, q_size);
    }
    bf16* key_cache = cache.data_ptr<bf16>();
    const PagedCache<bf16> paged{key_cache, key_cache + cache.stride(0), tables.data(), width, step.block_size,
                                 cache.stride(1), cache.stride(2)};
    decode_attention_kernel<bf16>(query_bf16_.data(), paged, attended_bf16_.data(), seq_lens.data(), num_outputs,
                                  num_heads_, num_kv_heads_, head_dim_, q_size, q_size, scale_, layer.sliding_window,
                                  /*soft_cap=*/0.f);
  } else {
    float* key_cache = cache.data_ptr<float>();
    const PagedCache<float> paged{key_cache, key_cache + cache.stride(0), tables.data(), width, step.block_size,
                                  cache.stride(1), cache.stride(2)};
    decode_attention_kernel<float>(qkv, paged, attended_.data(), seq_lens.data(), num_outputs, num_heads_,
                                   num_kv_heads_, head_dim_, qkv_rows, q_size, scale_, layer.sliding_window,
                                   /*soft_cap=*/0.f);
  }
  Step whole = step;
  whole.num_layers = last + 1;
  run_rows(whole, Rows{0, num_outputs, last, kOutputAndNorm}, nullptr);
}

void DecodeStack::norm_and_project_qkv(const Layer& layer, float* x, float* stream, int64_t count,
                                       float* qkv) const {
  for_each_token(count, hidden_, [&](int64_t token) {
    add_rms_norm_row<float>(x + token * hidden_, stream + token * hidden_, layer.input_norm.data_ptr<float>(),
                            hidden_, eps_);
  });
  project(layer.qkv, x, hidden_, count, qkv);
}

void DecodeStack::run_step(const Step& step, int64_t num_tokens, bool rows_share_sequences) {
  const int64_t num_threads = at::get_num_threads();
  last_step_handoffs_ = 0;
  last_step_lockstep_ = false;
  // Rows of one sequence (speculative drafts) read each other's keys: only rows that go through each stage
  // together have every row's keys written before any row attends.
  if (rows_share_sequences || num_threads < 2 || num_tokens < kMinRowsPerThread * num_threads ||
      at::in_parallel_region()) {
    run_rows(step, Rows{0, num_tokens, 0, 0}, nullptr);  // every kernel spreads its own work over the threads
    return;
  }
#if defined(PAGEDSERVE_HAS_AMX)
  // AMX linears share each projection's weight out among the threads instead: the row split below streams every
  // weight from memory once per thread.
  if (bf16_weights_ && all_amx_) {
    last_step_lockstep_ = true;
    run_lockstep(step, num_tokens);
    return;
  }
#endif
  // Each thread takes its share of the tokens through every layer on its own, its kernels single-threaded (they
  // are inside a parallel region): no barrier between a step's ~150 kernels, and the norms, rotary and SiLU
  // run on every thread. A thread done early takes half of what another has left at its next stage.
  RowShare share(num_tokens, num_threads);
  at::parallel_for(0, num_threads, 1, [&](int64_t, int64_t) {
    while (const std::optional<Rows> rows = share.next()) {
      share.finished(run_rows(step, *rows, &share));
    }
  });
  last_step_handoffs_ = share.num_handoffs();
}

#if defined(PAGEDSERVE_HAS_AMX)
bool DecodeStack::fuses_mlp(const Layer& layer, const RowShare* share) const {
  // The tiles hold one run's rows: rows shared out among threads (a share) keep the row-wise SiLU.
  return share == nullptr && layer.gate_up.amx.defined() && layer.down.amx.defined() && amx_gate_up_fuses(inter_);
}
#endif

int64_t DecodeStack::run_rows(const Step& step, Rows rows, RowShare* share) {
  const int64_t half = head_dim_ / 2;
  const int64_t q_size = num_heads_ * head_dim_;
  const int64_t kv_size = num_kv_heads_ * head_dim_;
  const int64_t qkv_rows = q_size + 2 * kv_size;
  for (; rows.layer < step.num_layers; ++rows.layer, rows.stage = 0) {
    const Layer& layer = layers_[rows.layer];
    const torch::Tensor& cache = (*step.kv_caches)[rows.layer];
    for (; rows.stage < kNumStages; ++rows.stage) {
      if (share != nullptr) {
        share->give_back_half(rows);
      }
      const int64_t begin = rows.begin;
      const int64_t count = rows.end - rows.begin;
      float* const x = step.hidden + begin * hidden_;
      float* const stream = step.residual + begin * hidden_;
      float* const qkv = qkv_.data() + begin * qkv_rows;
      float* const attended = attended_.data() + begin * q_size;
      float* const gate_up = gate_up_.data() + begin * 2 * inter_;
      float* const activated = activated_.data() + begin * inter_;
      c10::BFloat16* const query_bf16 = bf16_weights_ ? query_bf16_.data() + begin * q_size : nullptr;
      c10::BFloat16* const attended_bf16 = bf16_weights_ ? attended_bf16_.data() + begin * q_size : nullptr;
      switch (rows.stage) {
        case kNormAndQkv:
          norm_and_project_qkv(layer, x, stream, count, qkv);
          break;
        case kRotaryAndAttention:
          if (bf16_weights_) {
            attend<c10::BFloat16>(layer, step, cache, begin, count, qkv, query_bf16, attended_bf16);
          } else {
            attend<float>(layer, step, cache, begin, count, qkv, nullptr, attended);
          }
          break;
        case kOutputAndNorm:
          if (bf16_weights_) {
            project(layer.o, reinterpret_cast<const uint16_t*>(attended_bf16), q_size, count, x);
          } else {
            project(layer.o, attended, q_size, count, x);
          }
          for_each_token(count, hidden_, [&](int64_t token) {
            add_rms_norm_row<float>(x + token * hidden_, stream + token * hidden_,
                                    layer.post_norm.data_ptr<float>(), hidden_, eps_);
          });
          break;
        case kGateUp:
#if defined(PAGEDSERVE_HAS_AMX)
          if (fuses_mlp(layer, share)) {
            // SiLU-and-mul in the projection's epilogue, straight into the down projection's tiles.
            act_tiles_.resize(amx_x_tile_elements(count, inter_));
            const Linear& linear = layer.gate_up;
            amx_gate_up_silu_kernel(x, hidden_, count, amx_bits(linear.amx), inter_, hidden_,
                                    bias_or_null(linear.bias), act_tiles_.data());
            break;
          }
#endif
          project(layer.gate_up, x, hidden_, count, gate_up);
          for_each_token(count, 2 * inter_, [&](int64_t token) {
            const float* gate = gate_up + token * 2 * inter_;
            silu_and_mul_row<float>(activated + token * inter_, gate, gate + inter_, inter_);
          });
          break;
        case kDown:
#if defined(PAGEDSERVE_HAS_AMX)
          if (fuses_mlp(layer, share)) {
            const Linear& linear = layer.down;
            amx_linear_of_tiles(act_tiles_.data(), count, amx_bits(linear.amx), hidden_, inter_,
                                bias_or_null(linear.bias), x, hidden_);
            break;
          }
#endif
          project(layer.down, activated, inter_, count, x);
      }
    }
  }
  return rows.end - rows.begin;
}

#if defined(PAGEDSERVE_HAS_AMX)
void DecodeStack::run_lockstep(const Step& step, int64_t num_tokens) {
  const int64_t q_size = num_heads_ * head_dim_;
  const int64_t qkv_rows = q_size + 2 * num_kv_heads_ * head_dim_;
  x_tiles_.resize(amx_x_tile_elements(num_tokens, std::max({hidden_, q_size, inter_})));
  uint16_t* const x_tiles = x_tiles_.data();
  const bool fused_mlp = amx_gate_up_fuses(inter_);  // a stack holds one MLP shape
  if (fused_mlp) {
    act_tiles_.resize(amx_x_tile_elements(num_tokens, inter_));
  }
  uint16_t* const act_tiles = act_tiles_.data();
  constexpr int64_t kStagesPerLayer = 8;  // at most: 7 where the MLP is fused
  const int64_t num_threads = at::get_num_threads();
  StageClaims claims(static_cast<int64_t>(layers_.size()) * kStagesPerLayer, num_threads);
  at::parallel_for(0, num_threads, 1, [&](int64_t, int64_t) {
    amx_load_tile_config();  // once per thread and step: the stages' items run nothing else on the tiles
    int64_t stage = 0;
    for (int64_t index = 0; index < step.num_layers; ++index) {
      const Layer& layer = layers_[index];
      const torch::Tensor& cache = (*step.kv_caches)[index];
      // Each row-wise stage leaves the next projection's input in x_tiles (the projection before it is done).
      const auto norm_into_tiles = [&](const torch::Tensor& norm) {
        claims.run(stage++, num_tokens, [&](int64_t token) {
          float* row = step.hidden + token * hidden_;
          add_rms_norm_row<float>(row, step.residual + token * hidden_, norm.data_ptr<float>(), hidden_, eps_);
          amx_copy_token_row(row, hidden_, token, x_tiles);
        });
      };
      norm_into_tiles(layer.input_norm);
      project_pairs(layer.qkv, hidden_, num_tokens, x_tiles, qkv_.data(), claims, stage++);
      claims.run(stage++, num_tokens, [&](int64_t token) {
        c10::BFloat16* attended = attended_bf16_.data() + token * q_size;
        attend<c10::BFloat16>(layer, step, cache, token, 1, qkv_.data() + token * qkv_rows,
                              query_bf16_.data() + token * q_size, attended);
        amx_copy_token_row(reinterpret_cast<const uint16_t*>(attended), q_size, token, x_tiles);
      });
      project_pairs(layer.o, q_size, num_tokens, x_tiles, step.hidden, claims, stage++);
      norm_into_tiles(layer.post_norm);
      if (fused_mlp) {
        // SiLU-and-mul in the gate_up projection's epilogue: no fp32 gate_up rows, no row-wise stage.
        gate_up_silu_pairs(layer.gate_up, num_tokens, claims, stage++);
        project_pairs(layer.down, inter_, num_tokens, act_tiles, step.hidden, claims, stage++);
      } else {
        project_pairs(layer.gate_up, hidden_, num_tokens, x_tiles, gate_up_.data(), claims, stage++);
        claims.run(stage++, num_tokens, [&](int64_t token) {
          const float* gate = gate_up_.data() + token * 2 * inter_;
          float* activated = activated_.data() + token * inter_;
          silu_and_mul_row<float>(activated, gate, gate + inter_, inter_);
          amx_copy_token_row(activated, inter_, token, x_tiles);
        });
        project_pairs(layer.down, inter_, num_tokens, x_tiles, step.hidden, claims, stage++);
      }
    }
  });
}

void DecodeStack::project_pairs(const Linear& linear, int64_t columns, int64_t num_tokens, const uint16_t* tiles,
                                float* out, StageClaims& claims, int64_t stage) const {
  const int64_t rows = linear.weight.size(0);
  const uint16_t* packed = amx_bits(linear.amx);
  const float* bias = bias_or_null(linear.bias);
  // Items (weight pair, pair of token blocks), a pair's next to each other: a thread's share streams its weights
  // once, and the last items of a stage are short.
  const int64_t token_pairs = amx_blocks(amx_blocks(num_tokens, kAmxRows), 2);
  claims.run(stage, amx_output_pairs(rows) * token_pairs, [&](int64_t item) {
    const int64_t first_token_block = item % token_pairs * 2;
    amx_linear_pair(tiles, num_tokens, packed, rows, columns, bias, out, rows, item / token_pairs, first_token_block,
                    std::min(amx_blocks(num_tokens, kAmxRows), first_token_block + 2));
  });
}

void DecodeStack::gate_up_silu_pairs(const Linear& gate_up, int64_t num_tokens, StageClaims& claims,
                                     int64_t stage) {
  const uint16_t* packed = amx_bits(gate_up.amx);
  const float* bias = bias_or_null(gate_up.bias);
  // Items (gate block, pair of token blocks), as project_pairs's.
  const int64_t token_blocks = amx_blocks(num_tokens, kAmxRows);
  const int64_t token_pairs = amx_blocks(token_blocks, 2);
  claims.run(stage, inter_ / kAmxRows * token_pairs, [&](int64_t item) {
    const int64_t first_token_block = item % token_pairs * 2;
    amx_gate_up_silu_pair(x_tiles_.data(), num_tokens, packed, inter_, hidden_, bias, act_tiles_.data(),
                          item / token_pairs, first_token_block, std::min(token_blocks, first_token_block + 2));
  });
}
#endif

void DecodeStack::norm_and_rotate(const Layer& layer, const Step& step, int64_t row, float* token_qkv) const {
  const int64_t half = head_dim_ / 2;
  const int64_t q_size = num_heads_ * head_dim_;
  if (layer.q_norm.defined()) {
    rms_norm_heads(token_qkv, num_heads_, head_dim_, layer.q_norm.data_ptr<float>(), eps_);
  }
  if (layer.k_norm.defined()) {
    rms_norm_heads(token_qkv + q_size, num_kv_heads_, head_dim_, layer.k_norm.data_ptr<float>(), eps_);
  }
  const float* cos_row = step.cos + row * half;
  const float* sin_row = step.sin + row * half;
  rotate_heads<float>(token_qkv, num_heads_, head_dim_, half, cos_row, sin_row);
  rotate_heads<float>(token_qkv + q_size, num_kv_heads_, head_dim_, half, cos_row, sin_row);
}

template <typename scalar_t>
void DecodeStack::rotate_and_cache(const Layer& layer, const Step& step, const torch::Tensor& cache, int64_t begin,
                                   int64_t count, float* qkv, scalar_t* query) const {
  const int64_t q_size = num_heads_ * head_dim_;
  const int64_t kv_size = num_kv_heads_ * head_dim_;
  const int64_t qkv_rows = q_size + 2 * kv_size;
  scalar_t* key_cache = cache.data_ptr<scalar_t>();
  scalar_t* value_cache = key_cache + cache.stride(0);
  for_each_token(count, qkv_rows, [&](int64_t token) {
    float* token_qkv = qkv + token * qkv_rows;
    norm_and_rotate(layer, step, begin + token, token_qkv);
    const int64_t slot = step.slots[begin + token];
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      // Rounded to bf16 once here, as the layer-by-layer path's bf16 query, keys and values are.
      if (query != nullptr) {
        round_to_bf16(query + token * q_size, token_qkv, q_size);
      }
      if (slot >= 0) {  // -1: a padding row of a bucketed step, which writes nothing
        round_to_bf16(key_cache + slot * cache.stride(2), token_qkv + q_size, kv_size);
        round_to_bf16(value_cache + slot * cache.stride(2), token_qkv + q_size + kv_size, kv_size);
      }
    } else if (slot >= 0) {
      std::memcpy(key_cache + slot * cache.stride(2), token_qkv + q_size, kv_size * sizeof(float));
      std::memcpy(value_cache + slot * cache.stride(2), token_qkv + q_size + kv_size, kv_size * sizeof(float));
    }
  });
}

template <typename scalar_t>
void DecodeStack::attend(const Layer& layer, const Step& step, const torch::Tensor& cache, int64_t begin,
                         int64_t count, float* qkv, scalar_t* query, scalar_t* attended) const {
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  const int64_t q_size = num_heads_ * head_dim_;
  const int64_t kv_size = num_kv_heads_ * head_dim_;
  const int64_t qkv_rows = q_size + 2 * kv_size;
  scalar_t* key_cache = cache.data_ptr<scalar_t>();
  scalar_t* value_cache = key_cache + cache.stride(0);
  rotate_and_cache<scalar_t>(layer, step, cache, begin, count, qkv, query);
  // fp32 attends straight from the projections' rows; bf16 from its rounded queries.
  const scalar_t* queries = nullptr;
  int64_t query_stride = 0;
  if constexpr (kBf16) {
    queries = query;
    query_stride = q_size;
  } else {
    queries = qkv;
    query_stride = qkv_rows;
  }
  const int64_t num_decode_rows = std::clamp<int64_t>(step.num_decodes - begin, 0, count);
  if (num_decode_rows > 0) {
    const PagedCache<scalar_t> paged{key_cache, value_cache, step.block_tables + begin * step.width,
                                     step.width, step.block_size, cache.stride(1), cache.stride(2)};
    decode_attention_kernel<scalar_t>(queries, paged, attended, step.seq_lens + begin, num_decode_rows, num_heads_,
                                      num_kv_heads_, head_dim_, query_stride, q_size, scale_, layer.sliding_window,
                                      /*soft_cap=*/0.f);
  }
  if (step.num_chunks > 0) {
    // Steps with chunks run every row together (run_step), so the chunks' rows are all here.
    TORCH_CHECK(begin == 0 && count == step.num_decodes + step.prefill_query_starts[step.num_chunks],
                "a step with prefill chunks runs all its rows at once");
    const PagedCache<scalar_t> paged{key_cache, value_cache, step.prefill_block_tables, step.prefill_width,
                                     step.block_size, cache.stride(1), cache.stride(2)};
    prefill_attention_kernel<scalar_t>(queries + step.num_decodes * query_stride, paged,
                                       attended + step.num_decodes * q_size, step.prefill_query_starts,
                                       step.prefill_seq_lens, step.num_chunks, num_heads_, num_kv_heads_, head_dim_,
                                       query_stride, q_size, scale_, layer.sliding_window, /*soft_cap=*/0.f);
  }
}

template <typename In>
void DecodeStack::project_bf16_weight(const Linear& linear, const In* x, int64_t columns, int64_t num_tokens,
                                      float* out) const {
  const int64_t rows = linear.weight.size(0);
#if defined(PAGEDSERVE_HAS_AMX)
  if (linear.amx.defined()) {  // the kernel rounds an fp32 x into its own padded copy
    amx_linear_kernel(x, columns, num_tokens, amx_bits(linear.amx), rows, columns, bias_or_null(linear.bias), out,
                      rows);
    return;
  }
#endif
#if defined(__AVX512BF16__)
  TORCH_CHECK(linear.bf16_panels.defined(), "a bf16 weight runs on AMX tiles or bf16 panels only");
  const uint16_t* x_bits = nullptr;
  if constexpr (std::is_same_v<In, float>) {
    // Rounded once into this thread's scratch: the panels take bf16 x.
    thread_local std::vector<uint16_t> x_bf16;
    x_bf16.resize(num_tokens * columns);
    floats_to_bf16(x_bf16.data(), x, num_tokens * columns);
    x_bits = x_bf16.data();
  } else {
    x_bits = x;
  }
  bf16_panel_linear_kernel(x_bits, columns, num_tokens,
                           reinterpret_cast<const uint16_t*>(linear.bf16_panels.data_ptr<at::BFloat16>()), rows,
                           columns, out, rows);
  add_bias(linear, num_tokens, out);
#else
  TORCH_CHECK(false, "this build has no bf16 kernel");
#endif
}

void DecodeStack::project(const Linear& linear, const uint16_t* x, int64_t columns, int64_t num_tokens,
                          float* out) const {
  project_bf16_weight(linear, x, columns, num_tokens, out);
}

void DecodeStack::add_bias(const Linear& linear, int64_t num_tokens, float* out) const {
  if (!linear.bias.defined()) {
    return;
  }
  const int64_t rows = linear.weight.size(0);
  const float* bias_data = linear.bias.data_ptr<float>();
  for (int64_t token = 0; token < num_tokens; ++token) {
    for (int64_t i = 0; i < rows; ++i) {
      out[token * rows + i] += bias_data[i];
    }
  }
}

void DecodeStack::project(const Linear& linear, const float* x, int64_t columns, int64_t num_tokens,
                          float* out) const {
  const int64_t rows = linear.weight.size(0);
  if (linear.amx.defined() || linear.bf16_panels.defined()) {
    project_bf16_weight(linear, x, columns, num_tokens, out);
    return;
  }
  if (linear.panels.defined()) {
    panel_linear_kernel(x, columns, num_tokens, linear.panels.data_ptr<float>(), rows, columns, out, rows);
  } else {
    linear_tokens_kernel(x, columns, num_tokens, linear.weight.data_ptr<float>(), linear.weight.stride(0), out, rows,
                         rows, linear.weight.size(1));
  }
  add_bias(linear, num_tokens, out);
}

}  // namespace pagedserve
