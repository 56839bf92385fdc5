// A measurement, not part of Convoy: the loops of decode attention's scores (q . k over the keys
// of one KV head, G query heads) and weighted sums (sum of p * v), taken out of
// csrc/paged_attention.cpp and timed alone, one thread, in variants that give the same bits.
// An fp16 cache of `items` (sequence, KV head) pairs of n keys each, in blocks of 16 scattered
// over the pool; each call takes the next pair, so with many items the keys come from memory.
//
//   c++ -O3 -march=native -DGG=3 bench/attention_micro.cpp -o /tmp/attention_micro
//   /tmp/attention_micro N ITEMS REPS [AHEAD [D]]
//   /tmp/attention_micro 1000 192 192          # SmolLM2's heads, 49.5 MB of K/V: from memory
//   /tmp/attention_micro 1600 1 300            # one sequence, in cache (a draft's rows)
//   (-DGG=4 and D 256: Gemma 3's heads; -mavx2 -mfma -mf16c for the AVX2 build)
//
// Prints ns a key per variant (best of 5 rounds) and whether it gives the reference's bits.
// Variants: qk v0 (one key at a time, a reduction per key: the kernel before 2026-12-07), v2 (8
// keys' sums reduced together), v3 nk4 / nk8 (keys 4 or 8 at a time, d inside: the kernel since),
// z (zmm, two keys a register); pv v0 (16 dims a pass for G = 3), ch4 / ch8 (32 / 64 dims a pass),
// z (zmm). Measured 2026-12-07, 2-core Xeon VM (AVX-512), one thread, 1000 keys x 192 items:
// qk v0 13.6-16.8 ns, v3 nk4 11.0-11.2; pv v0 10.4-14.6, ch8 8.0-10.1 (AVX2 build: qk 14.8-18.1
// -> 12.1-12.5, pv 14.1-18.6 -> 10.9-12.7); in cache (1600 keys, one item) qk 7.7 -> 5.7, pv
// 6.3 -> 5.2. Every variant the same bits.
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
static inline __m256 load8(const u16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
static int64_t kAhead = 16;
static inline void prefetch_row(const u16* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t o = 0; o < D * 2; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}

template <int G>
__attribute__((noinline)) void qk_v0(const float* qf, const u16* kg, const int64_t* slots, int64_t n,
                                     int64_t D, float scale, float* scores) {
  for (int64_t i = 0; i < n; ++i) {
    const u16* krow = kg + slots[i] * D;
    if (i + kAhead < n) prefetch_row(kg + slots[i + kAhead] * D, D);
    __m256 a[G];
    for (int j = 0; j < G; ++j) a[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 k8 = load8(krow + d);
      for (int j = 0; j < G; ++j) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + j * D + d), k8, a[j]);
    }
    for (int j = 0; j < G; ++j) scores[j * n + i] = hsum8(a[j]) * scale;
  }
}

// 8 keys' accumulators of one head reduced together, in hsum8's order per key.
static inline __m256 hsum8x8(const __m256* a) {
  // step 1: lo + hi of each
  __m256 s[4];
  for (int p = 0; p < 4; ++p) {
    const __m256 x = a[2 * p], y = a[2 * p + 1];
    s[p] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
    // s[p] = [x0+x4 x1+x5 x2+x6 x3+x7 | y0+y4 ...]
  }
  // step 2: (e0+e2, e1+e3) for each 4-group
  __m256 t[2];
  for (int p = 0; p < 2; ++p) {
    const __m256 x = s[2 * p], y = s[2 * p + 1];
    // hsum8: x0 + x2 (movehl puts x2 at 0) -> add(x, movehl) = x0+x2, x1+x3
    const __m256 lo = _mm256_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0));  // x0 x1 y0 y1 | ...
    const __m256 hi = _mm256_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2));  // x2 x3 y2 y3
    t[p] = _mm256_add_ps(lo, hi);  // [A0 A1 C0 C1 | B0 B1 D0 D1] for keys (a=2p*2.., )
  }
  // step 3: e0 + e1
  const __m256 lo = _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0));
  const __m256 hi = _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1));
  const __m256 r = _mm256_add_ps(lo, hi);
  // key order: t[0] lanes: [k0 k0 k2 k2 | k1 k1 k3 k3] (s[0]=k0|k1, s[1]=k2|k3)
  // r lanes: [k0 k2 k4 k6 | k1 k3 k5 k7]
  return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

template <int G>
__attribute__((noinline)) void qk_v2(const float* qf, const u16* kg, const int64_t* slots, int64_t n,
                                     int64_t D, float scale, float* scores) {
  const __m256 sc = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 a[G][8];
    for (int u = 0; u < 8; ++u) {
      const u16* krow = kg + slots[i + u] * D;
      if (i + u + kAhead < n) prefetch_row(kg + slots[i + u + kAhead] * D, D);
      for (int j = 0; j < G; ++j) a[j][u] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 k8 = load8(krow + d);
        for (int j = 0; j < G; ++j) a[j][u] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + j * D + d), k8, a[j][u]);
      }
    }
    for (int j = 0; j < G; ++j) _mm256_storeu_ps(scores + j * n + i, _mm256_mul_ps(hsum8x8(a[j]), sc));
  }
  for (; i < n; ++i) {
    const u16* krow = kg + slots[i] * D;
    __m256 a[G];
    for (int j = 0; j < G; ++j) a[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 k8 = load8(krow + d);
      for (int j = 0; j < G; ++j) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + j * D + d), k8, a[j]);
    }
    for (int j = 0; j < G; ++j) scores[j * n + i] = hsum8(a[j]) * scale;
  }
}


// 4 keys' accumulators of one head reduced together, hsum8's order per key; 4 results.
static inline __m128 hsum8x4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s0 = _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20), _mm256_permute2f128_ps(a0, a1, 0x31));
  const __m256 s1 = _mm256_add_ps(_mm256_permute2f128_ps(a2, a3, 0x20), _mm256_permute2f128_ps(a2, a3, 0x31));
  const __m256 t = _mm256_add_ps(_mm256_shuffle_ps(s0, s1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(s0, s1, _MM_SHUFFLE(3, 2, 3, 2)));
  // t = [a0' a0'' a2' a2'' | a1' a1'' a3' a3'']
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(t, t, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(t, t, _MM_SHUFFLE(3, 1, 3, 1)));
  // r = [k0 k2 k0 k2 | k1 k3 k1 k3]
  const __m128 lo = _mm256_castps256_ps128(r), hi = _mm256_extractf128_ps(r, 1);
  return _mm_unpacklo_ps(lo, hi);  // k0 k1 k2 k3
}

// keys in groups of NK (4 or 8), d outermost inside a group: q chunks loaded once a group.
template <int G, int NK>
__attribute__((noinline)) void qk_v3(const float* qf, const u16* kg, const int64_t* slots, int64_t n,
                                     int64_t D, float scale, float* scores) {
  const __m256 sc = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + NK <= n; i += NK) {
    const u16* kr[NK];
    for (int u = 0; u < NK; ++u) {
      kr[u] = kg + slots[i + u] * D;
      if (i + u + kAhead < n) prefetch_row(kg + slots[i + u + kAhead] * D, D);
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
    for (int j = 0; j < G; ++j) {
      if constexpr (NK == 8) {
        _mm256_storeu_ps(scores + j * n + i, _mm256_mul_ps(hsum8x8(a[j]), sc));
      } else {
        _mm_storeu_ps(scores + j * n + i, _mm_mul_ps(hsum8x4(a[j][0], a[j][1], a[j][2], a[j][3]), _mm256_castps256_ps128(sc)));
      }
    }
  }
  for (; i < n; ++i) {
    const u16* krow = kg + slots[i] * D;
    __m256 a[G];
    for (int j = 0; j < G; ++j) a[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 k8 = load8(krow + d);
      for (int j = 0; j < G; ++j) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + j * D + d), k8, a[j]);
    }
    for (int j = 0; j < G; ++j) scores[j * n + i] = hsum8(a[j]) * scale;
  }
}

#ifdef __AVX512F__
// PV in zmm: 16 dims a register, all of D in one pass (D=64: 4 x G accumulators).
template <int G>
__attribute__((noinline)) void pv_z(const float* scores, const u16* vg, const int64_t* slots, int64_t n, int64_t D, float* acc) {
  constexpr int CH = G <= 4 ? 4 : 2;
  for (int64_t c = 0; c < D; c += 16 * CH) {
  __m512 a[G][CH];
  for (int j = 0; j < G; ++j)
    for (int u = 0; u < CH; ++u) a[j][u] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const u16* vrow = vg + slots[i] * D + c;
    if (c == 0 && i + kAhead < n) prefetch_row(vg + slots[i + kAhead] * D, D);
    __m512 v[CH];
    for (int u = 0; u < CH; ++u) v[u] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow + 16 * u)));
    for (int j = 0; j < G; ++j) {
      const __m512 p = _mm512_set1_ps(scores[j * n + i]);
      for (int u = 0; u < CH; ++u) a[j][u] = _mm512_fmadd_ps(p, v[u], a[j][u]);
    }
  }
  for (int j = 0; j < G; ++j)
    for (int u = 0; u < CH; ++u) _mm512_storeu_ps(acc + j * D + c + 16 * u, a[j][u]);
  }
}
// QK in zmm: lanes 0-7 one key, 8-15 the next; 8 keys a group (4 zmm x G accumulators).
template <int G>
__attribute__((noinline)) void qk_z(const float* qf, const u16* kg, const int64_t* slots, int64_t n,
                                     int64_t D, float scale, float* scores) {
  const __m256 sc = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const u16* kr[8];
    for (int u = 0; u < 8; ++u) {
      kr[u] = kg + slots[i + u] * D;
      if (i + u + kAhead < n) prefetch_row(kg + slots[i + u + kAhead] * D, D);
    }
    __m512 a[G][4];
    for (int j = 0; j < G; ++j)
      for (int u = 0; u < 4; ++u) a[j][u] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      __m512 qv[G];
      for (int j = 0; j < G; ++j) qv[j] = _mm512_broadcast_f32x8(_mm256_loadu_ps(qf + j * D + d));
      for (int u = 0; u < 4; ++u) {
        const __m256i h = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kr[2 * u] + d))),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(kr[2 * u + 1] + d)), 1);
        const __m512 k16 = _mm512_cvtph_ps(h);
        for (int j = 0; j < G; ++j) a[j][u] = _mm512_fmadd_ps(qv[j], k16, a[j][u]);
      }
    }
    for (int j = 0; j < G; ++j) {
      __m256 x[8];
      for (int u = 0; u < 4; ++u) {
        x[2 * u] = _mm512_castps512_ps256(a[j][u]);
        x[2 * u + 1] = _mm512_extractf32x8_ps(a[j][u], 1);
      }
      _mm256_storeu_ps(scores + j * n + i, _mm256_mul_ps(hsum8x8(x), sc));
    }
  }
  for (; i < n; ++i) {
    const u16* krow = kg + slots[i] * D;
    __m256 a[G];
    for (int j = 0; j < G; ++j) a[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 k8 = load8(krow + d);
      for (int j = 0; j < G; ++j) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + j * D + d), k8, a[j]);
    }
    for (int j = 0; j < G; ++j) scores[j * n + i] = hsum8(a[j]) * scale;
  }
}
#endif

template <int G, int CH>
void pv_chunks(const float* scores, const u16* vg, const int64_t* slots, int64_t n, int64_t D,
               int64_t c, float* acc) {
  __m256 a[G][CH];
  for (int j = 0; j < G; ++j)
    for (int u = 0; u < CH; ++u) a[j][u] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const u16* vrow = vg + slots[i] * D + c;
    if (c == 0 && i + kAhead < n) prefetch_row(vg + slots[i + kAhead] * D, D);
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
template <int G>
__attribute__((noinline)) void pv_v0(const float* scores, const u16* vg, const int64_t* slots, int64_t n, int64_t D, float* acc) {
  constexpr int CH = G <= 2 ? 4 : G <= 4 ? 2 : 1;
  int64_t c = 0;
  for (; c + 8 * CH <= D; c += 8 * CH) pv_chunks<G, CH>(scores, vg, slots, n, D, c, acc);
}
// all of D at once (D=64: 8 chunks x G=3 = 24 accumulators: needs 32 registers)
template <int G, int CH>
__attribute__((noinline)) void pv_v1(const float* scores, const u16* vg, const int64_t* slots, int64_t n, int64_t D, float* acc) {
  for (int64_t c = 0; c < D; c += 8 * CH) pv_chunks<G, CH>(scores, vg, slots, n, D, c, acc);
}


#ifndef GG
#define GG 3
#endif
#include <functional>
#include <string>
int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? atoll(argv[1]) : 1000;
  const int64_t items = argc > 2 ? atoll(argv[2]) : 1;
  const int reps = argc > 3 ? atoi(argv[3]) : 200;
  if (argc > 4) kAhead = atoll(argv[4]);
  const int64_t D = argc > 5 ? atoll(argv[5]) : 64, G = GG, bs = 16;
  const int64_t nb = (n + bs - 1) / bs;
  std::mt19937 rng(1);
  std::vector<int64_t> perm(nb * items);
  for (int64_t i = 0; i < (int64_t)perm.size(); ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  const int64_t S = nb * items * bs;
  std::vector<u16> K(S * D), V(S * D);
  std::uniform_real_distribution<float> U(-1, 1);
  for (auto& x : K) x = _cvtss_sh(U(rng), 0);
  for (auto& x : V) x = _cvtss_sh(U(rng), 0);
  std::vector<std::vector<int64_t>> slots(items, std::vector<int64_t>(n));
  for (int64_t it = 0; it < items; ++it)
    for (int64_t t = 0; t < n; ++t) slots[it][t] = perm[it * nb + t / bs] * bs + t % bs;
  std::vector<float> q(G * D), sc(G * n);
  for (auto& x : q) x = U(rng);
  for (auto& x : sc) x = U(rng) * 0.01f;
  struct Var { std::string name; bool qk; std::function<void(int, float*)> fn; double best = 1e30; };
  std::vector<Var> vs;
  static int64_t ctr = 0;
  auto S_ = [&](int) { return slots[(ctr++) % items].data(); };
  vs.push_back({"qk v0", true, [&](int r, float* o) { qk_v0<GG>(q.data(), K.data(), S_(r), n, D, 0.125f, o); }});
  vs.push_back({"qk v2 8red", true, [&](int r, float* o) { qk_v2<GG>(q.data(), K.data(), S_(r), n, D, 0.125f, o); }});
  vs.push_back({"qk v3 nk4", true, [&](int r, float* o) { qk_v3<GG, 4>(q.data(), K.data(), S_(r), n, D, 0.125f, o); }});
  vs.push_back({"qk v3 nk8", true, [&](int r, float* o) { qk_v3<GG, 8>(q.data(), K.data(), S_(r), n, D, 0.125f, o); }});
#ifdef __AVX512F__
  vs.push_back({"qk z", true, [&](int r, float* o) { qk_z<GG>(q.data(), K.data(), S_(r), n, D, 0.125f, o); }});
  vs.push_back({"pv z", false, [&](int r, float* o) { pv_z<GG>(sc.data(), V.data(), S_(r), n, D, o); }});
#endif
  vs.push_back({"pv v0", false, [&](int r, float* o) { pv_v0<GG>(sc.data(), V.data(), S_(r), n, D, o); }});
  vs.push_back({"pv ch4", false, [&](int r, float* o) { pv_v1<GG, 4>(sc.data(), V.data(), S_(r), n, D, o); }});
  vs.push_back({"pv ch8", false, [&](int r, float* o) { pv_v1<GG, 8>(sc.data(), V.data(), S_(r), n, D, o); }});
  std::vector<float> ref_qk(G * n), ref_pv(G * D), out(G * n);
  qk_v0<GG>(q.data(), K.data(), slots[0].data(), n, D, 0.125f, ref_qk.data());
  pv_v0<GG>(sc.data(), V.data(), slots[0].data(), n, D, ref_pv.data());
  for (int round = 0; round < 5; ++round)
    for (auto& v : vs) {
      auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r) v.fn(r, out.data());
      auto t1 = std::chrono::steady_clock::now();
      v.best = std::min(v.best, std::chrono::duration<double, std::nano>(t1 - t0).count() / reps / n);
    }
  printf("n=%ld items=%ld (%.1f MB K+V) ahead=%ld\n", n, items, 2.0 * S * D * 2 / 1e6, kAhead);
  for (auto& v : vs) {
    ctr = 0;
    v.fn(0, out.data());
    bool same = v.qk ? memcmp(out.data(), ref_qk.data(), ref_qk.size() * 4) == 0
                     : memcmp(out.data(), ref_pv.data(), ref_pv.size() * 4) == 0;
    printf("  %-12s %6.2f ns/key same=%d\n", v.name.c_str(), v.best, (int)same);
  }
}
