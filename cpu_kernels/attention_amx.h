// Prefill tiles of the CPU attention kernel on AMX tiles (ragged_paged_attention.cc calls
// these for a bf16 cache where the CPU has AMX and head_dim % 64 == 0).
//
// Why: a prefill tile (up to 64 query rows of one KV head) scored and weighed its keys with
// f32 FMAs, after converting every key to f32 and transposing it with scalar code; on the
// vLLM-peer trace that was a third of a 2048-token step. TDPBF16PS multiplies a 16-row
// bf16 tile by a 16-column one in one instruction, with exact bf16 products summed in f32:
//   scores   S[rows, keys] = q . k_j: A = q (bf16, as the engine rounds it for a bf16 cache),
//            B = the keys' 32-bit (d, d + 1) pairs transposed 16 x 16 (one shuffle network
//            per 16 keys and 32 dims), then times sm_scale in f32;
//   values   acc[rows, D] += P V: A = the softmax weights rounded to bf16 (as the GPU and TPU
//            kernels round them), B = pairs of value rows interleaved.
// The online softmax between the two stays the kernel's own f32 code. Tiles: 0-3 C, 4-5 A,
// 6-7 B, configured per thread by the caller (amx_tiles.h).

#pragma once

#include "amx_tiles.h"
#include "attention_problem.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

namespace paged_jax_cpu {

inline __mmask16 lanes_in(int32_t first, int32_t j0, int32_t j1) {  // lanes first + l within [j0, j1)
  const __m512i j = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                     _mm512_set1_epi32(first));
  return _mm512_cmpge_epi32_mask(j, _mm512_set1_epi32(j0)) & _mm512_cmplt_epi32_mask(j, _mm512_set1_epi32(j1));
}

// w.s[r][j] = scale * (q_r . key_j) for the rows [0, rows) of w.qb (up to the next multiple of
// 16 zero) and the chunk's keys j in [j0, j1) (key j's row at k + w.slot[j]); whole 16-key
// tiles are written, keys outside [j0, j1) scoring 0.
inline void amx_scores(Scratch& w, const uint16_t* k, int rows, int32_t j0, int32_t j1, int64_t D, float scale) {
  const int row_tiles = (rows + 15) / 16;
  constexpr int64_t q_stride = kMaxHeadDim * 2, s_stride = (kMaxBlockSize + kLanes) * 4;
  for (int32_t jt = j0 / 16 * 16; jt < j1; jt += 16) {
    for (int64_t db = 0; db < D / 32; ++db) {  // B tile db: dims [32 db, 32 db + 32) of the 16 keys
      __m512i r[16];
      for (int c = 0; c < 16; ++c) {
        const int32_t j = jt + c;
        r[c] = j >= j0 && j < j1 ? _mm512_loadu_si512(k + w.slot[j] + 32 * db) : _mm512_setzero_si512();
      }
      transpose16x16_epi32(r);
      for (int c = 0; c < 16; ++c) _mm512_storeu_si512(w.kb[db][c], r[c]);
    }
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t db = 0; db < D / 32; ++db) {
      _tile_loadd(6, w.kb[db], 64);
      _tile_loadd(4, &w.qb[0][32 * db], q_stride);
      _tile_dpbf16ps(0, 4, 6);
      if (row_tiles > 1) {
        _tile_loadd(5, &w.qb[16][32 * db], q_stride);
        _tile_dpbf16ps(1, 5, 6);
      }
      if (row_tiles > 2) {
        _tile_loadd(4, &w.qb[32][32 * db], q_stride);
        _tile_dpbf16ps(2, 4, 6);
      }
      if (row_tiles > 3) {
        _tile_loadd(5, &w.qb[48][32 * db], q_stride);
        _tile_dpbf16ps(3, 5, 6);
      }
    }
    _tile_stored(0, &w.s[0][jt], s_stride);
    if (row_tiles > 1) _tile_stored(1, &w.s[16][jt], s_stride);
    if (row_tiles > 2) _tile_stored(2, &w.s[32][jt], s_stride);
    if (row_tiles > 3) _tile_stored(3, &w.s[48][jt], s_stride);
    const __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < rows; ++r) _mm512_storeu_ps(&w.s[r][jt], _mm512_mul_ps(_mm512_loadu_ps(&w.s[r][jt]), sc));
  }
}

// w.acc[r][0..D) += sum over the chunk's keys j in [j0, j1) of w.s[r][j] (the softmax
// weights, rounded to bf16) times value j (at v + w.slot[j]), for the rows [0, rows); D % 64 == 0.
inline void amx_weighted_values(Scratch& w, const uint16_t* v, int rows, int32_t j0, int32_t j1, int64_t D) {
  const int row_tiles = (rows + 15) / 16;
  const int32_t g0 = j0 / 32 * 32, g1 = (j1 + 31) / 32 * 32;
  for (int r = 0; r < row_tiles * 16; ++r)  // A tiles: bf16 weights [r][j], 0 outside [j0, j1) and past the rows
    for (int32_t g = g0; g < g1; g += 32) {
      const __m512 lo = r < rows ? _mm512_maskz_loadu_ps(lanes_in(g, j0, j1), &w.s[r][g]) : _mm512_setzero_ps();
      const __m512 hi = r < rows ? _mm512_maskz_loadu_ps(lanes_in(g + 16, j0, j1), &w.s[r][g + 16]) : _mm512_setzero_ps();
      _mm512_storeu_si512(&w.pa[r][g], (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  // B tiles: for 32 keys and 16 dims, row i = keys 2i and 2i + 1 interleaved dim by dim
  const __m512i first = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                         37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
  for (int32_t g = g0; g < g1; g += 32)
    for (int i = 0; i < 16; ++i) {
      const int32_t ja = g + 2 * i, jb = ja + 1;
      const bool has_a = ja >= j0 && ja < j1, has_b = jb >= j0 && jb < j1;
      for (int64_t dc = 0; dc < D / 32; ++dc) {
        const __m512i a = has_a ? _mm512_loadu_si512(v + w.slot[ja] + 32 * dc) : _mm512_setzero_si512();
        const __m512i b = has_b ? _mm512_loadu_si512(v + w.slot[jb] + 32 * dc) : _mm512_setzero_si512();
        _mm512_storeu_si512(w.vt[g / 32][2 * dc][i], _mm512_permutex2var_epi16(a, first, b));
        _mm512_storeu_si512(w.vt[g / 32][2 * dc + 1][i], _mm512_permutex2var_epi16(a, second, b));
      }
    }
  constexpr int64_t acc_stride = kMaxHeadDim * 4, pa_stride = kMaxBlockSize * 2;
  for (int t = 0; t < row_tiles; ++t)
    for (int64_t dg = 0; dg < D / 64; ++dg) {  // C tiles 0-3: rows [16 t, 16 t + 16) x dims [64 dg, 64 dg + 64)
      float* out = &w.acc[16 * t][64 * dg];
      _tile_loadd(0, out, acc_stride);
      _tile_loadd(1, out + 16, acc_stride);
      _tile_loadd(2, out + 32, acc_stride);
      _tile_loadd(3, out + 48, acc_stride);
      for (int32_t g = g0; g < g1; g += 32) {
        _tile_loadd(4, &w.pa[16 * t][g], pa_stride);
        _tile_loadd(6, w.vt[g / 32][4 * dg], 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, w.vt[g / 32][4 * dg + 1], 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, w.vt[g / 32][4 * dg + 2], 64);
        _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, w.vt[g / 32][4 * dg + 3], 64);
        _tile_dpbf16ps(3, 4, 7);
      }
      _tile_stored(0, out, acc_stride);
      _tile_stored(1, out + 16, acc_stride);
      _tile_stored(2, out + 32, acc_stride);
      _tile_stored(3, out + 48, acc_stride);
    }
}

}  // namespace paged_jax_cpu

#endif
