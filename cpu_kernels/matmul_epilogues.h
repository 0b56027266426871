// What the matmul kernels (amx_matmul.cc, f32_matmul.cc) do with a finished f32 tile before
// or while it is stored: SwiGLU's silu(gate) * up, and the LM head's running argmax per row.
// Compiled only where the compiler targets AVX-512 (-march=native on such a CPU).

#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>
#include <limits>

#include "attention_vectors.h"  // exp_nonpositive16

namespace paged_jax_cpu {

// silu(g) * u, 16 lanes: g * sigmoid(g) * u, the sigmoid from e = exp(-|g|) <= 1 (1 / (1 + e)
// for g >= 0, e / (1 + e) below), so nothing overflows; the same order of products as
// jax.nn.silu(g) * u.
inline __m512 silu_times(__m512 g, __m512 u) {
  const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 sigmoid = _mm512_mask_mul_ps(inv, negative, e, inv);
  return _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), u);
}

// A thread's running best logit per row (argmax calls): value, then the least column holding it.
struct RowBest {
  float value = -std::numeric_limits<float>::infinity();
  int32_t index = std::numeric_limits<int32_t>::max();
  void offer(float v, int32_t i) {
    if (v > value || (v == value && i < index)) value = v, index = i;
  }
};

// Offer a stored row's 16 logits (32 with `two`), columns col0.., to its running best; read
// back while the row is still in L1.
inline void offer_row(RowBest& best, const float* row, bool two, int32_t col0) {
  __m512 v = _mm512_loadu_ps(row);
  if (two) v = _mm512_max_ps(v, _mm512_loadu_ps(row + 16));
  const float top = _mm512_reduce_max_ps(v);
  if (!(top >= best.value)) return;  // also skips NaN, as first_max never picks one
  const __m512 t = _mm512_set1_ps(top);
  uint32_t hits = _mm512_cmpeq_ps_mask(_mm512_loadu_ps(row), t);
  if (two) hits |= static_cast<uint32_t>(_mm512_cmpeq_ps_mask(_mm512_loadu_ps(row + 16), t)) << 16;
  if (hits) best.offer(top, col0 + static_cast<int32_t>(__builtin_ctz(hits)));
}

}  // namespace paged_jax_cpu

#endif
