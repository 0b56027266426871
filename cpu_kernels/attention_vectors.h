// The vector pieces of the CPU attention kernel (ragged_paged_attention.cc): limits, the
// bf16 -> f32 load, a vectorizable exp, and where the compiler targets AVX-512
// (-march=native on such a CPU) the hand-vectorized loops; the portable loops in the
// kernel serve every other machine.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace paged_jax_cpu {

constexpr int kMaxRows = 64;  // query rows (tokens x query heads) per work item: each key row loaded serves them all
constexpr int kMaxHeadDim = 256;
constexpr int kMaxBlockSize = 256;
constexpr int kLanes = 16;  // keys scored at once (one AVX-512 register of f32)
// query rows per pv_rows call (AVX-512); outside it, what the portable path converts V for
constexpr int kPvRows = 4;

// Ask for `rows` rows of `row_elems` values (row j at base + j * row_stride) to be brought
// into cache: the kernel calls it for the next block's K and V while it computes on this
// one, since a sequence's blocks are scattered and no hardware prefetcher can guess them.
template <typename T>
inline void prefetch_rows(const T* base, int32_t rows, int64_t row_stride, int64_t row_elems) {
  const char* p = reinterpret_cast<const char*>(base);
  const int64_t bytes = row_elems * static_cast<int64_t>(sizeof(T)), stride = row_stride * static_cast<int64_t>(sizeof(T));
  auto line = [](const char* a) {
#if defined(__x86_64__)  // GCC's vectorizer drops __builtin_prefetch from loops it vectorizes
    asm volatile("prefetcht0 %0" : : "m"(*a));
#else
    __builtin_prefetch(a);
#endif
  };
  if (stride == bytes) {  // the rows are contiguous (an item with every KV head): one run, 4 lines a turn
    const int64_t total = rows * bytes;
    int64_t o = 0;
    for (; o + 256 <= total; o += 256) line(p + o), line(p + o + 64), line(p + o + 128), line(p + o + 192);
    for (; o < total; o += 64) line(p + o);
    return;
  }
  for (int32_t j = 0; j < rows; ++j)
    for (int64_t o = 0; o < bytes; o += 64) line(p + j * stride + o);
}

inline float to_float(float x) { return x; }
inline uint16_t to_bf16(float x) {  // round to nearest even (inputs here are finite or exact bf16)
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
inline uint16_t to_bf16(uint16_t bits) { return bits; }  // already bf16 (q of a bf16 cache)
inline float to_float(uint16_t bits) {  // bfloat16 -> float: the top half of an f32
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// dst[0..D) = acc[0..D) * scale in dst's dtype (the cache's: bf16 rounds to nearest even).
inline void store_scaled(const float* acc, float scale, int64_t D, float* dst) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) dst[d] = acc[d] * scale;
}
inline void store_scaled(const float* acc, float scale, int64_t D, uint16_t* dst) {
  int64_t d = 0;
#if defined(__AVX512BF16__)
  for (; d + kLanes <= D; d += kLanes) {  // vcvtneps2bf16: the same rounding
    const __m256bh packed = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + d), _mm512_set1_ps(scale)));
    std::memcpy(dst + d, &packed, sizeof packed);
  }
#endif
  for (; d < D; ++d) dst[d] = to_bf16(acc[d] * scale);
}

// exp(x) for x <= 0 (scores minus their running max), written so GCC vectorizes it under
// `omp simd`: 2^n * e^y with n = round(x log2 e), |y| <= ln2 / 2, e^y by its degree-6
// Taylor polynomial (relative error < 2e-7); x below -87 gives 0.
#pragma omp declare simd
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.0f) * 1.44269504f;
  const float n = std::floor(t + 0.5f);
  const float y = (t - n) * 0.693147181f;
  float p = 1.0f / 720;
  p = p * y + 1.0f / 120;
  p = p * y + 1.0f / 24;
  p = p * y + 1.0f / 6;
  p = p * y + 0.5f;
  p = p * y + 1.0f;
  p = p * y + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.0f ? 0.0f : p * scale;
}

#if defined(__AVX512F__)
// Native vectors where the compiler targets AVX-512 (-march=native on such a CPU); the
// portable loops below serve every other machine.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bf16 -> 16 f32
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// out[j] = sum of v[j]'s 16 lanes, for j < 16, as one vector: a transpose-and-add tree
// (pairs of keys, then pairs of pairs within each 128-bit chunk, then across chunks).
inline __m512 sum_lanes16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)  // chunk lanes [a0+a2, b0+b2, a1+a3, b1+b3] for keys 2i, 2i+1
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // chunk lanes: keys 4i..4i+3, each summed over the chunk's 4 lanes
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The 16 x 16 matrix of 32-bit words in r[0..16) transposed in place (f32 keys here, bf16
// pairs in attention_amx.h).
inline void transpose16x16_epi32(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 4; ++i) {
      t[8 * h + i] = _mm512_shuffle_i32x4(r[8 * h + i], r[8 * h + 4 + i], 0x88);
      t[8 * h + 4 + i] = _mm512_shuffle_i32x4(r[8 * h + i], r[8 * h + 4 + i], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
  }
}

// kt[d * kt_stride + j] = keys[j * stride + d] as f32 for j < rows, d < D (rows, D
// multiples of 16): a block's keys transposed 16 x 16 at a time in registers, for the
// prefill tiles' scores (the scalar loop it replaces was a third of the f32 kernel's own time).
template <typename T>
inline void transpose_keys(const T* keys, int64_t stride, int32_t rows, int64_t D, float* kt, int32_t kt_stride) {
  __m512i v[kLanes];
  for (int32_t j = 0; j < rows; j += kLanes) {
    for (int64_t d = 0; d < D; d += kLanes) {
      for (int i = 0; i < kLanes; ++i) v[i] = _mm512_castps_si512(load16(keys + (j + i) * stride + d));
      transpose16x16_epi32(v);
      for (int i = 0; i < kLanes; ++i) _mm512_storeu_ps(kt + (d + i) * kt_stride + j, _mm512_castsi512_ps(v[i]));
    }
  }
}

// out[0..16) = q . key_j for 16 consecutive keys (row j at keys + j * stride); D % 16 == 0.
template <typename T>
inline void score16(const float* q, const T* keys, int64_t stride, int64_t D, float* out) {
  __m512 acc[kLanes];
  for (int j = 0; j < kLanes; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < D; c += kLanes) {
    const __m512 qc = _mm512_loadu_ps(q + c);
    for (int j = 0; j < kLanes; ++j) acc[j] = _mm512_fmadd_ps(qc, load16(keys + j * stride + c), acc[j]);
  }
  _mm512_storeu_ps(out, sum_lanes16(acc));
}
#endif

#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
// out[0..16) = scale * (q . key_j) for 16 consecutive bf16 keys, with q in bf16 (qb):
// vdpbf16ps multiplies bf16 pairs exactly and sums them in f32, so no key is converted
// (the f32 path spends two thirds of its instructions converting). D % 32 == 0.
inline void score16_bf16(const uint16_t* qb, const uint16_t* keys, int64_t stride, int64_t D, float scale,
                         float* out) {
  __m512 acc[kLanes];
  for (int j = 0; j < kLanes; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < D; c += 2 * kLanes) {
    const __m512bh qc = (__m512bh)_mm512_loadu_si512(qb + c);
    for (int j = 0; j < kLanes; ++j)
      acc[j] = _mm512_dpbf16_ps(acc[j], qc, (__m512bh)_mm512_loadu_si512(keys + j * stride + c));
  }
  _mm512_storeu_ps(out, _mm512_mul_ps(sum_lanes16(acc), _mm512_set1_ps(scale)));
}
#endif

// s[rows[i]][jc + 0..16) = q[rows[i]] . keys jc..jc+16, for N <= 8 rows at once (N
// independent FMA chains per transposed key row kt[d][...], loaded once for all of them).
template <int N>
inline void score_transposed(const float (*q)[kMaxHeadDim], const float* kt, int64_t kt_stride, int64_t D,
                             const int* rows, float (*s)[kMaxBlockSize + kLanes], int32_t jc) {
  __m512 acc[N];
  for (int i = 0; i < N; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 kd = _mm512_loadu_ps(kt + d * kt_stride);
    for (int i = 0; i < N; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[rows[i]][d]), kd, acc[i]);
  }
  for (int i = 0; i < N; ++i) _mm512_storeu_ps(&s[rows[i]][jc], acc[i]);
}

// exp(x) for x <= 0, 16 lanes: exp_nonpositive's polynomial, scaled by 2^n with scalef.
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 y = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147181f));
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(c));
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
}

// One row's block of scores row[j0, j1) -> softmax weights exp(s - m_new) on [a, e), 0
// elsewhere; returns m_new = max(m_old, max of row[a, e)) and adds the weights to *sum.
inline float softmax_weights16(float* row, int32_t j0, int32_t j1, int32_t a, int32_t e, float m_old, float* sum) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int32_t first = j0 / kLanes * kLanes;
  auto visible = [&](int32_t jc) {
    const __m512i j = _mm512_add_epi32(iota, _mm512_set1_epi32(jc));
    return static_cast<__mmask16>(_mm512_cmpge_epi32_mask(j, _mm512_set1_epi32(a)) &
                                  _mm512_cmplt_epi32_mask(j, _mm512_set1_epi32(e)));
  };
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (int32_t jc = first; jc < j1; jc += kLanes)
    vmax = _mm512_mask_max_ps(vmax, visible(jc), vmax, _mm512_loadu_ps(row + jc));
  const float m_new = std::max(m_old, _mm512_reduce_max_ps(vmax));
  __m512 vsum = _mm512_setzero_ps();
  for (int32_t jc = first; jc < j1; jc += kLanes) {
    const __m512 w = _mm512_maskz_mov_ps(
        visible(jc), exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(row + jc), _mm512_set1_ps(m_new))));
    _mm512_storeu_ps(row + jc, w);
    vsum = _mm512_add_ps(vsum, w);
  }
  *sum += _mm512_reduce_add_ps(vsum);
  return m_new;
}

// out[i] += sum_j w[i][j] v_j for N rows at once over keys [a, e) (v_j at vrows + j *
// stride, f32 or bf16 read straight from the cache), 64 dims at a time: each V row is
// loaded (and converted) once for all N rows, whose accumulators stay in registers
// (4N + 4 of the 32). D % 64 == 0.
template <int N, typename T>
inline void pv_rows(float* const* out, const float* const* w, const T* vrows, int64_t stride, int64_t D, int32_t a,
                    int32_t e) {
  for (int64_t c = 0; c < D; c += 4 * kLanes) {
    __m512 x[N][4];
    for (int i = 0; i < N; ++i)
      for (int k = 0; k < 4; ++k) x[i][k] = _mm512_loadu_ps(out[i] + c + k * kLanes);
    for (int32_t j = a; j < e; ++j) {
      const T* vj = vrows + j * stride + c;
      __m512 vk[4];
      for (int k = 0; k < 4; ++k) vk[k] = load16(vj + k * kLanes);
      for (int i = 0; i < N; ++i) {
        const __m512 p = _mm512_set1_ps(w[i][j]);
        for (int k = 0; k < 4; ++k) x[i][k] = _mm512_fmadd_ps(p, vk[k], x[i][k]);
      }
    }
    for (int i = 0; i < N; ++i)
      for (int k = 0; k < 4; ++k) _mm512_storeu_ps(out[i] + c + k * kLanes, x[i][k]);
  }
}

using ScoreFn = void (*)(const float (*)[kMaxHeadDim], const float*, int64_t, int64_t, const int*,
                         float (*)[kMaxBlockSize + kLanes], int32_t);
constexpr ScoreFn kScoreTransposed[9] = {nullptr,
                                         score_transposed<1>,
                                         score_transposed<2>,
                                         score_transposed<3>,
                                         score_transposed<4>,
                                         score_transposed<5>,
                                         score_transposed<6>,
                                         score_transposed<7>,
                                         score_transposed<8>};
#endif

}  // namespace paged_jax_cpu
