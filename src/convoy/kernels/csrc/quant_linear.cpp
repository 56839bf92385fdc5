// Linear layers on GGUF-quantized weights kept in their blocks (Q4_0, Q4_1, Q8_0), as llama.cpp
// runs them: activations are quantized to int8 blocks of 32 (one fp32 scale per block, plus the
// scaled sum for the formats with an offset), and each weight block meets its activation block in
// an int8 dot product (AVX2 maddubs: u8 x s8 pairs summed to int16, then to int32).
//
//   Q4_0 block (18 B): fp16 d, 16 B of nibbles      w[j] = d * (q[j] - 8)
//   Q4_1 block (20 B): fp16 d, fp16 m, 16 B          w[j] = d * q[j] + m
//   Q8_0 block (34 B): fp16 d, 32 x int8             w[j] = d * q[j]
//   nibbles: byte i holds weight i (low 4 bits) and weight i + 16 (high 4 bits)
//
//   sum_j w[j] x[j] ~= d_w d_x sum_j q[j] qx[j]  (+ m_w s_x for Q4_1, - 8 d_w s_x for Q4_0)
//   with x[j] ~= d_x qx[j] and s_x = d_x sum_j qx[j]
//
// NOTE: batch invariance. Every output element (m, n) sums its K/32 blocks in order into the same
// 8-lane accumulator whatever M is; rows are split across threads, never the reduction.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define CONVOY_AVX2 1
#endif

namespace {

constexpr int64_t QK = 32;
// GGML type ids (gguf.GGMLQuantizationType)
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
constexpr int64_t kTileM = 64;  // activation rows per tile: their int8 blocks stay in L2
constexpr int64_t kGroupM = 4;  // activation rows sharing one unpacked weight block

struct BlockQ8 {  // one activation block
  float d;        // scale
  float s;        // d * sum(q)
  int8_t q[QK];
};

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
    default: TORCH_CHECK(false, "unsupported quantized type ", qtype);
  }
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

void quantize_row(const float* x, BlockQ8* out, int64_t num_blocks) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* v = x + b * QK;
    float amax = 0.f;
    for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127.f;
    const float id = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int j = 0; j < QK; ++j) {
      const int q = static_cast<int>(std::nearbyint(v[j] * id));
      out[b].q[j] = static_cast<int8_t>(q);
      sum += q;
    }
    out[b].d = d;
    out[b].s = d * static_cast<float>(sum);
  }
}

// One weight block, decoded once and used against up to kGroupM activation rows.
struct WeightBlock {
  float d = 0.f, m = 0.f;  // scale; offset (Q4_1) or -8 d (Q4_0) applied to s_x
  bool is_signed = false;  // Q8_0: signed weights
#ifdef CONVOY_AVX2
  __m256i q;
#else
  int8_t q[QK];  // Q4: 0..15, Q8: -128..127
#endif
};

inline void load_block(const uint8_t* p, int64_t qtype, WeightBlock& w) {
  w.d = half_to_float(p);
  const uint8_t* qs = p + 2;
  if (qtype == kQ4_1) {
    w.m = half_to_float(p + 2);
    qs = p + 4;
  } else {
    w.m = qtype == kQ4_0 ? -8.f * w.d : 0.f;
  }
  w.is_signed = qtype == kQ8_0;
#ifdef CONVOY_AVX2
  if (w.is_signed) {
    w.q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
    w.q = _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
  }
#else
  if (w.is_signed) {
    std::memcpy(w.q, qs, QK);
  } else {
    for (int j = 0; j < 16; ++j) {
      w.q[j] = static_cast<int8_t>(qs[j] & 0x0F);
      w.q[j + 16] = static_cast<int8_t>(qs[j] >> 4);
    }
  }
#endif
}

#ifdef CONVOY_AVX2
// acc += d * (q_w . q_x) as 8 fp32 lanes
inline __m256 dot_block(const WeightBlock& w, const BlockQ8& x, __m256 acc) {
  const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q));
  __m256i p16;
  if (w.is_signed) {  // maddubs wants u8 x s8: move the weight's sign onto the activation
    p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w.q, w.q), _mm256_sign_epi8(xq, w.q));
  } else {
    p16 = _mm256_maddubs_epi16(w.q, xq);
  }
  const __m256i p32 = _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
  return _mm256_fmadd_ps(_mm256_set1_ps(w.d * x.d), _mm256_cvtepi32_ps(p32), acc);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// out[m, n] for m in [m0, m1) and n in [n0, n1)
void tile(const uint8_t* w, int64_t row_bytes, int64_t qtype, int64_t num_blocks,
          const BlockQ8* xq, float* out, int64_t N, int64_t m0, int64_t m1, int64_t n0,
          int64_t n1) {
  const int64_t bb = block_bytes(qtype);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t mg = m0; mg < m1; mg += kGroupM) {
      const int64_t g = std::min(kGroupM, m1 - mg);
      float offset[kGroupM] = {0.f, 0.f, 0.f, 0.f};
#ifdef CONVOY_AVX2
      __m256 acc[kGroupM] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                             _mm256_setzero_ps()};
#else
      float acc[kGroupM] = {0.f, 0.f, 0.f, 0.f};
#endif
      WeightBlock wb;
      for (int64_t b = 0; b < num_blocks; ++b) {
        load_block(row + b * bb, qtype, wb);
        for (int64_t i = 0; i < g; ++i) {
          const BlockQ8& x = xq[(mg + i) * num_blocks + b];
#ifdef CONVOY_AVX2
          acc[i] = dot_block(wb, x, acc[i]);
#else
          int32_t dot = 0;
          for (int j = 0; j < QK; ++j) dot += int32_t(wb.q[j]) * int32_t(x.q[j]);
          acc[i] += wb.d * x.d * static_cast<float>(dot);
#endif
          offset[i] += wb.m * x.s;
        }
      }
      for (int64_t i = 0; i < g; ++i) {
#ifdef CONVOY_AVX2
        out[(mg + i) * N + n] = hsum(acc[i]) + offset[i];
#else
        out[(mg + i) * N + n] = acc[i] + offset[i];
#endif
      }
    }
  }
}

// x (M, K) fp32 @ w (N, K/32 blocks) -> (M, N) fp32 (+ bias)
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight, int64_t qtype,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be (M, K) fp32");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte, "weight: (N, bytes) uint8");
  const at::Tensor xc = x.contiguous();
  const at::Tensor w = weight.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = w.size(0);
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32");
  const int64_t num_blocks = K / QK;
  TORCH_CHECK(w.size(1) == num_blocks * block_bytes(qtype), "weight row size does not match K");
  at::Tensor out = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return out;
  std::vector<BlockQ8> xq(static_cast<size_t>(M * num_blocks));
  const float* xp = xc.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row(xp + m * K, xq.data() + m * num_blocks, num_blocks);
  });
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += kTileM) {
    const int64_t m1 = std::min(M, m0 + kTileM);
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      tile(wp, w.size(1), qtype, num_blocks, xq.data(), op, N, m0, m1, begin, end);
    });
  }
  if (bias.has_value() && bias->defined()) out.add_(*bias);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(convoy, m) {
  m.def("quant_linear(Tensor x, Tensor weight, int qtype, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(convoy, CPU, m) { m.impl("quant_linear", &quant_linear); }
