// Decode attention straight from the paged KV cache, for the CPU.
//
// The torch path (attention.py) first copies every decode sequence's blocks into one padded
// (Hkv, B, L, D) tensor, then runs two batched matmuls over it: the copy is 40-60% of attention
// time at 16-64 sequences. This kernel reads each sequence's K/V rows where they live, once per
// KV head for all the query heads of its group, and parallelises over (sequence, KV head) with
// ATen's thread pool. fp32 and bf16 (widened to fp32 as it is read; all arithmetic in fp32).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
void decode_attention_impl(const at::Tensor& qc, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& bt, const at::Tensor& ln, int64_t block_size, float fscale,
                           int64_t window, at::Tensor& out) {
  const int64_t B = qc.size(0), H = qc.size(1), D = qc.size(2);
  const int64_t Hkv = k_cache.size(0), S = k_cache.size(1), NB = bt.size(1);
  const int64_t G = H / Hkv;
  const T* qp = qc.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t* lp = ln.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    std::vector<float> qf(G * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, g = item % Hkv;
      const int64_t len = lp[b];
      TORCH_CHECK(len > 0 && len <= NB * block_size, "context length out of range");
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      scores.resize(G * n);
      const T* qg = qp + (b * H + g * G) * D;  // the G query heads of this KV head
      for (int64_t x = 0; x < G * D; ++x) qf[x] = static_cast<float>(qg[x]);
      const T* kg = kp + g * S * D;
      const T* vg = vp + g * S * D;
      const int64_t* table = btp + b * NB;
      // scores[j * n + i] = q_j . k_(first + i) * scale
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = first + i;
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        TORCH_CHECK(slot >= 0 && slot < S, "slot out of range");
        const T* krow = kg + slot * D;
        for (int64_t j = 0; j < G; ++j) {
          const float* qrow = qf.data() + j * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qrow[d] * static_cast<float>(krow[d]);
          scores[j * n + i] = dot * fscale;
        }
      }
      // softmax per query head (max-subtracted, fp32)
      for (int64_t j = 0; j < G; ++j) {
        float* s = scores.data() + j * n;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) {
          s[i] = std::exp(s[i] - mx);
          sum += s[i];
        }
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < n; ++i) s[i] *= inv;
      }
      // acc_j = sum_i p_j[i] * v_(first + i)
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = first + i;
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const T* vrow = vg + slot * D;
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

at::Tensor decode_attention(
    const at::Tensor& q,             // (B, H, D) fp32 or bf16
    const at::Tensor& k_cache,       // (Hkv, num_slots, D) same dtype, contiguous
    const at::Tensor& v_cache,       // (Hkv, num_slots, D)
    const at::Tensor& block_tables,  // (B, NB) int64: blocks of each sequence, in order
    const at::Tensor& lens,          // (B,) int64: context length of each sequence (keys to read)
    int64_t block_size,
    double scale,
    int64_t window) {                // 0: none; else only the last `window` keys are visible
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "bad ranks");
  const auto dt = q.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && k_cache.scalar_type() == dt &&
                  v_cache.scalar_type() == dt, "fp32 or bf16, the same for q and the cache");
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
  if (dt == at::kFloat) {
    decode_attention_impl<float>(qc, k_cache, v_cache, bt, ln, block_size, static_cast<float>(scale),
                                 window, out);
  } else {
    decode_attention_impl<at::BFloat16>(qc, k_cache, v_cache, bt, ln, block_size,
                                        static_cast<float>(scale), window, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(convoy, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor lens, int block_size, float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(convoy, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
