// The CPU attention kernel's call, work items, per-thread scratch and the online softmax
// its two ways of scoring share (ragged_paged_attention.cc; the AMX one in attention_amx.h).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "attention_vectors.h"  // kMaxRows, kMaxHeadDim, kMaxBlockSize, kLanes

namespace paged_jax_cpu {

struct Problem {
  const void* q;  // [T, Hq, D] in the cache's dtype, as is out
  const void* k;
  const void* v;
  const int32_t* tables;
  const int32_t* context_lens;
  const int32_t* query_start;
  void* out;
  int64_t num_tokens, num_heads, head_dim, num_blocks, block_size, num_kv_heads, num_seqs, max_blocks;
  float scale, soft_cap;
  int32_t window;
  bool amx = false;  // prefill tiles of a bf16 cache score and weigh on AMX tiles (attention_amx.h)
};

struct Item {
  int32_t seq, first_token, num_tokens;  // first_token: index within the sequence's query tokens
  int32_t first_kv_head, num_kv_heads;
};

// Per-thread scratch (on the heap: a pool thread's stack may be small).
struct Scratch {
  float q[kMaxRows][kMaxHeadDim], acc[kMaxRows][kMaxHeadDim];  // q: times sm_scale
  uint16_t qb[kMaxRows][kMaxHeadDim];  // bf16 cache: q in bf16, unscaled (decode rows; AMX prefill tiles)
  float s[kMaxRows][kMaxBlockSize + kLanes];  // a chunk's scores, then its softmax weights
  float kt[kMaxHeadDim * (kMaxBlockSize + kLanes)];  // one head's keys of a block, transposed [D][keys]
  float vb[kMaxBlockSize][kMaxHeadDim];  // one head's values of a block as f32 (bf16 caches)
  float m[kMaxRows], l[kMaxRows], row[kMaxHeadDim];
  int32_t lo[kMaxRows], hi[kMaxRows];  // each query row's visible keys: [lo, hi)
  // AMX prefill tiles (attention_amx.h): where each chunk key's row of the head starts in
  // the K and V caches (-1: not a key of this chunk), the keys as B tiles for the scores,
  // the weights as bf16 A tiles, the values as B tiles
  int64_t slot[kMaxBlockSize + 32];
  uint32_t kb[kMaxHeadDim / 32][16][16];
  alignas(64) uint16_t pa[kMaxRows][kMaxBlockSize];
  alignas(64) uint16_t vt[kMaxBlockSize / 32][kMaxHeadDim / 16][16][32];
};

// One chunk of keys [c0, c1) (relative to key `origin`) through the online softmax, row by
// row: w.s[r] turns from scores into weights exp(s - m) on the row's visible keys (0 on
// the chunk's others), m and l move on, and acc is rescaled to the new maximum.
inline void online_softmax(Scratch& w, int rows, int32_t origin, int32_t c0, int32_t c1, int64_t D, float soft_cap) {
  auto& s = w.s;
  float *m = w.m, *l = w.l;
  for (int r = 0; r < rows; ++r) {
    const int32_t a = std::max(c0, w.lo[r] - origin), e = std::min(c1, w.hi[r] - origin);
    if (a >= e) {
      for (int32_t j = c0; j < c1; ++j) s[r][j] = 0.0f;
      continue;
    }
    if (soft_cap > 0)
      for (int32_t j = a; j < e; ++j) s[r][j] = soft_cap * std::tanh(s[r][j] / soft_cap);
    float m_new, sum = 0.0f;
#if defined(__AVX512F__)
    m_new = softmax_weights16(s[r], c0, c1, a, e, m[r], &sum);
#else
    float chunk_max = -INFINITY;
    for (int32_t j = a; j < e; ++j) chunk_max = std::max(chunk_max, s[r][j]);
    m_new = std::max(m[r], chunk_max);
#pragma omp simd reduction(+ : sum)
    for (int32_t j = c0; j < c1; ++j) {
      const float e_j = (j >= a && j < e) ? exp_nonpositive(s[r][j] - m_new) : 0.0f;
      s[r][j] = e_j;
      sum += e_j;
    }
#endif
    const float correction = exp_nonpositive(m[r] - m_new);  // m = -inf: 0
    l[r] = l[r] * correction + sum;
    m[r] = m_new;
    if (correction != 1.0f) {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) w.acc[r][d] *= correction;
    }
  }
}

}  // namespace paged_jax_cpu
