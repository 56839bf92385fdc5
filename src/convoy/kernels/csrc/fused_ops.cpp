// The small per-layer ops of a decoder step, fused: one call (and one pass over memory) each
// instead of the ~5-8 eager torch ops they take in Python.
//
//   rms_norm(x, w, eps, offset)                  out = rmsnorm(x) * (offset + w)
//   add_rms_norm(x, residual, w, eps, offset)    residual += x; out = rmsnorm(residual) * (offset + w)
//   rotary_cache(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping)
//       rotate-half rotary on q and k in place, then k and v written to their paged cache slots
//       (converted to the cache's dtype: fp32, bf16 or fp16)
//   act_and_mul(gate_up, act)                    out = act(gate) * up; act 0 = SiLU, 1 = GELU(tanh)
//
// Activations fp32 or bf16. Numerics follow the torch code they replace (models/layers.py): the
// norm's sum of squares and scale in fp32; Llama's scale (offset 0) multiplies the normalised row
// after it is rounded to the activation dtype, Gemma's (1 + w) before; rotary products and sums
// are rounded to the activation dtype one by one as torch's elementwise ops do (fp32: the same
// bits as torch). Rows (tokens) are split across threads, never a row's reduction: a row's result
// does not depend on how many rows the call has (batch invariance).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "activation.h"
#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// Rows of about this many elements per thread task: small calls stay on one thread.
constexpr int64_t kGrainElems = 16384;

inline int64_t grain_rows(int64_t row_elems) {
  return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, row_elems));
}

// Round a float to T and back (identity for float): what storing an intermediate in T does.
template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// Offset (in elements) of row `r` of a tensor viewed as (rows, last dim), any strides in the
// leading dims (up to 3 of them), the last dim contiguous.
struct Rows {
  int64_t n0 = 1, n1 = 1, s0 = 0, s1 = 0, s2 = 0, n2 = 1;
  explicit Rows(const at::Tensor& t) {
    const int64_t lead = t.dim() - 1;
    TORCH_CHECK(lead >= 1 && lead <= 3, "expected 2 to 4 dims");
    TORCH_CHECK(t.stride(-1) == 1, "the last dim must be contiguous");
    // leading dims right-aligned into (n0, n1, n2)
    int64_t sizes[3] = {1, 1, 1}, strides[3] = {0, 0, 0};
    for (int64_t i = 0; i < lead; ++i) {
      sizes[3 - lead + i] = t.size(i);
      strides[3 - lead + i] = t.stride(i);
    }
    n0 = sizes[0], n1 = sizes[1], n2 = sizes[2];
    s0 = strides[0], s1 = strides[1], s2 = strides[2];
  }
  int64_t count() const { return n0 * n1 * n2; }
  int64_t offset(int64_t r) const {
    const int64_t i2 = r % n2;
    const int64_t rest = r / n2;
    return (rest / n1) * s0 + (rest % n1) * s1 + i2 * s2;
  }
};

// ---------------------------------------------------------------------------------------------
// RMSNorm

template <typename T>
inline void norm_row(const T* xr, T* outr, const T* w, int64_t n, float eps, float offset) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(xr[i]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  if (offset != 0.f) {  // Gemma: x_hat * (offset + w) in fp32, one rounding
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float scale = offset + static_cast<float>(w[i]);
      outr[i] = static_cast<T>((static_cast<float>(xr[i]) * r) * scale);
    }
  } else {  // Llama: round x_hat to T, then w * x_hat in T
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float xh = round_to<T>(static_cast<float>(xr[i]) * r);
      outr[i] = static_cast<T>(static_cast<float>(w[i]) * xh);
    }
  }
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, at::Tensor* residual, const at::Tensor& w, double eps,
                   double offset, at::Tensor& out) {
  const int64_t n = x.size(-1);
  const Rows xrows(x);
  const Rows rrows = residual ? Rows(*residual) : xrows;
  const int64_t num_rows = xrows.count();
  const T* xp = x.data_ptr<T>();
  T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float feps = static_cast<float>(eps), foff = static_cast<float>(offset);
  at::parallel_for(0, num_rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = xp + xrows.offset(row);
      T* outr = op + row * n;
      if (rp != nullptr) {
        T* rr = rp + rrows.offset(row);
#pragma omp simd
        for (int64_t i = 0; i < n; ++i)
          rr[i] = static_cast<T>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
        norm_row<T>(rr, outr, wp, n, feps, foff);
      } else {
        norm_row<T>(xr, outr, wp, n, feps, foff);
      }
    }
  });
}

void check_norm_args(const at::Tensor& x, const at::Tensor& w) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "rms_norm: fp32 or bf16 activations");
  TORCH_CHECK(w.scalar_type() == dt && w.dim() == 1 && w.is_contiguous() &&
                  w.size(0) == x.size(-1), "rms_norm: weight (N,) contiguous, x's dtype");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset) {
  check_norm_args(x, weight);
  const at::Tensor xc = x.stride(-1) == 1 && x.dim() >= 2 && x.dim() <= 4 ? x : x.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  if (x.scalar_type() == at::kFloat) {
    rms_norm_impl<float>(xc, nullptr, weight, eps, offset, out);
  } else {
    rms_norm_impl<at::BFloat16>(xc, nullptr, weight, eps, offset, out);
  }
  return out;
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps, double offset) {
  check_norm_args(x, weight);
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() && residual.sizes() == x.sizes(),
              "add_rms_norm: residual of x's shape and dtype");
  TORCH_CHECK(residual.stride(-1) == 1 && residual.dim() >= 2 && residual.dim() <= 4,
              "add_rms_norm: residual's last dim contiguous");
  const at::Tensor xc = x.stride(-1) == 1 && x.dim() >= 2 && x.dim() <= 4 ? x : x.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  if (x.scalar_type() == at::kFloat) {
    rms_norm_impl<float>(xc, &residual, weight, eps, offset, out);
  } else {
    rms_norm_impl<at::BFloat16>(xc, &residual, weight, eps, offset, out);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Rotary embedding + paged cache write

// out[d] = x[d] * c[d] - x[d + h] * s[d], out[d + h] = x[d + h] * c[d] + x[d] * s[d], each
// product and sum rounded to T (torch: q * cos + rotate_half(q) * sin with cos/sin in T). GCC
// contracts a * b + c into an FMA in C++ by default; off here, so fp32 gives torch's exact bits.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T>
void rotate_row(T* x, const float* c, const float* s, int64_t half) {
  for (int64_t d = 0; d < half; ++d) {
    const float x1 = static_cast<float>(x[d]), x2 = static_cast<float>(x[d + half]);
    const float a = round_to<T>(x1 * c[d]);
    const float b = round_to<T>(-x2 * s[d]);
    const float e = round_to<T>(x2 * c[d]);
    const float f = round_to<T>(x1 * s[d]);
    x[d] = static_cast<T>(a + b);
    x[d + half] = static_cast<T>(e + f);
  }
}
#pragma GCC pop_options

template <typename C, typename T>
inline void store_row(C* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<C>(static_cast<float>(src[i]));
}

template <typename T, typename C>
void rotary_cache_impl(at::Tensor& q, at::Tensor& k, const at::Tensor& v, const int64_t* pos,
                       const float* cos, const float* sin, int64_t num_positions,
                       at::Tensor* k_cache, at::Tensor* v_cache, const int64_t* slots) {
  const int64_t T_ = q.size(0), H = q.size(1), Hkv = k.size(1), D = q.size(2), half = D / 2;
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1);
  C* kc = k_cache ? k_cache->data_ptr<C>() : nullptr;
  C* vc = v_cache ? v_cache->data_ptr<C>() : nullptr;
  const int64_t S = k_cache ? k_cache->size(1) : 0;
  at::parallel_for(0, T_, grain_rows((H + 2 * Hkv) * D), [&](int64_t begin, int64_t end) {
    float cb[512], sb[512];  // this token's cos/sin, rounded to T (D / 2 <= 512)
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = pos[t];
      TORCH_CHECK(p >= 0 && p < num_positions, "rotary: position out of range");
      for (int64_t d = 0; d < half; ++d) {
        cb[d] = round_to<T>(cos[p * half + d]);
        sb[d] = round_to<T>(sin[p * half + d]);
      }
      for (int64_t h = 0; h < H; ++h) rotate_row<T>(qp + t * qs0 + h * qs1, cb, sb, half);
      for (int64_t h = 0; h < Hkv; ++h) rotate_row<T>(kp + t * ks0 + h * ks1, cb, sb, half);
      if (kc != nullptr) {
        const int64_t slot = slots[t];
        TORCH_CHECK(slot >= 0 && slot < S, "rotary_cache: slot out of range");
        for (int64_t h = 0; h < Hkv; ++h) {
          store_row<C, T>(kc + (h * S + slot) * D, kp + t * ks0 + h * ks1, D);
          store_row<C, T>(vc + (h * S + slot) * D, vp + t * vs0 + h * vs1, D);
        }
      }
    }
  });
}

template <typename T>
void rotary_cache_dispatch(at::Tensor& q, at::Tensor& k, const at::Tensor& v, const int64_t* pos,
                           const float* cos, const float* sin, int64_t num_positions,
                           at::Tensor* k_cache, at::Tensor* v_cache, const int64_t* slots) {
  const auto ct = k_cache ? k_cache->scalar_type() : q.scalar_type();
  if (ct == at::kFloat) {
    rotary_cache_impl<T, float>(q, k, v, pos, cos, sin, num_positions, k_cache, v_cache, slots);
  } else if (ct == at::kBFloat16) {
    rotary_cache_impl<T, at::BFloat16>(q, k, v, pos, cos, sin, num_positions, k_cache, v_cache,
                                       slots);
  } else if (ct == at::kHalf) {
    rotary_cache_impl<T, at::Half>(q, k, v, pos, cos, sin, num_positions, k_cache, v_cache, slots);
  } else {
    TORCH_CHECK(false, "rotary_cache: cache dtype must be fp32, bf16 or fp16");
  }
}

void rotary_cache(at::Tensor& q, at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                  const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                  at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "rotary_cache: fp32 or bf16 q");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "rotary_cache: (T, heads, D)");
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt, "rotary_cache: q, k, v one dtype");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "rotary_cache: the head dim must be contiguous");
  const int64_t T_ = q.size(0), D = q.size(2), Hkv = k.size(1);
  TORCH_CHECK(k.size(0) == T_ && v.size(0) == T_ && k.size(2) == D && v.sizes() == k.sizes() &&
                  D % 2 == 0 && D / 2 <= 512, "rotary_cache: shapes");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.size(1) == D / 2 && sin.sizes() == cos.sizes(),
              "rotary_cache: cos/sin (P, D / 2) fp32 contiguous");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == T_,
              "rotary_cache: positions (T,) int64");
  const bool write = k_cache.numel() > 0;
  if (write) {
    TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                    v_cache.sizes() == k_cache.sizes() &&
                    v_cache.scalar_type() == k_cache.scalar_type() && k_cache.size(0) == Hkv &&
                    k_cache.size(2) == D, "rotary_cache: caches (Hkv, num_slots, D) contiguous");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T_,
                "rotary_cache: slot_mapping (T,) int64");
  }
  if (T_ == 0) return;
  const at::Tensor pc = positions.contiguous();
  const at::Tensor sc = write ? slot_mapping.contiguous() : slot_mapping;
  const int64_t* slots = write ? sc.data_ptr<int64_t>() : nullptr;
  at::Tensor* kc = write ? &k_cache : nullptr;
  at::Tensor* vc = write ? &v_cache : nullptr;
  if (dt == at::kFloat) {
    rotary_cache_dispatch<float>(q, k, v, pc.data_ptr<int64_t>(), cos.data_ptr<float>(),
                                 sin.data_ptr<float>(), cos.size(0), kc, vc, slots);
  } else {
    rotary_cache_dispatch<at::BFloat16>(q, k, v, pc.data_ptr<int64_t>(), cos.data_ptr<float>(),
                                        sin.data_ptr<float>(), cos.size(0), kc, vc, slots);
  }
}

// ---------------------------------------------------------------------------------------------
// Gated activations (csrc/activation.h)

using convoy_act::act_mul_row;
using convoy_act::act_row;

template <typename T, int Act>
void act_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t n = out.size(-1);
  const Rows rows(x);
  const int64_t num_rows = rows.count();
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, num_rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n);
    for (int64_t row = begin; row < end; ++row) {
      const T* g = xp + rows.offset(row);
      const T* u = g + n;
      T* o = op + row * n;
      if constexpr (std::is_same_v<T, float>) {
        act_mul_row<Act>(g, u, o, n);
        continue;
      }
      for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(g[i]);
      act_row<Act>(buf.data(), n);
      for (int64_t i = 0; i < n; ++i)
        o[i] = static_cast<T>(round_to<T>(buf[i]) * static_cast<float>(u[i]));
    }
  });
}

at::Tensor act_and_mul(const at::Tensor& x, int64_t act) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "act_and_mul: fp32 or bf16");
  TORCH_CHECK(act == 0 || act == 1, "act_and_mul: act 0 (SiLU) or 1 (GELU tanh)");
  TORCH_CHECK(x.size(-1) % 2 == 0, "act_and_mul: even last dim (gate, up)");
  const at::Tensor xc = x.stride(-1) == 1 && x.dim() >= 2 && x.dim() <= 4 ? x : x.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() /= 2;
  at::Tensor out = at::empty(sizes, x.options());
  if (out.numel() == 0) return out;
  if (dt == at::kFloat) {
    act == 0 ? act_and_mul_impl<float, 0>(xc, out) : act_and_mul_impl<float, 1>(xc, out);
  } else {
    act == 0 ? act_and_mul_impl<at::BFloat16, 0>(xc, out)
             : act_and_mul_impl<at::BFloat16, 1>(xc, out);
  }
  return out;
}

}  // namespace

namespace convoy {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset) {
  return ::rms_norm(x, weight, eps, offset);
}
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps, double offset) {
  return ::add_rms_norm(x, residual, weight, eps, offset);
}
void rotary_cache(at::Tensor& q, at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                  const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                  at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  ::rotary_cache(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping);
}
at::Tensor act_and_mul(const at::Tensor& x, int64_t act) { return ::act_and_mul(x, act); }
}  // namespace convoy

TORCH_LIBRARY_FRAGMENT(convoy, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float offset) -> Tensor");
  m.def(
      "add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps, float offset) "
      "-> Tensor");
  m.def(
      "rotary_cache(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor positions, Tensor cos, "
      "Tensor sin, Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_mapping) -> ()");
  m.def("act_and_mul(Tensor x, int act) -> Tensor");
}

TORCH_LIBRARY_IMPL(convoy, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_cache", &rotary_cache);
  m.impl("act_and_mul", &act_and_mul);
}
