// Ragged paged attention for CPUs, as an XLA FFI custom call.
//
// Why native code: on CPU, XLA cannot fuse a gather into a dot, so every formulation in
// plain JAX first copies each sequence's K/V out of the paged cache and then reads the
// copy (measured: about 5x the memory traffic of reading the cache once), and Pallas runs
// on CPU only in interpret mode. This kernel reads every K/V row straight through the
// block table, once per (sequence, KV head, query tile), with an f32 online softmax.
//
// Contract (the same as pallas_kernels.ragged_paged_attention_reference):
//   k, v    f32 or bf16 [num_blocks, block_size, Hkv, D]   (Hq a multiple of Hkv)
//   q       [T, Hq, D] in the caches' dtype
//   tables  i32[S, max_blocks]        context_lens i32[S]     query_start_loc i32[S + 1]
//   out     [T, Hq, D] in the caches' dtype; tokens past query_start_loc[S] (padding) get zeros.
// Scores, softmax and the weighted values accumulate in f32 (bf16 products are exact);
// where the CPU has AMX, a bf16 cache's prefill tiles run on its tiles and round the
// softmax weights to bf16 for P V (attention_amx.h).
// Sequence s's q_len = qsl[s+1] - qsl[s] new tokens end its context, so token i of the
// sequence sits at position ctx - q_len + i and sees keys in
// [max(0, position - window + 1), position]. Slots past a context are never read.
// Attributes: sm_scale; sliding_window (0: none); soft_cap (0: none).
//
// Work is split into items (sequence, a range of KV heads, a tile of query tokens: at
// most kMaxRows query rows) that the XLA intra-op thread pool's threads
// and the calling thread take from a shared counter.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_amx.h"
#include "attention_problem.h"
#include "attention_vectors.h"
#include "helper_threads.h"  // schedule_helpers
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace paged_jax_cpu;  // attention_{problem,vectors,amx}.h

// One work item: a tile of query tokens x the query heads of a range of KV heads. Its rows
// are r = (token * num_kv_heads + kv_head) * group + g. Per block and head, the scores
// come from one of two loops: a decode item (one token: `group` rows) takes a dot product
// per key; a prefill tile (up to kMaxRows rows) transposes the block's keys once and
// scores kLanes keys per vector with no horizontal sums, which pays only with many rows.
template <typename T>
bool attend_item(const Problem& p, const Item& item, Scratch& w) {
  const int group = static_cast<int>(p.num_heads / p.num_kv_heads), nh = item.num_kv_heads;
  const int64_t D = p.head_dim, row_stride = p.num_kv_heads * D;
  const int32_t bs = static_cast<int32_t>(p.block_size), ctx = p.context_lens[item.seq];
  const int32_t lanes_bs = (bs + kLanes - 1) / kLanes * kLanes;  // kt's row length
  const int32_t q_begin = p.query_start[item.seq], q_len = p.query_start[item.seq + 1] - q_begin;
  const int rows = item.num_tokens * nh * group;
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const int32_t* table = p.tables + static_cast<int64_t>(item.seq) * p.max_blocks;
  auto& q = w.q;
  auto& acc = w.acc;
  auto& s = w.s;
  float *m = w.m, *l = w.l, *kt = w.kt;
  int32_t *lo = w.lo, *hi = w.hi;
  auto row_of = [&](int tok, int hh, int g) { return (tok * nh + hh) * group + g; };
  // decode rows of a bf16 cache score with bf16 dot products (q rounded to bf16, which the
  // Python wrapper has already done for bf16 caches: exact)
#if defined(__AVX512BF16__)
  const bool use_bf16_dot = std::is_same_v<T, uint16_t> && item.num_tokens == 1 && D % (2 * kLanes) == 0;
#else
  const bool use_bf16_dot = false;
#endif
  // prefill tiles of a bf16 cache on AMX tiles (attention_amx.h; p.amx: the CPU has them, D % 64 == 0)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  const bool use_amx = std::is_same_v<T, uint16_t> && p.amx && item.num_tokens > 1 && nh == 1;
#else
  const bool use_amx = false;
#endif
  auto query_row = [&](int tok, int hh, int g) {  // this row's slice of q / out
    return ((q_begin + item.first_token + tok) * p.num_heads + (item.first_kv_head + hh) * group + g) * D;
  };
  for (int tok = 0; tok < item.num_tokens; ++tok) {
    const int32_t position = ctx - q_len + item.first_token + tok;
    for (int hh = 0; hh < nh; ++hh) {
      for (int g = 0; g < group; ++g) {
        const int r = row_of(tok, hh, g);
        hi[r] = position + 1;
        lo[r] = p.window > 0 ? std::max(0, position - p.window + 1) : 0;
        const T* src = static_cast<const T*>(p.q) + query_row(tok, hh, g);
        if (!use_amx)  // (AMX tiles read qb only)
          for (int64_t d = 0; d < D; ++d) q[r][d] = to_float(src[d]) * p.scale;
        if (use_bf16_dot || use_amx)
          for (int64_t d = 0; d < D; ++d) w.qb[r][d] = to_bf16(src[d]);
        std::fill(acc[r], acc[r] + D, 0.0f);
        m[r] = -INFINITY;
        l[r] = 0.0f;
      }
    }
  }
  if (use_amx)  // the last row tile's padding rows score 0
    for (int r = rows; r < (rows + 15) / 16 * 16; ++r) std::fill(w.qb[r], w.qb[r] + D, uint16_t{0});
  const int32_t key_begin = *std::min_element(lo, lo + rows), key_end = *std::max_element(hi, hi + rows);
  // Blocks go in chunks of up to kMaxBlockSize keys: every block's scores first (s[r][key -
  // chunk start]), then one online-softmax update per row for the whole chunk, then P.V
  // block by block. A chunk's K is prefetched block by block ahead of its scores, its V
  // while it is scored, and the next chunk's K during its P.V: a sequence's blocks are
  // scattered, so no hardware prefetcher can guess them.
  const int32_t chunk_blocks = std::max(1, kMaxBlockSize / bs), end_block = (key_end + bs - 1) / bs;
  auto block_base = [&](int32_t b) -> int64_t {  // where block b's rows of these heads start; -1: bad entry
    const int32_t block = b < end_block ? table[b] : -1;
    if (block < 0 || block >= p.num_blocks) return -1;
    return (static_cast<int64_t>(block) * bs) * row_stride + item.first_kv_head * D;
  };
  // (decode items only: a prefill tile's blocks were read by the sequence's tile before it)
  auto prefetch = [&](const T* cache, int32_t b) {
    if (b >= end_block || item.num_tokens > 1) return;
    const int64_t base = block_base(b);
    if (base >= 0) prefetch_rows(cache + base, std::min<int32_t>(bs, key_end - b * bs), row_stride, nh * D);
  };
  for (int32_t cb = key_begin / bs; cb < end_block; cb += chunk_blocks) {
    const int32_t ce = std::min(cb + chunk_blocks, end_block), origin = cb * bs;
    const int32_t c0 = std::max(key_begin, origin) - origin, c1 = std::min(key_end, ce * bs) - origin;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if constexpr (std::is_same_v<T, uint16_t>) {
      if (use_amx) {  // the chunk's key rows, then all its scores at once
        for (int32_t b = cb; b < ce; ++b) {
          const int64_t base = block_base(b);
          if (base < 0) return false;
          for (int32_t i = 0; i < bs; ++i) w.slot[(b - cb) * bs + i] = base + i * row_stride;
        }
        amx_scores(w, k, rows, c0, c1, D, p.scale);
      }
    }
#endif
    for (int32_t b = cb; b < ce && !use_amx; ++b) {  // scores of block b's keys [j0, j1) at s[r][off + j]
      const int64_t base = block_base(b);
      if (base < 0) return false;
      prefetch(k, b + 1);
      prefetch(v, b);
      const int32_t off = (b - cb) * bs, j0 = std::max(c0 - off, 0), j1 = std::min(c1 - off, bs);
      for (int hh = 0; hh < nh; ++hh) {
        const T* keys = k + base + hh * D;
        if (item.num_tokens == 1) {
          float* krow = w.row;
          int32_t j = j0;
#if defined(__AVX512F__)
          // 16 keys at a time, one horizontal reduction for all of them; a last group that
          // fits in the block is scored whole (its slots past the context are this block's
          // own rows: read, then masked by the softmax and never used)
          if (D % kLanes == 0) {
            for (; j < j1 && j + kLanes <= bs; j += kLanes) {
              for (int g = 0; g < group; ++g) {
                const int r = row_of(0, hh, g);
#if defined(__AVX512BF16__)
                if constexpr (std::is_same_v<T, uint16_t>) {
                  if (use_bf16_dot) {
                    score16_bf16(w.qb[r], keys + j * row_stride, row_stride, D, p.scale, &s[r][off + j]);
                    continue;
                  }
                }
#endif
                score16(q[r], keys + j * row_stride, row_stride, D, &s[r][off + j]);
              }
            }
          }
#endif
          for (; j < j1; ++j) {
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) krow[d] = to_float(keys[j * row_stride + d]);
            for (int g = 0; g < group; ++g) {
              const int r = row_of(0, hh, g);
              float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < D; ++d) dot += q[r][d] * krow[d];
              s[r][off + j] = dot;
            }
          }
        } else {
#if defined(__AVX512F__)
          // the whole block (its rows past the context or before a window are its own: read,
          // then masked by the softmax and never used)
          if (bs % kLanes == 0 && D % kLanes == 0) {
            transpose_keys(keys, row_stride, bs, D, kt, lanes_bs);
          } else
#endif
          {  // later blocks overwrite what a block writes past its keys (bs % 16 != 0)
            for (int64_t d = 0; d < D; ++d) std::fill(kt + d * lanes_bs, kt + (d + 1) * lanes_bs, 0.0f);
            for (int32_t j = j0; j < j1; ++j)
              for (int64_t d = 0; d < D; ++d) kt[d * lanes_bs + j] = to_float(keys[j * row_stride + d]);
          }
          int head_rows[kMaxRows], n = 0;  // this KV head's query rows
          for (int tok = 0; tok < item.num_tokens; ++tok)
            for (int g = 0; g < group; ++g) head_rows[n++] = row_of(tok, hh, g);
          for (int32_t jc = j0 / kLanes * kLanes; jc < j1; jc += kLanes) {
            int i = 0;
#if defined(__AVX512F__)
            for (; i < n; i += 8)
              kScoreTransposed[std::min(8, n - i)](q, kt + jc, lanes_bs, D, head_rows + i, s, off + jc);
#endif
            for (; i < n; ++i) {
              const int r = head_rows[i];
              float lane[kLanes] = {};
              for (int64_t d = 0; d < D; ++d) {
                const float qd = q[r][d];
                const float* kd = kt + d * lanes_bs + jc;
#pragma omp simd
                for (int l = 0; l < kLanes; ++l) lane[l] += qd * kd[l];
              }
              for (int l = 0; l < kLanes; ++l) s[r][off + jc + l] = lane[l];
            }
          }
        }
      }
    }
    online_softmax(w, rows, origin, c0, c1, D, p.soft_cap);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if constexpr (std::is_same_v<T, uint16_t>) {
      if (use_amx) amx_weighted_values(w, v, rows, c0, c1, D);
    }
#endif
    for (int32_t b = cb; b < ce && !use_amx; ++b) {  // acc += p v, block by block
      const int64_t base = block_base(b);
      prefetch(k, b + chunk_blocks);
      const int32_t off = (b - cb) * bs, j0 = std::max(c0 - off, 0), j1 = std::min(c1 - off, bs);
      for (int hh = 0; hh < nh; ++hh) {
        const T* values = v + base + hh * D;
        int head_rows[kMaxRows], n = 0;  // this KV head's query rows
        for (int tok = 0; tok < item.num_tokens; ++tok)
          for (int g = 0; g < group; ++g) head_rows[n++] = row_of(tok, hh, g);
        auto range = [&](int r) {  // the row's weights outside it are 0 (the softmax wrote them)
          return std::pair<int32_t, int32_t>(std::max(j0, lo[r] - origin - off), std::min(j1, hi[r] - origin - off));
        };
        // V rows straight from the cache, or (bf16 rows read by several pv_rows calls, or by
        // the portable loop) converted to f32 once for all the head's rows
        const float* vf = nullptr;
        if constexpr (!std::is_same_v<T, float>) {
#if defined(__AVX512F__)
          const bool convert = n > kPvRows || D % (4 * kLanes) != 0;
#else
          const bool convert = true;  // without AVX-512 only the portable loop runs, on f32 rows
#endif
          if (convert) {
            for (int32_t j = j0; j < j1; ++j)
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) w.vb[j][d] = to_float(values[j * row_stride + d]);
            vf = &w.vb[0][0];
          }
        } else {
          vf = values;
        }
        const int64_t vf_stride = std::is_same_v<T, float> ? row_stride : kMaxHeadDim;
        int i = 0;
#if defined(__AVX512F__)
        if (D % (4 * kLanes) == 0) {  // up to kPvRows rows at a time over their keys' union
          auto rows_at_once = [&](auto vrows, int64_t stride) {
            for (int m_rows; i < n; i += m_rows) {
              m_rows = std::min(kPvRows, n - i);
              float* outs[kPvRows];
              const float* weights[kPvRows];
              int32_t a = bs, e = 0;
              for (int t = 0; t < m_rows; ++t) {
                const auto [ar, er] = range(head_rows[i + t]);
                a = std::min(a, ar), e = std::max(e, er);
                outs[t] = acc[head_rows[i + t]], weights[t] = s[head_rows[i + t]] + off;
              }
              switch (m_rows) {
                case 1: pv_rows<1>(outs, weights, vrows, stride, D, a, e); break;
                case 2: pv_rows<2>(outs, weights, vrows, stride, D, a, e); break;
                case 3: pv_rows<3>(outs, weights, vrows, stride, D, a, e); break;
                default: pv_rows<4>(outs, weights, vrows, stride, D, a, e); break;
              }
            }
          };
          if (vf) rows_at_once(vf, vf_stride);
          else rows_at_once(values, row_stride);
        }
#endif
        if (i == n) continue;
        const float* vrows = vf;  // the portable loop reads f32 rows
        const int64_t vstride = vf_stride;
        for (; i < n; ++i) {
          const int r = head_rows[i];
          const auto [a, e] = range(r);
          float* out = acc[r];
          const float* weight_row = s[r] + off;
          for (int32_t j = a; j < e; ++j) {
            const float weight = weight_row[j];
            const float* vj = vrows + j * vstride;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) out[d] += weight * vj[d];
          }
        }
      }
    }
  }
  for (int tok = 0; tok < item.num_tokens; ++tok) {
    for (int hh = 0; hh < nh; ++hh) {
      for (int g = 0; g < group; ++g) {
        const int r = row_of(tok, hh, g);
        T* dst = static_cast<T*>(p.out) + query_row(tok, hh, g);
        const float inv = l[r] > 0 ? 1.0f / l[r] : 0.0f;
        store_scaled(acc[r], inv, D, dst);
      }
    }
  }
  return true;
}

// Shared by the calling thread and the pool's tasks; a task that starts after the work is
// done touches only this (kept alive by its shared_ptr), never the call's buffers.
struct Work {
  Problem problem;
  std::vector<Item> items;
  std::atomic<int64_t> next{0};
  std::atomic<int> active{0};
  std::atomic<bool> failed{false};
};

template <typename T>
void drain(Work& work) {
  work.active.fetch_add(1);
  // one scratch per thread, kept across calls (uninitialized: every item writes what it reads)
  thread_local std::unique_ptr<Scratch> scratch;
  if (!scratch) scratch.reset(new Scratch);
  [[maybe_unused]] bool tiles = false;  // configured on this thread's first AMX item, released when done
  for (int64_t i = work.next.fetch_add(1); i < static_cast<int64_t>(work.items.size()); i = work.next.fetch_add(1)) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (work.problem.amx && work.items[i].num_tokens > 1 && !tiles) configure_tiles(), tiles = true;
#endif
    if (!attend_item<T>(work.problem, work.items[i], *scratch)) work.failed.store(true);
  }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (tiles) _tile_release();
#endif
  work.active.fetch_sub(1);
}

template <ffi::DataType KV>
ffi::Error attention_impl(ffi::ThreadPool pool, ffi::Buffer<KV> q, ffi::Buffer<KV> k, ffi::Buffer<KV> v,
                          ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> context_lens,
                          ffi::Buffer<ffi::S32> query_start, ffi::ResultBuffer<KV> out, float sm_scale,
                          int32_t sliding_window, float soft_cap) {
  using T = ffi::NativeType<KV>;
  const auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2) return ffi::Error::InvalidArgument("bad ranks");
  auto work = std::make_shared<Work>();
  Problem& p = work->problem;
  p = Problem{q.typed_data(), k.typed_data(), v.typed_data(), tables.typed_data(), context_lens.typed_data(),
              query_start.typed_data(), out->typed_data(), qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], td[0], td[1],
              sm_scale, soft_cap, sliding_window};
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  p.amx = KV == ffi::BF16 && p.head_dim % 64 == 0 && amx_permitted();
#endif
  if (p.num_heads % p.num_kv_heads || p.head_dim > kMaxHeadDim || p.block_size > kMaxBlockSize ||
      kd[3] != p.head_dim || p.num_heads / p.num_kv_heads > kMaxRows)
    return ffi::Error::InvalidArgument("unsupported shapes (head_dim <= 256, block_size <= 256, group <= 64)");
  // a decode item (one token): as many KV heads as fit kMaxRows query rows, so one pass over
  // the blocks serves them all; a prefill item: one KV head and as many tokens as fit, since
  // its cost is per head (each block's keys are transposed and scored for that head's rows)
  const int group = static_cast<int>(p.num_heads / p.num_kv_heads);
  const int heads = static_cast<int>(std::min<int64_t>(p.num_kv_heads, kMaxRows / group));
  const int tile = std::max(1, kMaxRows / group);
  // the items write every head of every token in [qsl[0], qsl[S]); only the rest is zeroed
  const int64_t row = p.num_heads * p.head_dim, tokens = p.num_tokens;
  const int64_t first = std::clamp<int64_t>(p.query_start[0], 0, tokens);
  const int64_t used = std::clamp<int64_t>(p.query_start[p.num_seqs], first, tokens);
  T* const out_rows = static_cast<T*>(p.out);
  std::memset(out_rows, 0, sizeof(T) * first * row);
  std::memset(out_rows + used * row, 0, sizeof(T) * (tokens - used) * row);
  for (int32_t s = 0; s < p.num_seqs; ++s) {
    const int32_t q_len = p.query_start[s + 1] - p.query_start[s], ctx = p.context_lens[s];
    if (q_len <= 0) continue;
    if (p.query_start[s] < 0 || q_len > ctx || ctx > p.max_blocks * p.block_size ||
        p.query_start[s + 1] > p.num_tokens)
      return ffi::Error::InvalidArgument("query_start_loc / context_lens out of range");
    if (q_len == 1) {
      for (int32_t h = 0; h < p.num_kv_heads; h += heads)
        work->items.push_back({s, 0, 1, h, static_cast<int32_t>(std::min<int64_t>(heads, p.num_kv_heads - h))});
      continue;
    }
    for (int32_t h = 0; h < p.num_kv_heads; ++h)
      for (int32_t t = 0; t < q_len; t += tile) work->items.push_back({s, t, std::min(tile, q_len - t), h, 1});
  }
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), static_cast<int64_t>(work->items.size()) - 1);
  schedule_helpers(pool, p.num_tokens, helpers, [work] { drain<T>(*work); });
  drain<T>(*work);
  while (work->active.load() > 0) std::this_thread::yield();
  if (work->failed.load()) return ffi::Error::InvalidArgument("a block table entry is out of range");
  return ffi::Error::Success();
}

}  // namespace

#define PAGED_JAX_ATTENTION_HANDLER(name, KV)                                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, attention_impl<KV>,                                    \
                                ffi::Ffi::Bind()                                             \
                                    .Ctx<ffi::ThreadPool>()                                  \
                                    .Arg<ffi::Buffer<KV>>()                                  \
                                    .Arg<ffi::Buffer<KV>>()                                  \
                                    .Arg<ffi::Buffer<KV>>()                                  \
                                    .Arg<ffi::Buffer<ffi::S32>>()                            \
                                    .Arg<ffi::Buffer<ffi::S32>>()                            \
                                    .Arg<ffi::Buffer<ffi::S32>>()                            \
                                    .Ret<ffi::Buffer<KV>>()                                  \
                                    .Attr<float>("sm_scale")                                 \
                                    .Attr<int32_t>("sliding_window")                         \
                                    .Attr<float>("soft_cap"));

PAGED_JAX_ATTENTION_HANDLER(RaggedPagedAttentionF32, ffi::F32)
PAGED_JAX_ATTENTION_HANDLER(RaggedPagedAttentionBF16, ffi::BF16)
