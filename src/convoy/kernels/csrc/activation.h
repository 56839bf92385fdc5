// Gated activations, one lane and 8 AVX2 lanes: act_and_mul (fused_ops.cpp) and the MoE experts
// (quant_linear.cpp) run this one code, so an expert's activation is the same bits as the per-op
// path's. Compiled into each file that includes it with the same flags: the same instructions.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "fast_exp.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace convoy_act {

using convoy_math::fast_exp;

inline float silu(float x) { return x / (1.0f + fast_exp(-x)); }

inline float gelu_tanh(float x) {  // torch's formula: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
  constexpr float kBeta = 0.7978845608028654f;
  constexpr float kKappa = 0.044715f;
  const float inner = kBeta * (x + kKappa * (x * x * x));
  const float e = fast_exp(2.0f * std::min(std::max(inner, -20.0f), 20.0f));
  const float th = (e - 1.0f) / (e + 1.0f);
  return 0.5f * x * (1.0f + th);
}

#if defined(__AVX2__) && defined(__FMA__)
using convoy_math::exp8;

template <int Act>
inline __m256 act8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  if (Act == 0) {  // x / (1 + exp(-x))
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
    return _mm256_div_ps(x, _mm256_add_ps(one, e));
  }
  const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
  __m256 inner = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                               _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
  inner = _mm256_min_ps(_mm256_max_ps(inner, _mm256_set1_ps(-20.0f)), _mm256_set1_ps(20.0f));
  const __m256 e = exp8(_mm256_add_ps(inner, inner));
  const __m256 th = _mm256_div_ps(_mm256_sub_ps(e, one), _mm256_add_ps(e, one));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, th));
}
#endif

// buf[i] = act(buf[i]) for one row (the same lanes whatever the row count).
template <int Act>
inline void act_row(float* buf, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(buf + i, act8<Act>(_mm256_loadu_ps(buf + i)));
#endif
  for (; i < n; ++i) buf[i] = Act == 0 ? silu(buf[i]) : gelu_tanh(buf[i]);
}

// o = act(g) * u for one fp32 row, straight from and to memory.
template <int Act>
inline void act_mul_row(const float* g, const float* u, float* o, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= n; i += 8) {
    const __m256 a = act8<Act>(_mm256_loadu_ps(g + i));
    _mm256_storeu_ps(o + i, _mm256_mul_ps(a, _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) o[i] = (Act == 0 ? silu(g[i]) : gelu_tanh(g[i])) * u[i];
}

}  // namespace convoy_act
