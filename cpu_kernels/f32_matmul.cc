// f32 matmuls with AVX-512 FMAs, for the decode-sized steps of a float32 model, as XLA FFI calls.
//
// Why: XLA's CPU f32 dot ran SmolLM2's 64-row projections at 125-165 GFLOP/s on these two
// cores, about half of what the FMA units do with operands in cache, and the f32 decode
// step is mostly those matmuls. A 64-row product reads each weight once from L3 or memory
// and uses it 64 times, so what decides its speed is keeping the FMA units fed while the
// weights stream in: here each work item (a panel of rows, 32 output columns) runs
// 8-row x 32-column register tiles over all of K, and prefetches the next item's weights
// while it computes, spread over its row tiles, so they arrive ahead of their first use
// instead of at memory latency. Rows come in panels of 256, so prefill-sized products
// (hundreds to thousands of rows) reuse each panel's weights from L2 and run at least as
// fast as XLA's dot there too.
//
// Tried and not kept: wider register tiles (8 rows x 48 columns for the matmuls, 10 rows x
// 16 + 16 for SwiGLU) with the next item's weights prefetched into L2 instead of L1. Alone,
// on SmolLM2's shapes, the matmuls ran a little faster. But a served 64-row decode step and a
// 1024-token mixed step did not get measurably faster when the two builds were timed in
// turn. So what limits a served step is not these tiles' FMA-to-load ratio. The 10-row tile
// also spilled its row pointers: with K a runtime value, each row needs its own register.
// Also tried: each thread packing its x panel k-major ([tile][K][8], one pointer per tile, no
// spills). A served 64-row decode step did not change and a 1024-token mixed step got slower
// (the packing). In a profile of the served decode step, the tile loop's samples spread evenly
// over its FMAs and loads, with no stall on the weight loads or the spilled pointers. And:
// K in chunks of 192 swept over all row tiles, so each chunk's weights (24 KiB) are read from
// L1 by every tile instead of from L2: decode unchanged, the mixed step a little slower.
// What did pay: stepping k in groups of 4 (one prefetch countdown, loop test and pointer
// update per group). In a profile the loop had about as many scalar uops as FMAs, and
// scalar uops can issue on the two ports the 512-bit FMAs use. Served decode and mixed steps
// were faster in every alternating pair of runs; groups of 8 were no faster than 4.
//
// Contract:
//   x    f32[M, K]   any M, K
//   w_i  f32[K, N_i] (the checkpoint's [in, out] layout, read in place), or
//        f32[N_i / 16, K, 16] (`pack_columns`: each 16-column block's K rows contiguous,
//        for a matrix that is read only here, such as the LM head's copy); N_i % 16 == 0
//   F32Matmul: 1 to 4 weights -> out_i f32[M, N_i] = x @ W_i (q, k and v in one call).
//   F32Swiglu: gate, up of one shape -> f32[M, N] = silu(x @ gate) * (x @ up), the products
//        combined in registers instead of two [M, N] arrays through memory.
//   F32LogitsArgmax: one weight (the LM head) -> logits f32[M, N], and per row the first
//        index of its largest logit (i32[M]) and that logit (f32[M]): a greedy step then
//        needs no second pass over the [rows, vocab] logits.
// Products accumulate in f32 in the order k = 0, 1, ..., K - 1 (one FMA per term), so they
// differ from XLA's dot only by the order of summation.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>

#include "helper_threads.h"  // schedule_helpers
#include "xla/ffi/api/ffi.h"

#include "matmul_epilogues.h"  // RowBest, offer_row, silu_times

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)

using paged_jax_cpu::RowBest;

constexpr int kTileRows = 8;     // x rows per register tile: 8 x 2 accumulators + 2 weight vectors of 32
constexpr int64_t kPanelRows = 256;  // rows per work item (its x panel stays in L2 while the columns sweep it)
constexpr int kMaxParts = 4;

// One weight matrix of a call: where its 16-column block j starts, how far apart its K rows
// are (N in [K, N], 16 packed), and where its product goes.
struct Part {
  const float* w = nullptr;
  int64_t N = 0, block_stride = 0, k_stride = 0, pairs = 0;
  float* out = nullptr;
  const float* block(int64_t j) const { return w + j * block_stride; }
};

struct Work {
  const float* x;
  int64_t M, K;
  Part parts[kMaxParts];
  int num_parts = 0;
  int64_t pairs = 0, items = 0;  // column pairs per row panel, over every part; items = pairs x panels
  float* swiglu_out = nullptr;   // SwiGLU: parts[0] = gate, [1] = up, each item one 16-column block of both
  int32_t* argmax = nullptr;     // logits + argmax: per row the first index of the largest logit, and its value
  float* best = nullptr;
  std::mutex merge;
  std::atomic<int64_t> next{0};
  std::atomic<int> active{0};
};

// The two 16-column weight blocks an item multiplies (b1 null: a lone last block).
struct Blocks {
  const float* b0 = nullptr;
  const float* b1 = nullptr;
  int64_t k_stride = 0;
};

Blocks item_blocks(const Work& p, int64_t item) {
  int64_t pair = item % p.pairs;
  if (p.swiglu_out) return {p.parts[0].block(pair), p.parts[1].block(pair), p.parts[0].k_stride};
  int part = 0;
  while (pair >= p.parts[part].pairs) pair -= p.parts[part++].pairs;
  const Part& q = p.parts[part];
  return {q.block(2 * pair), (2 * pair + 1) * 16 < q.N ? q.block(2 * pair + 1) : nullptr, q.k_stride};
}

inline void prefetch_line(const float* a) { asm volatile("prefetcht0 %0" : : "m"(*a)); }

// acc0/acc1[r] = x rows [0, MR) @ the blocks' 16 columns each, over all of K; meanwhile the
// K rows [pf_begin, pf_end) of the next item's blocks are prefetched, `pf_per` rows of each
// every `pf_every` groups of k steps.
template <int MR, bool kTwo>
inline void tile(const float* x, int64_t K, const Blocks& b, const Blocks& pf, int64_t pf_begin, int64_t pf_end,
                 __m512* out0, __m512* out1) {
  // local accumulators, copied out at the end: updated through out0 / out1 (__m512 may alias
  // x's floats) they lived in memory, and the tile ran at a third of the speed
  __m512 acc0[MR], acc1[MR];
  for (int r = 0; r < MR; ++r) acc0[r] = _mm512_setzero_ps(), acc1[r] = _mm512_setzero_ps();
  // k steps in groups of kUnroll: the pointer arithmetic, loop test and prefetch countdown
  // once per group instead of once per k, so fewer scalar uops compete with the FMAs' ports
  constexpr int64_t kUnroll = 4;
  const int64_t groups = K / kUnroll, pf_rows = pf_end - pf_begin;
  const int64_t pf_per = groups > 0 ? std::max<int64_t>(1, (pf_rows + groups - 1) / groups) : 0;
  const int64_t pf_every = pf_rows > 0 && groups > 0 ? std::max<int64_t>(1, groups * pf_per / pf_rows) : groups + 1;
  int64_t pf_k = pf_begin, countdown = 0;  // a countdown, not a modulo: a division per group costs more than its FMAs
  const float* w0p = b.b0;
  const float* w1p = b.b1;
  const int64_t ks = b.k_stride;
  int64_t k = 0;
  for (int64_t g = 0; g < groups; ++g, k += kUnroll) {
    if (--countdown <= 0 && pf_k < pf_end) {
      for (int64_t i = 0; i < pf_per && pf_k < pf_end; ++i, ++pf_k) {
        prefetch_line(pf.b0 + pf_k * pf.k_stride);
        if (pf.b1) prefetch_line(pf.b1 + pf_k * pf.k_stride);
      }
      countdown = pf_every;
    }
#pragma GCC unroll 4
    for (int64_t u = 0; u < kUnroll; ++u) {
      const __m512 w0 = _mm512_loadu_ps(w0p + (k + u) * ks);
      const __m512 w1 = kTwo ? _mm512_loadu_ps(w1p + (k + u) * ks) : _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512 a = _mm512_set1_ps(x[r * K + k + u]);
        acc0[r] = _mm512_fmadd_ps(a, w0, acc0[r]);
        if (kTwo) acc1[r] = _mm512_fmadd_ps(a, w1, acc1[r]);
      }
    }
  }
  for (; k < K; ++k) {  // the last K % kUnroll steps
    const __m512 w0 = _mm512_loadu_ps(w0p + k * ks);
    const __m512 w1 = kTwo ? _mm512_loadu_ps(w1p + k * ks) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * K + k]);
      acc0[r] = _mm512_fmadd_ps(a, w0, acc0[r]);
      if (kTwo) acc1[r] = _mm512_fmadd_ps(a, w1, acc1[r]);
    }
  }
  for (; pf_k < pf_end; ++pf_k) {
    prefetch_line(pf.b0 + pf_k * pf.k_stride);
    if (pf.b1) prefetch_line(pf.b1 + pf_k * pf.k_stride);
  }
  for (int r = 0; r < MR; ++r) out0[r] = acc0[r], out1[r] = acc1[r];
}

template <int MR>
inline void tile_any(const float* x, int64_t K, const Blocks& b, const Blocks& pf, int64_t lo, int64_t hi,
                     __m512* acc0, __m512* acc1) {
  if (b.b1) tile<MR, true>(x, K, b, pf, lo, hi, acc0, acc1);
  else tile<MR, false>(x, K, b, pf, lo, hi, acc0, acc1);
}

// Item `item` (rows of its panel x its column pair); `next` is the item this thread takes
// after it (-1: none), whose weights it prefetches.
void run_item(Work& p, int64_t item, int64_t next, RowBest* rows) {
  const int64_t m0 = (item / p.pairs) * kPanelRows, m1 = std::min<int64_t>(p.M, m0 + kPanelRows);
  const Blocks b = item_blocks(p, item);
  const Blocks pf = next >= 0 ? item_blocks(p, next) : Blocks{};
  const int64_t pf_rows = next >= 0 ? p.K : 0, tiles = (m1 - m0 + kTileRows - 1) / kTileRows;
  const int64_t pf_share = (pf_rows + tiles - 1) / tiles;
  // the item's columns in its part's output
  int64_t pair = item % p.pairs;
  int part = 0;
  if (!p.swiglu_out)
    while (pair >= p.parts[part].pairs) pair -= p.parts[part++].pairs;
  const Part& q = p.parts[part];
  __m512 acc0[kTileRows], acc1[kTileRows];
  for (int64_t m = m0, t = 0; m < m1; m += kTileRows, ++t) {
    const int mr = static_cast<int>(std::min<int64_t>(kTileRows, m1 - m));
    const int64_t lo = std::min(pf_rows, t * pf_share), hi = std::min(pf_rows, lo + pf_share);
    const float* x = p.x + m * p.K;
    switch (mr) {
      case 8: tile_any<8>(x, p.K, b, pf, lo, hi, acc0, acc1); break;
      case 7: tile_any<7>(x, p.K, b, pf, lo, hi, acc0, acc1); break;
      case 6: tile_any<6>(x, p.K, b, pf, lo, hi, acc0, acc1); break;
      case 5: tile_any<5>(x, p.K, b, pf, lo, hi, acc0, acc1); break;
      case 4: tile_any<4>(x, p.K, b, pf, lo, hi, acc0, acc1); break;
      case 3: tile_any<3>(x, p.K, b, pf, lo, hi, acc0, acc1); break;
      case 2: tile_any<2>(x, p.K, b, pf, lo, hi, acc0, acc1); break;
      default: tile_any<1>(x, p.K, b, pf, lo, hi, acc0, acc1); break;
    }
    if (p.swiglu_out) {
      for (int r = 0; r < mr; ++r)
        _mm512_storeu_ps(p.swiglu_out + (m + r) * q.N + pair * 16, paged_jax_cpu::silu_times(acc0[r], acc1[r]));
      continue;
    }
    const bool two = b.b1 != nullptr;
    for (int r = 0; r < mr; ++r) {
      float* c = q.out + (m + r) * q.N + pair * 32;
      _mm512_storeu_ps(c, acc0[r]);
      if (two) _mm512_storeu_ps(c + 16, acc1[r]);
      if (rows) paged_jax_cpu::offer_row(rows[m + r], c, two, static_cast<int32_t>(pair * 32));
    }
  }
}

void drain(Work& work) {
  work.active.fetch_add(1);
  int64_t i = work.next.fetch_add(1);
  if (i < work.items) {
    std::unique_ptr<RowBest[]> rows(work.argmax ? new RowBest[work.M] : nullptr);
    while (i < work.items) {
      const int64_t next = work.next.fetch_add(1);
      run_item(work, i, next < work.items ? next : -1, rows.get());
      i = next;
    }
    if (rows) {
      std::lock_guard<std::mutex> lock(work.merge);
      for (int64_t r = 0; r < work.M; ++r) {
        RowBest merged{work.best[r], work.argmax[r]};
        merged.offer(rows[r].value, rows[r].index);
        work.best[r] = merged.value, work.argmax[r] = merged.index;
      }
    }
  }
  work.active.fetch_sub(1);
}

// The items on XLA's intra-op threads and the caller; returns when every item is done.
void run(ffi::ThreadPool& pool, std::shared_ptr<Work> work) {
  work->items = work->pairs * ((work->M + kPanelRows - 1) / kPanelRows);
  if (work->items == 0) return;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), (work->items - 1) / 2);  // >= 2 items each
  paged_jax_cpu::schedule_helpers(pool, work->M, helpers, [work] { drain(*work); });
  drain(*work);
  while (work->active.load() > 0 || work->next.load() < work->items) std::this_thread::yield();
}

// x and the weights, checked; the Work's parts get their blocks and columns.
ffi::Error prepare(Work& work, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs weights) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("x f32[M, K]");
  if (weights.size() < 1 || weights.size() > kMaxParts) return ffi::Error::InvalidArgument("1 to 4 weight matrices");
  work.x = x.typed_data();
  work.M = xd[0], work.K = xd[1];
  work.num_parts = static_cast<int>(weights.size());
  for (int i = 0; i < work.num_parts; ++i) {
    auto w = weights.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value()) return ffi::Error::InvalidArgument("weights must be f32 buffers");
    const auto wd = w->dimensions();
    Part& part = work.parts[i];
    part.w = w->typed_data();
    if (wd.size() == 2 && wd[0] == work.K && wd[1] % 16 == 0) {  // [K, N]
      part.N = wd[1], part.block_stride = 16, part.k_stride = wd[1];
    } else if (wd.size() == 3 && wd[1] == work.K && wd[2] == 16) {  // [N / 16, K, 16]
      part.N = wd[0] * 16, part.block_stride = work.K * 16, part.k_stride = 16;
    } else {
      return ffi::Error::InvalidArgument("weights f32[K, N] or f32[N/16, K, 16] with x's K, N % 16 == 0");
    }
    part.pairs = (part.N / 16 + 1) / 2;
  }
  return ffi::Error::Success();
}

ffi::Error matmul_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs weights,
                       ffi::RemainingRets outs) {
  auto work = std::make_shared<Work>();
  if (auto error = prepare(*work, x, weights); error.failure()) return error;
  if (outs.size() != weights.size()) return ffi::Error::InvalidArgument("one f32 output per weight matrix");
  for (int i = 0; i < work->num_parts; ++i) {
    auto out = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (!out.has_value()) return ffi::Error::InvalidArgument("outputs must be f32 buffers");
    Part& part = work->parts[i];
    const auto od = (*out)->dimensions();
    if (od.size() != 2 || od[0] != work->M || od[1] != part.N) return ffi::Error::InvalidArgument("output i is f32[M, N_i]");
    part.out = (*out)->typed_data();
    work->pairs += part.pairs;
  }
  run(pool, work);
  return ffi::Error::Success();
}

ffi::Error swiglu_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs weights,
                       ffi::ResultBuffer<ffi::F32> out) {
  auto work = std::make_shared<Work>();
  if (auto error = prepare(*work, x, weights); error.failure()) return error;
  const Part &gate = work->parts[0], &up = work->parts[1];
  if (work->num_parts != 2 || gate.N != up.N || gate.k_stride != up.k_stride)
    return ffi::Error::InvalidArgument("SwiGLU takes two weight matrices of one shape and layout (gate, up)");
  const auto od = out->dimensions();
  if (od.size() != 2 || od[0] != work->M || od[1] != gate.N) return ffi::Error::InvalidArgument("out f32[M, N]");
  work->swiglu_out = out->typed_data();
  work->parts[0].out = work->swiglu_out;
  work->pairs = gate.N / 16;
  run(pool, work);
  return ffi::Error::Success();
}

ffi::Error logits_argmax_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs weights,
                              ffi::ResultBuffer<ffi::F32> logits, ffi::ResultBuffer<ffi::S32> argmax,
                              ffi::ResultBuffer<ffi::F32> best) {
  auto work = std::make_shared<Work>();
  if (auto error = prepare(*work, x, weights); error.failure()) return error;
  if (work->num_parts != 1) return ffi::Error::InvalidArgument("logits + argmax takes one weight matrix");
  Part& part = work->parts[0];
  const auto od = logits->dimensions();
  if (od.size() != 2 || od[0] != work->M || od[1] != part.N) return ffi::Error::InvalidArgument("logits f32[M, N]");
  if (argmax->dimensions().size() != 1 || argmax->dimensions()[0] != work->M || best->dimensions().size() != 1 ||
      best->dimensions()[0] != work->M)
    return ffi::Error::InvalidArgument("argmax i32[M], best f32[M]");
  part.out = logits->typed_data();
  work->pairs = part.pairs;
  work->argmax = argmax->typed_data(), work->best = best->typed_data();
  for (int64_t r = 0; r < work->M; ++r)
    work->argmax[r] = static_cast<int32_t>(part.N), work->best[r] = -std::numeric_limits<float>::infinity();
  run(pool, work);
  return ffi::Error::Success();
}

#else  // no AVX-512 in this build: the Python side checks `paged_jax_f32_matmul_supported` first

ffi::Error matmul_impl(ffi::ThreadPool, ffi::Buffer<ffi::F32>, ffi::RemainingArgs, ffi::RemainingRets) {
  return ffi::Error::Internal("built without AVX-512");
}

ffi::Error swiglu_impl(ffi::ThreadPool, ffi::Buffer<ffi::F32>, ffi::RemainingArgs, ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error::Internal("built without AVX-512");
}

ffi::Error logits_argmax_impl(ffi::ThreadPool, ffi::Buffer<ffi::F32>, ffi::RemainingArgs, ffi::ResultBuffer<ffi::F32>,
                              ffi::ResultBuffer<ffi::S32>, ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error::Internal("built without AVX-512");
}

#endif

}  // namespace

// 1 where this build has the AVX-512 kernels, else 0.
extern "C" int paged_jax_f32_matmul_supported() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(F32Matmul, matmul_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(F32Swiglu, swiglu_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(F32LogitsArgmax, logits_argmax_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
