// bf16 x bf16 -> f32 matmul on Intel AMX, with the weights packed once, as an XLA FFI call.
//
// Why: XLA's CPU dot (YNNPACK) repacks the weight matrix into AMX's tile layout on every
// call. In a 64-row SmolLM2 decode step that repacking (ynn::transpose_x32 /
// interleave2) cost about as much as the matmuls themselves, since it reads and writes
// every weight once more per step. Here the weights arrive already packed
// (cpu_kernels/amx_matmul.py packs them when the runner starts), so a step reads each
// weight once, straight into the tile registers.
//
// Contract:
//   x    bf16[M, K]   M % 16 == 0, K % 32 == 0 (the wrapper pads rows)
//   w    bf16[N / 16, K / 32, 16, 32]: B tiles, w[nb, kb, r, 2c + p] = W[32 kb + 2 r + p, 16 nb + c]
//        for W [K, N] (the pairs of K rows interleaved, as TDPBF16PS takes them)
//   out  f32[M, N] = x @ W, accumulated in f32.
// Work items are (a panel of up to 128 rows, a pair of 16-column blocks), taken by XLA's intra-op
// threads and the caller; each thread configures its tiles (8 tiles: 4 of C, 2 of A, 2 of B)
// and releases them when done. Built only where the compiler targets AMX (-march=native on
// such a CPU); elsewhere the handler returns an error and the Python side never calls it.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace ffi = xla::ffi;

namespace {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: ask the kernel for the AMX tile state
constexpr long kXfeatureXtiledata = 18;

bool amx_permitted() {  // once per process
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;  // 16 rows x 64 bytes each
  _tile_loadconfig(&cfg);
}

struct Work {
  const uint16_t* x;
  const uint16_t* w;
  float* out;
  int64_t M, K, N;
  std::atomic<int64_t> next{0};
  std::atomic<int> active{0};
};

// How many B tiles ahead the first row pass prefetches its weights: a tile load waits for
// the dot product that reads the tile before it (tiles are not renamed), so without this
// each 1 KB weight tile arrives at memory latency (measured, 64 rows, 60 SmolLM2-shaped
// matrices from DRAM: 10-15% faster with 2-4 tiles ahead, no change at 1024 rows).
constexpr int64_t kPrefetchTiles = 4;

// Output columns [32 item, 32 item + 32) for rows [m_begin, m_end), 32 rows at a time: C tiles 0..3 =
// (rows 0-15, 16-31) x (columns 0-15, 16-31); A tiles 4, 5; B tiles 6, 7.
// Rows per work item: an item is (a panel of kPanelRows rows, a column pair), panel-major,
// so the threads sweep every column pair against one panel of x while it sits in their
// L2, instead of every item streaming all of x (3 MB for a 1024-row down projection) from
// L3 (in-process A/B, 1024 rows, 60 SmolLM2-shaped matmuls: 7 of 8 rounds faster, median
// 149 -> 133 ms; 64 and 256 rows per panel measured about the same as 128).
constexpr int64_t kPanelRows = 128;

void column_pair(const Work& p, int64_t item, int64_t m_begin, int64_t m_end) {
  const int64_t kb_count = p.K / 32, nb0 = 2 * item;
  const bool two_n = (nb0 + 1) * 16 < p.N;
  const uint16_t* b0 = p.w + nb0 * kb_count * 512;
  const uint16_t* b1 = b0 + kb_count * 512;
  const int64_t x_stride = p.K * 2, out_stride = p.N * 4;
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
        const char* n1 = reinterpret_cast<const char*>(b1 + (kb + kPrefetchTiles) * 512);
        for (int o = 0; o < 1024; o += 64) {
          asm volatile("prefetcht0 %0" : : "m"(n0[o]));
          if (two_n) asm volatile("prefetcht0 %0" : : "m"(n1[o]));
        }
      }
      _tile_loadd(4, a0 + kb * 32, x_stride);
      _tile_loadd(6, b0 + kb * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (two_n) {
        _tile_loadd(7, b1 + kb * 512, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (two_m) {
        _tile_loadd(5, a1 + kb * 32, x_stride);
        _tile_dpbf16ps(2, 5, 6);
        if (two_n) _tile_dpbf16ps(3, 5, 7);
      }
    }
    float* c = p.out + m * p.N + nb0 * 16;
    _tile_stored(0, c, out_stride);
    if (two_n) _tile_stored(1, c + 16, out_stride);
    if (two_m) {
      _tile_stored(2, c + 16 * p.N, out_stride);
      if (two_n) _tile_stored(3, c + 16 * p.N + 16, out_stride);
    }
  }
}

void drain(Work& work) {
  work.active.fetch_add(1);
  const int64_t pairs = (work.N / 16 + 1) / 2, panels = (work.M + kPanelRows - 1) / kPanelRows;
  const int64_t items = pairs * panels;
  int64_t i = work.next.fetch_add(1);
  if (i < items) {
    configure_tiles();
    for (; i < items; i = work.next.fetch_add(1)) {
      const int64_t panel = i / pairs, m0 = panel * kPanelRows;
      column_pair(work, i % pairs, m0, std::min<int64_t>(work.M, m0 + kPanelRows));
    }
    _tile_release();
  }
  work.active.fetch_sub(1);
}

ffi::Error matmul_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                       ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || wd[2] != 16 || wd[3] != 32 || xd[1] != wd[1] * 32 || xd[0] % 16)
    return ffi::Error::InvalidArgument("x [M, K] (M % 16 == 0) and packed w [N/16, K/32, 16, 32]");
  if (!amx_permitted()) return ffi::Error::Internal("the kernel refused the AMX tile state (arch_prctl)");
  auto work = std::make_shared<Work>();
  work->x = reinterpret_cast<const uint16_t*>(x.typed_data());
  work->w = reinterpret_cast<const uint16_t*>(w.typed_data());
  work->out = out->typed_data();
  work->M = xd[0], work->K = xd[1], work->N = wd[0] * 16;
  if (work->M == 0 || work->N == 0) return ffi::Error::Success();
  const int64_t items = (work->N / 16 + 1) / 2 * ((work->M + kPanelRows - 1) / kPanelRows);
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), items - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { drain(*work); });
  drain(*work);
  while (work->active.load() > 0 || work->next.load() < items) std::this_thread::yield();
  return ffi::Error::Success();
}

#else  // no AMX in this build: the Python side checks `amx_matmul_supported` first

ffi::Error matmul_impl(ffi::ThreadPool, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::BF16>, ffi::ResultBuffer<ffi::F32>) {
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
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
