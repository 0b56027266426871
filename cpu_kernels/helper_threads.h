// The threads that share a native kernel call's work items with the calling thread.
//
// Why not only XLA's intra-op pool: a decode step makes about 200 short kernel calls (7 per
// layer), each a fraction of a millisecond, with a little XLA work between them. A pool
// thread that has gone to sleep between two calls must be woken for the next one, and in
// a virtual machine an idle vCPU halts, so the wake-up is slow: `perf` put 11% (f32) to 16%
// (bf16) of a 64-sequence decode step's CPU time in the guest's halt. These helpers
// instead wait for the next call spinning (with `pause`, yielding the CPU to any thread
// that has work on it) for a short window after each one (PAGED_JAX_CPU_SPIN_US, 300 us by
// default), then sleep on a condition variable, so an idle server burns no CPU. Measured
// (experiments/helper_threads.py): 64-sequence decode steps 1.1-1.3x faster. Only calls of
// up to kSpinMaxRows rows take them: a prefill-sized call's items are long, XLA runs its
// own multi-threaded work between such calls, and there the helpers only competed with
// XLA's awake threads (a 256-token bf16 prefill step ran 0.87x). With the window at 0 the
// kernels use XLA's pool as before.
//
// The calling thread always drains the call's items too and waits for the helpers that
// took one, so a call's result never depends on a helper joining: calls from several
// threads at once (one per XLA device) share the helpers, and whichever call posted last
// gets them. There is one helper per CPU this process may run on, less the caller's.

#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <utility>

namespace paged_jax_cpu {

// Spin window in microseconds (0: the kernels use XLA's pool); from
// $PAGED_JAX_CPU_SPIN_US at the first call, changed by paged_jax_cpu_set_spin_us.
std::atomic<int>& spin_us();
// Runs `task` on up to `wanted` spinning helpers (each at most once); returns at once.
// Returns false if there are none (one CPU), leaving the work to the caller.
bool start_helpers(int64_t wanted, std::function<void()> task);

// Calls of at most this many rows (tokens) take the spinning helpers; larger ones, whose
// items are long, XLA's pool.
constexpr int64_t kSpinMaxRows = 128;

// The call's helpers: for a call of `rows` rows (tokens), the spinning ones, or (window 0,
// or more than kSpinMaxRows rows) `wanted` tasks on XLA's pool.
template <typename Pool>
inline void schedule_helpers(Pool& pool, int64_t rows, int64_t wanted, std::function<void()> task) {
  if (wanted <= 0) return;
  if (rows <= kSpinMaxRows && spin_us().load(std::memory_order_relaxed) > 0) {
    start_helpers(wanted, std::move(task));
    return;
  }
  for (int64_t i = 0; i < wanted; ++i) pool.Schedule(std::function<void()>(task));
}

}  // namespace paged_jax_cpu
