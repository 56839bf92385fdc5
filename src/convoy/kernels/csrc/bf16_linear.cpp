// bf16-weight linear layers for CPUs without native bf16 arithmetic (AVX2 hosts).
//
// There torch's bf16 matmul is emulated: 64x576x3072 runs at ~16 GFLOP/s on two cores, against
// ~120 for fp32 through oneDNN. This kernel keeps the weights in bf16 (half the memory and memory
// traffic of fp32), widens them to fp32 in registers (a bf16 is the top half of an fp32) and
// accumulates in fp32 with FMAs, as bf16 hardware does; the output is rounded to bf16 once.
//
// Weights are repacked once into panels of 16 output features, K-major: panel p holds
// w[16p .. 16p+15, k] for k = 0..K-1 contiguously, so the inner loop reads 32 bytes of weights per k
// and broadcasts one activation per row: a 6 x 16 register tile of accumulators (BLIS-style).
//
// fp16 weights (a GGUF's F16 linears) take the same panels and loop; they widen with F16C's
// vcvtph2ps instead of a shift. Widening either type to fp32 is exact, so the result differs from
// an fp32 matmul of the same weights only by summation order, and each row's sum runs in one
// fixed order whatever the batch: batch invariant.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CONVOY_AVX2 1
#endif

namespace {

constexpr int64_t kPanel = 16;  // output features per panel
constexpr int64_t kRows = 6;    // activation rows per register tile

// (N, K) bf16 or fp16 -> (ceil(N / 16), K, 16) of the same dtype, zero-padded past N.
at::Tensor pack_bf16_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 &&
                  (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kHalf),
              "(N, K) bf16 or fp16 weight");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t P = (N + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({P, K, kPanel}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j) {
        const uint16_t* row = src + (p * kPanel + j) * K;
        uint16_t* col = dst + p * K * kPanel + j;
        for (int64_t k = 0; k < K; ++k) col[k * kPanel] = row[k];
      }
    }
  });
  return packed;
}

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <bool HALF>
inline float widen(uint16_t v) {
  if constexpr (HALF) {
    return static_cast<float>(c10::Half(v, c10::Half::from_bits()));
  } else {
    return bf16_to_float(v);
  }
}

#ifdef CONVOY_AVX2
template <bool HALF>
inline __m256 widen8(const __m128i* p) {
  if constexpr (HALF) {
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128(p));
#else
    alignas(32) float f[8];
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
    for (int j = 0; j < 8; ++j) f[j] = widen<true>(h[j]);
    return _mm256_load_ps(f);
#endif
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p)), 16));
  }
}
#endif

// out[i, 0..ncols) = x[i, :] . panel[:, 0..ncols) for i < mr (mr <= 6).
template <int MR, bool HALF>
inline void tile(const float* x, int64_t ldx, const uint16_t* panel, int64_t K, float* out,
                 int64_t ldo, int64_t ncols) {
#ifdef CONVOY_AVX2
  // Every loop over the tile's rows is fully unrolled so the 2 * MR accumulators stay in registers
  // (with a runtime-indexed epilogue GCC spills them to the stack on every k).
  __m256 acc[MR][2];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m128i* wk = reinterpret_cast<const __m128i*>(panel + k * kPanel);
    const __m256 w0 = widen8<HALF>(wk);
    const __m256 w1 = widen8<HALF>(wk + 1);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m256 xb = _mm256_broadcast_ss(x + i * ldx + k);
      acc[i][0] = _mm256_fmadd_ps(xb, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xb, w1, acc[i][1]);
    }
  }
  alignas(32) float buf[MR][kPanel];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    _mm256_store_ps(buf[i], acc[i][0]);
    _mm256_store_ps(buf[i] + 8, acc[i][1]);
  }
  for (int i = 0; i < MR; ++i) std::copy(buf[i], buf[i] + ncols, out + i * ldo);
#else
  float acc[MR][kPanel] = {};
  for (int64_t k = 0; k < K; ++k) {
    for (int i = 0; i < MR; ++i) {
      const float xv = x[i * ldx + k];
      for (int64_t j = 0; j < kPanel; ++j) acc[i][j] += xv * widen<HALF>(panel[k * kPanel + j]);
    }
  }
  for (int i = 0; i < MR; ++i) std::copy(acc[i], acc[i] + ncols, out + i * ldo);
#endif
}

template <bool HALF>
void run_tile(int64_t mr, const float* x, int64_t ldx, const uint16_t* panel, int64_t K, float* out,
              int64_t ldo, int64_t ncols) {
  switch (mr) {
    case 6: tile<6, HALF>(x, ldx, panel, K, out, ldo, ncols); break;
    case 5: tile<5, HALF>(x, ldx, panel, K, out, ldo, ncols); break;
    case 4: tile<4, HALF>(x, ldx, panel, K, out, ldo, ncols); break;
    case 3: tile<3, HALF>(x, ldx, panel, K, out, ldo, ncols); break;
    case 2: tile<2, HALF>(x, ldx, panel, K, out, ldo, ncols); break;
    default: tile<1, HALF>(x, ldx, panel, K, out, ldo, ncols); break;
  }
}

// x (M, K) bf16 or fp32, packed from pack_bf16_weight (bf16 or fp16), bias (N,) or none ->
// (M, N) in x's dtype.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2, "x must be (M, K)");
  const bool half = packed.scalar_type() == at::kHalf;
  TORCH_CHECK(packed.dim() == 3 && (half || packed.scalar_type() == at::kBFloat16) &&
                  packed.is_contiguous(),
              "packed weight expected");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && packed.size(2) == kPanel && (N + kPanel - 1) / kPanel == P,
              "weight shape does not match input");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint16_t* panel = wp + p * K * kPanel;
      const int64_t ncols = std::min(kPanel, N - p * kPanel);
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int64_t mr = std::min(kRows, M - m0);
        float* o = op + m0 * N + p * kPanel;
        if (half) {
          run_tile<true>(mr, xp + m0 * K, K, panel, K, o, N, ncols);
        } else {
          run_tile<false>(mr, xp + m0 * K, K, panel, K, o, N, ncols);
        }
      }
    }
  });
  if (bias.has_value() && bias->defined()) out.add_(bias->to(at::kFloat));
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(convoy, m) {
  m.def("pack_bf16_weight(Tensor weight) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(convoy, CPU, m) {
  m.impl("pack_bf16_weight", &pack_bf16_weight);
  m.impl("bf16_linear", &bf16_linear);
}
