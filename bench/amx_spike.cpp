// A measurement, not part of Convoy: how fast AMX would run Convoy's many-row quantized linears
// if they kept today's numerics. Per 32-block, TDPBSUD takes the int8 activations (s8, straight
// from the ActBlocks: A, 16 rows) and 16 output columns of 4-bit weights unpacked to u8 from two
// panels (B: the panel layout is already AMX's), two blocks in flight; each block's 16 x 16 exact
// integer dots then go through today's fp32 steps (acc = fma(d * dx, dot, acc), acc -= m * s).
// One thread, a 3072 x 3072 linear, M activation rows; prints GMAC/s.
//
//   c++ -O2 -march=native -mamx-tile -mamx-int8 bench/amx_spike.cpp -o /tmp/amx_spike
//   /tmp/amx_spike 64        # weights unpacked per 16-row tile
//   /tmp/amx_spike 64 once   # unpacked once per panel pair for all row tiles
//
// Measured 2026-12-06 on a 2-core Xeon VM with AMX (one thread): 16 rows 172 GMAC/s, 64 rows 164,
// 128 rows 169-184, against Convoy's zmm tiles on a 3B Q4_K_M o_proj at one thread 130 / 146 /
// 149 (one block in flight: 144 / 156 / 184): 1.1-1.3x. The per-block fp32 steps (~5 zmm ops
// per 16 outputs, a tile store and reload) bound it, not the multiply-adds: AMX pays only with
// integer sums across blocks (one scale per superblock, as llama.cpp's Q8_K activations), which
// would change the bits of every path.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
struct TileCfg { uint8_t palette, start_row, rsv[14]; uint16_t colsb[16]; uint8_t rows[16]; };
struct ActBlock { int8_t q[32]; float d, s; int32_t sa, sb; float s0, s1; };
int main(int argc, char** argv) {
  const int M = atoi(argv[1]), K = 3072, nb = K / 32, N = 3072, G2 = N / 16;
  const bool shared_unpack = argc > 2;
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { puts("no AMX permission"); return 1; }
  TileCfg cfg{}; cfg.palette = 1;
  cfg.rows[0] = 16; cfg.colsb[0] = 64; cfg.rows[1] = 16; cfg.colsb[1] = 32; cfg.rows[2] = 8; cfg.colsb[2] = 64;
  cfg.rows[3] = 16; cfg.colsb[3] = 64; cfg.rows[4] = 16; cfg.colsb[4] = 32; cfg.rows[5] = 8; cfg.colsb[5] = 64;
  _tile_loadconfig(&cfg);
  std::vector<uint8_t> w((size_t)G2 * 2 * nb * 128); for (auto& v : w) v = rand();
  std::vector<float> sc((size_t)G2 * nb * 32); for (auto& v : sc) v = 0.001f * (rand() % 100);
  std::vector<ActBlock> xq((size_t)M * nb); for (auto& a : xq) { for (auto& q : a.q) q = rand(); a.d = 0.01f; a.s = 0.5f; }
  std::vector<float> out((size_t)M * N);
  std::vector<uint8_t> unpacked((size_t)nb * 512 + 1024);
  alignas(64) int32_t cbuf[256];
  const __m512i low = _mm512_set1_epi8(0x0F);
  auto unpack = [&](const uint8_t* p0, const uint8_t* p1, int b, uint8_t* dst) {
    for (int j = 0; j < 4; ++j) {
      __m512i raw = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(p0 + b * 128 + 32 * j))),
                                       _mm256_loadu_si256((const __m256i*)(p1 + b * 128 + 32 * j)), 1);
      _mm512_storeu_si512(dst + 64 * j, _mm512_and_si512(raw, low));
      _mm512_storeu_si512(dst + 64 * (4 + j), _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
    }
  };
  auto run = [&] {
    for (int g = 0; g < G2; ++g) {
      const uint8_t* p0 = &w[(size_t)g * 2 * nb * 128]; const uint8_t* p1 = p0 + nb * 128;
      const float* s = &sc[(size_t)g * nb * 32];
      if (shared_unpack) for (int b = 0; b < nb; ++b) unpack(p0, p1, b, &unpacked[b * 512]);
      for (int m0 = 0; m0 < M; m0 += 16) {
        __m512 acc[16]; for (auto& a : acc) a = _mm512_setzero_ps();
        alignas(64) int32_t cb2[2][256];
        auto epi = [&](int b, const int32_t* cb) {
          const __m512 d = _mm512_loadu_ps(s + 32 * b), m = _mm512_loadu_ps(s + 32 * b + 16);
          for (int r = 0; r < 16; ++r) {
            const ActBlock& a = xq[(size_t)(m0 + r) * nb + b];
            const __m512 c = _mm512_cvtepi32_ps(_mm512_load_si512(cb + 16 * r));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(a.d)), c, acc[r]);
            acc[r] = _mm512_fnmadd_ps(m, _mm512_set1_ps(a.s), acc[r]);
          }
        };
        for (int b = 0; b < nb; b += 2) {  // two blocks in flight: C tiles 0 and 3
          uint8_t* b0 = &unpacked[shared_unpack ? b * 512 : 0];
          uint8_t* b1 = &unpacked[shared_unpack ? (b + 1) * 512 : 512];
          if (!shared_unpack) { unpack(p0, p1, b, b0); unpack(p0, p1, b + 1, b1); }
          _tile_zero(0); _tile_zero(3);
          _tile_loadd(1, xq[(size_t)m0 * nb + b].q, nb * sizeof(ActBlock));
          _tile_loadd(2, b0, 64);
          _tile_loadd(4, xq[(size_t)m0 * nb + b + 1].q, nb * sizeof(ActBlock));
          _tile_loadd(5, b1, 64);
          _tile_dpbsud(0, 1, 2);
          _tile_dpbsud(3, 4, 5);
          _tile_stored(0, cb2[0], 64);
          _tile_stored(3, cb2[1], 64);
          epi(b, cb2[0]);
          epi(b + 1, cb2[1]);
        }
        for (int r = 0; r < 16; ++r) _mm512_storeu_ps(&out[(size_t)(m0 + r) * N + g * 16], acc[r]);
      }
    }
  };
  run();
  double best = 1e9;
  for (int it = 0; it < 7; ++it) {
    auto t0 = std::chrono::steady_clock::now(); run();
    double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (t < best) best = t;
  }
  printf("M=%d %s: %.3f ms, %.1f GMAC/s one thread (out %f)\n", M, shared_unpack ? "unpack once" : "unpack per tile", best * 1e3, (double)M * K * N / best / 1e9, out[5]);
  _tile_release();
}
