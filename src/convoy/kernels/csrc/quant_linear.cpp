// Linear layers on GGUF-quantized weights, kept quantized: repacked once at load into 8-row panels
// and run with int8 dot products, as llama.cpp and its faster fork do on AVX2.
//
// Repack (quant_pack). Every GGUF block type is decoded into one of four panel kinds, 32 weights a
// block, w[j] = d[j / 16] * q[j] + m (one scale for Q4 and Q8S, two for the 16-weight halves in
// Q8 and Q8M):
//   kQ4  (Q4_0, Q4_1, Q4_K):          4-bit q 0..15,     fp16 d, fp16 m          160 B / 8x32
//   kQ8S (Q8_0, Q5_0):                int8 q,            fp16 d (m = 0)          272 B / 8x32
//   kQ8  (Q6_K, or Q6_K with kQ8S):   int8 q,            fp16 d0, d1 (m = 0)     288 B / 8x32
//   kQ8M (Q5_1, Q5_K, or mixed):      int8 q,            fp16 d0, d1, fp16 m     304 B / 8x32
//   kI4  (IQ4_NL, IQ4_XS):            4-bit index into the IQ4 codebook (int8 values), fp16 d
//                                                                                144 B / 8x32
//   kQ4D (Q2_K, or Q3_K with kQ4):    4-bit q 0..15, fp16 d0, d1, fp16 m0, m1      192 B / 8x32
//   kQ5  (Q5_0, Q5_1, Q5_K, or kQ4):  5-bit q 0..31,     fp16 d, fp16 m          192 B / 8x32
//   kQ6  (Q6_K, or Q3_K with it):     6-bit q + 32,      fp16 d0, d1 (m = 0)     224 B / 8x32
//   kQ3  (Q3_K):                      3-bit q + 4,       fp16 d0, d1 (m = 0)     128 B / 8x32
//   kQ40 (Q4_0 alone):                kQ4's quants, fp16 d (m = -8 d, computed)  144 B / 8x32
//   kQ4K, kQ5K, kQ6K (Q4_K, Q5_K, Q6_K alone): kQ4's, kQ5's, kQ6's quants, the file's 8-bit
//                                     scales per block and fp16 d (dmin) per superblock, below
// (kQ4D: each 16-weight half has its own scale and offset; Q3_K's signed q -4..3 is stored as
// q + 4 with offsets -4 d.) kI4 and kQ8S types in one linear are packed as kQ8S (the codebook's
// values are int8), Q3_K with 8-bit kinds as kQ8/kQ8M (signed q, no offset); Q2_K's two offsets
// fit no 8-bit kind. Types that only an 8-bit kind holds together but that split into two runs
// each held by a narrow kind take a two-part layout instead (below: Panels).
// (kQ5, kQ6, kQ3: the quants in bit planes, so that a panel is as narrow as the file's type: the
// low 4 bits in kQ4's nibbles (kQ5, kQ6) or the low 2 in a 2-bit plane (kQ3), the rest in a 1-bit
// (kQ5, kQ3) or 2-bit (kQ6) plane, all laid out lane by lane as the nibbles; kQ6's and kQ3's
// stored quants are q + 32 and q + 4, and the integer dot takes 32 or 4 times the activations'
// sum back off, exactly: their results are kQ8's bits.)
// A panel holds 8 weight rows: for each 32-block, the quants of 8 rows interleaved so that one
// 32-byte load gives 4 consecutive quants of each row in its own 32-bit lane, then the 8 rows'
// scales (and offsets). Q4: load j (0..3) holds q[4j..4j+3] in its low nibbles and q[16+4j..] in
// its high ones; Q8: load k (0..7) holds q[4k..4k+3]. K-quant sub-block scales are multiplied out
// into fp16 (relative rounding <= 2^-11, far below the 4-6 bit quantization step).
//
// Run (quant_linear). Activations are quantized per row to int8 blocks of 32 (scale amax / 127,
// rounded to nearest even), and one weight panel block meets one activation block as 8 exact
// integer dot products (one per weight row, one per 32-bit lane: AVX2 maddubs + madd, or AVX512-VNNI
// dpbusd), then each output element accumulates in fp32, block after block, in a fixed order:
//   acc = fma(d0 * dx, dot(q[0..15]), acc); acc = fma(d1 * dx, dot(q[16..31]), acc)   (kQ8, kQ8M)
//   acc = fma(d * dx, dot(q[0..31]), acc)                                              (kQ4, kQ8S)
//   acc = fma(m, dx * sum(qx), acc)                                                    (kQ4, kQ8M)
// NOTE: batch invariance. The integer dots are exact and the float steps are the same on every
// path (scalar, AVX2, VNNI) and for any batch size, tile or thread split: threads split weight
// panels and activation rows, never the reduction. An output element is bitwise the same whatever
// else is in the batch, and the same on every x86 host.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "activation.h"
#include "ops.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CONVOY_AVX2 1
#endif
// CONVOY_DPBUSD: the integer dots are vpdpbusd (u8 x s8, four products and the sum into an int32
// lane, one instruction) on ymm: AVX-512 VNNI with VL, or AVX-VNNI (the VEX form: Intel's cores
// from Alder Lake on, which lack AVX-512, and Zen 5). CONVOY_VNNI: besides, AVX-512's 32 vector
// registers, so the tiles take two panels at once. Without DPBUSD, AVX2's maddubs + madd pairs.
// The integer sums are exact either way: every build gives the same bits.
#if defined(CONVOY_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define CONVOY_VNNI 1
#define CONVOY_DPBUSD 1
#elif defined(CONVOY_AVX2) && defined(__AVXVNNI__)
#define CONVOY_DPBUSD 1
#endif
#if defined(CONVOY_VNNI) && defined(__AVX512F__) && defined(__AVX512BW__)
#define CONVOY_ZMM 1  // many-row tiles run two panels a zmm (VZ below)
#endif

namespace {

constexpr int64_t QK = 32;  // weights per block
constexpr int64_t R = 8;    // weight rows per panel
constexpr int64_t kTileM = 64;  // activation rows per tile: their int8 blocks stay in L2
constexpr int64_t kMR = 4;      // activation rows per register tile

enum Kind : int64_t {
  kQ4 = 0, kQ8 = 1, kQ8M = 2, kQ8S = 3, kI4 = 4, kQ4D = 5, kQ5 = 6, kQ6 = 7, kQ3 = 8,
  kQ4K = 9, kQ5K = 10, kQ6K = 11, kQ40 = 12
};  // fmt: the Python side's QUANT_KIND_* (kernels/ops.py)

// Superblock-scaled kinds (kQ4K, kQ5K, kQ6K: Q4_K, Q5_K, Q6_K alone) keep the file's scales: a
// panel is a run of superblocks (8 blocks, 256 weights of 8 rows), each a 160-byte header, then
// the 8 blocks' quants laid out as the base kind's (kQ4, kQ5, kQ6) without their fp16 scales:
//   header: fp16 d[8 rows] | fp16 dmin[8] (kQ6K: zero) | u8 sc[8 blocks][8 rows] (kQ6K: int8
//           sc0) | u8 mn[8][8] (kQ6K: int8 sc1)
// So the panel is about as narrow as the file (Q4_K 4.625 bits a weight against kQ4's 5.0, Q6_K
// 6.625 against 7.0), every 32-byte load stays within a cache line, and a scale d * sc (an fp16
// times a 6- or 8-bit integer) is exact in fp32 where kQ4's fp16 d * sc rounded it.
constexpr int64_t kSuperBlocks = 8;  // 32-blocks in a K-quant superblock of 256
inline bool sb_kind(int64_t kind) { return kind == kQ4K || kind == kQ5K || kind == kQ6K; }
inline int64_t base_kind(int64_t kind) {
  return kind == kQ4K ? kQ4 : kind == kQ5K ? kQ5 : kind == kQ6K ? kQ6 : kind;
}
// kQ40: kQ4 without the stored offset, which is -8 d (exact in fp32: the same value kQ4 would
// store, as long as 8 d fits fp16)
constexpr int64_t kSbHeader = 160;  // bytes of a superblock's header
constexpr int64_t kSbScales = 32, kSbSecond = 96;  // its 8-bit scales' (and mins') offsets

// Bit-plane kinds: the bytes of each part in a panel block, and the integer offset of the stored
// quants (kQ5's offset is a float m, as kQ4's)
constexpr int64_t kNibbleBytes = 4 * 32, kPlane2Bytes = 2 * 32, kPlane1Bytes = 32;
inline bool bit_planes(int64_t kind) {
  kind = base_kind(kind);
  return kind == kQ5 || kind == kQ6 || kind == kQ3;
}
inline int plane_offset(int64_t kind) {
  kind = base_kind(kind);
  return kind == kQ6 ? 32 : kind == kQ3 ? 4 : 0;
}

// GGML type ids (gguf.GGMLQuantizationType)
constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11,
                  Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23;

// IQ4_NL / IQ4_XS's non-linear codebook (ggml-common.h kvalues_iq4nl)
alignas(16) constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};

struct TypeInfo {
  int64_t elems, bytes;  // per GGUF block
};

TypeInfo type_info(int64_t t) {
  switch (t) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0: return {32, 34};
    case Q2_K: return {256, 84};
    case Q3_K: return {256, 110};
    case IQ4_NL: return {32, 18};
    case IQ4_XS: return {256, 136};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
    default: TORCH_CHECK(false, "unsupported quantized type ", t);
  }
}

int64_t kind_block_bytes(int64_t kind) {
  switch (kind) {
    case kQ4: return 4 * 32 + 2 * 16;
    case kQ40: return 4 * 32 + 16;
    case kQ8: return 8 * 32 + 2 * 16;
    case kQ8M: return 8 * 32 + 3 * 16;
    case kQ8S: return 8 * 32 + 16;
    case kI4: return 4 * 32 + 16;
    case kQ4D: return 4 * 32 + 4 * 16;
    case kQ5: return kNibbleBytes + kPlane1Bytes + 2 * 16;
    case kQ6: return kNibbleBytes + kPlane2Bytes + 2 * 16;
    case kQ3: return kPlane2Bytes + kPlane1Bytes + 2 * 16;
    case kQ4K:
    case kQ5K:
    case kQ6K: return kind_block_bytes(base_kind(kind)) - 32;  // the quants alone
    default: TORCH_CHECK(false, "unknown panel kind ", kind);
  }
}

// The bytes of one panel (8 rows) of nb blocks
int64_t panel_bytes(int64_t kind, int64_t nb) {
  if (!sb_kind(kind)) return nb * kind_block_bytes(kind);
  TORCH_CHECK(nb % kSuperBlocks == 0, "a superblock-scaled panel needs K a multiple of 256");
  return nb / kSuperBlocks * (kSbHeader + kSuperBlocks * kind_block_bytes(kind));
}

// A two-part layout: a joined linear whose parts no narrow kind holds together (Q4_K_M's Q4_K q
// and k beside its Q6_K v: the one 8-bit kind that holds both, kQ8M, reads 9.5 bits a weight)
// keeps each part's own kind: panels [0, split) of kind a, then panels of kind b, each part's
// panels back to back in one 1-D run of bytes (padding the narrower part's panels to one stride
// cost its reads half again: the gaps break the hardware's streams). The kind argument carries it
// (kernels/linear.py two_part_kind):
//   kind = kTwoPart | a | b << 4 | split << 8
constexpr int64_t kTwoPart = int64_t{1} << 40;
int64_t panel_bytes(int64_t kind, int64_t nb);

// Where each panel of a packed weight starts, and its kind
struct Panels {
  const uint8_t* base;
  int64_t a, b, split, sa, sb, G;  // one kind: a == b, split = G
  int64_t kind(int64_t g) const { return g < split ? a : b; }
  const uint8_t* at(int64_t g) const {
    return g < split ? base + g * sa : base + split * sa + (g - split) * sb;
  }
};

// w: contiguous uint8, (G, panel bytes) panels of one kind or a two-part layout's 1-D run
Panels panels_of(const at::Tensor& w, int64_t kind, int64_t nb) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous(), "packed: uint8 panels");
  const uint8_t* base = w.data_ptr<uint8_t>();
  if (!(kind & kTwoPart)) {
    TORCH_CHECK(w.dim() == 2, "packed: (panels, bytes) uint8");
    const int64_t s = panel_bytes(kind, nb);
    TORCH_CHECK(w.size(1) == s, "panel size does not match K");
    return {base, kind, kind, w.size(0), s, s, w.size(0)};
  }
  TORCH_CHECK(kind < 2 * kTwoPart, "unknown panel kind ", kind);
  const int64_t a = kind & 15, b = (kind >> 4) & 15, split = kind >> 8 & ((int64_t{1} << 32) - 1);
  const int64_t sa = panel_bytes(a, nb), sb = panel_bytes(b, nb);
  TORCH_CHECK(w.dim() == 1, "packed: a two-part layout's panels are one 1-D run of bytes");
  const int64_t rest = w.numel() - split * sa;
  TORCH_CHECK(split > 0 && rest > 0 && rest % sb == 0, "two-part panels do not match K");
  return {base, a, b, split, sa, sb, split + rest / sb};
}

// Block b's quants in a panel; `header`: its superblock's header (SB kinds)
template <typename Byte>  // uint8_t (packing) or const uint8_t
inline Byte* block_at(Byte* panel, int64_t kind, int64_t b, Byte** header = nullptr) {
  const int64_t bsz = kind_block_bytes(kind);
  if (!sb_kind(kind)) return panel + b * bsz;
  Byte* h = panel + b / kSuperBlocks * (kSbHeader + kSuperBlocks * bsz);
  if (header != nullptr) *header = h;
  return h + kSbHeader + b % kSuperBlocks * bsz;
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

inline uint16_t float_to_half(float f) {
  TORCH_CHECK(std::isfinite(f) && std::fabs(f) < 65504.f, "quantized scale out of fp16 range");
  return c10::detail::fp16_ieee_from_fp32_value(f);
}

// ---------------------------------------------------------------------------------------------
// Decoding GGUF blocks (layouts as ggml-common.h): 32 weights w[j] = d[j / 16] * q[j] + m.

struct Decoded {
  int q[QK];
  float d0, d1, m, m1;  // m1: the second half's offset (Q2_K; every other type: m1 == m)
  // Q4_K, Q5_K: d0 = d * sc0, m = -dmin * mn; Q6_K: d0 = d * sc0, d1 = d * sc1 (d, dmin as fp16)
  int sc0, sc1, mn;
  uint16_t dh, dminh;
};

// K-quant 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes
inline void scale_min_k4(int j, const uint8_t* s, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void decode_block(int64_t t, const uint8_t* row, int64_t b, Decoded& o) {
  o.m = 0.f;
  switch (t) {
    case IQ4_NL:
    case IQ4_XS: {
      const uint8_t* qs;
      if (t == IQ4_NL) {
        const uint8_t* p = row + b * 18;
        o.d0 = o.d1 = half_to_float(p);
        qs = p + 2;
      } else {  // d, scales_h (u16), scales_l[4], qs[128]: a 6-bit scale (minus 32) per 32
        const int64_t sb = b / 8;
        const int ib = static_cast<int>(b % 8);
        const uint8_t* p = row + sb * 136;
        const int sh = p[2] | (p[3] << 8);
        const int ls = ((p[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((sh >> (2 * ib)) & 3) << 4);
        o.d0 = o.d1 = half_to_float(p) * static_cast<float>(ls - 32);
        qs = p + 8 + 16 * ib;
      }
      for (int j = 0; j < 16; ++j) {
        o.q[j] = kIQ4Values[qs[j] & 0x0F];
        o.q[j + 16] = kIQ4Values[qs[j] >> 4];
      }
      return;
    }
    case Q2_K: {  // scales[16] (4-bit scale | 4-bit min << 4 per 16), qs[64], d, dmin
      const int64_t sb = b / 8;
      const int s = static_cast<int>(b % 8), n = s / 4, sh = 2 * (s % 4);
      const uint8_t* p = row + sb * 84;
      const float d = half_to_float(p + 80), dmin = half_to_float(p + 82);
      const uint8_t* qs = p + 16 + 32 * n;
      const uint8_t sc0 = p[2 * s], sc1 = p[2 * s + 1];
      o.d0 = d * static_cast<float>(sc0 & 0x0F);
      o.d1 = d * static_cast<float>(sc1 & 0x0F);
      o.m = -dmin * static_cast<float>(sc0 >> 4);
      o.m1 = -dmin * static_cast<float>(sc1 >> 4);
      for (int l = 0; l < QK; ++l) o.q[l] = (qs[l] >> sh) & 3;
      return;
    }
    case Q3_K: {  // hmask[32], qs[64], scales[12] (16 6-bit scales, minus 32), d
      const int64_t sb = b / 8;
      const int s = static_cast<int>(b % 8), n = s / 4, j = s % 4;
      const uint8_t* p = row + sb * 110;
      const uint8_t* hm = p;
      const uint8_t* qs = p + 32 + 32 * n;
      const uint8_t* sc = p + 96;
      int scale[2];
      for (int h = 0; h < 2; ++h) {
        const int i = 2 * s + h;  // 0..15: low 4 bits in sc[0..7], high 2 bits in sc[8..11]
        const int lo = i < 8 ? sc[i] & 0x0F : sc[i - 8] >> 4;
        const int hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        scale[h] = (lo | (hi << 4)) - 32;
      }
      const float d = half_to_float(p + 108);
      o.d0 = d * static_cast<float>(scale[0]);
      o.d1 = d * static_cast<float>(scale[1]);
      const int bit = 4 * n + j;
      for (int l = 0; l < QK; ++l)
        o.q[l] = ((qs[l] >> (2 * j)) & 3) - (((hm[l] >> bit) & 1) ? 0 : 4);
      return;
    }
    case Q4_0:
    case Q4_1: {
      const uint8_t* p = row + b * (t == Q4_0 ? 18 : 20);
      const float d = half_to_float(p);
      o.d0 = o.d1 = d;
      o.m = t == Q4_0 ? -8.f * d : half_to_float(p + 2);
      const uint8_t* qs = p + (t == Q4_0 ? 2 : 4);
      for (int j = 0; j < 16; ++j) {
        o.q[j] = qs[j] & 0x0F;
        o.q[j + 16] = qs[j] >> 4;
      }
      return;
    }
    case Q5_0:
    case Q5_1: {
      const uint8_t* p = row + b * (t == Q5_0 ? 22 : 24);
      o.d0 = o.d1 = half_to_float(p);
      const uint8_t* qhp = p + (t == Q5_0 ? 2 : 4);
      uint32_t qh;
      std::memcpy(&qh, qhp, 4);
      const uint8_t* qs = qhp + 4;
      for (int j = 0; j < 16; ++j) {
        o.q[j] = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
        o.q[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      }
      if (t == Q5_0) {
        for (int j = 0; j < QK; ++j) o.q[j] -= 16;
      } else {
        o.m = half_to_float(p + 2);
      }
      return;
    }
    case Q8_0: {
      const uint8_t* p = row + b * 34;
      o.d0 = o.d1 = half_to_float(p);
      for (int j = 0; j < QK; ++j) o.q[j] = static_cast<int8_t>(p[2 + j]);
      return;
    }
    case Q4_K:
    case Q5_K: {
      const int64_t sb = b / 8;
      const int s = static_cast<int>(b % 8);
      const uint8_t* p = row + sb * (t == Q4_K ? 144 : 176);
      const float d = half_to_float(p), dmin = half_to_float(p + 2);
      int sc, mn;
      scale_min_k4(s, p + 4, sc, mn);
      o.d0 = o.d1 = d * static_cast<float>(sc);
      o.m = -dmin * static_cast<float>(mn);
      o.sc0 = o.sc1 = sc;
      o.mn = mn;
      std::memcpy(&o.dh, p, 2);
      std::memcpy(&o.dminh, p + 2, 2);
      const uint8_t* qh = p + 16;  // Q5_K only
      const uint8_t* qs = p + (t == Q4_K ? 16 : 48) + 32 * (s / 2);
      for (int j = 0; j < QK; ++j) {
        int q = (s % 2 == 0) ? (qs[j] & 0x0F) : (qs[j] >> 4);
        if (t == Q5_K) q += ((qh[j] >> s) & 1) << 4;
        o.q[j] = q;
      }
      return;
    }
    case Q6_K: {
      const int64_t sb = b / 8;
      const int s = static_cast<int>(b % 8), n = s / 4, c = s % 4;
      const uint8_t* p = row + sb * 210;
      const uint8_t* ql = p + 64 * n + (c % 2 == 1 ? 32 : 0);
      const uint8_t* qh = p + 128 + 32 * n;
      const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192) + 8 * n + 2 * c;
      const float d = half_to_float(p + 208);
      o.d0 = d * static_cast<float>(sc[0]);
      o.d1 = d * static_cast<float>(sc[1]);
      o.sc0 = sc[0];
      o.sc1 = sc[1];
      std::memcpy(&o.dh, p + 208, 2);
      for (int l = 0; l < QK; ++l) {
        const int lo = c < 2 ? (ql[l] & 0x0F) : (ql[l] >> 4);
        o.q[l] = (lo | (((qh[l] >> (2 * c)) & 3) << 4)) - 32;
      }
      return;
    }
    default: TORCH_CHECK(false, "unsupported quantized type ", t);
  }
}

// Block b of a row of type t, as the panel kind wants it.
void decode(int64_t t, const uint8_t* row, int64_t b, int64_t kind, Decoded& o) {
  o.m1 = NAN;
  decode_block(t, row, b, o);
  if (std::isnan(o.m1)) o.m1 = o.m;  // the type has one offset
  if (t == Q3_K && kind == kQ4D) {  // q + 4 in 0..7, offsets -4 d (exact: a power of two)
    for (int j = 0; j < QK; ++j) o.q[j] += 4;
    o.m = -4.f * o.d0;
    o.m1 = -4.f * o.d1;
  }
  if (t == Q5_0 && kind == kQ5) {  // q + 16 in 0..31, offset -16 d (exact: a power of two)
    for (int j = 0; j < QK; ++j) o.q[j] += 16;
    o.m = o.m1 = -16.f * o.d0;
  }
}

// Decoded blocks of 8 rows (rows past N are zero) -> one panel block.
int iq4_index(int v) {
  for (int i = 0; i < 16; ++i)
    if (kIQ4Values[i] == v) return i;
  TORCH_CHECK(false, "IQ4 panel: a value outside the codebook");
}

// Bit-plane panels (kQ5, kQ6, kQ3): quant u of weight 16 h + 4 j + t of row r, stored as
// u = q + plane_offset: its low 4 bits in nibble byte 32 j + 4 r + t (half h in nibble h), its
// bits from `low` on in plane byte 4 r + t: a 1-bit plane holds bit 4 h + j, a 2-bit plane (one
// 32-byte vector per half) bits 2 j, 2 j + 1.
void pack_planes(const Decoded* rows, int64_t kind, uint8_t* out) {
  const int low = kind == kQ3 ? 2 : 4, top = kind == kQ6 ? 6 : kind == kQ5 ? 5 : 3;
  const int64_t nib = kind == kQ3 ? 0 : kNibbleBytes;  // the planes' start
  std::memset(out, 0, static_cast<size_t>(kind_block_bytes(kind)));
  for (int r = 0; r < R; ++r) {
    const Decoded& o = rows[r];
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 4; ++j)
        for (int t = 0; t < 4; ++t) {
          const int u = o.q[16 * h + 4 * j + t] + plane_offset(kind);
          TORCH_CHECK(u >= 0 && u < (1 << top), "bit-plane panel: quant out of range");
          const int byte = 4 * r + t, rest = u >> low;
          if (kind == kQ3) {
            out[32 * h + byte] |= static_cast<uint8_t>((u & 3) << (2 * j));
            out[kPlane2Bytes + byte] |= static_cast<uint8_t>(rest << (4 * h + j));
            continue;
          }
          out[32 * j + byte] |= static_cast<uint8_t>((u & 0x0F) << (4 * h));
          if (kind == kQ5) {
            out[nib + byte] |= static_cast<uint8_t>(rest << (4 * h + j));
          } else {
            out[nib + 32 * h + byte] |= static_cast<uint8_t>(rest << (2 * j));
          }
        }
    uint16_t* scales = reinterpret_cast<uint16_t*>(out + kind_block_bytes(kind) - 32);
    TORCH_CHECK(o.m == o.m1, "bit-plane panel: the type has two offsets a block");
    scales[r] = float_to_half(o.d0);
    if (kind == kQ5) {
      TORCH_CHECK(o.d0 == o.d1, "5-bit panel: one scale a block");
      scales[R + r] = float_to_half(o.m);
    } else {
      TORCH_CHECK(o.m == 0.f, "bit-plane panel with integer offsets: the type has a float one");
      scales[R + r] = float_to_half(o.d1);
    }
  }
}

void pack_block(const Decoded* rows, int64_t kind, uint8_t* out) {
  if (bit_planes(kind)) return pack_planes(rows, kind, out);
  uint16_t* scales;
  if (kind == kQ4 || kind == kQ40 || kind == kI4 || kind == kQ4D) {
    for (int j = 0; j < 4; ++j)
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < 4; ++t) {
          int lo = rows[r].q[4 * j + t], hi = rows[r].q[16 + 4 * j + t];
          if (kind == kI4) {
            lo = iq4_index(lo);
            hi = iq4_index(hi);
          }
          TORCH_CHECK(lo >= 0 && lo < 16 && hi >= 0 && hi < 16, "4-bit panel: quant out of range");
          out[32 * j + 4 * r + t] = static_cast<uint8_t>(lo | (hi << 4));
        }
    scales = reinterpret_cast<uint16_t*>(out + 128);
    for (int r = 0; r < R; ++r) {
      const Decoded& o = rows[r];
      scales[r] = float_to_half(o.d0);
      if (kind == kQ4D) {
        scales[R + r] = float_to_half(o.d1);
        scales[2 * R + r] = float_to_half(o.m);
        scales[3 * R + r] = float_to_half(o.m1);
        continue;
      }
      TORCH_CHECK(o.d0 == o.d1 && o.m == o.m1, "4-bit panel: one scale and offset per block");
      if (kind == kQ4) {
        scales[R + r] = float_to_half(o.m);
      } else if (kind == kQ40) {
        TORCH_CHECK(o.m == -8.f * o.d0, "Q4_0 panel: the offset is not -8 d");
        float_to_half(o.m);  // in fp16 range, as kQ4 would store it
      } else {
        TORCH_CHECK(o.m == 0.f, "IQ4 panel: the type has an offset");
      }
    }
    return;
  }
  for (int k = 0; k < 8; ++k)
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < 4; ++t) {
        const int q = rows[r].q[4 * k + t];
        TORCH_CHECK(q >= -128 && q < 128, "8-bit panel: quant out of range");
        out[32 * k + 4 * r + t] = static_cast<uint8_t>(static_cast<int8_t>(q));
      }
  scales = reinterpret_cast<uint16_t*>(out + 256);
  for (int r = 0; r < R; ++r) {
    TORCH_CHECK(rows[r].m == rows[r].m1, "8-bit panel: the type has two offsets a block");
    scales[r] = float_to_half(rows[r].d0);
    if (kind == kQ8S) {
      TORCH_CHECK(rows[r].d0 == rows[r].d1 && rows[r].m == 0.f, "8-bit panel: one scale, no offset");
      continue;
    }
    scales[R + r] = float_to_half(rows[r].d1);
    if (kind == kQ8M) {
      scales[2 * R + r] = float_to_half(rows[r].m);
    } else {
      TORCH_CHECK(rows[r].m == 0.f, "8-bit panel without offsets: the type has one");
    }
  }
}

// (N, row bytes) GGUF blocks of type qtype -> (ceil(N / 8), K / 32 * panel block bytes) panels
at::Tensor quant_pack(const at::Tensor& blocks, int64_t qtype, int64_t kind, int64_t K) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte, "blocks: (N, bytes) uint8");
  const TypeInfo ti = type_info(qtype);
  TORCH_CHECK(K > 0 && K % ti.elems == 0, "K must be a multiple of ", ti.elems);
  TORCH_CHECK(blocks.size(1) == K / ti.elems * ti.bytes, "row size does not match K");
  TORCH_CHECK(!sb_kind(kind) || qtype == (kind == kQ4K ? Q4_K : kind == kQ5K ? Q5_K : Q6_K),
              "panel kind ", kind, " holds its own K-quant type only, not type ", qtype);
  const at::Tensor src = blocks.contiguous();
  const int64_t N = src.size(0), nb = K / QK, G = (N + R - 1) / R, bsz = kind_block_bytes(kind);
  const int64_t pstride = panel_bytes(kind, nb);
  at::Tensor out = at::empty({G, pstride}, src.options());
  const uint8_t* sp = src.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  const int64_t row_bytes = src.size(1);
  at::parallel_for(0, G, 8, [&](int64_t g0, int64_t g1) {
    Decoded rows[R];
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        for (int64_t r = 0; r < R; ++r) {
          const int64_t n = g * R + r;
          if (n < N) {
            decode(qtype, sp + n * row_bytes, b, kind, rows[r]);
          } else {
            std::memset(&rows[r], 0, sizeof(Decoded));  // scale 0
            if (kind == kI4) std::fill(rows[r].q, rows[r].q + QK, kIQ4Values[0]);
          }
        }
        uint8_t* h = nullptr;
        uint8_t* blk = block_at(op + g * pstride, kind, b, &h);
        if (!sb_kind(kind)) {
          pack_block(rows, kind, blk);
          continue;
        }
        alignas(32) uint8_t base[304];
        pack_block(rows, base_kind(kind), base);
        std::memcpy(blk, base, static_cast<size_t>(bsz));
        const int64_t s = b % kSuperBlocks;
        if (s == 0) std::memset(h, 0, kSbHeader);
        for (int r = 0; r < R; ++r) {
          const Decoded& o = rows[r];
          if (s == 0) {  // the superblock's d (and dmin) of the 8 rows
            std::memcpy(h + 2 * r, &o.dh, 2);
            if (kind != kQ6K) std::memcpy(h + 16 + 2 * r, &o.dminh, 2);
          }
          if (kind == kQ6K) {
            h[kSbScales + 8 * s + r] = static_cast<uint8_t>(static_cast<int8_t>(o.sc0));
            h[kSbSecond + 8 * s + r] = static_cast<uint8_t>(static_cast<int8_t>(o.sc1));
          } else {
            TORCH_CHECK(o.sc0 == o.sc1 && o.sc0 >= 0 && o.sc0 < 64 && o.mn >= 0 && o.mn < 64,
                        "superblock-scaled panel: 6-bit scales");
            h[kSbScales + 8 * s + r] = static_cast<uint8_t>(o.sc0);
            h[kSbSecond + 8 * s + r] = static_cast<uint8_t>(o.mn);
          }
        }
      }
  });
  return out;
}

inline bool four_bit(int64_t kind) {
  kind = base_kind(kind);
  return kind == kQ4 || kind == kQ40 || kind == kI4 || kind == kQ4D;
}

// One scale a block (the halves' integer dots are added, then scaled once)
inline bool one_scale(int64_t kind) {
  kind = base_kind(kind);
  return kind == kQ4 || kind == kQ40 || kind == kQ8S || kind == kI4 || kind == kQ5;
}

// Row r's scales and offsets in block b of a panel: half 0 (weights 0..15) d0, m0;
// half 1 d1, m1
inline void panel_scales(const uint8_t* panel, int64_t b, int64_t kind, int r,
                         float& d0, float& d1, float& m0, float& m1) {
  const uint8_t* hd = nullptr;
  const uint8_t* blk = block_at(panel, kind, b, &hd);
  if (sb_kind(kind)) {  // d * sc, -(dmin * mn): exact in fp32, as the kernels compute them
    const int64_t s = b % kSuperBlocks;
    const uint8_t first = hd[kSbScales + 8 * s + r], second = hd[kSbSecond + 8 * s + r];
    const float d = half_to_float(hd + 2 * r);
    if (kind == kQ6K) {
      d0 = d * static_cast<float>(static_cast<int8_t>(first));
      d1 = d * static_cast<float>(static_cast<int8_t>(second));
      m0 = m1 = 0.f;
    } else {
      d0 = d1 = d * static_cast<float>(first);
      m0 = m1 = -(half_to_float(hd + 16 + 2 * r) * static_cast<float>(second));
    }
    return;
  }
  const int64_t off =
      bit_planes(kind) ? kind_block_bytes(kind) - 32 : four_bit(kind) ? 128 : 256;
  const auto h = [&](int64_t i) { return half_to_float(blk + off + 2 * (i * R + r)); };
  d0 = h(0);
  d1 = d0;
  m0 = 0.f;
  if (kind == kQ4 || kind == kQ5) {
    m0 = h(1);
  } else if (kind == kQ40) {
    m0 = -8.f * d0;
  } else if (kind == kQ4D) {
    d1 = h(1);
    m0 = h(2);
    m1 = h(3);
    return;
  } else if (kind == kQ8 || kind == kQ8M || kind == kQ6 || kind == kQ3) {
    d1 = h(1);
    if (kind == kQ8M) m0 = h(2);
  }
  m1 = m0;
}

// Weight j (0..31) of panel row r as the integer dot takes it: kQ6's and kQ3's less their offset
inline int panel_quant(const uint8_t* blk, int64_t kind, int r, int j) {
  kind = base_kind(kind);
  if (bit_planes(kind)) {
    const int h = j / 16, jj = j % 16, byte = 4 * r + jj % 4, l = jj / 4;
    int u;
    if (kind == kQ3) {
      u = ((blk[32 * h + byte] >> (2 * l)) & 3) | (((blk[kPlane2Bytes + byte] >> (4 * h + l)) & 1) << 2);
    } else {
      u = (blk[32 * l + byte] >> (4 * h)) & 0x0F;
      if (kind == kQ5) {
        u |= ((blk[kNibbleBytes + byte] >> (4 * h + l)) & 1) << 4;
      } else {
        u |= ((blk[kNibbleBytes + 32 * h + byte] >> (2 * l)) & 3) << 4;
      }
    }
    return u - plane_offset(kind);
  }
  if (four_bit(kind)) {
    const int hi = j >= 16, jj = j % 16;
    const uint8_t byte = blk[32 * (jj / 4) + 4 * r + jj % 4];
    const int q = hi ? byte >> 4 : byte & 0x0F;
    return kind == kI4 ? kIQ4Values[q] : q;
  }
  return static_cast<int8_t>(blk[32 * (j / 4) + 4 * r + j % 4]);
}

// rows ids of the packed weight, dequantized: (T, K) fp32, w = d * q + m
at::Tensor quant_dequant_rows(const at::Tensor& packed, int64_t kind, int64_t K,
                              const at::Tensor& ids) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids: (T,) int64");
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32");
  const int64_t nb = K / QK;
  const at::Tensor pc = packed.contiguous(), ic = ids.contiguous();
  const Panels P = panels_of(pc, kind, nb);
  const int64_t T = ic.size(0), rows = P.G * R;
  at::Tensor out = at::empty({T, K}, pc.options().dtype(at::kFloat));
  const int64_t* ip = ic.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < rows, "row id out of range");
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = ip[t] / R, kind = P.kind(g);
      const int r = static_cast<int>(ip[t] % R);
      const uint8_t* panel = P.at(g);
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = block_at(panel, kind, b);
        float d0, d1, m0, m1;
        panel_scales(panel, b, kind, r, d0, d1, m0, m1);
        for (int j = 0; j < QK; ++j)
          op[t * K + b * QK + j] =
              (j < 16 ? d0 : d1) * panel_quant(blk, kind, r, j) + (j < 16 ? m0 : m1);
      }
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Activations: int8 blocks of 32, x[j] ~= d * q[j]

struct ActBlock {
  int8_t q[QK];
  float d;         // scale
  float s;         // d * sum(q)
  int32_t sa, sb;  // sum(q[0..15]), sum(q[16..31])
  float s0, s1;    // d * sa, d * sb
  // 32 * sa, 32 * sb: kQ6's stored offset (plane_offset) off its halves' dots, broadcast straight
  // from memory (from sa it was a shift, a move to a vector register and a broadcast, on the
  // shuffle port)
  int32_t oa, ob;
};

void quantize_row(const float* x, ActBlock* out, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    const float* v = x + b * QK;
    ActBlock& o = out[b];
#ifdef CONVOY_AVX2
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 mx = _mm256_setzero_ps();
    for (int j = 0; j < QK; j += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
#else
    float amax = 0.f;
    for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(v[j]));
#endif
    const float d = amax / 127.f;
    const float id = d > 0.f ? 1.f / d : 0.f;
#ifdef CONVOY_AVX2
    const __m256 vid = _mm256_set1_ps(id);
    __m256i qi[4];
    for (int j = 0; j < 4; ++j)
      qi[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * j), vid),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i p16 = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
    __m256i p8 = _mm256_packs_epi16(p16, p16b);  // lanes shuffled by the packs: put them back
    p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.q), p8);
    int sa = 0, sb = 0;
    for (int j = 0; j < 16; ++j) sa += o.q[j];
    for (int j = 16; j < QK; ++j) sb += o.q[j];
#else
    int sa = 0, sb = 0;
    for (int j = 0; j < QK; ++j) {
      const int q = static_cast<int>(std::nearbyint(v[j] * id));
      o.q[j] = static_cast<int8_t>(q);
      (j < 16 ? sa : sb) += q;
    }
#endif
    o.d = d;
    o.sa = sa;
    o.sb = sb;
    o.s = d * static_cast<float>(sa + sb);
    o.s0 = d * static_cast<float>(sa);
    o.s1 = d * static_cast<float>(sb);
    o.oa = plane_offset(kQ6) * sa;
    o.ob = plane_offset(kQ6) * sb;
  }
}

// ---------------------------------------------------------------------------------------------
// One weight panel (8 rows) x MR activation rows -> MR x 8 outputs, over all nb blocks.

#ifdef CONVOY_AVX2
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The weights of one decode step stream from memory once (every layer's, in a model larger than
// the caches), in short bursts: one linear's panels split over the threads, ~100-500 KB each. The
// hardware prefetcher ramps up too slowly for such bursts; asking for the block kPrefetchBlocks
// ahead moved SmolLM2's 120 decode linears (66 MB, 2 threads) from 8.3 to 7.2 ms (median, AVX2
// EPYC host), Gemma's from 8.6 to 7.8. Panels of a thread's range are contiguous, so a prefetch
// past a panel's end is the next panel's start; past the buffer it is harmless (no fault).
// A tile of several panels (NP > 1) reads them side by side, so past a panel's end the block
// ahead is in the same slot of the next group: `jump` (the first to the last panel of the group,
// (NP - 1) panels' bytes where they lie back to back) is added there. Without it, panels of 18
// blocks (K = 576) had their next group's first blocks fetched only on demand.
// The distance: 10 blocks (~1.4 KB a panel) kept up while the host's DRAM gave ~40 GB/s, but
// when the same 2-core VM got ~70 GB/s (a plain 2 GiB sum; it moves between the two over
// minutes) one-stream decode read only ~50: too few misses in flight to cover the latency.
// 40 blocks, alternating with 10 in one process at the fast moments (Zen 5, 2 threads, no
// drafting): llama-3b Q4_K_M 26.2 -> 31.9 tok/s (AVX2 build 25.4 -> 31.6), llama-1b 66.2 ->
// 76.7, OLMoE Q4_K_M 62.8 -> 72.6; at the slow moments +3-6%; 20 and 30 fell between, 60 and
// 80 gained nothing more; 16 streams even (AVX-512) or +12% (AVX2 build), SmolLM2 +3%, prefill
// and 64 streams unchanged. The hint stays T0: T1 (to L2 only) was no better.
// That is ~5 KB in flight a thread for one panel at a time (one-row decode; every AVX2 tile). A
// tile of NP panels asks for each 40 / NP blocks ahead (at least 10, the old distance): the same
// bytes in flight, not NP times them (40 blocks of a 4-panel zmm tile would be 22 KB, most of a
// 32 KB L1, where a prefetched line could be evicted before its use).
constexpr int64_t kPrefetchBlocks = 40;
template <int64_t BSZ, int NP>
inline void prefetch_ahead(const uint8_t* blk, int64_t b, int64_t nb, std::ptrdiff_t jump) {
  constexpr int64_t kAhead = std::max<int64_t>(10, kPrefetchBlocks / NP);
  const uint8_t* ahead = blk + kAhead * BSZ + (b + kAhead >= nb ? jump : 0);
  for (int64_t o = 0; o < BSZ; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T0);
}
template <int NP>
inline std::ptrdiff_t group_jump(const uint8_t* const* panels) {
  return NP > 1 ? panels[NP - 1] - panels[0] : 0;
}

// The running integer sums of the AVX2 tiles stay in registers, added to product after product
// in the order written: the empty asm is a point the compiler cannot see through, so it cannot
// regroup the sums. Without it GCC computed a 4-row tile's products of a whole block first, kept
// them on the stack and added them after (integer adds regroup freely), ~30 spills a block: the
// 3B Q4_K_M file's o_proj (Q4_K) at 64 rows on one thread ran at 65 GMAC/s, with it 94. Integer
// sums are exact: the same bits either way. Used by the 4-bit and bit-plane tiles; the int8
// tiles (panel_q8, whose sign trick widens every product at once) ran slower with it (the 3B
// IQ4_XS file's linears at 16 rows 94-98 -> 82 GMAC/s), so they go without.
template <typename T>
inline void in_register(T& v) {
  asm("" : "+x"(v));
}

// The largest register tile (MR x P) that leaves registers for a superblock's scales (AVX2 has 16
// vector registers, AVX-512VL 32)
#ifdef CONVOY_VNNI
constexpr int kHoistTile = 4;
#else
constexpr int kHoistTile = 2;
#endif

// Superblock-scaled kinds: 8 u8 (or int8) sub-block scales as floats, times the 8 rows' fp16 d
// of the superblock (exact: at most 11 + 8 significant bits).
inline __m256 sb_scale(__m256 d, const uint8_t* p, bool is_signed) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m256i wide = is_signed ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw);
  return _mm256_mul_ps(d, _mm256_cvtepi32_ps(wide));
}
// The 8 rows' fp16 d (i = 0) or dmin (i = 1) in a superblock's header
inline __m256 sb_d(const uint8_t* header, int i) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(header + 16 * i)));
}
// Each of P panels' next block (`at`) and its superblock's header, block after block
template <int P, bool SB, int64_t BSZ>
struct Cursor {
  const uint8_t *at[P], *header[P];
  explicit Cursor(const uint8_t* const* panels) {
    for (int p = 0; p < P; ++p) {
      header[p] = panels[p];
      at[p] = panels[p] + (SB ? kSbHeader : 0);
    }
  }
  void next(int64_t b) {  // past block b
    for (int p = 0; p < P; ++p) {
      at[p] += BSZ;
      if (SB && b % kSuperBlocks == kSuperBlocks - 1) {
        header[p] = at[p];
        at[p] += kSbHeader;
      }
    }
  }
};

// Register vectors of panel lanes. VY: one panel's 8 rows, a ymm. VZ: two panels' 16 rows, a zmm
// (the first panel's rows in its low half), where the CPU has AVX-512 VNNI: a zmm dpbusd does
// twice a ymm's multiply-adds in one instruction, and at many rows the kernels are bound by
// instructions, not by the weights' read. `at[v]` (VY) or `at[2v]`, `at[2v + 1]` (VZ) are vector
// v's panels. The kernels below are written once over V: every lane runs the same integer dots
// and the same float steps in the same order, so VZ gives VY's bits.
struct VY {
  using I = __m256i;
  using F = __m256;
  static constexpr int kPanels = 1;
  static I load(const uint8_t* const* at, int v, int64_t off) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at[v] + off));
  }
  static I bytes(char c) { return _mm256_set1_epi8(c); }
  static I zero() { return _mm256_setzero_si256(); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I high_nibbles(I raw, I low) { return _mm256_and_si256(_mm256_srli_epi16(raw, 4), low); }
  static I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  // the IQ4 codebook in every 128-bit lane, and its int8 values of 4-bit indices
  static I codebook() {
    return _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
  }
  static I lookup(I table, I idx) { return _mm256_shuffle_epi8(table, idx); }
  static I add32(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub32(I a, int32_t s) { return _mm256_sub_epi32(a, _mm256_set1_epi32(s)); }
  // bits `from`.. of every byte moved to bits `to`.. (what crosses a byte is masked off later)
  static I move_bits(I v, int from, int to) {
    return from >= to ? _mm256_srl_epi16(v, _mm_cvtsi32_si128(from - to))
                      : _mm256_sll_epi16(v, _mm_cvtsi32_si128(to - from));
  }
#ifdef CONVOY_VNNI
  static I dot(I acc, I w, const int8_t* x) { return _mm256_dpbusd_epi32(acc, w, bcast4(x)); }
#elif defined(CONVOY_DPBUSD)
  static I dot(I acc, I w, const int8_t* x) { return _mm256_dpbusd_avx_epi32(acc, w, bcast4(x)); }
#endif
  static F fzero() { return _mm256_setzero_ps(); }
  static F set1(float f) { return _mm256_set1_ps(f); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  // 8 fp16 of each panel at `off`
  static F half8(const uint8_t* const* at, int v, int64_t off) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at[v] + off)));
  }
  // 8 floats of each panel's precomputed scales
  static F floats(const float* const* fs, int v, int64_t off) {
    return _mm256_loadu_ps(fs[v] + off);
  }
  static F sb_d(const uint8_t* const* header, int v, int i) { return ::sb_d(header[v], i); }
  static F sb_scale(F d, const uint8_t* const* header, int v, int64_t off, bool is_signed) {
    return ::sb_scale(d, header[v] + off, is_signed);
  }
};

#ifdef CONVOY_ZMM
struct VZ {
  using I = __m512i;
  using F = __m512;
  static constexpr int kPanels = 2;
  static I load(const uint8_t* const* at, int v, int64_t off) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at[2 * v] + off));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at[2 * v + 1] + off));
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  static I bytes(char c) { return _mm512_set1_epi8(c); }
  static I zero() { return _mm512_setzero_si512(); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I high_nibbles(I raw, I low) { return _mm512_and_si512(_mm512_srli_epi16(raw, 4), low); }
  static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  static I codebook() {
    return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
  }
  static I lookup(I table, I idx) { return _mm512_shuffle_epi8(table, idx); }
  static I add32(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub32(I a, int32_t s) { return _mm512_sub_epi32(a, _mm512_set1_epi32(s)); }
  static I move_bits(I v, int from, int to) {
    return from >= to ? _mm512_srl_epi16(v, _mm_cvtsi32_si128(from - to))
                      : _mm512_sll_epi16(v, _mm_cvtsi32_si128(to - from));
  }
  static I dot(I acc, I w, const int8_t* x) {
    int32_t q;
    std::memcpy(&q, x, 4);
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(q));
  }
  static F fzero() { return _mm512_setzero_ps(); }
  static F set1(float f) { return _mm512_set1_ps(f); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static __m256i pair128(const uint8_t* a, const uint8_t* b) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
  }
  static F half8(const uint8_t* const* at, int v, int64_t off) {
    return _mm512_cvtph_ps(pair128(at[2 * v] + off, at[2 * v + 1] + off));
  }
  static F floats(const float* const* fs, int v, int64_t off) {
    const __m512d lo = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(fs[2 * v] + off)));
    return _mm512_castpd_ps(
        _mm512_insertf64x4(lo, _mm256_castps_pd(_mm256_loadu_ps(fs[2 * v + 1] + off)), 1));
  }
  static F sb_d(const uint8_t* const* header, int v, int i) {
    return _mm512_cvtph_ps(pair128(header[2 * v] + 16 * i, header[2 * v + 1] + 16 * i));
  }
  static F sb_scale(F d, const uint8_t* const* header, int v, int64_t off, bool is_signed) {
    const __m128i raw = _mm_unpacklo_epi64(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(header[2 * v] + off)),
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(header[2 * v + 1] + off)));
    const __m512i wide = is_signed ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw);
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(wide));
  }
};
#endif

// The accumulator of a block's second half (or high nibbles): 1, a chain of its own, or 0, one
// chain with the first where the halves' sums are added anyway (`summed`) and the tile is zmm:
// VZ's tile has 8 chains a row set and one chain was 3-5% faster there (3B Q4_K_M layers, zmm_ab
// three runs each: 1.17-1.21x / 1.27-1.31x the ymm tiles at 16 / 64 rows, two chains
// 1.16-1.18x / 1.18-1.24x). Integer sums are exact: the same bits either way.
template <typename V>
constexpr int one_chain(bool summed) {
  return V::kPanels == 2 && summed ? 0 : 1;
}

// NOTE: each activation row keeps two integer accumulators per vector (low and high nibbles, or
// the two 16-weight halves), summed after the block: dpbusd has a latency of several cycles, and
// one chain per row left the ymm kernel latency-bound (zmm tiles: one_chain above). Integer sums
// are exact, so the split changes no result. P vectors of panels (2 with VNNI's 32 registers)
// share each broadcast of the activations.
// TWO (kQ4D): each half has its own scale and offset, so the halves' sums stay apart.
// M8 (kQ40): no stored offset; m = -8 d, an exact product, so kQ4's bits.
template <int MR, int P, bool TWO, bool SB = false, typename V = VY, bool M8 = false>
void panel_q4(const uint8_t* const* panels, int64_t nb, const ActBlock* const* x,
              typename V::F (*acc)[MR], const float* const* fs = nullptr) {
  static_assert(!(TWO && SB), "kQ4D has no superblock-scaled form");
  using I = typename V::I;
  using F = typename V::F;
  constexpr int NP = P * V::kPanels;  // panels: P vectors of them
  constexpr int H1 = one_chain<V>(!TWO);  // the high nibbles' accumulator
  constexpr int64_t bsz = SB ? 128 : TWO ? 192 : M8 ? 144 : 160;
  constexpr int64_t stride = SB ? bsz + kSbHeader / kSuperBlocks : bsz;  // on average
  const I low = V::bytes(0x0F);
#ifndef CONVOY_DPBUSD
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  // SB: the superblock's d and dmin kept in registers where the tile leaves them free
  constexpr bool hoist = SB && MR * P <= kHoistTile;
  F dsb[P], msb[P];
  Cursor<NP, SB, bsz> cur(panels);
  const std::ptrdiff_t jump = group_jump<NP>(panels);
  for (int64_t b = 0; b < nb; cur.next(b++)) {
    I isum[P][2][MR];
    const uint8_t* const* at = cur.at;
    const uint8_t* const* header = cur.header;
    for (int q = 0; q < NP; ++q) prefetch_ahead<stride, NP>(at[q], b, nb, jump);
    if constexpr (hoist)
      if (b % kSuperBlocks == 0)
        for (int p = 0; p < P; ++p) {
          dsb[p] = V::sb_d(header, p, 0);
          msb[p] = V::sb_d(header, p, 1);
        }
    for (int p = 0; p < P; ++p)
      for (int i = 0; i < MR; ++i) isum[p][0][i] = isum[p][1][i] = V::zero();
    for (int j = 0; j < 4; ++j) {
      I lo[P], hi[P];
      for (int p = 0; p < P; ++p) {
        const I raw = V::load(at, p, 32 * j);
        lo[p] = V::and_(raw, low);
        hi[p] = V::high_nibbles(raw, low);
      }
      for (int i = 0; i < MR; ++i) {
        const int8_t *xl = x[i][b].q + 4 * j, *xh = x[i][b].q + 16 + 4 * j;
        for (int p = 0; p < P; ++p) {
#ifdef CONVOY_DPBUSD
          isum[p][0][i] = V::dot(isum[p][0][i], lo[p], xl);
          isum[p][H1][i] = V::dot(isum[p][H1][i], hi[p], xh);
#else  // |pair sums| <= 2 * 15 * 127: eight of them fit int16
          isum[p][0][i] =
              _mm256_add_epi16(isum[p][0][i], _mm256_maddubs_epi16(lo[p], bcast4(xl)));
          isum[p][TWO][i] =
              _mm256_add_epi16(isum[p][TWO][i], _mm256_maddubs_epi16(hi[p], bcast4(xh)));
          in_register(isum[p][TWO][i]);
#endif
        }
      }
    }
    for (int p = 0; p < P; ++p) {
      if constexpr (TWO) {
        const F d0 = V::half8(at, p, 128), d1 = V::half8(at, p, 144);
        const F m0 = V::half8(at, p, 160), m1 = V::half8(at, p, 176);
        for (int i = 0; i < MR; ++i) {
#ifdef CONVOY_DPBUSD
          const I dot0 = isum[p][0][i], dot1 = isum[p][1][i];
#else
          const __m256i dot0 = _mm256_madd_epi16(isum[p][0][i], ones);
          const __m256i dot1 = _mm256_madd_epi16(isum[p][1][i], ones);
#endif
          const F dx = V::set1(x[i][b].d);
          acc[p][i] = V::fmadd(V::mul(d0, dx), V::cvt(dot0), acc[p][i]);
          acc[p][i] = V::fmadd(V::mul(d1, dx), V::cvt(dot1), acc[p][i]);
          acc[p][i] = V::fmadd(m0, V::set1(x[i][b].s0), acc[p][i]);
          acc[p][i] = V::fmadd(m1, V::set1(x[i][b].s1), acc[p][i]);
        }
        continue;
      }
      F d, m;  // SB: m = dmin * mn, subtracted (the offset is -m, exact)
      if constexpr (SB) {
        if (fs != nullptr) {  // precomputed: the same values
          d = V::floats(fs, p, 16 * b);
          m = V::floats(fs, p, 16 * b + 8);
        } else {
          const int64_t s = 8 * (b % kSuperBlocks);
          d = V::sb_scale(hoist ? dsb[p] : V::sb_d(header, p, 0), header, p, kSbScales + s, false);
          m = V::sb_scale(hoist ? msb[p] : V::sb_d(header, p, 1), header, p, kSbSecond + s, false);
        }
      } else {
        d = V::half8(at, p, 128);
        m = M8 ? V::mul(d, V::set1(-8.f)) : V::half8(at, p, 144);
      }
      for (int i = 0; i < MR; ++i) {
#ifdef CONVOY_DPBUSD
        const I dot = H1 == 0 ? isum[p][0][i] : V::add32(isum[p][0][i], isum[p][1][i]);
#else
        const __m256i dot = _mm256_madd_epi16(isum[p][0][i], ones);
#endif
        acc[p][i] = V::fmadd(V::mul(d, V::set1(x[i][b].d)), V::cvt(dot), acc[p][i]);
        if constexpr (SB) {
          acc[p][i] = V::fnmadd(m, V::set1(x[i][b].s), acc[p][i]);
        } else {
          acc[p][i] = V::fmadd(m, V::set1(x[i][b].s), acc[p][i]);
        }
      }
    }
  }
}

// SINGLE (kQ8S, kI4): one scale per block, so the halves' exact sums are added and scaled once.
// LUT (kI4): the int8 weights are looked up from 4-bit indices in the 16-entry codebook (one
// shuffle), laid out as kQ4's nibbles: load k's low nibbles are weights 4k.., its high 16 + 4k..
template <int MR, int P, bool HAS_M, bool SINGLE, bool LUT = false, typename V = VY>
void panel_q8(const uint8_t* const* wg, int64_t nb, const ActBlock* const* x,
              typename V::F (*acc)[MR]) {
  static_assert(!(HAS_M && SINGLE), "kQ8S has no offsets");
  static_assert(!LUT || SINGLE, "kI4 has one scale");
  using I = typename V::I;
  using F = typename V::F;
  constexpr int NP = P * V::kPanels;  // panels: P vectors of them
  constexpr int H1 = one_chain<V>(SINGLE);  // the second half's accumulator
  constexpr int64_t bsz = LUT ? 144 : SINGLE ? 272 : HAS_M ? 304 : 288;
  constexpr int64_t soff = LUT ? 128 : 256;  // the scales' offset in a block
  const I low = V::bytes(0x0F);
  const I lut = V::codebook();
  (void)low;
  (void)lut;
#ifdef CONVOY_DPBUSD
  const I flip = V::bytes(static_cast<char>(0x80));
#else
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  const uint8_t* at[NP];
  const std::ptrdiff_t jump = group_jump<NP>(wg);
  for (int64_t b = 0; b < nb; ++b) {
    I isum[P][2][MR];
    for (int q = 0; q < NP; ++q) {
      at[q] = wg[q] + b * bsz;
      prefetch_ahead<bsz, NP>(at[q], b, nb, jump);
    }
    for (int p = 0; p < P; ++p)
      for (int i = 0; i < MR; ++i) isum[p][0][i] = isum[p][1][i] = V::zero();
    for (int k = 0; k < 4; ++k) {
      I raw[P];
      if constexpr (LUT)
        for (int p = 0; p < P; ++p) raw[p] = V::load(at, p, 32 * k);
      for (int h = 0; h < 2; ++h) {
        const int kk = 4 * h + k;
        I w[P];
        for (int p = 0; p < P; ++p) {
          if constexpr (LUT) {
            w[p] = V::lookup(lut, h == 0 ? V::and_(raw[p], low) : V::high_nibbles(raw[p], low));
          } else {
            w[p] = V::load(at, p, 32 * kk);
          }
#ifdef CONVOY_DPBUSD
          w[p] = V::xor_(w[p], flip);  // w + 128 as u8; corrected below
#endif
        }
        for (int i = 0; i < MR; ++i) {
          const int8_t* xb = x[i][b].q + 4 * kk;
          for (int p = 0; p < P; ++p) {
#ifdef CONVOY_DPBUSD
            isum[p][h * H1][i] = V::dot(isum[p][h * H1][i], w[p], xb);
#else  // maddubs takes u8 x s8: |w| times x with w's sign
            const __m256i prod =
                _mm256_maddubs_epi16(_mm256_abs_epi8(w[p]), _mm256_sign_epi8(bcast4(xb), w[p]));
            isum[p][h][i] = _mm256_add_epi32(isum[p][h][i], _mm256_madd_epi16(prod, ones));
#endif
          }
        }
      }
    }
    for (int p = 0; p < P; ++p) {
      for (int h = 0; h < (SINGLE ? 1 : 2); ++h) {
        const F d = V::half8(at, p, soff + 16 * h);
        for (int i = 0; i < MR; ++i) {
          I dot = !SINGLE ? isum[p][h][i]
                  : H1 == 0 ? isum[p][0][i]
                            : V::add32(isum[p][0][i], isum[p][1][i]);
#ifdef CONVOY_DPBUSD
          const int32_t xs = SINGLE ? x[i][b].sa + x[i][b].sb : h == 0 ? x[i][b].sa : x[i][b].sb;
          dot = V::sub32(dot, 128 * xs);
#endif
          acc[p][i] = V::fmadd(V::mul(d, V::set1(x[i][b].d)), V::cvt(dot), acc[p][i]);
        }
      }
      if constexpr (HAS_M) {
        const F m = V::half8(at, p, 288);
        for (int i = 0; i < MR; ++i) acc[p][i] = V::fmadd(m, V::set1(x[i][b].s), acc[p][i]);
      }
    }
  }
}

// Bit-plane kinds (kQ5, kQ6, kQ3): load j's quants of both halves rebuilt from the planes as u8,
// then kQ4's dots (kQ5) or kQ8's (kQ6, kQ3: two scales, the offset taken back off in integers).
// AVX2 keeps int16 pair sums while they fit (4 loads x 2 * 31 * 127 for kQ5) and widens kQ6's
// every two loads (2 * 63 * 127 a pair).
template <int MR, int P, int64_t KIND, bool SB = false, typename V = VY>
void panel_bits(const uint8_t* const* panels, int64_t nb, const ActBlock* const* x,
                typename V::F (*acc)[MR], const float* const* fs = nullptr) {
  static_assert(!(SB && KIND == kQ3), "kQ3 has no superblock-scaled form");
  using I = typename V::I;
  using F = typename V::F;
  constexpr int NP = P * V::kPanels;  // panels: P vectors of them
  constexpr int H1 = one_chain<V>(KIND == kQ5);  // the second half's accumulator
  constexpr int64_t bsz = (KIND == kQ5 ? 192 : KIND == kQ6 ? 224 : 128) - (SB ? 32 : 0);
  constexpr int64_t soff = bsz - 32;  // the fp16 scales (not SB)
  constexpr int64_t stride = SB ? bsz + kSbHeader / kSuperBlocks : bsz;  // on average
  constexpr int offset = KIND == kQ6 ? 32 : KIND == kQ3 ? 4 : 0;
  constexpr bool wide = KIND == kQ6;
  (void)wide;
  // loads of quants a pass: AVX2 adds kQ6's int16 pair sums of two loads (2 * 2 * 63 * 127 fit
  // int16; |activation q| <= 127) before widening them, half the widenings of one a load
#ifdef CONVOY_DPBUSD
  constexpr int kLoads = 1;
#else
  constexpr int kLoads = wide ? 2 : 1;
#endif
  const I low = V::bytes(0x0F);
  const I bit4 = V::bytes(0x10), bits45 = V::bytes(0x30);
  const I bits01 = V::bytes(0x03), bit2 = V::bytes(0x04);
#ifndef CONVOY_DPBUSD
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  // SB: the superblock's d (and dmin) kept in registers where the tile leaves them free
  constexpr bool hoist = SB && MR * P <= kHoistTile;
  F dsb[P], msb[P];
  Cursor<NP, SB, bsz> cur(panels);
  const std::ptrdiff_t jump = group_jump<NP>(panels);
  for (int64_t b = 0; b < nb; cur.next(b++)) {
    I isum[P][2][MR];
    I plane[P][2];
    const uint8_t* const* at = cur.at;
    const uint8_t* const* header = cur.header;
    if constexpr (hoist)
      if (b % kSuperBlocks == 0)
        for (int p = 0; p < P; ++p) {
          dsb[p] = V::sb_d(header, p, 0);
          msb[p] = KIND == kQ6 ? dsb[p] : V::sb_d(header, p, 1);
        }
    for (int q = 0; q < NP; ++q) prefetch_ahead<stride, NP>(at[q], b, nb, jump);
    for (int p = 0; p < P; ++p) {
      if constexpr (KIND == kQ5) {
        plane[p][0] = plane[p][1] = V::load(at, p, kNibbleBytes);
      } else if constexpr (KIND == kQ6) {
        plane[p][0] = V::load(at, p, kNibbleBytes);
        plane[p][1] = V::load(at, p, kNibbleBytes + 32);
      } else {
        plane[p][0] = V::load(at, p, 0);
        plane[p][1] = V::load(at, p, 32);
      }
      for (int i = 0; i < MR; ++i) isum[p][0][i] = isum[p][1][i] = V::zero();
    }
    for (int j0 = 0; j0 < 4; j0 += kLoads) {
      I w[kLoads][P][2];
      for (int u = 0; u < kLoads; ++u)
        for (int p = 0; p < P; ++p) {
          const int j = j0 + u;
          if constexpr (KIND == kQ3) {
            const I one = V::load(at, p, kPlane2Bytes);
            for (int h = 0; h < 2; ++h)
              w[u][p][h] = V::or_(V::and_(V::move_bits(plane[p][h], 2 * j, 0), bits01),
                                  V::and_(V::move_bits(one, 4 * h + j, 2), bit2));
          } else {
            const I raw = V::load(at, p, 32 * j);
            const I nib[2] = {V::and_(raw, low), V::high_nibbles(raw, low)};
            for (int h = 0; h < 2; ++h) {
              const I top = KIND == kQ5 ? V::and_(V::move_bits(plane[p][h], 4 * h + j, 4), bit4)
                                        : V::and_(V::move_bits(plane[p][h], 2 * j, 4), bits45);
              w[u][p][h] = V::or_(nib[h], top);
            }
          }
        }
      for (int i = 0; i < MR; ++i) {
        const int8_t* xq = x[i][b].q + 4 * j0;  // + 16 for the second half
        for (int p = 0; p < P; ++p)
          for (int h = 0; h < 2; ++h) {
#ifdef CONVOY_DPBUSD
            isum[p][h * H1][i] = V::dot(isum[p][h * H1][i], w[0][p][h], xq + 16 * h);
#else  // AVX2 keeps int16 pair sums while they fit: kQ5 over the block, kQ6 over two loads
            __m256i prod = _mm256_maddubs_epi16(w[0][p][h], bcast4(xq + 16 * h));
            for (int u = 1; u < kLoads; ++u)
              prod = _mm256_add_epi16(
                  prod, _mm256_maddubs_epi16(w[u][p][h], bcast4(xq + 16 * h + 4 * u)));
            isum[p][h][i] = wide ? _mm256_add_epi32(isum[p][h][i], _mm256_madd_epi16(prod, ones))
                                 : _mm256_add_epi16(isum[p][h][i], prod);
            in_register(isum[p][h][i]);
#endif
          }
      }
    }
    for (int p = 0; p < P; ++p) {
      // the block's two scales (kQ6, kQ3: halves 0 and 1; kQ5: scale and offset; SB kQ5: the
      // offset's magnitude, subtracted)
      F sc[2];
      if constexpr (SB) {
        if (fs != nullptr) {  // precomputed: the same values
          sc[0] = V::floats(fs, p, 16 * b);
          sc[1] = V::floats(fs, p, 16 * b + 8);
        } else {
          const int64_t s = 8 * (b % kSuperBlocks);
          const F d = hoist ? dsb[p] : V::sb_d(header, p, 0);  // the superblock's d (and dmin)
          sc[0] = V::sb_scale(d, header, p, kSbScales + s, KIND == kQ6);
          sc[1] = V::sb_scale(KIND == kQ6 ? d : hoist ? msb[p] : V::sb_d(header, p, 1), header,
                              p, kSbSecond + s, KIND == kQ6);
        }
      } else {
        sc[0] = V::half8(at, p, soff);
        sc[1] = V::half8(at, p, soff + 16);
      }
      for (int i = 0; i < MR; ++i) {
        I dot[2];
        for (int h = 0; h < 2; ++h) {
#ifdef CONVOY_DPBUSD
          dot[h] = isum[p][h][i];
#else
          dot[h] = wide ? isum[p][h][i] : _mm256_madd_epi16(isum[p][h][i], ones);
#endif
        }
        const F dx = V::set1(x[i][b].d);
        if constexpr (KIND == kQ5) {
          const I sum = H1 == 0 ? dot[0] : V::add32(dot[0], dot[1]);
          acc[p][i] = V::fmadd(V::mul(sc[0], dx), V::cvt(sum), acc[p][i]);
          if constexpr (SB) {
            acc[p][i] = V::fnmadd(sc[1], V::set1(x[i][b].s), acc[p][i]);
          } else {
            acc[p][i] = V::fmadd(sc[1], V::set1(x[i][b].s), acc[p][i]);
          }
        } else {
          for (int h = 0; h < 2; ++h) {
            const ActBlock& a = x[i][b];
            const int32_t off = KIND == kQ6 ? (h == 0 ? a.oa : a.ob)
                                            : offset * (h == 0 ? a.sa : a.sb);
            const I d = V::sub32(dot[h], off);
            acc[p][i] = V::fmadd(V::mul(sc[h], dx), V::cvt(d), acc[p][i]);
          }
        }
      }
    }
  }
}

// P vectors of panels x MR activation rows, over all nb blocks, into acc: the kind's kernel
template <int MR, int P, typename V>
void panel_kernel(int64_t kind, const uint8_t* const* wg, int64_t nb, const ActBlock* const* x,
                  typename V::F (*acc)[MR], const float* const* fs) {
  if (kind == kQ4) {
    panel_q4<MR, P, false, false, V>(wg, nb, x, acc);
  } else if (kind == kQ40) {
    panel_q4<MR, P, false, false, V, true>(wg, nb, x, acc);
  } else if (kind == kQ4K) {
    panel_q4<MR, P, false, true, V>(wg, nb, x, acc, fs);
  } else if (kind == kQ5K) {
    panel_bits<MR, P, kQ5, true, V>(wg, nb, x, acc, fs);
  } else if (kind == kQ6K) {
    panel_bits<MR, P, kQ6, true, V>(wg, nb, x, acc, fs);
  } else if (kind == kQ4D) {
    panel_q4<MR, P, true, false, V>(wg, nb, x, acc);
  } else if (kind == kQ5) {
    panel_bits<MR, P, kQ5, false, V>(wg, nb, x, acc);
  } else if (kind == kQ6) {
    panel_bits<MR, P, kQ6, false, V>(wg, nb, x, acc);
  } else if (kind == kQ3) {
    panel_bits<MR, P, kQ3, false, V>(wg, nb, x, acc);
  } else if (kind == kI4) {
    panel_q8<MR, P, false, true, true, V>(wg, nb, x, acc);
  } else if (kind == kQ8S) {
    panel_q8<MR, P, false, true, false, V>(wg, nb, x, acc);
  } else if (kind == kQ8) {
    panel_q8<MR, P, false, false, false, V>(wg, nb, x, acc);
  } else {
    panel_q8<MR, P, true, false, false, V>(wg, nb, x, acc);
  }
}

// P panels (8 * P weight rows, `lanes` of them real) x MR activation rows -> out (MR, ldo)
template <int MR, int P>
void panel(int64_t kind, const uint8_t* const* wg, int64_t nb, const ActBlock* const* x,
           float* out, int64_t ldo, int64_t lanes, const float* const* fs) {
  __m256 acc[P][MR];
  for (int p = 0; p < P; ++p)
    for (int i = 0; i < MR; ++i) acc[p][i] = _mm256_setzero_ps();
  panel_kernel<MR, P, VY>(kind, wg, nb, x, acc, fs);
  for (int p = 0; p < P; ++p)
    for (int i = 0; i < MR; ++i) {
      const int64_t n = std::min<int64_t>(R, lanes - p * R);
      if (n == R) {
        _mm256_storeu_ps(out + i * ldo + p * R, acc[p][i]);
      } else if (n > 0) {
        alignas(32) float tmp[R];
        _mm256_store_ps(tmp, acc[p][i]);
        std::memcpy(out + i * ldo + p * R, tmp, sizeof(float) * n);
      }
    }
}
#else   // portable: the same integer dots and the same float steps, one lane at a time
template <int MR, int P>
void panel(int64_t kind, const uint8_t* const* wg, int64_t nb, const ActBlock* const* x,
           float* out, int64_t ldo, int64_t lanes, const float* const*) {
  const int64_t bsz = kind_block_bytes(kind);
  for (int i = 0; i < MR; ++i)
    for (int64_t n = 0; n < lanes; ++n) {
      const int r = static_cast<int>(n % R);
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = block_at(wg[n / R], kind, b);
        const ActBlock& a = x[i][b];
        float d0, d1, m0, m1;
        panel_scales(wg[n / R], b, kind, r, d0, d1, m0, m1);
        int dot_a = 0, dot_b = 0;
        for (int j = 0; j < 16; ++j) dot_a += panel_quant(blk, kind, r, j) * a.q[j];
        for (int j = 16; j < QK; ++j) dot_b += panel_quant(blk, kind, r, j) * a.q[j];
        if (one_scale(kind)) {
          acc = std::fma(d0 * a.d, static_cast<float>(dot_a + dot_b), acc);
        } else {
          acc = std::fma(d0 * a.d, static_cast<float>(dot_a), acc);
          acc = std::fma(d1 * a.d, static_cast<float>(dot_b), acc);
        }
        const int64_t base = base_kind(kind);
        if (kind == kQ4D) {
          acc = std::fma(m0, a.s0, acc);
          acc = std::fma(m1, a.s1, acc);
        } else if (base == kQ4 || base == kQ40 || base == kQ8M || base == kQ5) {
          acc = std::fma(m0, a.s, acc);
        }
      }
      out[i * ldo + n] = acc;
    }
}
#endif

// Activation rows from which a tile runs kP panels: below 32 a tile is still bound by the weight
// stream, and two panels are two streams (Gemma head at 16 rows: 16.5 ms one panel, 20.2 two,
// AVX2 EPYC). With zmm tiles 16 rows are already bound by instructions (2-core Xeon with AVX-512
// VNNI, in one process: a 3B Q4_K_M layer at 16 rows 195 GMAC/s in zmm tiles, 152-155 one panel
// at a time; Gemma's head at 16 rows 16.9-17.4 ms either way). CONVOY_CPU_ZMM=0 keeps 32.
constexpr int64_t kPairMinRows = 32, kZmmMinRows = 16;
inline int64_t pair_min_rows(bool zmm) { return zmm ? kZmmMinRows : kPairMinRows; }
// Rows from which zmm tiles (kP panels, four weight streams) run a range of panels that is
// still split statically (memory-bound, under kZmmMinRows rows). At 3-15 rows the one-panel ymm
// tiles were bound by their instructions, not by the weights' read: every linear of the 1B
// Q4_K_M file at 3 / 4 / 8 / 12 rows 1.38x / 1.6x / 1.86x / 1.87x faster in zmm tiles, SmolLM2's
// 1.0x / 1.1x / 1.54x / 1.6x (Zen 5, AVX-512 VNNI, alternating in one process). At 2 rows one
// stream still wins (0.93-1.06x), except IQ4_XS, whose codebook lookups cost more a block
// (the 3B IQ4_XS file's linears at 2 rows 55.5 -> 37.6 ms).
constexpr int64_t kZmmTileMinRows = 3, kZmmTileMinRowsI4 = 2;
inline int64_t tile_min_rows(bool zmm, int64_t kind) {
  if (!zmm) return kPairMinRows;
  return kind == kI4 ? kZmmTileMinRowsI4 : kZmmTileMinRows;
}
// Rows from which a superblock-scaled kind's block scales are computed in a pass of their own
// before the row tiles (which then read them) rather than in each tile. The pass is the first to
// touch a panel, its loads of superblock headers miss one after another, and below 32 rows the
// tiles that follow do not make up for it: zmm tiles at 16 rows, 16 streams of decode, 1B / 3B
// Q4_K_M 163 -> 178 / 61 -> 68 tok/s computing them in the tiles (2-core Xeon, alternating runs;
// `perf` put 15% of the step on the pass's first header load); 32 rows even, 64 rows 3% better
// with the pass. AVX2 tiles reach it at 32 rows as before (kPairMinRows).
constexpr int64_t kPrecomputeMinRows = 32;

// Whether zmm tiles run (VZ); CONVOY_CPU_ZMM=0 says no, for an A/B in one process (read once a
// call of a linear or an experts' pass: the results are the same bits either way)
#ifdef CONVOY_ZMM
bool zmm_tiles() {
  const char* off = std::getenv("CONVOY_CPU_ZMM");
  return !(off && off[0] == '0');
}
#else
constexpr bool zmm_tiles() { return false; }
#endif
constexpr int64_t kChunksPerThread = 8;  // of a compute-bound linear's panels
constexpr int64_t kStagePanels = 32;     // staged outputs: 64 rows x 256 columns, 64 KB
#ifdef CONVOY_ZMM
constexpr int64_t kP = 4;  // weight panels per register tile: two zmm (VZ) or two ymm tiles
#elif defined(CONVOY_VNNI)
constexpr int64_t kP = 2;  // weight panels per register tile
#else
constexpr int64_t kP = 1;  // AVX2 has 16 registers: one panel's accumulators fill them
#endif

template <int P>
void run_tile(int64_t kind, const uint8_t* const* wg, int64_t nb, const ActBlock* const* rows,
              int64_t cnt, float* o, int64_t ldo, int64_t lanes,
              const float* const* fs = nullptr) {
  switch (cnt) {
    case 4: panel<4, P>(kind, wg, nb, rows, o, ldo, lanes, fs); break;
    case 3: panel<3, P>(kind, wg, nb, rows, o, ldo, lanes, fs); break;
    case 2: panel<2, P>(kind, wg, nb, rows, o, ldo, lanes, fs); break;
    default: panel<1, P>(kind, wg, nb, rows, o, ldo, lanes, fs); break;
  }
}

#ifdef CONVOY_ZMM
// 4 panels (two zmm of 16 rows, `lanes` of 32 real) x MR activation rows -> out (MR, ldo)
template <int MR>
void panel_z(int64_t kind, const uint8_t* const* wg, int64_t nb, const ActBlock* const* x,
             float* out, int64_t ldo, int64_t lanes, const float* const* fs) {
  __m512 acc[2][MR];
  for (int v = 0; v < 2; ++v)
    for (int i = 0; i < MR; ++i) acc[v][i] = _mm512_setzero_ps();
  panel_kernel<MR, 2, VZ>(kind, wg, nb, x, acc, fs);
  for (int v = 0; v < 2; ++v) {
    const int64_t n = std::min<int64_t>(2 * R, lanes - v * 2 * R);
    if (n <= 0) continue;
    const __mmask16 mask = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
    for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(out + i * ldo + v * 2 * R, mask, acc[v][i]);
  }
}
#endif

// np (1..kP) panels x cnt activation rows -> o; `lanes` of the panels' rows are real; zmm: a
// full group runs VZ tiles (zmm_tiles())
void run_group(int64_t kind, const uint8_t* const* wg, int64_t np, int64_t nb,
               const ActBlock* const* rows, int64_t cnt, float* o, int64_t ldo, int64_t lanes,
               bool zmm, const float* const* fs = nullptr) {
  if (np < kP) {  // the end of a range: pairs, then single panels
    int64_t p = 0;
#ifdef CONVOY_VNNI
    for (; p + 2 <= np; p += 2)
      run_tile<2>(kind, wg + p, nb, rows, cnt, o + p * R, ldo, lanes - p * R, fs ? fs + p : nullptr);
#endif
    for (; p < np; ++p)
      run_tile<1>(kind, wg + p, nb, rows, cnt, o + p * R, ldo, lanes - p * R, fs ? fs + p : nullptr);
    return;
  }
#ifdef CONVOY_ZMM
  if (zmm) {
    switch (cnt) {
      case 4: panel_z<4>(kind, wg, nb, rows, o, ldo, lanes, fs); break;
      case 3: panel_z<3>(kind, wg, nb, rows, o, ldo, lanes, fs); break;
      case 2: panel_z<2>(kind, wg, nb, rows, o, ldo, lanes, fs); break;
      default: panel_z<1>(kind, wg, nb, rows, o, ldo, lanes, fs); break;
    }
    return;
  }
  for (int64_t h = 0; h < 2; ++h)  // two ymm tiles of 2 panels
    if (lanes > h * 2 * R)
      run_tile<2>(kind, wg + 2 * h, nb, rows, cnt, o + h * 2 * R, ldo, lanes - h * 2 * R,
                  fs ? fs + 2 * h : nullptr);
#else
  (void)zmm;
  run_tile<kP>(kind, wg, nb, rows, cnt, o, ldo, lanes, fs);
#endif
}

// A superblock-scaled panel's block scales as fp32, 16 a block (d of the 8 rows, then dmin * mn
// or Q6_K's second scale): what its kernel computes each block, once for many activation rows.
// The values are exact products, so a tile that reads them gives the bits of one that computes
// them; without SIMD kernels nothing is precomputed (false).
bool sb_scales_f32(int64_t kind, const uint8_t* panel, int64_t nb, float* out) {
#ifdef CONVOY_AVX2
  const bool sgn = kind == kQ6K;
  for (int64_t b0 = 0; b0 < nb; b0 += kSuperBlocks) {
    const uint8_t* h = nullptr;
    block_at(panel, kind, b0, &h);
    const __m256 d = sb_d(h, 0), dm = sgn ? d : sb_d(h, 1);
    for (int64_t s = 0; s < kSuperBlocks; ++s) {
      _mm256_storeu_ps(out + 16 * (b0 + s), sb_scale(d, h + kSbScales + 8 * s, sgn));
      _mm256_storeu_ps(out + 16 * (b0 + s) + 8, sb_scale(dm, h + kSbSecond + 8 * s, sgn));
    }
  }
  return true;
#else
  (void)kind, (void)panel, (void)nb, (void)out;
  return false;
#endif
}

// x (M, K) fp32 @ panels (N rows) (+ bias) -> out, (M, N) fp32 contiguous
void quant_linear_into(const at::Tensor& x, const at::Tensor& packed, int64_t kind, int64_t N,
                       const std::optional<at::Tensor>& bias, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be (M, K) fp32");
  const at::Tensor xc = x.contiguous();
  const at::Tensor w = packed.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32");
  const int64_t nb = K / QK;
  const Panels P = panels_of(w, kind, nb);
  const int64_t G = P.G;
  TORCH_CHECK(N > (G - 1) * R && N <= G * R, "N does not match the panels");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.is_contiguous() &&
                  out.scalar_type() == at::kFloat,
              "out must be a contiguous (M, N) fp32 tensor");
  if (M == 0 || N == 0) return;
  std::vector<ActBlock> xq(static_cast<size_t>(M * nb));
  const float* xp = xc.data_ptr<float>();
  at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize_row(xp + m * K, xq.data() + m * nb, nb);
  });
  float* op = out.data_ptr<float>();
  const bool zmm = zmm_tiles();
  for (int64_t m0 = 0; m0 < M; m0 += kTileM) {
    const int64_t m1 = std::min(M, m0 + kTileM);
    // Two panels at once read two streams of weights. With few activation rows the weights
    // stream from memory once (every layer's in a model larger than the caches) and two streams
    // ran slower than one (Gemma's head at M=1: 9.8 vs 5.9 ms; SmolLM2's decode step at B=1-4
    // 20-50% slower, AVX2); with many rows the kernel is compute-bound and sharing each broadcast
    // pays. zmm tiles pay from 3 rows (tile_min_rows) while the split stays static below 16
    // (`many`). The results are the same bits either way.
    const bool many = m1 - m0 >= pair_min_rows(zmm);
    // panels g0..g1 (all of kind `kind`) of rows m0..m1 -> dst (ld floats a row), whose first
    // column is column col0
    const auto run_panels = [&](int64_t kind, int64_t g0, int64_t g1, float* dst, int64_t ld,
                                int64_t col0) {
      // Many rows of a superblock-scaled kind: each panel's block scales computed once for all
      // the row tiles (each would compute them again), from kPrecomputeMinRows rows
      const bool precompute = m1 - m0 >= kPrecomputeMinRows && sb_kind(kind);
      const ActBlock* rows[kMR];
      const uint8_t* wg[kP];
      const int64_t step = m1 - m0 >= tile_min_rows(zmm, kind) ? kP : 1;
      std::vector<float> scales(precompute ? static_cast<size_t>(kP * 16 * nb) : 0);
      const float* fs[kP] = {};
      for (int64_t g = g0; g < g1; g += step) {
        const int64_t np = std::min(step, g1 - g);
        const int64_t lanes = std::min<int64_t>(R * np, N - g * R);
        for (int64_t p = 0; p < np; ++p) {
          wg[p] = P.at(g + p);
          if (precompute && sb_scales_f32(kind, wg[p], nb, scales.data() + p * 16 * nb))
            fs[p] = scales.data() + p * 16 * nb;
        }
        for (int64_t mi = m0; mi < m1; mi += kMR) {
          const int64_t cnt = std::min(kMR, m1 - mi);
          for (int64_t i = 0; i < cnt; ++i) rows[i] = xq.data() + (mi + i) * nb;
          float* o = dst + (mi - m0) * ld + g * R - col0;
          run_group(kind, wg, np, nb, rows, cnt, o, ld, lanes, zmm, fs[0] ? fs : nullptr);
        }
      }
    };
    // a range of panels, cut where a two-part layout's kind changes
    const auto panels = [&](int64_t g0, int64_t g1, float* dst, int64_t ld, int64_t col0) {
      const int64_t cut = std::clamp(P.split, g0, g1);
      if (g0 < cut) run_panels(P.a, g0, cut, dst, ld, col0);
      if (cut < g1) run_panels(P.b, cut, g1, dst, ld, col0);
    };
    if (!many && P.a == P.b) {  // few rows: each thread streams a range of panels
      const int64_t unit = m1 - m0 >= tile_min_rows(zmm, P.a) ? kP : 1;  // whole register tiles
      at::parallel_for(0, (G + unit - 1) / unit, 1, [&](int64_t u0, int64_t u1) {
        panels(u0 * unit, std::min(G, u1 * unit), op + m0 * N, N, 0);
      });
      continue;
    }
    if (!many) {  // the same, two-part: ranges of equal bytes (its kinds' panels differ in size)
      const int64_t nt = std::max<int64_t>(1, at::get_num_threads());
      const int64_t total = P.split * P.sa + (G - P.split) * P.sb;
      const auto first_panel_at = [&](int64_t bytes) {  // the first panel starting at >= bytes
        if (bytes <= P.split * P.sa) return (bytes + P.sa - 1) / P.sa;
        return std::min(G, P.split + (bytes - P.split * P.sa + P.sb - 1) / P.sb);
      };
      at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t)
          panels(first_panel_at(total * t / nt), first_panel_at(total * (t + 1) / nt),
                 op + m0 * N, N, 0);
      });
      continue;
    }
    // Compute-bound: threads take chunks of panels from a shared counter, so a thread slowed by
    // anything else on the host does not leave the other waiting at the end (Gemma's linears at
    // 64 and 256 rows, A/B in one process on a noisy 2-core host: median GMAC/s 5-11% higher than
    // a static half each; the head, 262144 outputs, 57 -> 64). Which thread runs a panel changes
    // no result.
    const int64_t nt = std::max<int64_t>(1, at::get_num_threads());
    int64_t chunk = std::max<int64_t>(1, G / (nt * kChunksPerThread));
    chunk = (chunk + kP - 1) / kP * kP;  // whole groups of kP panels
    const int64_t nchunks = (G + chunk - 1) / chunk;
    std::atomic<int64_t> next{0};
    // NOTE: a register tile's 8 outputs of a row are half a cache line, and the rows of a wide
    // output lie far apart (1 MB for Gemma's head): written in place, every tile store missed the
    // caches (with a read for ownership). Each thread stages kStagePanels panels of all the tile's
    // rows in a small buffer, then copies whole row segments out: Gemma's head at 64 and 256 rows
    // 5% faster (A/B in one process, median 65.6 -> 69.3 GMAC/s; 15-20% in a microbenchmark of
    // the tile loop alone), its layers 0-3%.
    at::parallel_for(0, std::min(nt, nchunks), 1, [&](int64_t, int64_t) {
      std::vector<float> stage(static_cast<size_t>(kTileM * kStagePanels * R));
      for (int64_t c = next.fetch_add(1); c < nchunks; c = next.fetch_add(1)) {
        const int64_t c1 = std::min(G, (c + 1) * chunk);
        for (int64_t gs = c * chunk; gs < c1; gs += kStagePanels) {
          const int64_t ge = std::min(c1, gs + kStagePanels), width = (ge - gs) * R;
          panels(gs, ge, stage.data(), width, gs * R);
          const int64_t cols = std::min(width, N - gs * R);
          for (int64_t m = m0; m < m1; ++m)
            std::memcpy(op + m * N + gs * R, stage.data() + (m - m0) * width, sizeof(float) * cols);
        }
      }
    });
  }
  if (bias.has_value() && bias->defined()) out.add_(*bias);
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t kind, int64_t N,
                        const std::optional<at::Tensor>& bias) {
  at::Tensor out = at::empty({x.dim() == 2 ? x.size(0) : 0, N}, x.options());
  quant_linear_into(x, packed, kind, N, bias, out);
  return out;
}

// into a caller's buffer: the engine's logits, (rows, vocab) each step, are 67 MB for Gemma 3 at
// 64 rows; a fresh tensor of that size is a fresh mmap whose page faults and zeroing cost ~30 ms.
void quant_linear_out(const at::Tensor& x, const at::Tensor& packed, int64_t kind, int64_t N,
                      const std::optional<at::Tensor>& bias, at::Tensor out) {
  quant_linear_into(x, packed, kind, N, bias, out);
}


// ---------------------------------------------------------------------------------------------
// MoE routed experts (moe_experts): every expert's panels stacked in one buffer (expert e owns
// panels [e * Gp, (e + 1) * Gp) of each projection). The (T, k) routed slots are grouped by expert
// (a stable counting sort), then the step runs as three passes over all experts at once:
//   gate|up = x[rows of e] @ gate_up[e]   one parallel region, work items (expert, panel range)
//   a = act(gate) * up, int8 blocks        one pass over the slots
//   y = a @ down[e]                        one parallel region, as the first
// and out[t] = w[t, 0] * y[t, 0], then out[t] = out[t] + w[t, j] * y[t, j] for j = 1..k-1 (a
// rounded product, then a rounded sum, never an fma: torch's two ops in models/moe.py's loop).
// Each output element runs the same panel code on the same int8 blocks as quant_linear over that
// expert's rows, and x's rows are quantized once for all their experts: the result is the bits of
// the per-expert quant_linear + act_and_mul loop, whatever T, the step's other rows or the threads.

using convoy_act::act_mul_row;

// NOTE: g++ contracts a * b + c into an fma by default (-ffp-contract=fast, C++ too, intrinsics
// included), which would round once where torch's `out + w * y` rounds twice: the product is
// forced out of the expression (an empty asm the compiler cannot see through).
inline float rounded_product(float a, float b) {
  float p = a * b;
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  asm("" : "+x"(p));
#elif defined(__GNUC__) && defined(__aarch64__)
  asm("" : "+w"(p));
#else
  volatile float v = p;
  p = v;
#endif
  return p;
}

// The routed slots grouped by expert: sorted position i (0..T*k) holds slot order[i] = t * k + j;
// expert e owns positions [start[e], start[e + 1]); pos[t * k + j] is that slot's position.
struct Routing {
  std::vector<int64_t> start, token, pos;
};

Routing group_slots(const int64_t* ids, int64_t S, int64_t k, int64_t E) {
  Routing r;
  r.start.assign(E + 1, 0);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(ids[s] >= 0 && ids[s] < E, "moe_experts: expert id ", ids[s], " of slot ", s,
                " out of range [0, ", E, ")");
    ++r.start[ids[s] + 1];
  }
  for (int64_t e = 0; e < E; ++e) r.start[e + 1] += r.start[e];
  std::vector<int64_t> fill(r.start.begin(), r.start.end() - 1);
  r.token.resize(S);
  r.pos.resize(S);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t i = fill[ids[s]]++;
    r.token[i] = s / k;
    r.pos[s] = i;
  }
  return r;
}

struct Segment {
  int64_t e, g0, g1;  // panels [g0, g1) of expert e
};

// The experts' (expert, panel) pairs in order, cut into at most `parts` chunks of equal cost: a
// panel of expert e costs its row count + 1 (the weights stream once, each row is a dot more). At
// T = 1 the k experts' panels spread over all threads as one dense linear's do.
std::vector<std::vector<Segment>> expert_chunks(const std::vector<int64_t>& start, int64_t Gp,
                                                int64_t parts) {
  const int64_t E = static_cast<int64_t>(start.size()) - 1;
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) total += Gp * (start[e + 1] - start[e] + 1);
  std::vector<std::vector<Segment>> chunks;
  if (total == 0) return chunks;
  const int64_t target = std::max<int64_t>(1, (total + parts - 1) / parts);
  std::vector<Segment> cur;
  int64_t acc = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;
    const int64_t cost = n + 1;
    for (int64_t g = 0; g < Gp;) {
      int64_t take = std::max<int64_t>(1, (target - acc + cost - 1) / cost);
      take = std::min(Gp - g, (take + kP - 1) / kP * kP);  // whole groups of kP panels
      cur.push_back({e, g, g + take});
      acc += take * cost;
      g += take;
      if (acc >= target) {
        chunks.push_back(std::move(cur));
        cur.clear();
        acc = 0;
      }
    }
  }
  if (!cur.empty()) chunks.push_back(std::move(cur));
  return chunks;
}

// One GEMM phase: for every expert, its sorted rows (int8 blocks row_blocks(i)) @ its Gp panels
// (N outputs) -> out rows i (N floats each). One parallel region, split as quant_linear splits a
// linear: every expert under pair_min_rows rows (few) -> one contiguous range of the
// (expert, panel) sequence a thread; else chunks taken from a shared counter. Tiles as
// quant_linear's (kTileM rows, kMR a register tile, kP panels from tile_min_rows rows): the same
// bits whichever thread, tile or pairing runs an output.
template <typename RowBlocks>
void experts_gemm(const uint8_t* wp, int64_t gstride, int64_t Gp, int64_t kind, int64_t nb,
                  int64_t N, const std::vector<int64_t>& start, const RowBlocks& row_blocks,
                  float* out) {
  const int64_t nt = std::max<int64_t>(1, at::get_num_threads());
  const bool zmm = zmm_tiles();
  int64_t most = 0;
  for (size_t e = 0; e + 1 < start.size(); ++e) most = std::max(most, start[e + 1] - start[e]);
  const bool many = most >= pair_min_rows(zmm);
  const std::vector<std::vector<Segment>> chunks =
      expert_chunks(start, Gp, many ? nt * kChunksPerThread : nt);
  const int64_t nchunks = static_cast<int64_t>(chunks.size());
  std::atomic<int64_t> next{0};
  const auto segment = [&](const Segment& sg) {
    const ActBlock* rows[kMR];
    const uint8_t* wg[kP];
    const int64_t r0 = start[sg.e], n = start[sg.e + 1] - r0;
    for (int64_t m0 = 0; m0 < n; m0 += kTileM) {
      const int64_t m1 = std::min(n, m0 + kTileM);
      const int64_t step = m1 - m0 >= tile_min_rows(zmm, kind) ? kP : 1;
      for (int64_t g = sg.g0; g < sg.g1; g += step) {
        const int64_t np = std::min(step, sg.g1 - g);
        const int64_t lanes = std::min<int64_t>(R * np, N - g * R);
        for (int64_t p = 0; p < np; ++p) wg[p] = wp + (sg.e * Gp + g + p) * gstride;
        for (int64_t mi = m0; mi < m1; mi += kMR) {
          const int64_t cnt = std::min(kMR, m1 - mi);
          for (int64_t i = 0; i < cnt; ++i) rows[i] = row_blocks(r0 + mi + i);
          float* o = out + (r0 + mi) * N + g * R;
          run_group(kind, wg, np, nb, rows, cnt, o, N, lanes, zmm);
        }
      }
    }
  };
  if (!many) {  // memory-bound: each thread streams one contiguous range of panels
    at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c)
        for (const Segment& sg : chunks[c]) segment(sg);
    });
    return;
  }
  at::parallel_for(0, std::min(nt, nchunks), 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < nchunks; c = next.fetch_add(1))
      for (const Segment& sg : chunks[c]) segment(sg);
  });
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                       const at::Tensor& gate_up, int64_t gate_up_kind, const at::Tensor& down,
                       int64_t down_kind, int64_t inter, int64_t act) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "moe_experts: x must be (T, H) fp32");
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong && ids.size(0) == x.size(0),
              "moe_experts: ids must be (T, k) int64");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.sizes() == ids.sizes(),
              "moe_experts: weights must be (T, k) fp32, as ids");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kByte && down.dim() == 2 &&
                  down.scalar_type() == at::kByte, "moe_experts: gate_up, down: uint8 panels");
  TORCH_CHECK(act == 0 || act == 1, "moe_experts: act 0 (SiLU) or 1 (GELU tanh)");
  const int64_t T = x.size(0), H = x.size(1), k = ids.size(1);
  TORCH_CHECK(k >= 1, "moe_experts: k >= 1 experts per row");
  TORCH_CHECK(H > 0 && H % QK == 0, "moe_experts: hidden must be a multiple of 32");
  TORCH_CHECK(inter > 0 && inter % QK == 0, "moe_experts: intermediate must be a multiple of 32");
  const int64_t nbh = H / QK, nbi = inter / QK, N1 = 2 * inter;
  const int64_t Gu = N1 / R, Gd = (H + R - 1) / R;
  TORCH_CHECK(gate_up.size(0) % Gu == 0 && gate_up.size(0) > 0,
              "moe_experts: gate_up panels are not a whole number of experts");
  const int64_t E = gate_up.size(0) / Gu;
  TORCH_CHECK(gate_up.size(1) == panel_bytes(gate_up_kind, nbh),
              "moe_experts: gate_up panel size does not match hidden");
  TORCH_CHECK(down.size(0) == E * Gd, "moe_experts: down holds ", down.size(0), " panels, not ",
              E, " experts x ", Gd);
  TORCH_CHECK(down.size(1) == panel_bytes(down_kind, nbi),
              "moe_experts: down panel size does not match intermediate");
  const at::Tensor xc = x.contiguous(), ic = ids.contiguous(), wc = weights.contiguous();
  const at::Tensor gw = gate_up.contiguous(), dw = down.contiguous();
  at::Tensor out = at::empty({T, H}, xc.options());
  const int64_t S = T * k;
  const Routing rt = group_slots(ic.data_ptr<int64_t>(), S, k, E);
  if (T == 0) return out;

  std::vector<ActBlock> xq(static_cast<size_t>(T * nbh));  // each row once, for all its experts
  const float* xp = xc.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) quantize_row(xp + t * H, xq.data() + t * nbh, nbh);
  });
  std::vector<float> g(static_cast<size_t>(S * N1));
  experts_gemm(gw.data_ptr<uint8_t>(), gw.size(1), Gu, gate_up_kind, nbh, N1, rt.start,
               [&](int64_t i) { return xq.data() + rt.token[i] * nbh; }, g.data());

  std::vector<ActBlock> aq(static_cast<size_t>(S * nbi));
  at::parallel_for(0, S, 4, [&](int64_t i0, int64_t i1) {
    std::vector<float> a(static_cast<size_t>(inter));
    for (int64_t i = i0; i < i1; ++i) {
      const float* gi = g.data() + i * N1;
      if (act == 0) {
        act_mul_row<0>(gi, gi + inter, a.data(), inter);
      } else {
        act_mul_row<1>(gi, gi + inter, a.data(), inter);
      }
      quantize_row(a.data(), aq.data() + i * nbi, nbi);
    }
  });
  std::vector<float> y(static_cast<size_t>(S * H));
  experts_gemm(dw.data_ptr<uint8_t>(), dw.size(1), Gd, down_kind, nbi, H, rt.start,
               [&](int64_t i) { return aq.data() + i * nbi; }, y.data());

  const float* wt = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / (H * k)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* o = op + t * H;
      for (int64_t j = 0; j < k; ++j) {
        const float w = wt[t * k + j];
        const float* yj = y.data() + rt.pos[t * k + j] * H;
        int64_t h = 0;
#ifdef CONVOY_AVX2
        const __m256 vw = _mm256_set1_ps(w);
        for (; h + 8 <= H; h += 8) {
          __m256 p = _mm256_mul_ps(vw, _mm256_loadu_ps(yj + h));
          asm("" : "+x"(p));  // the rounded product: no contraction into an fma
          _mm256_storeu_ps(o + h, j == 0 ? p : _mm256_add_ps(_mm256_loadu_ps(o + h), p));
        }
#endif
        for (; h < H; ++h) o[h] = j == 0 ? w * yj[h] : o[h] + rounded_product(w, yj[h]);
      }
    }
  });
  return out;
}

}  // namespace

namespace convoy {
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t kind, int64_t N,
                        const std::optional<at::Tensor>& bias) {
  return ::quant_linear(x, packed, kind, N, bias);
}
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                       const at::Tensor& gate_up, int64_t gate_up_kind, const at::Tensor& down,
                       int64_t down_kind, int64_t inter, int64_t act) {
  return ::moe_experts(x, ids, weights, gate_up, gate_up_kind, down, down_kind, inter, act);
}
}  // namespace convoy

TORCH_LIBRARY_FRAGMENT(convoy, m) {
  m.def("quant_pack(Tensor blocks, int qtype, int kind, int K) -> Tensor");
  m.def("quant_dequant_rows(Tensor packed, int kind, int K, Tensor ids) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor packed, int kind, int N, Tensor? bias) -> Tensor");
  m.def(
      "quant_linear_out(Tensor x, Tensor packed, int kind, int N, Tensor? bias, Tensor(a!) out) "
      "-> ()");
  m.def(
      "moe_experts(Tensor x, Tensor ids, Tensor weights, Tensor gate_up, int gate_up_kind, "
      "Tensor down, int down_kind, int inter, int act) -> Tensor");
}

TORCH_LIBRARY_IMPL(convoy, CPU, m) {
  m.impl("quant_pack", &quant_pack);
  m.impl("quant_dequant_rows", &quant_dequant_rows);
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_linear_out", &quant_linear_out);
  m.impl("moe_experts", &moe_experts);
}
