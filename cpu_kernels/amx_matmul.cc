// bf16 x bf16 -> f32 matmul on Intel AMX, with the weights packed once, as an XLA FFI call.
//
// Why: XLA's CPU dot (YNNPACK) repacks the weight matrix into AMX's tile layout on every
// call. In a 64-row SmolLM2 decode step that repacking (ynn::transpose_x32 /
// interleave2) cost about as much as the matmuls themselves, since it reads and writes
// every weight once more per step. Here the weights arrive already packed
// (cpu_kernels/amx_matmul.py packs them when the runner starts), so a step reads each
// weight once, straight into the tile registers.
//
// Contract (two targets):
//   x    bf16[M, K]   M % 16 == 0, K % 32 == 0 (the wrapper pads rows)
//   w_i  bf16[N_i / 16, K / 32, 16, 32]: B tiles, w[nb, kb, r, 2c + p] = W[32 kb + 2 r + p, 16 nb + c]
//        for W [K, N] (the pairs of K rows interleaved, as TDPBF16PS takes them)
//   AmxMatmulBF16: 1 to 4 weights -> out_i f32[M, N_i] = x @ W_i, accumulated in f32. Several
//        weights of one input (q, k and v) are one call: one wake-up of the threads, one
//        pass of x through their caches.
//   AmxSwigluBF16: w_gate, w_up of one shape -> bf16[M, N] = silu(x @ W_gate) * (x @ W_up),
//        the f32 products combined in registers and rounded to bf16 once (the down
//        projection's input dtype), instead of two f32 [M, N] arrays through memory.
//   AmxLogitsArgmaxBF16: one weight (the LM head) -> logits f32[M, N] = x @ W, and per row
//        the first index of its largest logit (i32[M]) and that logit (f32[M]), taken from
//        the C tiles as they are stored: a greedy step then needs no second pass over the
//        [rows, vocab] logits (XLA's reductions over them took ~5 ms of a 64-row SmolLM2
//        decode step).
// Work items are (a panel of up to kPanelRows rows, a pair of 16-column blocks; for SwiGLU
// the gate's and the up projection's block of the same columns), taken by XLA's intra-op
// threads and the caller; each thread configures its tiles (8 tiles: 4 of C, 2 of A, 2 of B)
// and releases them when done. Built only where the compiler targets AMX (-march=native on
// such a CPU); elsewhere the handler returns an error and the Python side never calls it.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>

#include "helper_threads.h"  // schedule_helpers
#include "xla/ffi/api/ffi.h"

#include "amx_tiles.h"  // amx_permitted, configure_tiles
#include "matmul_epilogues.h"  // RowBest, offer_row, silu_times

namespace ffi = xla::ffi;

namespace {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

using paged_jax_cpu::amx_permitted;
using paged_jax_cpu::configure_tiles;
using paged_jax_cpu::RowBest;
using paged_jax_cpu::silu_times;

// One weight matrix of a call: its packed tiles, its columns, where its product goes.
struct Part {
  const uint16_t* w = nullptr;
  int64_t N = 0, pairs = 0;  // pairs: its items per row panel (column pairs, or one column block for SwiGLU)
  float* out = nullptr;
};

constexpr int kMaxParts = 4;

struct Work {
  const uint16_t* x;
  int64_t M, K;
  Part parts[kMaxParts];
  int num_parts = 0;
  int64_t pairs = 0;  // items per row panel, over every part
  uint16_t* swiglu_out = nullptr;  // SwiGLU: bf16[M, N] = silu(x @ gate) * (x @ up), parts[0] = gate, [1] = up
  int32_t* argmax = nullptr;  // logits + argmax: per row the first index of the largest logit...
  float* best = nullptr;      // ... and that logit; threads merge their rows' bests under `merge`
  std::mutex merge;
  std::atomic<int64_t> next{0};
  std::atomic<int> active{0};
};

// How many B tiles ahead the first row pass prefetches its weights: a tile load waits for
// the dot product that reads the tile before it (tiles are not renamed), so without this
// each 1 KB weight tile arrives at memory latency (measured, 64 rows, 60 SmolLM2-shaped
// matrices from DRAM: 10-15% faster with 2-4 tiles ahead, no change at 1024 rows).
constexpr int64_t kPrefetchTiles = 4;

// Rows per work item: an item is (a panel of kPanelRows rows, a column pair), panel-major,
// so the threads sweep every column pair against one panel of x while it sits in their
// L2, instead of every item streaming all of x (3 MB for a 1024-row down projection) from
// L3 (in-process A/B, 1024 rows, 60 SmolLM2-shaped matmuls: 7 of 8 rounds faster, median
// 149 -> 133 ms). 256 rows, not 128: each weight column pair is then read from L3 half as
// often in the 2048-token chunks the engine runs on the vLLM-peer trace (one layer's
// matrices: 7 MB). Measured on SmolLM2's 30 layers of q/k/v, o, SwiGLU and down at 2048
// rows, two rounds each: 295 / 290 ms with 128 rows, 271 / 263 with 256 (1024 rows: no
// difference); its prefill-only run of the trace's 64 prompts 2.71-2.81 s -> 2.54-2.72 s.
constexpr int64_t kPanelRows = 256;

// x [rows m_begin..m_end) @ the two 16-column B blocks b0 (and b1 unless null), 32 rows at a
// time: C tiles 0..3 = (rows 0-15, 16-31) x (b0, b1); A tiles 4, 5; B tiles 6, 7. Each 32-row
// step's C tiles go to `store(m, two_m, two_n)` (two_m: rows 16-31 exist), which reads them out.
// x's tiles load with TILELOADDT1, the non-temporal hint: each 32-row step streams 32 rows of
// x (36 KB at K = 576) through L1, which otherwise evicted the column pair's weights (36 KB,
// read again by every step) from the 48 KB L1, so both came from L2 at about half the rate
// the tile unit uses them. A single-thread probe with one operand held in L1 ran at 3.1-3.4
// TFLOP/s against 1.7-1.9 with both streaming; in-process at 2048 rows, SmolLM2 shapes, two
// rounds: q/k/v 1.29 / 1.31 -> 1.18 / 1.17 ms, o 0.76 / 0.74 -> 0.70 / 0.72, SwiGLU 4.27 /
// 4.16 -> 3.64 / 3.62; the down projection (K = 1536: its 96 KB column pair never fits)
// unchanged, and splitting K into chunks that fit made it slower (2.0-2.2 ms against 1.7).
template <typename Store>
void column_pair(const Work& p, const uint16_t* b0, const uint16_t* b1, int64_t m_begin, int64_t m_end,
                 const Store& store) {
  const int64_t kb_count = p.K / 32, x_stride = p.K * 2;
  const bool two_n = b1 != nullptr;
  for (int64_t m = m_begin; m < m_end; m += 32) {
    const bool two_m = m + 16 < m_end;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* a0 = p.x + m * p.K;
    const uint16_t* a1 = a0 + 16 * p.K;
    for (int64_t kb = 0; kb < kb_count; ++kb) {
      if (m == m_begin && kb + kPrefetchTiles < kb_count) {  // the weights' first pass streams them from memory
        const char* n0 = reinterpret_cast<const char*>(b0 + (kb + kPrefetchTiles) * 512);
        const char* n1 = two_n ? reinterpret_cast<const char*>(b1 + (kb + kPrefetchTiles) * 512) : nullptr;
        for (int o = 0; o < 1024; o += 64) {
          asm volatile("prefetcht0 %0" : : "m"(n0[o]));
          if (two_n) asm volatile("prefetcht0 %0" : : "m"(n1[o]));
        }
      }
      _tile_stream_loadd(4, a0 + kb * 32, x_stride);  // x: TILELOADDT1 (see above)
      _tile_loadd(6, b0 + kb * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (two_n) {
        _tile_loadd(7, b1 + kb * 512, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (two_m) {
        _tile_stream_loadd(5, a1 + kb * 32, x_stride);
        _tile_dpbf16ps(2, 5, 6);
        if (two_n) _tile_dpbf16ps(3, 5, 7);
      }
    }
    store(m, two_m, two_n);
  }
}

// Item i of a plain call: output columns [32 pair, 32 pair + 32) of part `part`, f32; with
// `rows` (argmax calls), each stored row's 16 or 32 logits, read back while in L1, are
// offered to its running best.
void plain_item(const Work& p, const Part& part, int64_t pair, int64_t m_begin, int64_t m_end, RowBest* rows) {
  const int64_t kb_count = p.K / 32, nb0 = 2 * pair;
  const uint16_t* b0 = part.w + nb0 * kb_count * 512;
  const uint16_t* b1 = (nb0 + 1) * 16 < part.N ? b0 + kb_count * 512 : nullptr;
  const int64_t out_stride = part.N * 4;
  column_pair(p, b0, b1, m_begin, m_end, [&](int64_t m, bool two_m, bool two_n) {
    float* c = part.out + m * part.N + nb0 * 16;
    _tile_stored(0, c, out_stride);
    if (two_n) _tile_stored(1, c + 16, out_stride);
    if (two_m) {
      _tile_stored(2, c + 16 * part.N, out_stride);
      if (two_n) _tile_stored(3, c + 16 * part.N + 16, out_stride);
    }
    if (rows == nullptr) return;
    for (int r = 0; r < (two_m ? 32 : 16); ++r)
      paged_jax_cpu::offer_row(rows[m + r], c + r * part.N, two_n, static_cast<int32_t>(nb0 * 16));
  });
}

// Item of a SwiGLU call: bf16 output columns [16 block, 16 block + 16) = silu(gate) * up,
// the gate's and the up projection's column block side by side in the C tiles; the f32
// products never leave the thread (before: two f32 [M, N] arrays written, read back and
// multiplied by XLA, then rounded to bf16 for the down projection).
void swiglu_item(const Work& p, int64_t block, int64_t m_begin, int64_t m_end) {
  const int64_t kb_count = p.K / 32, N = p.parts[0].N;
  const uint16_t* gate = p.parts[0].w + block * kb_count * 512;
  const uint16_t* up = p.parts[1].w + block * kb_count * 512;
  alignas(64) float c[4][16][16];
  column_pair(p, gate, up, m_begin, m_end, [&](int64_t m, bool two_m, bool) {
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    if (two_m) {
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
    }
    const int rows = two_m ? 32 : 16;
    for (int r = 0; r < rows; ++r) {
      const int half = r / 16, row = r % 16;
      const __m512 h = silu_times(_mm512_load_ps(c[2 * half][row]), _mm512_load_ps(c[2 * half + 1][row]));
      const __m256bh packed = _mm512_cvtneps_pbh(h);  // round to nearest even, as XLA's convert
      std::memcpy(p.swiglu_out + (m + r) * N + block * 16, &packed, 32);
    }
  });
}

void drain(Work& work) {
  work.active.fetch_add(1);
  const int64_t panels = (work.M + kPanelRows - 1) / kPanelRows, items = work.pairs * panels;
  int64_t i = work.next.fetch_add(1);
  if (i < items) {
    configure_tiles();
    std::unique_ptr<RowBest[]> rows(work.argmax ? new RowBest[work.M] : nullptr);
    for (; i < items; i = work.next.fetch_add(1)) {
      const int64_t panel = i / work.pairs, m0 = panel * kPanelRows, m1 = std::min<int64_t>(work.M, m0 + kPanelRows);
      int64_t pair = i % work.pairs;
      if (work.swiglu_out) {
        swiglu_item(work, pair, m0, m1);
        continue;
      }
      int part = 0;
      while (pair >= work.parts[part].pairs) pair -= work.parts[part++].pairs;
      plain_item(work, work.parts[part], pair, m0, m1, rows.get());
    }
    _tile_release();
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

void run(ffi::ThreadPool& pool, std::shared_ptr<Work> work) {
  const int64_t items = work->pairs * ((work->M + kPanelRows - 1) / kPanelRows);
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), items - 1);
  paged_jax_cpu::schedule_helpers(pool, work->M, helpers, [work] { drain(*work); });
  drain(*work);
  while (work->active.load() > 0 || work->next.load() < items) std::this_thread::yield();
}

// x and the packed weights, checked; the Work's parts get their weights and columns.
ffi::Error prepare(Work& work, ffi::Buffer<ffi::BF16> x, ffi::RemainingArgs weights) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || xd[0] % 16 || xd[1] % 32) return ffi::Error::InvalidArgument("x [M, K], M % 16 == 0, K % 32 == 0");
  if (weights.size() < 1 || weights.size() > kMaxParts) return ffi::Error::InvalidArgument("1 to 4 weight matrices");
  if (!amx_permitted()) return ffi::Error::Internal("the kernel refused the AMX tile state (arch_prctl)");
  work.x = reinterpret_cast<const uint16_t*>(x.typed_data());
  work.M = xd[0], work.K = xd[1];
  work.num_parts = static_cast<int>(weights.size());
  for (int i = 0; i < work.num_parts; ++i) {
    auto w = weights.get<ffi::Buffer<ffi::BF16>>(i);
    if (!w.has_value()) return ffi::Error::InvalidArgument("weights must be bf16 buffers");
    const auto wd = w->dimensions();
    if (wd.size() != 4 || wd[2] != 16 || wd[3] != 32 || wd[1] * 32 != work.K)
      return ffi::Error::InvalidArgument("packed weights bf16 [N/16, K/32, 16, 32] with x's K");
    work.parts[i].w = reinterpret_cast<const uint16_t*>(w->typed_data());
    work.parts[i].N = wd[0] * 16;
  }
  return ffi::Error::Success();
}

ffi::Error matmul_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::RemainingArgs weights,
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
    part.pairs = (part.N / 16 + 1) / 2;
    work->pairs += part.pairs;
  }
  if (work->M > 0 && work->pairs > 0) run(pool, work);
  return ffi::Error::Success();
}

ffi::Error logits_argmax_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::RemainingArgs weights,
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
  part.pairs = work->pairs = (part.N / 16 + 1) / 2;
  work->argmax = argmax->typed_data(), work->best = best->typed_data();
  for (int64_t r = 0; r < work->M; ++r) work->argmax[r] = static_cast<int32_t>(part.N), work->best[r] = -std::numeric_limits<float>::infinity();
  if (work->M > 0 && work->pairs > 0) run(pool, work);
  return ffi::Error::Success();
}

ffi::Error swiglu_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::RemainingArgs weights,
                       ffi::ResultBuffer<ffi::BF16> out) {
  auto work = std::make_shared<Work>();
  if (auto error = prepare(*work, x, weights); error.failure()) return error;
  if (work->num_parts != 2 || work->parts[0].N != work->parts[1].N)
    return ffi::Error::InvalidArgument("SwiGLU takes two weight matrices of one shape (gate, up)");
  const auto od = out->dimensions();
  if (od.size() != 2 || od[0] != work->M || od[1] != work->parts[0].N) return ffi::Error::InvalidArgument("out bf16[M, N]");
  work->swiglu_out = reinterpret_cast<uint16_t*>(out->typed_data());
  work->pairs = work->parts[0].N / 16;
  if (work->M > 0 && work->pairs > 0) run(pool, work);
  return ffi::Error::Success();
}

#else  // no AMX in this build: the Python side checks `amx_matmul_supported` first

ffi::Error matmul_impl(ffi::ThreadPool, ffi::Buffer<ffi::BF16>, ffi::RemainingArgs, ffi::RemainingRets) {
  return ffi::Error::Internal("built without AMX (the compiler does not target amx-tile / amx-bf16)");
}

ffi::Error swiglu_impl(ffi::ThreadPool, ffi::Buffer<ffi::BF16>, ffi::RemainingArgs, ffi::ResultBuffer<ffi::BF16>) {
  return ffi::Error::Internal("built without AMX (the compiler does not target amx-tile / amx-bf16)");
}

ffi::Error logits_argmax_impl(ffi::ThreadPool, ffi::Buffer<ffi::BF16>, ffi::RemainingArgs, ffi::ResultBuffer<ffi::F32>,
                              ffi::ResultBuffer<ffi::S32>, ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error::Internal("built without AMX (the compiler does not target amx-tile / amx-bf16)");
}

#endif

}  // namespace

// 1 where this build can run AMX tiles (the CPU has them and the OS grants them), else 0.
extern "C" int paged_jax_amx_matmul_supported() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(AmxMatmulBF16, matmul_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AmxSwigluBF16, swiglu_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AmxLogitsArgmaxBF16, logits_argmax_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
