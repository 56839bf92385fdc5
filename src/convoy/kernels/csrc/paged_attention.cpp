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

// The sums of 4 keys' accumulators of one head, each in hsum8's order (its lo + hi halves, then
// lanes 0+2 and 1+3, then 0+1), so a key's score has the bits hsum8 gives it alone; 4 lanes out.
inline __m128 hsum8x4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s0 = _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20),
                                  _mm256_permute2f128_ps(a0, a1, 0x31));  // a0's 4 | a1's 4
  const __m256 s1 = _mm256_add_ps(_mm256_permute2f128_ps(a2, a3, 0x20),
                                  _mm256_permute2f128_ps(a2, a3, 0x31));  // a2's 4 | a3's 4
  const __m256 t = _mm256_add_ps(_mm256_shuffle_ps(s0, s1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(s0, s1, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(t, t, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(t, t, _MM_SHUFFLE(3, 1, 3, 1)));
  // r = [k0 k2 k0 k2 | k1 k3 k1 k3]
  return _mm_unpacklo_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1));
}

// Keys [i0, n) one at a time, for P (row, head) pairs whose q rows lie D apart from qf:
// scores[p * n + i] = hsum8(the chain of FMAs over D in chunks of 8) * scale. The tail of the
// 4-key loops below (and every key where their accumulators would not fit the registers).
template <int P, typename C>
void qk_keys_singly(const float* qf, const C* kg, const int64_t* slots, int64_t i0, int64_t n,
                    int64_t D, float scale, float* scores) {
  for (int64_t i = i0; i < n; ++i) {
    const C* krow = kg + slots[i] * D;
    if (i + kAheadKeys < n) prefetch_row(kg + slots[i + kAheadKeys] * D, D);
    __m256 a[P];
    for (int p = 0; p < P; ++p) a[p] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 k8 = load8(krow + d);
      for (int p = 0; p < P; ++p) a[p] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + p * D + d), k8, a[p]);
    }
    for (int p = 0; p < P; ++p) scores[p * n + i] = hsum8(a[p]) * scale;
  }
}

// scores[j * n + i] = q_j . k_i * scale for the G query heads of one KV head: per key and head a
// chain of FMAs over D in chunks of 8, then hsum8, then * scale (prefill's qk_tile computes the
// same). Keys go 4 at a time, the chunk loop inside: each q chunk is loaded once for 4 keys, the
// 4 keys' rows are in flight together and their sums are reduced together (hsum8x4, the same
// bits). One key at a time (a q load per FMA, a reduction per key) ran 1.2-1.5x slower: 64
// sequences x 1,000 keys of SmolLM2's heads, fp16, one thread (bench/attention_micro.cpp).
template <int G, typename C>
void qk_scores(const float* qf, const C* kg, const int64_t* slots, int64_t n, int64_t D,
               float scale, float* scores) {
  constexpr int NK = 4;
  const __m128 sc4 = _mm_set1_ps(scale);
  int64_t i = 0;
  // G > 4: 4 x G accumulators would not fit the registers; one key at a time (below)
  for (; G <= 4 && i + NK <= n; i += NK) {
    const C* kr[NK];
    for (int u = 0; u < NK; ++u) {
      kr[u] = kg + slots[i + u] * D;
      if (i + u + kAheadKeys < n) prefetch_row(kg + slots[i + u + kAheadKeys] * D, D);
    }
    __m256 a[G][NK];
    for (int j = 0; j < G; ++j)
      for (int u = 0; u < NK; ++u) a[j][u] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      __m256 qv[G];
      for (int j = 0; j < G; ++j) qv[j] = _mm256_loadu_ps(qf + j * D + d);
      for (int u = 0; u < NK; ++u) {
        const __m256 k8 = load8(kr[u] + d);
        for (int j = 0; j < G; ++j) a[j][u] = _mm256_fmadd_ps(qv[j], k8, a[j][u]);
      }
    }
    for (int j = 0; j < G; ++j)
      _mm_storeu_ps(scores + j * n + i,
                    _mm_mul_ps(hsum8x4(a[j][0], a[j][1], a[j][2], a[j][3]), sc4));
  }
  qk_keys_singly<G, C>(qf, kg, slots, i, n, D, scale, scores);  // the last n % 4 (all, G > 4)
}

// The weighted sums' registers: 8 fp32 lanes (ymm), or 16 (zmm) where the build has AVX-512.
struct Ymm {
  using V = __m256;
  static constexpr int W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  template <typename C>
  static V load(const C* p) { return load8(p); }
};

#ifdef __AVX512F__
// 16 cache values widened to fp32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

struct Zmm {
  using V = __m512;
  static constexpr int W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  template <typename C>
  static V load(const C* p) { return load16(p); }
};
#endif

// acc_j = sum_i p_j[i] * v_i over CH chunks of VT::W dims from dim c: G a compile-time constant,
// so the G x CH accumulators stay in registers. Each accumulator is a chain of dependent FMAs (one
// a key), so one chunk of G <= 3 heads kept the FMA units a third busy (latency-bound); CH
// independent chunks fill them. Every output element sums its keys in order: the same bits for
// any CH and either register width.
template <typename VT, int G, int CH, typename C>
void pv_chunks(const float* scores, const C* vg, const int64_t* slots, int64_t n, int64_t D,
               int64_t c, float* acc) {
  using V = typename VT::V;
  constexpr int W = VT::W;
  V a[G][CH];
  for (int j = 0; j < G; ++j)
    for (int u = 0; u < CH; ++u) a[j][u] = VT::zero();
  for (int64_t i = 0; i < n; ++i) {
    const C* vrow = vg + slots[i] * D + c;
    if (c == 0 && i + kAheadKeys < n) prefetch_row(vg + slots[i + kAheadKeys] * D, D);
    V v[CH];
    for (int u = 0; u < CH; ++u) v[u] = VT::load(vrow + W * u);
    for (int j = 0; j < G; ++j) {
      const V p = VT::set1(scores[j * n + i]);
      for (int u = 0; u < CH; ++u) a[j][u] = VT::fmadd(p, v[u], a[j][u]);
    }
  }
  for (int j = 0; j < G; ++j)
    for (int u = 0; u < CH; ++u) VT::store(acc + j * D + c + W * u, a[j][u]);
}

template <int G, typename C>
void pv_accumulate(const float* scores, const C* vg, const int64_t* slots, int64_t n, int64_t D,
                   float* acc) {
  // Up to 4 heads, 32 dims a pass over the keys (64 on AVX-512 builds, in zmm, below): 1.2-1.5x
  // faster than 16 dims a pass once the cache comes from memory, and than 64 dims a pass (more
  // accumulators than 16 registers) in cache, where prefill and verification rows read it
  // (bench/attention_micro.cpp; AVX2 build: a 3,000-token prefill 7.4-7.6 s at 64 dims a pass,
  // 6.9 at 32). More heads: G * CH + CH + 1 registers of 16, as before.
  constexpr int CH = G <= 4 ? 4 : 1;
  int64_t c = 0;
#ifdef __AVX512F__
  if constexpr (G <= 4) {
    for (; c + 64 <= D; c += 64) pv_chunks<Zmm, G, 4, C>(scores, vg, slots, n, D, c, acc);
    for (; c + 16 <= D; c += 16) pv_chunks<Zmm, G, 1, C>(scores, vg, slots, n, D, c, acc);
  }
#endif
  for (; c + 8 * CH <= D; c += 8 * CH) pv_chunks<Ymm, G, CH, C>(scores, vg, slots, n, D, c, acc);
  if constexpr (CH > 2)
    for (; c + 16 <= D; c += 16) pv_chunks<Ymm, G, 2, C>(scores, vg, slots, n, D, c, acc);
  for (; c < D; c += 8) pv_chunks<Ymm, G, 1, C>(scores, vg, slots, n, D, c, acc);
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


// out[i] = the cache slot of position first + i, for positions [first, len): a block's slots
// are consecutive, so each block is looked up and range-checked once.
inline void fill_slots(const int64_t* table, int64_t block_size, int64_t first, int64_t len,
                       int64_t S, int64_t* out) {
  for (int64_t t = first; t < len;) {
    const int64_t off = t % block_size;
    const int64_t cnt = std::min(block_size - off, len - t);
    const int64_t base = table[t / block_size] * block_size + off;
    TORCH_CHECK(base >= 0 && base + cnt <= S, "slot out of range");
    for (int64_t k = 0; k < cnt; ++k) *out++ = base + k;
    t += cnt;
  }
}

// Scores of one query row's G heads over n keys by the scalar path (no AVX2, D % 8, G > 8):
// scores[j * n + i] = q_j . k_i * scale.
template <typename C>
void qk_scalar(const float* qf, const C* kg, const int64_t* slots, int64_t n, int64_t G, int64_t D,
               float fscale, float* scores) {
  for (int64_t i = 0; i < n; ++i) {
    const C* krow = kg + slots[i] * D;
    for (int64_t j = 0; j < G; ++j) {
      const float* qrow = qf + j * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qrow[d] * static_cast<float>(krow[d]);
      scores[j * n + i] = dot * fscale;
    }
  }
}

// The rest of one query row once its scores are in (scores[j * n + i], keys in order):
// soft-cap, softmax per head, the weighted sum of V in key order, written to og (G heads x D).
// Decode and prefill both end here, so a row's bits do not depend on how its scores were tiled.
template <typename T, typename C>
void finish_row(float* scores, int64_t n, int64_t G, int64_t D, const C* vg,
                const int64_t* slots, float fscale, float softcap, bool vec, float* acc, T* og) {
  // Soft-capping (Gemma 2): s = cap * tanh(s / cap), before the softmax, as transformers'
  // eager attention orders it (a division, then tanh, then the product). 0: none.
  if (softcap > 0.f) {
    for (int64_t x = 0; x < G * n; ++x) scores[x] = std::tanh(scores[x] / softcap) * softcap;
  }
  // softmax per query head (max-subtracted, fp32)
  for (int64_t j = 0; j < G; ++j) {
    float* s = scores + j * n;
    float mx = -std::numeric_limits<float>::infinity();
    int64_t i = 0;
#ifdef CONVOY_ATTN_AVX2
    // the max in 8 lanes (a scalar max is a chain of dependent maxss: ~10% of a verification
    // step's attention at 1,300 keys); a max is the same whatever the order
    if (n >= 8) {
      __m256 m8 = _mm256_loadu_ps(s);
      for (i = 8; i + 8 <= n; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + i));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      mx = _mm_cvtss_f32(m4);
    }
#endif
    for (; i < n; ++i) mx = std::max(mx, s[i]);
    float sum = 0.f;
    i = 0;
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
  // acc_j = sum_i p_j[i] * v_i, keys in order
#ifdef CONVOY_ATTN_AVX2
  if (vec) attend_vec<C>(G, nullptr, nullptr, vg, slots, n, D, fscale, scores, acc, true);
#else
  (void)fscale;
#endif
  if (!vec) std::fill(acc, acc + G * D, 0.f);
  for (int64_t i = 0; i < n && !vec; ++i) {
    const C* vrow = vg + slots[i] * D;
    for (int64_t j = 0; j < G; ++j) {
      const float p = scores[j * n + i];
      float* a = acc + j * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<float>(vrow[d]);
    }
  }
  for (int64_t x = 0; x < G * D; ++x) og[x] = static_cast<T>(acc[x]);
}

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
      fill_slots(table, block_size, first, len, S, slots.data());
#ifdef CONVOY_ATTN_AVX2
      const bool vec = attend_vec<C>(G, qf.data(), kg, vg, slots.data(), n, D, fscale,
                                     scores.data(), acc.data(), false);
#else
      const bool vec = false;
#endif
      if (!vec) qk_scalar<C>(qf.data(), kg, slots.data(), n, G, D, fscale, scores.data());
      finish_row<T, C>(scores.data(), n, G, D, vg, slots.data(), fscale, softcap, vec, acc.data(),
                       op + (b * H + g * G) * D);
    }
  });
}

#ifdef CONVOY_ATTN_AVX2
// Scores of R query rows (of one sequence, consecutive positions) x G heads over the same n
// keys, scores[(r * G + j) * n + i]. Every score is the same chain of FMAs over D in chunks of 8,
// then hsum8's order, then * scale, as qk_scores computes it for one row: the same bits. Keys go
// 4 at a time, widened once into a small fp32 buffer; then 3 (row, head) pairs at a time run
// over the chunks (12 accumulators, 3 q chunks and a key chunk: 16 registers) and each pair's 4
// sums are reduced together (hsum8x4). The tile's rows used to take one key at a time, a
// reduction per score and a q load per FMA: 30-36 ns a key for 4 rows x 3 heads at 1,600 keys,
// one thread, against 20-21 now (AVX2 and AVX-512 builds; 94 -> 70-82 for Gemma 3's 256-dim
// heads). A head wider than kTileMaxD goes the old way, one key at a time (also the last n % 4).
constexpr int64_t kTileMaxD = 512;

template <int G, int R, typename C>
void qk_tile(const float* qf, const C* kg, const int64_t* slots, int64_t n, int64_t D,
             float scale, float* scores) {
  constexpr int PAIRS = R * G, P = 3;
  alignas(32) float kb[4 * kTileMaxD];
  const __m128 sc4 = _mm_set1_ps(scale);
  int64_t i = 0;
  for (; D <= kTileMaxD && i + 4 <= n; i += 4) {
    for (int u = 0; u < 4; ++u) {
      const C* krow = kg + slots[i + u] * D;
      if (i + u + kAheadKeys < n) prefetch_row(kg + slots[i + u + kAheadKeys] * D, D);
      for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(kb + u * D + d, load8(krow + d));
    }
    int p = 0;
    for (; p + P <= PAIRS; p += P) {
      const float* q = qf + p * D;
      __m256 a[P][4];
      for (int x = 0; x < P; ++x)
        for (int u = 0; u < 4; ++u) a[x][u] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        __m256 qv[P];
        for (int x = 0; x < P; ++x) qv[x] = _mm256_loadu_ps(q + x * D + d);
        for (int u = 0; u < 4; ++u) {
          const __m256 k = _mm256_load_ps(kb + u * D + d);
          for (int x = 0; x < P; ++x) a[x][u] = _mm256_fmadd_ps(qv[x], k, a[x][u]);
        }
      }
      for (int x = 0; x < P; ++x)
        _mm_storeu_ps(scores + (p + x) * n + i,
                      _mm_mul_ps(hsum8x4(a[x][0], a[x][1], a[x][2], a[x][3]), sc4));
    }
    for (; p < PAIRS; ++p) {  // the last PAIRS % 3
      const float* q = qf + p * D;
      __m256 a[4];
      for (int u = 0; u < 4; ++u) a[u] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int u = 0; u < 4; ++u) a[u] = _mm256_fmadd_ps(qv, _mm256_load_ps(kb + u * D + d), a[u]);
      }
      _mm_storeu_ps(scores + p * n + i, _mm_mul_ps(hsum8x4(a[0], a[1], a[2], a[3]), sc4));
    }
  }
  qk_keys_singly<PAIRS, C>(qf, kg, slots, i, n, D, scale, scores);  // the last n % 4
}

// Rows tiled per G: R * G <= 12 accumulators (of 16 registers). 0: G not tiled (scalar path).
constexpr int tile_rows(int64_t G) { return G <= 3 ? 4 : G == 4 ? 3 : G <= 6 ? 2 : G <= 8 ? 1 : 0; }

template <typename C>
void qk_tile_any(int64_t G, const float* qf, const C* kg, const int64_t* slots, int64_t n,
                 int64_t D, float scale, float* scores) {
#define CONVOY_TILE(g)                                                          \
  case g:                                                                       \
    qk_tile<g, tile_rows(g), C>(qf, kg, slots, n, D, scale, scores);           \
    return;
  switch (G) {
    CONVOY_TILE(1) CONVOY_TILE(2) CONVOY_TILE(3) CONVOY_TILE(4)
    CONVOY_TILE(5) CONVOY_TILE(6) CONVOY_TILE(7) CONVOY_TILE(8)
    default:
      TORCH_CHECK(false, "qk_tile: G out of range");
  }
#undef CONVOY_TILE
}
#endif

// A prefill chunk's queries, each attended as the decode row of its position would be (its own
// context length; keys from the cache, which holds the chunk's K/V already): the same bits as
// decode_attention_impl per row, with the scores of a few rows computed together.
template <typename T, typename C>
void prefill_attention_impl(const at::Tensor& qc, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& table_t, int64_t start,
                            int64_t block_size, float fscale, int64_t window, float softcap,
                            at::Tensor& out) {
  const int64_t Tq = qc.size(0), H = qc.size(1), D = qc.size(2);
  const int64_t Hkv = k_cache.size(0), S = k_cache.size(1), NB = table_t.size(0);
  const int64_t G = H / Hkv;
  const int64_t ctx = start + Tq;
  TORCH_CHECK(start >= 0 && ctx <= NB * block_size, "context length out of range");
  const T* qp = qc.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  const int64_t* table = table_t.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  std::vector<int64_t> slots(ctx);  // of every key of the sequence, shared by all rows
  fill_slots(table, block_size, 0, ctx, S, slots.data());
#ifdef CONVOY_ATTN_AVX2
  const int R = D % 8 == 0 ? tile_rows(G) : 0;
#else
  const int R = 0;
#endif
  const int64_t rows_per_item = R > 0 ? R : 1;
  const int64_t tiles = (Tq + rows_per_item - 1) / rows_per_item;
  at::parallel_for(0, tiles * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile_scores, scores, acc(G * D), qf(rows_per_item * G * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t tile = item / Hkv, g = item % Hkv;
      const int64_t r0 = tile * rows_per_item;
      const int64_t nr = std::min(rows_per_item, Tq - r0);
      const C* kg = kp + g * S * D;
      const C* vg = vp + g * S * D;
      std::fill(qf.begin(), qf.end(), 0.f);
      for (int64_t r = 0; r < nr; ++r) {
        const T* qg = qp + ((r0 + r) * H + g * G) * D;
        for (int64_t x = 0; x < G * D; ++x) qf[r * G * D + x] = static_cast<float>(qg[x]);
      }
      // keys [lo, hi) cover every row of the tile; row r uses [first_r, len_r) of them
      const int64_t hi = start + r0 + nr;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, start + r0 + 1 - window) : 0;
      const int64_t span = hi - lo;
#ifdef CONVOY_ATTN_AVX2
      if (R > 0) {
        tile_scores.resize(rows_per_item * G * span);
        qk_tile_any<C>(G, qf.data(), kg, slots.data() + lo, span, D, fscale, tile_scores.data());
      }
#endif
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t len = start + r0 + r + 1;
        const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
        const int64_t n = len - first;
        scores.resize(G * n);
        if (R > 0) {  // this row's keys out of the tile's, compact as decode lays them out
          for (int64_t j = 0; j < G; ++j)
            std::copy_n(tile_scores.data() + (r * G + j) * span + (first - lo), n,
                        scores.data() + j * n);
        } else {
          qk_scalar<C>(qf.data() + r * G * D, kg, slots.data() + first, n, G, D, fscale,
                       scores.data());
        }
        finish_row<T, C>(scores.data(), n, G, D, vg, slots.data() + first, fscale, softcap,
                         R > 0, acc.data(), op + ((r0 + r) * H + g * G) * D);
      }
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

template <typename T>
void dispatch_prefill(const at::Tensor& qc, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& table, int64_t start, int64_t block_size, float fs,
                      int64_t window, float cap, at::Tensor& out) {
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      prefill_attention_impl<T, float>(qc, k_cache, v_cache, table, start, block_size, fs, window,
                                       cap, out);
      break;
    case at::kBFloat16:
      prefill_attention_impl<T, at::BFloat16>(qc, k_cache, v_cache, table, start, block_size, fs,
                                              window, cap, out);
      break;
    default:
      prefill_attention_impl<T, at::Half>(qc, k_cache, v_cache, table, start, block_size, fs,
                                          window, cap, out);
  }
}

at::Tensor prefill_attention(
    const at::Tensor& q,            // (T, H, D) fp32 or bf16: one sequence's chunk of queries
    const at::Tensor& k_cache,      // (Hkv, num_slots, D), holding the chunk's K/V already
    const at::Tensor& v_cache,
    const at::Tensor& block_table,  // (NB,) int64: the sequence's blocks, in order
    int64_t start,                  // position of the chunk's first query
    int64_t block_size, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "bad ranks");
  const auto dt = q.scalar_type();
  const auto ct = k_cache.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && v_cache.scalar_type() == ct &&
                  (ct == at::kFloat || ct == at::kBFloat16 || ct == at::kHalf),
              "q fp32 or bf16; the cache fp32, bf16 or fp16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cache must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 1, "int64 (NB,)");
  const at::Tensor qc = q.contiguous();
  const at::Tensor table = block_table.contiguous();
  const int64_t H = qc.size(1), D = qc.size(2), Hkv = k_cache.size(0);
  TORCH_CHECK(k_cache.size(2) == D && v_cache.sizes() == k_cache.sizes() && H % Hkv == 0, "shapes");
  TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0: none)");
  at::Tensor out = at::empty(qc.sizes(), qc.options());
  const float fs = static_cast<float>(scale);
  const float cap = static_cast<float>(softcap);
  if (dt == at::kFloat) {
    dispatch_prefill<float>(qc, k_cache, v_cache, table, start, block_size, fs, window, cap, out);
  } else {
    dispatch_prefill<at::BFloat16>(qc, k_cache, v_cache, table, start, block_size, fs, window,
                                   cap, out);
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
  m.def(
      "prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "int start, int block_size, float scale, int window, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(convoy, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("prefill_attention", &prefill_attention);
}
