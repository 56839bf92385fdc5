// The dense linears' GEMM (fp32_linear.cpp, bf16_linear.cpp): fp32 activations times a weight
// packed in 16-wide K-major panels of fp32, bf16 or fp16, accumulated in fp32.
//
// Panel p holds w[16p .. 16p+15, k] for k = 0..K-1 contiguously, zero-padded past N. A register
// tile of 6 activation rows x 16 columns (AVX2: two ymm a row; AVX-512: 6 x 32, two panels, one
// zmm each) accumulates over K in blocks of kKBlock, so a panel block and the tile's rows stay in
// L1; the partial sums wait in `out` between blocks (an fp32 store and load: exact). Threads take
// panels (pairs with AVX-512); rows go in blocks of kMBlock per panel. A 16-bit weight is widened
// to fp32 in registers (a bf16 is the top half of an fp32; fp16 through vcvtph2ps), which is
// exact.
//
// Each output element is one fp32 FMA chain over k = 0..K-1 in order, whatever the tile, the
// block, the row count or the ISA path (AVX2, AVX-512 and the portable loop give the same bits):
// batch invariant, and no per-shape state at all (issue #29: oneDNN's per-shape primitive caches
// were the exact modes' memory growth).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CONVOY_PANEL_AVX2 1
#endif
#if defined(__AVX512F__)
#define CONVOY_PANEL_AVX512 1
#endif

namespace convoy::panel {

constexpr int64_t kPanel = 16;    // output features per panel
constexpr int64_t kRows = 6;      // activation rows per register tile
constexpr int64_t kKBlock = 256;  // k per pass over a tile
constexpr int64_t kMBlock = 192;  // rows per pass over a panel

// The weight's element type and layout: fp32, or 16 bits widened in registers (BF16, F16), or
// bf16 in k pairs (BF16_PAIRS: each column's w[c, k] and w[c, k + 1] side by side, 32 values a
// k pair, K even), the layout of AVX512-BF16's vdpbf16ps. That instruction adds a pair's two
// products to its fp32 sum one after the other, k + 1 first, each rounded as an FMA (its
// products of two bf16s are exact in fp32): BF16_PAIRS takes that order on every path, and
// BF16_DP, the same layout with bf16 activations, runs vdpbf16ps itself (AVX-512 builds on a
// CPU that has it; it also flushes denormal inputs and results to zero, which bf16 activations
// and weights of a model do not reach).
enum class Weight { F32, BF16, F16, BF16_PAIRS, BF16_DP };
template <Weight T>
using elem_t = std::conditional_t<T == Weight::F32, float, uint16_t>;
// The activations' type: bf16 (uint16_t) for BF16_DP, fp32 otherwise.
template <Weight T>
using x_t = std::conditional_t<T == Weight::BF16_DP, uint16_t, float>;
// K steps of one inner loop iteration: a k pair for the paired layouts.
template <Weight T>
constexpr int64_t kStep = (T == Weight::BF16_PAIRS || T == Weight::BF16_DP) ? 2 : 1;

// (N, K) weight -> (ceil(N / 16), ceil(K / S), 16 S) of the same dtype, zero-padded past N and K:
// [p][j][S c + t] = w[16 p + c, S j + t]. S = 1: 16-wide K-major panels; S = 2: k pairs side by
// side (the BF16_PAIRS / BF16_DP layout).
template <typename E, int64_t S = 1>
at::Tensor pack(const at::Tensor& weight) {
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t P = (N + kPanel - 1) / kPanel, KS = (K + S - 1) / S;
  at::Tensor packed = at::zeros({P, KS, S * kPanel}, w.options());
  const E* src = reinterpret_cast<const E*>(w.data_ptr());
  E* dst = reinterpret_cast<E*>(packed.data_ptr());
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < kPanel && p * kPanel + c < N; ++c) {
        const E* row = src + (p * kPanel + c) * K;
        E* col = dst + p * KS * S * kPanel + S * c;
        for (int64_t k = 0; k < K; ++k) col[(k / S) * S * kPanel + k % S] = row[k];
      }
    }
  });
  return packed;
}

inline float bf16_bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <Weight T>
inline float widen1(const elem_t<T>* p) {
  if constexpr (T == Weight::F32) {
    return *p;
  } else if constexpr (T == Weight::F16) {
    return static_cast<float>(c10::Half(*p, c10::Half::from_bits()));
  } else {
    return bf16_bits_to_float(static_cast<uint32_t>(*p) << 16);
  }
}

#ifdef CONVOY_PANEL_AVX2
template <Weight T>
inline __m256 load8(const elem_t<T>* p) {
  if constexpr (T == Weight::F32) {
    return _mm256_loadu_ps(p);
  } else if constexpr (T == Weight::F16) {
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    alignas(32) float f[8];
    for (int j = 0; j < 8; ++j) f[j] = widen1<T>(p + j);
    return _mm256_load_ps(f);
#endif
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}
// A k pair's 8 columns (8 dwords: w[c, k] low, w[c, k + 1] high) -> w[., k + 1] or w[., k].
inline __m256 odd8(__m256i v) {  // two shifts: no mask register
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(v, 16), 16));
}
inline __m256 even8(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
#endif

#ifdef CONVOY_PANEL_AVX512
inline __m512 odd16(__m512i v) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline __m512 even16(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }

// vdpbf16ps tiles (BF16_DP): compiled for AVX512-BF16 alone, called only where the CPU has it.
// x holds bf16 activations, a k pair a dword.
template <int MR>
__attribute__((target("avx512f,avx512vl,avx512bf16"))) void tile16_dp(
    const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t k0, int64_t k1, float* c,
    int64_t ldc, bool first) {
  __m256 acc[MR][2];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    acc[i][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + i * ldc);
    acc[i][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + i * ldc + 8);
  }
  for (int64_t k = k0; k < k1; k += 2) {
    const __m256bh w0 = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k * kPanel));
    const __m256bh w1 = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k * kPanel + 16));
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * ldx + k, sizeof pair);
      const __m256bh xb = (__m256bh)_mm256_set1_epi32(pair);
      acc[i][0] = _mm256_dpbf16_ps(acc[i][0], w0, xb);
      acc[i][1] = _mm256_dpbf16_ps(acc[i][1], w1, xb);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    _mm256_storeu_ps(c + i * ldc, acc[i][0]);
    _mm256_storeu_ps(c + i * ldc + 8, acc[i][1]);
  }
}

template <int MR>
__attribute__((target("avx512f,avx512vl,avx512bf16"))) void tile32_dp(
    const uint16_t* x, int64_t ldx, const uint16_t* p0, const uint16_t* p1, int64_t k0, int64_t k1,
    float* c, int64_t ldc, bool first) {
  __m512 a0[MR], a1[MR];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    a0[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * ldc);
    a1[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * ldc + kPanel);
  }
  for (int64_t k = k0; k < k1; k += 2) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(p0 + k * kPanel);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(p1 + k * kPanel);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * ldx + k, sizeof pair);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      a0[i] = _mm512_dpbf16_ps(a0[i], w0, xb);
      a1[i] = _mm512_dpbf16_ps(a1[i], w1, xb);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    _mm512_storeu_ps(c + i * ldc, a0[i]);
    _mm512_storeu_ps(c + i * ldc + kPanel, a1[i]);
  }
}

template <Weight T>
inline __m512 load16(const elem_t<T>* p) {
  if constexpr (T == Weight::F32) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (T == Weight::F16) {
      return _mm512_cvtph_ps(h);
    } else {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
}
#endif

// c[i][0..16) (+)= sum over k in [k0, k1) of x[i, k] * panel[k, 0..16), i < MR, into a
// caller's (MR, 16) buffer `c` with row stride ldc; `first` starts the sums at zero.
template <Weight T, int MR>
inline void tile16(const x_t<T>* x, int64_t ldx, const elem_t<T>* panel, int64_t k0, int64_t k1,
                   float* c, int64_t ldc, bool first) {
#ifdef CONVOY_PANEL_AVX512
  if constexpr (T == Weight::BF16_DP) {
    tile16_dp<MR>(x, ldx, panel, k0, k1, c, ldc, first);
    return;
  }
#endif
  if constexpr (T != Weight::BF16_DP) {
#ifdef CONVOY_PANEL_AVX2
  // Every loop over the tile's rows is fully unrolled so the 2 * MR accumulators stay in registers.
  __m256 acc[MR][2];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    acc[i][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + i * ldc);
    acc[i][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + i * ldc + 8);
  }
  for (int64_t k = k0; k < k1; k += kStep<T>) {
    if constexpr (T == Weight::BF16_PAIRS) {
      // all rows' k + 1 products, then all rows' k products: each sum takes vdpbf16ps's order
      const __m256i* wk = reinterpret_cast<const __m256i*>(panel + k * kPanel);
      __m256 w0 = odd8(_mm256_loadu_si256(wk)), w1 = odd8(_mm256_loadu_si256(wk + 1));
#pragma GCC unroll 6
      for (int i = 0; i < MR; ++i) {
        const __m256 xb = _mm256_broadcast_ss(x + i * ldx + k + 1);
        acc[i][0] = _mm256_fmadd_ps(xb, w0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(xb, w1, acc[i][1]);
      }
      // Load the pair again (an L1 hit) rather than hold it: 12 accumulators, 2 weights and a
      // broadcast fill the 16 ymm registers; held, it spilled (~25% slower).
      asm volatile("" ::: "memory");
      w0 = even8(_mm256_loadu_si256(wk));
      w1 = even8(_mm256_loadu_si256(wk + 1));
#pragma GCC unroll 6
      for (int i = 0; i < MR; ++i) {
        const __m256 xb = _mm256_broadcast_ss(x + i * ldx + k);
        acc[i][0] = _mm256_fmadd_ps(xb, w0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(xb, w1, acc[i][1]);
      }
    } else {
      const __m256 w0 = load8<T>(panel + k * kPanel);
      const __m256 w1 = load8<T>(panel + k * kPanel + 8);
#pragma GCC unroll 6
      for (int i = 0; i < MR; ++i) {
        const __m256 xb = _mm256_broadcast_ss(x + i * ldx + k);
        acc[i][0] = _mm256_fmadd_ps(xb, w0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(xb, w1, acc[i][1]);
      }
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    _mm256_storeu_ps(c + i * ldc, acc[i][0]);
    _mm256_storeu_ps(c + i * ldc + 8, acc[i][1]);
  }
#else
  for (int i = 0; i < MR; ++i) {
    float acc[kPanel];
    for (int64_t j = 0; j < kPanel; ++j) acc[j] = first ? 0.0f : c[i * ldc + j];
    for (int64_t k = k0; k < k1; k += kStep<T>) {
      const float xv = x[i * ldx + k];
      // std::fma: one rounding per step, as the FMA instructions above (same bits)
      if constexpr (T == Weight::BF16_PAIRS) {
        const float xo = x[i * ldx + k + 1];
        const uint16_t* wk = panel + k * kPanel;
        for (int64_t j = 0; j < kPanel; ++j) {
          acc[j] = std::fma(xo, widen1<Weight::BF16>(wk + 2 * j + 1), acc[j]);
          acc[j] = std::fma(xv, widen1<Weight::BF16>(wk + 2 * j), acc[j]);
        }
      } else {
        for (int64_t j = 0; j < kPanel; ++j) {
          acc[j] = std::fma(xv, widen1<T>(panel + k * kPanel + j), acc[j]);
        }
      }
    }
    std::copy(acc, acc + kPanel, c + i * ldc);
  }
#endif
  }
}

#ifdef CONVOY_PANEL_AVX512
// Two panels side by side (32 columns), one zmm each: 12 accumulators, 2 weight loads and 6
// broadcasts per k.
template <Weight T, int MR>
inline void tile32(const x_t<T>* x, int64_t ldx, const elem_t<T>* p0, const elem_t<T>* p1,
                   int64_t k0, int64_t k1, float* c, int64_t ldc, bool first) {
  if constexpr (T == Weight::BF16_DP) {
    tile32_dp<MR>(x, ldx, p0, p1, k0, k1, c, ldc, first);
  } else {
  __m512 a0[MR], a1[MR];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    a0[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * ldc);
    a1[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * ldc + kPanel);
  }
  for (int64_t k = k0; k < k1; k += kStep<T>) {
    if constexpr (T == Weight::BF16_PAIRS) {
      const __m512i v0 = _mm512_loadu_si512(p0 + k * kPanel);
      const __m512i v1 = _mm512_loadu_si512(p1 + k * kPanel);
      const __m512 o0 = odd16(v0), o1 = odd16(v1), e0 = even16(v0), e1 = even16(v1);
#pragma GCC unroll 6
      for (int i = 0; i < MR; ++i) {
        const __m512 xo = _mm512_set1_ps(x[i * ldx + k + 1]);
        const __m512 xe = _mm512_set1_ps(x[i * ldx + k]);
        a0[i] = _mm512_fmadd_ps(xe, e0, _mm512_fmadd_ps(xo, o0, a0[i]));
        a1[i] = _mm512_fmadd_ps(xe, e1, _mm512_fmadd_ps(xo, o1, a1[i]));
      }
    } else {
      const __m512 w0 = load16<T>(p0 + k * kPanel);
      const __m512 w1 = load16<T>(p1 + k * kPanel);
#pragma GCC unroll 6
      for (int i = 0; i < MR; ++i) {
        const __m512 xb = _mm512_set1_ps(x[i * ldx + k]);
        a0[i] = _mm512_fmadd_ps(xb, w0, a0[i]);
        a1[i] = _mm512_fmadd_ps(xb, w1, a1[i]);
      }
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    _mm512_storeu_ps(c + i * ldc, a0[i]);
    _mm512_storeu_ps(c + i * ldc + kPanel, a1[i]);
  }
  }
}
#endif

// Rows [m0, m1) of `span` panels starting at panel p (span 2 only with AVX-512 and whole
// panels), every k block; out has N columns. A panel past N's end (ncols < 16) goes through a
// (6, 16) buffer so nothing is written past the row.
template <Weight T>
void run_panels(const x_t<T>* x, int64_t K, const elem_t<T>* w, int64_t p, int64_t span,
                int64_t m0, int64_t m1, float* out, int64_t N) {
  const int64_t ncols = std::min(kPanel * span, N - p * kPanel);
  const elem_t<T>* p0 = w + p * K * kPanel;
  alignas(64) float buf[kRows * kPanel];
  for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
    const int64_t k1 = std::min(K, k0 + kKBlock);
    const bool first = k0 == 0;
    for (int64_t r = m0; r < m1; r += kRows) {
      const int64_t mr = std::min(kRows, m1 - r);
      const x_t<T>* xr = x + r * K;
      float* o = out + r * N + p * kPanel;
#ifdef CONVOY_PANEL_AVX512
      if (span == 2) {
        const elem_t<T>* p1 = p0 + K * kPanel;
        switch (mr) {
          case 6: tile32<T, 6>(xr, K, p0, p1, k0, k1, o, N, first); break;
          case 5: tile32<T, 5>(xr, K, p0, p1, k0, k1, o, N, first); break;
          case 4: tile32<T, 4>(xr, K, p0, p1, k0, k1, o, N, first); break;
          case 3: tile32<T, 3>(xr, K, p0, p1, k0, k1, o, N, first); break;
          case 2: tile32<T, 2>(xr, K, p0, p1, k0, k1, o, N, first); break;
          default: tile32<T, 1>(xr, K, p0, p1, k0, k1, o, N, first); break;
        }
        continue;
      }
#endif
      const bool whole = ncols == kPanel;
      float* c = whole ? o : buf;
      const int64_t ldc = whole ? N : kPanel;
      if (!whole && !first) {
        for (int64_t i = 0; i < mr; ++i) std::copy(o + i * N, o + i * N + ncols, buf + i * kPanel);
      }
      switch (mr) {
        case 6: tile16<T, 6>(xr, K, p0, k0, k1, c, ldc, first); break;
        case 5: tile16<T, 5>(xr, K, p0, k0, k1, c, ldc, first); break;
        case 4: tile16<T, 4>(xr, K, p0, k0, k1, c, ldc, first); break;
        case 3: tile16<T, 3>(xr, K, p0, k0, k1, c, ldc, first); break;
        case 2: tile16<T, 2>(xr, K, p0, k0, k1, c, ldc, first); break;
        default: tile16<T, 1>(xr, K, p0, k0, k1, c, ldc, first); break;
      }
      if (!whole) {
        for (int64_t i = 0; i < mr; ++i) std::copy(buf + i * kPanel, buf + i * kPanel + ncols, o + i * N);
      }
    }
  }
}

// out (M, N) = x (M, K) @ the P panels of w, in parallel over the panels (K even for the paired
// layouts: x's rows padded to it).
template <Weight T>
void gemm(const x_t<T>* x, int64_t M, int64_t K, const elem_t<T>* w, int64_t P, float* out,
          int64_t N) {
  if (M == 0 || N == 0) return;
#ifdef CONVOY_PANEL_AVX512
  constexpr int64_t kSpan = 2;
#else
  constexpr int64_t kSpan = 1;
#endif
  const int64_t groups = (P + kSpan - 1) / kSpan;  // a lone last panel is a group of one
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kMBlock) {
      const int64_t m1 = std::min(M, m0 + kMBlock);
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p = g * kSpan;
        const int64_t span = std::min(kSpan, P - p);
        // two panels only where both are whole: a partial one takes the buffered 16-wide path
        if (span == 2 && (p + 2) * kPanel > N) {
          run_panels<T>(x, K, w, p, 1, m0, m1, out, N);
          run_panels<T>(x, K, w, p + 1, 1, m0, m1, out, N);
        } else {
          run_panels<T>(x, K, w, p, span, m0, m1, out, N);
        }
      }
    }
  });
}

}  // namespace convoy::panel
