// A measurement, not part of Convoy: prefill attention's tile scores (R rows x G heads of one
// sequence over the same keys, csrc/paged_attention.cpp's qk_tile) timed alone, one thread, keys
// in cache, in variants that give the same bits (checked against t1).
//
//   c++ -O3 -march=native -DGG=3 -DRR=4 bench/attention_tile_micro.cpp -o /tmp/tile34
//   /tmp/tile34 1600 64        # keys, head dim (-DGG=4 -DRR=3 and 256: Gemma 3's heads)
//
// t1: one key at a time, every (row, head) pair's sum reduced alone (the kernel before
// 2026-12-07); t3: 4 keys widened into an fp32 buffer, one pair at a time with the 4-key
// reduction; t4 / t5pP: 2 / P pairs at once (t5p3 is the kernel since). Measured 2026-12-07 on
// the 2-core Xeon VM, 1,600 keys, ns a key: 4 x 3 heads x 64 t1 35.6 (AVX2 build 30.0), t5p3 20.8
// (20.3); 3 x 4 heads x 256 t1 94.4 (94.0), t5p3 70.1 (81.9).
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <random>
#include <algorithm>
#include <cstdint>
using u16 = uint16_t;
static inline __m256 load8(const u16* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
static inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
static inline __m128 hsum8x4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s0 = _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20), _mm256_permute2f128_ps(a0, a1, 0x31));
  const __m256 s1 = _mm256_add_ps(_mm256_permute2f128_ps(a2, a3, 0x20), _mm256_permute2f128_ps(a2, a3, 0x31));
  const __m256 t = _mm256_add_ps(_mm256_shuffle_ps(s0, s1, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(s0, s1, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(t, t, _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(t, t, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm_unpacklo_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1));
}
constexpr int64_t kAhead = 16;
static inline void prefetch_row(const u16* row, int64_t D) { const char* p = (const char*)row; for (int64_t o = 0; o < D * 2; o += 64) _mm_prefetch(p + o, _MM_HINT_T0); }

template <int G, int R>
__attribute__((noinline)) void t1(const float* qf, const u16* kg, const int64_t* slots, int64_t n, int64_t D, float scale, float* scores) {
  for (int64_t i = 0; i < n; ++i) {
    const u16* krow = kg + slots[i] * D;
    if (i + kAhead < n) prefetch_row(kg + slots[i + kAhead] * D, D);
    __m256 a[R][G];
    for (int r = 0; r < R; ++r) for (int j = 0; j < G; ++j) a[r][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 k8 = load8(krow + d);
      for (int r = 0; r < R; ++r) for (int j = 0; j < G; ++j)
        a[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + (r * G + j) * D + d), k8, a[r][j]);
    }
    for (int r = 0; r < R; ++r) for (int j = 0; j < G; ++j) scores[(r * G + j) * n + i] = hsum8(a[r][j]) * scale;
  }
}
// T3: 4 keys widened to an fp32 buffer, then each (row, head) pair: 4 accumulators over the chunks
template <int G, int R>
__attribute__((noinline)) void t3(const float* qf, const u16* kg, const int64_t* slots, int64_t n, int64_t D, float scale, float* scores) {
  alignas(64) float kb[4 * 256];
  const __m128 sc4 = _mm_set1_ps(scale);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int u = 0; u < 4; ++u) {
      const u16* krow = kg + slots[i + u] * D;
      if (i + u + kAhead < n) prefetch_row(kg + slots[i + u + kAhead] * D, D);
      for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(kb + u * D + d, load8(krow + d));
    }
    for (int p = 0; p < R * G; ++p) {
      const float* q = qf + p * D;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_load_ps(kb + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_load_ps(kb + D + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_load_ps(kb + 2 * D + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_load_ps(kb + 3 * D + d), a3);
      }
      _mm_storeu_ps(scores + p * n + i, _mm_mul_ps(hsum8x4(a0, a1, a2, a3), sc4));
    }
  }
  for (; i < n; ++i) {
    const u16* krow = kg + slots[i] * D;
    __m256 a[R][G];
    for (int r = 0; r < R; ++r) for (int j = 0; j < G; ++j) a[r][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 k8 = load8(krow + d);
      for (int r = 0; r < R; ++r) for (int j = 0; j < G; ++j)
        a[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + (r * G + j) * D + d), k8, a[r][j]);
    }
    for (int r = 0; r < R; ++r) for (int j = 0; j < G; ++j) scores[(r * G + j) * n + i] = hsum8(a[r][j]) * scale;
  }
}
// T4: as T3, two (row, head) pairs at once (8 accumulators: q loads shared by none, K loads shared by 2)
template <int G, int R>
__attribute__((noinline)) void t4(const float* qf, const u16* kg, const int64_t* slots, int64_t n, int64_t D, float scale, float* scores) {
  alignas(64) float kb[4 * 256];
  const __m128 sc4 = _mm_set1_ps(scale);
  static_assert((R * G) % 2 == 0);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int u = 0; u < 4; ++u) {
      const u16* krow = kg + slots[i + u] * D;
      if (i + u + kAhead < n) prefetch_row(kg + slots[i + u + kAhead] * D, D);
      for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(kb + u * D + d, load8(krow + d));
    }
    for (int p = 0; p < R * G; p += 2) {
      const float* q = qf + p * D;
      __m256 a[2][4];
      for (int x = 0; x < 2; ++x) for (int u = 0; u < 4; ++u) a[x][u] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 q0 = _mm256_loadu_ps(q + d), q1 = _mm256_loadu_ps(q + D + d);
        for (int u = 0; u < 4; ++u) {
          const __m256 k = _mm256_load_ps(kb + u * D + d);
          a[0][u] = _mm256_fmadd_ps(q0, k, a[0][u]);
          a[1][u] = _mm256_fmadd_ps(q1, k, a[1][u]);
        }
      }
      _mm_storeu_ps(scores + p * n + i, _mm_mul_ps(hsum8x4(a[0][0], a[0][1], a[0][2], a[0][3]), sc4));
      _mm_storeu_ps(scores + (p + 1) * n + i, _mm_mul_ps(hsum8x4(a[1][0], a[1][1], a[1][2], a[1][3]), sc4));
    }
  }
  for (; i < n; ++i) {
    const u16* krow = kg + slots[i] * D;
    __m256 a[R][G];
    for (int r = 0; r < R; ++r) for (int j = 0; j < G; ++j) a[r][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 k8 = load8(krow + d);
      for (int r = 0; r < R; ++r) for (int j = 0; j < G; ++j)
        a[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + (r * G + j) * D + d), k8, a[r][j]);
    }
    for (int r = 0; r < R; ++r) for (int j = 0; j < G; ++j) scores[(r * G + j) * n + i] = hsum8(a[r][j]) * scale;
  }
}

// T5: as T4 with P pairs at once
template <int G, int R, int P>
__attribute__((noinline)) void t5(const float* qf, const u16* kg, const int64_t* slots, int64_t n, int64_t D, float scale, float* scores) {
  alignas(64) float kb[4 * 256];
  const __m128 sc4 = _mm_set1_ps(scale);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int u = 0; u < 4; ++u) {
      const u16* krow = kg + slots[i + u] * D;
      if (i + u + kAhead < n) prefetch_row(kg + slots[i + u + kAhead] * D, D);
      for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(kb + u * D + d, load8(krow + d));
    }
    int p = 0;
    for (; p + P <= R * G; p += P) {
      const float* q = qf + p * D;
      __m256 a[P][4];
      for (int x = 0; x < P; ++x) for (int u = 0; u < 4; ++u) a[x][u] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        __m256 qv[P];
        for (int x = 0; x < P; ++x) qv[x] = _mm256_loadu_ps(q + x * D + d);
        for (int u = 0; u < 4; ++u) {
          const __m256 k = _mm256_load_ps(kb + u * D + d);
          for (int x = 0; x < P; ++x) a[x][u] = _mm256_fmadd_ps(qv[x], k, a[x][u]);
        }
      }
      for (int x = 0; x < P; ++x)
        _mm_storeu_ps(scores + (p + x) * n + i, _mm_mul_ps(hsum8x4(a[x][0], a[x][1], a[x][2], a[x][3]), sc4));
    }
    for (; p < R * G; ++p) {
      const float* q = qf + p * D;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_load_ps(kb + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_load_ps(kb + D + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_load_ps(kb + 2 * D + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_load_ps(kb + 3 * D + d), a3);
      }
      _mm_storeu_ps(scores + p * n + i, _mm_mul_ps(hsum8x4(a0, a1, a2, a3), sc4));
    }
  }
  for (; i < n; ++i) {
    const u16* krow = kg + slots[i] * D;
    __m256 a[R][G];
    for (int r = 0; r < R; ++r) for (int j = 0; j < G; ++j) a[r][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 k8 = load8(krow + d);
      for (int r = 0; r < R; ++r) for (int j = 0; j < G; ++j)
        a[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + (r * G + j) * D + d), k8, a[r][j]);
    }
    for (int r = 0; r < R; ++r) for (int j = 0; j < G; ++j) scores[(r * G + j) * n + i] = hsum8(a[r][j]) * scale;
  }
}
int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? atoll(argv[1]) : 1600, D = argc > 2 ? atoll(argv[2]) : 64;
  const int reps = 300; constexpr int G = GG, R = RR;
  const int64_t bs = 16, nb = (n + bs - 1) / bs, S = nb * bs;
  std::mt19937 rng(1);
  std::vector<int64_t> perm(nb); for (int64_t i = 0; i < nb; ++i) perm[i] = i; std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<u16> K(S * D); std::uniform_real_distribution<float> U(-1, 1);
  for (auto& x : K) x = _cvtss_sh(U(rng), 0);
  std::vector<int64_t> slots(n); for (int64_t t = 0; t < n; ++t) slots[t] = perm[t / bs] * bs + t % bs;
  std::vector<float> q(R * G * D); for (auto& x : q) x = U(rng);
  std::vector<float> ref(R * G * n), out(R * G * n);
  t1<G, R>(q.data(), K.data(), slots.data(), n, D, 0.125f, ref.data());
  auto bench = [&](const char* name, auto fn) {
    double best = 1e30;
    for (int round = 0; round < 5; ++round) {
      auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r) fn(out.data());
      auto t1_ = std::chrono::steady_clock::now();
      best = std::min(best, std::chrono::duration<double, std::nano>(t1_ - t0).count() / reps / n);
    }
    fn(out.data());
    printf("  %-6s %6.2f ns/key (%d rows x %d heads) same=%d\n", name, best, R, G, (int)(memcmp(out.data(), ref.data(), ref.size() * 4) == 0));
  };
  bench("t1", [&](float* o) { t1<G, R>(q.data(), K.data(), slots.data(), n, D, 0.125f, o); });
  bench("t3", [&](float* o) { t3<G, R>(q.data(), K.data(), slots.data(), n, D, 0.125f, o); });
  bench("t5p3", [&](float* o) { t5<G, R, 3>(q.data(), K.data(), slots.data(), n, D, 0.125f, o); });
  bench("t5p4", [&](float* o) { t5<G, R, 4>(q.data(), K.data(), slots.data(), n, D, 0.125f, o); });
  bench("t5p6", [&](float* o) { t5<G, R, 6>(q.data(), K.data(), slots.data(), n, D, 0.125f, o); });
  bench("t4", [&](float* o) { t4<G, R>(q.data(), K.data(), slots.data(), n, D, 0.125f, o); });
}
