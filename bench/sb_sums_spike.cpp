// A measurement, not part of Convoy: how much faster the AVX2 4-bit tile would run with integer
// sums across a superblock (activations with one scale per 256, as llama.cpp's Q8_K), against
// today's per-32-block float steps. Both on the same Q4_K-like panels (8 weight rows a panel,
// 32-byte loads of nibbles laid out as quant_linear.cpp's), a tile of 4 activation rows x 1
// panel, block scales already expanded (as quant_linear.cpp's pass does from 32 rows):
//   today:  per block and row, 8 maddubs into int16, then madd(ones), cvt, d * dx, fma, and the
//           offset's fnmadd (acc = fma(d * dx, dot, acc); acc = fnmadd(m, s, acc))
//   sums:   per block and row, the same 8 maddubs, then madd(the rows' 6-bit sub-block scales)
//           and an int32 add; per superblock the offsets as int16 mins x the activations' block
//           sums (4 madd), then cvt and two fmas
// One thread, M activation rows (a multiple of 4), a K x N linear; prints GMAC/s of each and
// each one's mean relative error against the fp32 product of the same weights (sampled outputs).
// -O3 as Convoy's build: at -O2 GCC keeps the tile's vectors on the stack (both ~42 GMAC/s).
//
//   c++ -O3 -mavx2 -mfma -mf16c bench/sb_sums_spike.cpp -o /tmp/sb_sums_spike
//   /tmp/sb_sums_spike 16 && /tmp/sb_sums_spike 64
//
// Measured 2026-12-07 on a 2-core Xeon VM (AVX2 code, one thread): 16 rows 1.00-1.04x, 64 rows
// 1.04-1.11x; figures in bench/README.md ("What one activation scale per 256 would cost").
#include <immintrin.h>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

constexpr int K = 3072, N = 3072, NB = K / 32, NS = K / 256, G = N / 8, MR = 4;

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

int main(int argc, char** argv) {
  const int M = argc > 1 ? atoi(argv[1]) : 16;
  srand(1);
  // weights: nibbles (G, NB, 128 bytes), sub-block scales / mins 0..63 (G, NB, 8 rows), d / dmin
  std::vector<uint8_t> w((size_t)G * NB * 128);
  for (auto& v : w) v = rand();
  std::vector<uint8_t> sc((size_t)G * NB * 8), mn((size_t)G * NB * 8);
  for (auto& v : sc) v = rand() % 64;
  for (auto& v : mn) v = rand() % 64;
  std::vector<float> dsb((size_t)G * NS * 8), msb((size_t)G * NS * 8);
  for (auto& v : dsb) v = 1e-3f * (1 + rand() % 100);
  for (auto& v : msb) v = 1e-3f * (1 + rand() % 100);
  // today's expanded block scales (d * sc, dmin * mn: exact in fp32), per block 8 + 8 floats
  std::vector<float> fsc((size_t)G * NB * 16);
  // superblock sums' int16 pairs: per block, each row's sc in both halves of its lane; per
  // superblock 4 vectors of (mn[2k], mn[2k + 1]) pairs per row lane
  std::vector<int16_t> sc16((size_t)G * NB * 16), mn16((size_t)G * NS * 4 * 16);
  for (int g = 0; g < G; ++g)
    for (int b = 0; b < NB; ++b) {
      int16_t* s16 = &sc16[((size_t)g * NB + b) * 16];
      for (int r = 0; r < 8; ++r) {
        const size_t i = ((size_t)g * NB + b) * 8 + r, sb = ((size_t)g * NS + b / 8) * 8 + r;
        fsc[((size_t)g * NB + b) * 16 + r] = dsb[sb] * sc[i];
        fsc[((size_t)g * NB + b) * 16 + 8 + r] = msb[sb] * mn[i];
        s16[2 * r] = s16[2 * r + 1] = sc[i];
      }
    }
  for (int g = 0; g < G; ++g)
    for (int s = 0; s < NS; ++s)
      for (int k = 0; k < 4; ++k) {
        int16_t* m16 = &mn16[(((size_t)g * NS + s) * 4 + k) * 16];
        for (int r = 0; r < 8; ++r)
          for (int h = 0; h < 2; ++h) m16[2 * r + h] = mn[((size_t)g * NB + 8 * s + 2 * k + h) * 8 + r];
      }
  // activations: fp32 rows, quantized per 32 (today) and per 256 (sums)
  std::vector<float> x((size_t)M * K);
  for (auto& v : x) v = (rand() % 2001 - 1000) * 1e-3f * (rand() % 8 == 0 ? 8 : 1);
  std::vector<int8_t> q32((size_t)M * K), q256((size_t)M * K);
  std::vector<float> d32((size_t)M * NB), s32((size_t)M * NB), d256((size_t)M * NS);
  std::vector<int16_t> bs256((size_t)M * NB);
  for (int m = 0; m < M; ++m) {
    for (int b = 0; b < NB; ++b) {
      float amax = 0;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[(size_t)m * K + 32 * b + j]));
      const float d = amax / 127, id = d > 0 ? 1 / d : 0;
      int sum = 0;
      for (int j = 0; j < 32; ++j) sum += q32[(size_t)m * K + 32 * b + j] = std::nearbyint(x[(size_t)m * K + 32 * b + j] * id);
      d32[(size_t)m * NB + b] = d;
      s32[(size_t)m * NB + b] = d * sum;
    }
    for (int s = 0; s < NS; ++s) {
      float amax = 0;
      for (int j = 0; j < 256; ++j) amax = std::max(amax, std::fabs(x[(size_t)m * K + 256 * s + j]));
      const float d = amax / 127, id = d > 0 ? 1 / d : 0;
      d256[(size_t)m * NS + s] = d;
      for (int b = 0; b < 8; ++b) {
        int sum = 0;
        for (int j = 0; j < 32; ++j) {
          const size_t i = (size_t)m * K + 256 * s + 32 * b + j;
          sum += q256[i] = std::nearbyint(x[i] * id);
        }
        bs256[(size_t)m * NB + 8 * s + b] = sum;
      }
    }
  }
  std::vector<float> out_a((size_t)M * N), out_b((size_t)M * N);
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);

  // one block's int16 pair sums of a 4-row tile (the same in both): 8 maddubs a row, in order
  auto block_dots = [&](const uint8_t* pw, int b, const std::vector<int8_t>& q, int m0, __m256i* is) {
    for (int i = 0; i < MR; ++i) is[i] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pw + 128 * b + 32 * j));
      const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
      for (int i = 0; i < MR; ++i) {
        const int8_t* xq = &q[(size_t)(m0 + i) * K + 32 * b];
        is[i] = _mm256_add_epi16(is[i], _mm256_maddubs_epi16(lo, bcast4(xq + 4 * j)));
        is[i] = _mm256_add_epi16(is[i], _mm256_maddubs_epi16(hi, bcast4(xq + 16 + 4 * j)));
      }
    }
  };

  auto today = [&] {
    for (int g = 0; g < G; ++g) {
      const uint8_t* pw = &w[(size_t)g * NB * 128];
      const float* fs = &fsc[(size_t)g * NB * 16];
      for (int m0 = 0; m0 < M; m0 += MR) {
        __m256 acc[MR];
        for (auto& a : acc) a = _mm256_setzero_ps();
        for (int b = 0; b < NB; ++b) {
          __m256i is[MR];
          block_dots(pw, b, q32, m0, is);
          const __m256 d = _mm256_loadu_ps(fs + 16 * b), mv = _mm256_loadu_ps(fs + 16 * b + 8);
          for (int i = 0; i < MR; ++i) {
            const size_t a = (size_t)(m0 + i) * NB + b;
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(is[i], ones));
            acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(d32[a])), dot, acc[i]);
            acc[i] = _mm256_fnmadd_ps(mv, _mm256_set1_ps(s32[a]), acc[i]);
          }
        }
        for (int i = 0; i < MR; ++i) _mm256_storeu_ps(&out_a[(size_t)(m0 + i) * N + 8 * g], acc[i]);
      }
    }
  };

  auto sums = [&] {
    for (int g = 0; g < G; ++g) {
      const uint8_t* pw = &w[(size_t)g * NB * 128];
      for (int m0 = 0; m0 < M; m0 += MR) {
        __m256 acc[MR];
        for (auto& a : acc) a = _mm256_setzero_ps();
        for (int s = 0; s < NS; ++s) {
          __m256i isb[MR];
          for (auto& v : isb) v = _mm256_setzero_si256();
          for (int b = 8 * s; b < 8 * s + 8; ++b) {
            __m256i is[MR];
            block_dots(pw, b, q256, m0, is);
            const __m256i scv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&sc16[((size_t)g * NB + b) * 16]));
            for (int i = 0; i < MR; ++i) isb[i] = _mm256_add_epi32(isb[i], _mm256_madd_epi16(is[i], scv));
          }
          const __m256 d = _mm256_loadu_ps(&dsb[((size_t)g * NS + s) * 8]);
          const __m256 dm = _mm256_loadu_ps(&msb[((size_t)g * NS + s) * 8]);
          const int16_t* mk16 = &mn16[((size_t)g * NS + s) * 64];
          __m256i mk[4];
          for (int k = 0; k < 4; ++k) mk[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mk16 + 16 * k));
          for (int i = 0; i < MR; ++i) {
            const int16_t* bs = &bs256[(size_t)(m0 + i) * NB + 8 * s];
            __m256i ms = _mm256_madd_epi16(mk[0], bcast4(reinterpret_cast<const int8_t*>(bs)));
            for (int k = 1; k < 4; ++k)
              ms = _mm256_add_epi32(ms, _mm256_madd_epi16(mk[k], bcast4(reinterpret_cast<const int8_t*>(bs + 2 * k))));
            const __m256 dx = _mm256_set1_ps(d256[(size_t)(m0 + i) * NS + s]);
            acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(isb[i]), acc[i]);
            acc[i] = _mm256_fnmadd_ps(_mm256_mul_ps(dm, dx), _mm256_cvtepi32_ps(ms), acc[i]);
          }
        }
        for (int i = 0; i < MR; ++i) _mm256_storeu_ps(&out_b[(size_t)(m0 + i) * N + 8 * g], acc[i]);
      }
    }
  };

  auto time = [&](auto&& f) {
    double best = 1e9;
    for (int t = 0; t < 7; ++t) {
      const auto t0 = std::chrono::steady_clock::now();
      f();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return (double)M * K * N / best / 1e9;
  };
  today();
  sums();
  // the same linear: both against the fp32 product of the dequantized weights
  double err_a = 0, err_b = 0, norm = 0;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; n += 97) {
      const int g = n / 8, r = n % 8;
      double ref = 0;
      for (int k = 0; k < K; ++k) {
        const int b = k / 32, j = k % 32, jj = j % 16;
        const uint8_t byte = w[((size_t)g * NB + b) * 128 + 32 * (jj / 4) + 4 * r + jj % 4];
        const int qv = j < 16 ? byte & 15 : byte >> 4;
        ref += (fsc[((size_t)g * NB + b) * 16 + r] * qv - fsc[((size_t)g * NB + b) * 16 + 8 + r]) * x[(size_t)m * K + k];
      }
      err_a += std::fabs(out_a[(size_t)m * N + n] - ref);
      err_b += std::fabs(out_b[(size_t)m * N + n] - ref);
      norm += std::fabs(ref);
    }
  const double a = time(today), b = time(sums);
  printf("M=%d K=%d N=%d, one thread: today %.1f GMAC/s, superblock sums %.1f GMAC/s (%.2fx); "
         "mean |error| against fp32, relative: today %.2e, sums %.2e\n",
         M, K, N, a, b, b / a, err_a / norm, err_b / norm);
  return 0;
}
