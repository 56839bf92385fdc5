// Decode attention straight from the paged KV cache, for the CPU.
//
// The torch path (attention.py) first copies every decode sequence's blocks into one padded
// (Hkv, B, L, D) tensor, then runs two batched matmuls over it: the copy is 40-60% of attention
// time at 16-64 sequences. This kernel reads each sequence's K/V rows where they live, once per
// KV head for all the query heads of its group, and parallelises over (sequence, KV head) with
// ATen's thread pool. q fp32 or bf16; the cache q's dtype or a 16-bit one (bf16/fp16 under fp32
// activations: `kv_cache_dtype`); 16-bit values are widened to fp32 as they are read and all
// arithmetic is fp32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "fast_exp.h"
#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define CONVOY_ATTN_AVX2 1
#endif

namespace {

#ifdef CONVOY_ATTN_AVX2
// 8 cache values widened to fp32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // a bf16 is the top half of an fp32
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

using convoy_math::exp8;  // the softmax's exp (fast_exp.h)

#endif

using convoy_math::fast_exp;  // the same on one lane, for the last n % 8 scores

#ifdef CONVOY_ATTN_AVX2
// A sequence's keys live in blocks scattered over the pool (16 rows of 128-512 B each): the
// hardware prefetcher loses the stream at every block, so each row is asked for this many keys
// ahead (its K row while scoring, its V row on the first pass of the weighted sum). Measured on
// a 2-core AVX2 EPYC, 64 sequences of 256 keys, 2 threads, the same bits out: SmolLM2's heads
// (9/3 x 64) 1.47x faster in fp16, 1.51x in fp32; Gemma 3's (4/1 x 256) 1.22x / 1.28x; 8 keys
// ahead gave less (1.41x, 1.28x).
constexpr int64_t kAheadKeys = 16;
template <typename C>
inline void prefetch_row(const C* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t o = 0; o < D * static_cast<int64_t>(sizeof(C)); o += 64)
    _mm_prefetch(p + o, _MM_HINT_T0);
}

// scores[j * n + i] = q_j . k_i * scale for the G query heads of one KV head, and
// acc_j = sum_i p_j[i] * v_i: G a compile-time constant, so the G accumulators stay in registers.
template <int G, typename C>
void qk_scores(const float* qf, const C* kg, const int64_t* slots, int64_t n, int64_t D,
               float scale, float* scores) {
  for (int64_t i = 0; i < n; ++i) {
    const C* krow = kg + slots[i] * D;
    if (i + kAheadKeys < n) prefetch_row(kg + slots[i + kAheadKeys] * D, D);
    __m256 a[G];
    for (int j = 0; j < G; ++j) a[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 k8 = load8(krow + d);
      for (int j = 0; j < G; ++j) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + j * D + d), k8, a[j]);
    }
    for (int j = 0; j < G; ++j) scores[j * n + i] = hsum8(a[j]) * scale;
  }
}

// CH chunks of 8 dims at once: each accumulator is a chain of dependent FMAs (one a key), so one
// chunk of G <= 3 heads kept the FMA units a third busy (latency-bound); CH independent chunks
// fill them. Every output element still sums its keys in order: the same bits for any CH.
template <int G, int CH, typename C>
void pv_chunks(const float* scores, const C* vg, const int64_t* slots, int64_t n, int64_t D,
               int64_t c, float* acc) {
  __m256 a[G][CH];
  for (int j = 0; j < G; ++j)
    for (int u = 0; u < CH; ++u) a[j][u] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const C* vrow = vg + slots[i] * D + c;
    if (c == 0 && i + kAheadKeys < n) prefetch_row(vg + slots[i + kAheadKeys] * D, D);
    __m256 v8[CH];
    for (int u = 0; u < CH; ++u) v8[u] = load8(vrow + 8 * u);
    for (int j = 0; j < G; ++j) {
      const __m256 p = _mm256_set1_ps(scores[j * n + i]);
      for (int u = 0; u < CH; ++u) a[j][u] = _mm256_fmadd_ps(p, v8[u], a[j][u]);
    }
  }
  for (int j = 0; j < G; ++j)
    for (int u = 0; u < CH; ++u) _mm256_storeu_ps(acc + j * D + c + 8 * u, a[j][u]);
}

template <int G, typename C>
void pv_accumulate(const float* scores, const C* vg, const int64_t* slots, int64_t n, int64_t D,
                   float* acc) {
  constexpr int CH = G <= 2 ? 4 : G <= 4 ? 2 : 1;  // G * CH + CH + 1 registers of 16
  int64_t c = 0;
  for (; c + 8 * CH <= D; c += 8 * CH) pv_chunks<G, CH, C>(scores, vg, slots, n, D, c, acc);
  for (; c < D; c += 8) pv_chunks<G, 1, C>(scores, vg, slots, n, D, c, acc);
}

// Both for a runtime G in 1..8; false (nothing done) for other G or D % 8 != 0.
template <typename C>
bool attend_vec(int64_t G, const float* qf, const C* kg, const C* vg, const int64_t* slots,
                int64_t n, int64_t D, float scale, float* scores, float* acc, bool pv) {
  if (D % 8 != 0) return false;
#define CONVOY_CASE(g)                                                   \
  case g:                                                                \
    if (pv) pv_accumulate<g, C>(scores, vg, slots, n, D, acc);           \
    else qk_scores<g, C>(qf, kg, slots, n, D, scale, scores);            \
    return true;
  switch (G) {
    CONVOY_CASE(1) CONVOY_CASE(2) CONVOY_CASE(3) CONVOY_CASE(4)
    CONVOY_CASE(5) CONVOY_CASE(6) CONVOY_CASE(7) CONVOY_CASE(8)
    default:
      return false;
  }
#undef CONVOY_CASE
}
#endif


template <typename T, typename C>  // T: q and out, C: the cache
void decode_attention_impl(const at::Tensor& qc, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& bt, const at::Tensor& ln, int64_t block_size, float fscale,
                           int64_t window, float softcap, at::Tensor& out) {
  const int64_t B = qc.size(0), H = qc.size(1), D = qc.size(2);
  const int64_t Hkv = k_cache.size(0), S = k_cache.size(1), NB = bt.size(1);
  const int64_t G = H / Hkv;
  const T* qp = qc.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t* lp = ln.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    std::vector<float> qf(G * D);
    std::vector<int64_t> slots;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, g = item % Hkv;
      const int64_t len = lp[b];
      TORCH_CHECK(len > 0 && len <= NB * block_size, "context length out of range");
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      scores.resize(G * n);
      slots.resize(n);
      const T* qg = qp + (b * H + g * G) * D;  // the G query heads of this KV head
      for (int64_t x = 0; x < G * D; ++x) qf[x] = static_cast<float>(qg[x]);
      const C* kg = kp + g * S * D;
      const C* vg = vp + g * S * D;
      const int64_t* table = btp + b * NB;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = first + i;
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        TORCH_CHECK(slot >= 0 && slot < S, "slot out of range");
        slots[i] = slot;
      }
#ifdef CONVOY_ATTN_AVX2
      const bool vec = attend_vec<C>(G, qf.data(), kg, vg, slots.data(), n, D, fscale,
                                     scores.data(), acc.data(), false);
#else
      const bool vec = false;
#endif
      // scores[j * n + i] = q_j . k_(first + i) * scale
      for (int64_t i = 0; i < n && !vec; ++i) {
        const C* krow = kg + slots[i] * D;
        for (int64_t j = 0; j < G; ++j) {
          const float* qrow = qf.data() + j * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qrow[d] * static_cast<float>(krow[d]);
          scores[j * n + i] = dot * fscale;
        }
      }
      // Soft-capping (Gemma 2): s = cap * tanh(s / cap), before the softmax, as transformers'
      // eager attention orders it (a division, then tanh, then the product). 0: none.
      if (softcap > 0.f) {
        for (int64_t x = 0; x < G * n; ++x) scores[x] = std::tanh(scores[x] / softcap) * softcap;
      }
      // softmax per query head (max-subtracted, fp32)
      for (int64_t j = 0; j < G; ++j) {
        float* s = scores.data() + j * n;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
        float sum = 0.f;
        int64_t i = 0;
#ifdef CONVOY_ATTN_AVX2
        __m256 sum8 = _mm256_setzero_ps();
        const __m256 mx8 = _mm256_set1_ps(mx);
        for (; i + 8 <= n; i += 8) {
          const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mx8));
          _mm256_storeu_ps(s + i, e);
          sum8 = _mm256_add_ps(sum8, e);
        }
        sum = hsum8(sum8);
#endif
        for (; i < n; ++i) {
          s[i] = fast_exp(s[i] - mx);
          sum += s[i];
        }
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < n; ++i) s[i] *= inv;
      }
      // acc_j = sum_i p_j[i] * v_(first + i), keys in order
#ifdef CONVOY_ATTN_AVX2
      if (vec) {
        attend_vec<C>(G, qf.data(), kg, vg, slots.data(), n, D, fscale, scores.data(), acc.data(),
                      true);
      }
#endif
      if (!vec) std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < n && !vec; ++i) {
        const C* vrow = vg + slots[i] * D;
        for (int64_t j = 0; j < G; ++j) {
          const float p = scores[j * n + i];
          float* a = acc.data() + j * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<float>(vrow[d]);
        }
      }
      T* og = op + (b * H + g * G) * D;
      for (int64_t x = 0; x < G * D; ++x) og[x] = static_cast<T>(acc[x]);
    }
  });
}

template <typename T>
void dispatch_cache(const at::Tensor& qc, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& bt, const at::Tensor& ln, int64_t block_size, float fs,
                    int64_t window, float cap, at::Tensor& out) {
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      decode_attention_impl<T, float>(qc, k_cache, v_cache, bt, ln, block_size, fs, window, cap,
                                      out);
      break;
    case at::kBFloat16:
      decode_attention_impl<T, at::BFloat16>(qc, k_cache, v_cache, bt, ln, block_size, fs, window,
                                             cap, out);
      break;
    default:
      decode_attention_impl<T, at::Half>(qc, k_cache, v_cache, bt, ln, block_size, fs, window, cap,
                                         out);
  }
}

at::Tensor decode_attention(
    const at::Tensor& q,             // (B, H, D) fp32 or bf16
    const at::Tensor& k_cache,       // (Hkv, num_slots, D) fp32, bf16 or fp16, contiguous
    const at::Tensor& v_cache,       // (Hkv, num_slots, D)
    const at::Tensor& block_tables,  // (B, NB) int64: blocks of each sequence, in order
    const at::Tensor& lens,          // (B,) int64: context length of each sequence (keys to read)
    int64_t block_size,
    double scale,
    int64_t window,                  // 0: none; else only the last `window` keys are visible
    double softcap) {                // 0: none; else scores = softcap * tanh(scores / softcap)
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "bad ranks");
  const auto dt = q.scalar_type();
  const auto ct = k_cache.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && v_cache.scalar_type() == ct &&
                  (ct == at::kFloat || ct == at::kBFloat16 || ct == at::kHalf),
              "q fp32 or bf16; the cache fp32, bf16 or fp16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cache must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "int64");
  const at::Tensor qc = q.contiguous();
  const at::Tensor bt = block_tables.contiguous();
  const at::Tensor ln = lens.contiguous();
  const int64_t B = qc.size(0), H = qc.size(1), D = qc.size(2);
  const int64_t Hkv = k_cache.size(0);
  TORCH_CHECK(k_cache.size(2) == D && v_cache.sizes() == k_cache.sizes() && H % Hkv == 0 &&
                  bt.size(0) == B && ln.size(0) == B, "shapes");
  at::Tensor out = at::empty({B, H, D}, qc.options());
  TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0: none)");
  const float fs = static_cast<float>(scale);
  const float cap = static_cast<float>(softcap);
  if (dt == at::kFloat) {
    dispatch_cache<float>(qc, k_cache, v_cache, bt, ln, block_size, fs, window, cap, out);
  } else {
    dispatch_cache<at::BFloat16>(qc, k_cache, v_cache, bt, ln, block_size, fs, window, cap, out);
  }
  return out;
}

}  // namespace

namespace convoy {
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& lens, int64_t block_size, double scale,
                            int64_t window, double softcap) {
  return ::decode_attention(q, k_cache, v_cache, block_tables, lens, block_size, scale, window,
                            softcap);
}
}  // namespace convoy

TORCH_LIBRARY(convoy, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor lens, int block_size, float scale, int window, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(convoy, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
