// fp32 linear layers on the CPU, in place of oneDNN's (issue #29).
//
// oneDNN builds and caches a primitive (its JIT code, 0.4-1.8 MB) per input shape, in its own
// cache and ideep's, and a serving step's row count takes any value up to the token budget: the
// fp32 server's RSS rose in steps for as long as new row counts came (7-8 KB a request over
// 20,000 requests, padded counts and all), and was flat with both caches off (at ~12% of its
// throughput: every call rebuilt). This kernel has no per-shape state at all.
//
// Weights are packed once into panels of 16 output features, K-major (as csrc/bf16_linear.cpp's
// 16-bit ones): panel p holds w[16p .. 16p+15, k] for k = 0..K-1 contiguously, zero-padded past N.
// A register tile of 6 activation rows x 16 columns (AVX2: two ymm a row; AVX-512: 6 x 32, two
// panels, one zmm each) accumulates over K in blocks of kKBlock, so a panel block and the tile's
// rows stay in L1; the partial sums wait in `out` between blocks (an fp32 store and load: exact).
// Threads take panels (pairs with AVX-512); rows go in blocks of kMBlock per panel.
//
// Each output element is one fp32 FMA chain over k = 0..K-1 in order, whatever the tile, the
// block, the row count or the ISA path (AVX2, AVX-512 and the portable loop give the same bits):
// batch invariant. Against oneDNN on SmolLM2's shapes (2 cores): 1.2-2x at <= 66 rows,
// 0.93-1.05x at 258-702 (AVX2 and AVX-512 alike).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CONVOY_AVX2 1
#endif
#if defined(__AVX512F__)
#define CONVOY_AVX512 1
#endif

namespace {

constexpr int64_t kPanel = 16;    // output features per panel
constexpr int64_t kRows = 6;      // activation rows per register tile
constexpr int64_t kKBlock = 256;  // k per pass over a tile
constexpr int64_t kMBlock = 192;  // rows per pass over a panel

// (N, K) fp32 -> (ceil(N / 16), K, 16), zero-padded past N.
at::Tensor pack_fp32_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "(N, K) fp32 weight");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t P = (N + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({P, K, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j) {
        const float* row = src + (p * kPanel + j) * K;
        float* col = dst + p * K * kPanel + j;
        for (int64_t k = 0; k < K; ++k) col[k * kPanel] = row[k];
      }
    }
  });
  return packed;
}

// acc[i][0..16) (+)= sum over k in [k0, k1) of x[i, k] * panel[k, 0..16), i < MR, into a
// caller's (MR, 16) buffer `c` with row stride ldc; `first` starts the sums at zero.
template <int MR>
inline void tile16(const float* x, int64_t ldx, const float* panel, int64_t k0, int64_t k1,
                   float* c, int64_t ldc, bool first) {
#ifdef CONVOY_AVX2
  __m256 acc[MR][2];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    acc[i][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + i * ldc);
    acc[i][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + i * ldc + 8);
  }
  for (int64_t k = k0; k < k1; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m256 xb = _mm256_broadcast_ss(x + i * ldx + k);
      acc[i][0] = _mm256_fmadd_ps(xb, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xb, w1, acc[i][1]);
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
    for (int64_t k = k0; k < k1; ++k) {
      const float xv = x[i * ldx + k];
      // std::fma: one rounding per step, as the FMA instructions above (same bits)
      for (int64_t j = 0; j < kPanel; ++j) acc[j] = std::fma(xv, panel[k * kPanel + j], acc[j]);
    }
    std::copy(acc, acc + kPanel, c + i * ldc);
  }
#endif
}

#ifdef CONVOY_AVX512
// Two panels side by side (32 columns), one zmm each: 12 accumulators, 2 weight loads and 6
// broadcasts per k.
template <int MR>
inline void tile32(const float* x, int64_t ldx, const float* p0, const float* p1, int64_t k0,
                   int64_t k1, float* c, int64_t ldc, bool first) {
  __m512 a0[MR], a1[MR];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    a0[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * ldc);
    a1[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * ldc + kPanel);
  }
  for (int64_t k = k0; k < k1; ++k) {
    const __m512 w0 = _mm512_loadu_ps(p0 + k * kPanel);
    const __m512 w1 = _mm512_loadu_ps(p1 + k * kPanel);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m512 xb = _mm512_set1_ps(x[i * ldx + k]);
      a0[i] = _mm512_fmadd_ps(xb, w0, a0[i]);
      a1[i] = _mm512_fmadd_ps(xb, w1, a1[i]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    _mm512_storeu_ps(c + i * ldc, a0[i]);
    _mm512_storeu_ps(c + i * ldc + kPanel, a1[i]);
  }
}
#endif

// Rows [m0, m1) of `span` panels starting at panel p (span 2 only with AVX-512 and whole
// panels), every k block; out has N columns. A panel past N's end (ncols < 16) goes through a
// (6, 16) buffer so nothing is written past the row.
void run_panels(const float* x, int64_t K, const float* w, int64_t p, int64_t span, int64_t m0,
                int64_t m1, float* out, int64_t N) {
  const int64_t ncols = std::min(kPanel * span, N - p * kPanel);
  const float* p0 = w + p * K * kPanel;
  alignas(64) float buf[kRows * kPanel];
  for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
    const int64_t k1 = std::min(K, k0 + kKBlock);
    const bool first = k0 == 0;
    for (int64_t r = m0; r < m1; r += kRows) {
      const int64_t mr = std::min(kRows, m1 - r);
      const float* xr = x + r * K;
      float* o = out + r * N + p * kPanel;
#ifdef CONVOY_AVX512
      if (span == 2) {
        switch (mr) {
          case 6: tile32<6>(xr, K, p0, p0 + K * kPanel, k0, k1, o, N, first); break;
          case 5: tile32<5>(xr, K, p0, p0 + K * kPanel, k0, k1, o, N, first); break;
          case 4: tile32<4>(xr, K, p0, p0 + K * kPanel, k0, k1, o, N, first); break;
          case 3: tile32<3>(xr, K, p0, p0 + K * kPanel, k0, k1, o, N, first); break;
          case 2: tile32<2>(xr, K, p0, p0 + K * kPanel, k0, k1, o, N, first); break;
          default: tile32<1>(xr, K, p0, p0 + K * kPanel, k0, k1, o, N, first); break;
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
        case 6: tile16<6>(xr, K, p0, k0, k1, c, ldc, first); break;
        case 5: tile16<5>(xr, K, p0, k0, k1, c, ldc, first); break;
        case 4: tile16<4>(xr, K, p0, k0, k1, c, ldc, first); break;
        case 3: tile16<3>(xr, K, p0, k0, k1, c, ldc, first); break;
        case 2: tile16<2>(xr, K, p0, k0, k1, c, ldc, first); break;
        default: tile16<1>(xr, K, p0, k0, k1, c, ldc, first); break;
      }
      if (!whole) {
        for (int64_t i = 0; i < mr; ++i) std::copy(buf + i * kPanel, buf + i * kPanel + ncols, o + i * N);
      }
    }
  }
}

// x (M, K) fp32, packed from pack_fp32_weight, bias (N,) or none -> (M, N) fp32.
at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be (M, K) fp32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous(),
              "packed weight expected");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && packed.size(2) == kPanel && (N + kPanel - 1) / kPanel == P,
              "weight shape does not match input");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return out;
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
#ifdef CONVOY_AVX512
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
          run_panels(xp, K, wp, p, 1, m0, m1, op, N);
          run_panels(xp, K, wp, p + 1, 1, m0, m1, op, N);
        } else {
          run_panels(xp, K, wp, p, span, m0, m1, op, N);
        }
      }
    }
  });
  if (bias.has_value() && bias->defined()) out.add_(bias->to(at::kFloat));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(convoy, m) {
  m.def("pack_fp32_weight(Tensor weight) -> Tensor");
  m.def("fp32_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(convoy, CPU, m) {
  m.impl("pack_fp32_weight", &pack_fp32_weight);
  m.impl("fp32_linear", &fp32_linear);
}
