// The MoE router, batch invariant: its logits decide which experts a row meets, so a row's logits
// must not depend on which other rows share its step (torch's GEMM picks kernels and blockings by
// the batch size, and a logit one ulp off can swap two experts).
//
//   dense_linear(x, w)               x (T, H) fp32 @ w (E, H) fp32 .T -> (T, E) fp32
//   sigmoid_gate(x, w)               sigmoid(dense_linear(x, w)), elementwise in scalar code
//   moe_topk(logits, k, normalize)   softmax (fp32), top k (ties: the lower expert first),
//                                    [weights /= their sum] -> (weights (T, k) fp32, ids int64)
//
// dense_linear: every output is one dot in a fixed order: element i goes to accumulator lane
// i % 32 (fma), then lanes l and l + 16 are added, then l and l + 8, + 4, + 2, + 1. The AVX2 path
// (4 registers of 8 lanes) and the portable one do exactly these steps: the same bits on every
// host, for any T or thread split (threads split the experts, never a dot).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CONVOY_ROUTER_AVX2 1
#endif

namespace {

constexpr int64_t kLanes = 32;

// lanes l and l + half added for l < half, half = 16, 8, 4, 2, 1 -> lane 0
inline float reduce_lanes(float* acc) {
  for (int64_t half = kLanes / 2; half >= 1; half /= 2)
    for (int64_t l = 0; l < half; ++l) acc[l] = acc[l] + acc[l + half];
  return acc[0];
}

float dot_fixed(const float* x, const float* w, int64_t n) {
  alignas(32) float acc[kLanes] = {};
  int64_t i = 0;
#ifdef CONVOY_ROUTER_AVX2
  __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                 _mm256_setzero_ps()};
  for (; i + kLanes <= n; i += kLanes)
    for (int r = 0; r < 4; ++r)
      a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8 * r), _mm256_loadu_ps(w + i + 8 * r), a[r]);
  for (int r = 0; r < 4; ++r) _mm256_store_ps(acc + 8 * r, a[r]);
#endif
  for (; i < n; ++i) acc[i % kLanes] = std::fma(x[i], w[i], acc[i % kLanes]);
  return reduce_lanes(acc);
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "dense_linear: x (T, H) fp32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.size(1) == x.size(1),
              "dense_linear: w (E, H) fp32, H as x's");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t T = xc.size(0), H = xc.size(1), E = wc.size(0);
  at::Tensor out = at::empty({T, E}, xc.options());
  if (T == 0 || E == 0) return out;
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // experts split across threads; each expert's weight row is reused by every x row
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, T * H));
  at::parallel_for(0, E, grain, [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; ++e)
      for (int64_t t = 0; t < T; ++t) op[t * E + e] = dot_fixed(xp + t * H, wp + e * H, H);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> moe_topk(const at::Tensor& logits, int64_t k, bool normalize) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "moe_topk: logits (T, E) fp32");
  const at::Tensor lc = logits.contiguous();
  const int64_t T = lc.size(0), E = lc.size(1);
  TORCH_CHECK(k >= 1 && k <= E, "moe_topk: k must be in [1, ", E, "], not ", k);
  at::Tensor weights = at::empty({T, k}, lc.options());
  at::Tensor ids = at::empty({T, k}, lc.options().dtype(at::kLong));
  const float* lp = lc.data_ptr<float>();
  float* wp = weights.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  at::parallel_for(0, T, std::max<int64_t>(1, 4096 / E), [&](int64_t t0, int64_t t1) {
    std::vector<float> p(static_cast<size_t>(E)), key(static_cast<size_t>(E));
    std::vector<int64_t> order(static_cast<size_t>(E));
    for (int64_t t = t0; t < t1; ++t) {
      const float* l = lp + t * E;
      float mx = l[0];
      for (int64_t e = 1; e < E; ++e) mx = std::max(mx, l[e]);
      float sum = 0.f;
      for (int64_t e = 0; e < E; ++e) {
        p[e] = std::exp(l[e] - mx);
        sum += p[e];
      }
      for (int64_t e = 0; e < E; ++e) p[e] = p[e] / sum;
      for (int64_t e = 0; e < E; ++e) {
        order[e] = e;
        key[e] = std::isnan(p[e]) ? -INFINITY : p[e];  // a strict weak order even with NaNs
      }
      // the larger probability first, the lower expert among equals
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
        return key[a] > key[b] || (key[a] == key[b] && a < b);
      });
      float* w = wp + t * k;
      int64_t* id = ip + t * k;
      float total = 0.f;
      for (int64_t j = 0; j < k; ++j) {
        id[j] = order[j];
        w[j] = p[order[j]];
        total += w[j];
      }
      if (normalize)
        for (int64_t j = 0; j < k; ++j) w[j] = w[j] / total;
    }
  });
  return {weights, ids};
}

// sigmoid(dense_linear(x, w)), each element by the scalar 1 / (1 + expf(-g)): torch's sigmoid
// takes a vector path for most elements and a scalar one for a tail, so an element's bits would
// depend on where its row sits in the batch (Qwen2-MoE's shared-expert gate is one column).
at::Tensor sigmoid_gate(const at::Tensor& x, const at::Tensor& w) {
  at::Tensor g = dense_linear(x, w);
  float* p = g.data_ptr<float>();
  for (int64_t i = 0, n = g.numel(); i < n; ++i) p[i] = 1.f / (1.f + std::exp(-p[i]));
  return g;
}

}  // namespace

namespace convoy {
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w) { return ::dense_linear(x, w); }
at::Tensor sigmoid_gate(const at::Tensor& x, const at::Tensor& w) { return ::sigmoid_gate(x, w); }
std::tuple<at::Tensor, at::Tensor> moe_topk(const at::Tensor& logits, int64_t k, bool normalize) {
  return ::moe_topk(logits, k, normalize);
}
}  // namespace convoy

TORCH_LIBRARY_FRAGMENT(convoy, m) {
  m.def("dense_linear(Tensor x, Tensor w) -> Tensor");
  m.def("moe_topk(Tensor logits, int k, bool normalize) -> (Tensor, Tensor)");
  m.def("sigmoid_gate(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(convoy, CPU, m) {
  m.impl("dense_linear", &dense_linear);
  m.impl("moe_topk", &moe_topk);
  m.impl("sigmoid_gate", &sigmoid_gate);
}
