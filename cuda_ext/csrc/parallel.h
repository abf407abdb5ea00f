// Splitting a kernel's work over torch's thread pool. Header-only: each region's body inlines into its caller.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace pagedserve {

// Fewer elements than this per chunk run on one thread: waking the pool costs more than the work, and on a
// busy machine a descheduled pool thread stalls the whole region.
constexpr int64_t kMinParallelElements = 1 << 18;

inline int64_t grain_rows(int64_t elements_per_row) {
  return std::max<int64_t>(1, kMinParallelElements / std::max<int64_t>(1, elements_per_row));
}

// About this many elements of work make one claim: several microseconds, next to the atomic add that takes it.
constexpr int64_t kClaimElements = 1 << 19;

// One thread's share of a parallel_claims region: claims are taken from its front, by its owner first.
struct alignas(64) ClaimCursor {
  std::atomic<int64_t> next;
  int64_t end;
};

// fn(begin, end) over [0, num_items) on the pool threads. Each thread has a contiguous share, as with a static
// split (its memory streams stay sequential), and takes it a claim at a time; a thread done with its share goes on
// with the claims left in the others'. The serving processes share the machine's cores with the model: a thread
// the OS preempts then leaves the rest of its share to the others, instead of holding the region at its end while
// they spin (a static split costs the step all the time a thread loses; claims, that time shared out). Claims hold
// at least `min_per_claim` items and, where that allows, a share is eight claims or more, so whichever thread ends
// last waits at most one claim. Work below kMinParallelElements per thread stays on the calling thread.
template <typename Fn>
void parallel_claims(int64_t num_items, int64_t elements_per_item, int64_t min_per_claim, const Fn& fn) {
  if (num_items <= 0) {
    return;
  }
  const int64_t per_item = std::max<int64_t>(1, elements_per_item);
  const int64_t useful_threads = (num_items * per_item + kMinParallelElements - 1) / kMinParallelElements;
  const int64_t num_threads = std::min<int64_t>({at::get_num_threads(), useful_threads, num_items});
  if (num_threads <= 1 || at::in_parallel_region()) {
    fn(0, num_items);
    return;
  }
  const int64_t eighth_of_a_share = (num_items + 8 * num_threads - 1) / (8 * num_threads);
  const int64_t per_claim = std::max(min_per_claim, std::min(kClaimElements / per_item, eighth_of_a_share));
  std::unique_ptr<ClaimCursor[]> shares(new ClaimCursor[num_threads]);
  for (int64_t thread = 0; thread < num_threads; ++thread) {
    shares[thread].next.store(num_items * thread / num_threads, std::memory_order_relaxed);
    shares[thread].end = num_items * (thread + 1) / num_threads;
  }
  at::parallel_for(0, num_threads, 1, [&](int64_t first_thread, int64_t last_thread) {
    for (int64_t thread = first_thread; thread < last_thread; ++thread) {
      for (int64_t offset = 0; offset < num_threads; ++offset) {
        ClaimCursor& share = shares[(thread + offset) % num_threads];
        for (int64_t begin = share.next.fetch_add(per_claim, std::memory_order_relaxed); begin < share.end;
             begin = share.next.fetch_add(per_claim, std::memory_order_relaxed)) {
          fn(begin, std::min(share.end, begin + per_claim));
        }
      }
    }
  });
}

}  // namespace pagedserve
