// bf16- and fp16-weight linear layers on the CPU: the model's bf16 linears, and a GGUF's F16 and
// BF16 ones kept 16-bit.
//
// Without native bf16 (AVX2 hosts) torch's bf16 matmul is emulated: 64x576x3072 runs at ~16
// GFLOP/s on two cores, against ~120 for fp32 through oneDNN. With native bf16 oneDNN is fast,
// but it builds and caches a primitive per input shape (issue #29: the bf16 server grew ~17 KB a
// request on an AVX-512 BF16 host with padded row counts). This kernel (panel_gemm.h) keeps the
// weights in their 16 bits (half the memory and memory traffic of fp32), widens them to fp32 in
// registers, exactly, and accumulates in fp32 with FMAs; the output is rounded to x's dtype once.
// It has no per-shape state, and each row's sum runs in one fixed order whatever the batch and
// the ISA path: batch invariant, the same bits on AVX2, AVX-512 and the portable loop. Widening
// is exact, so the result differs from an fp32 matmul of the same weights only by summation order.
// Two forms: `bf16_linear` (16-wide panels, fp32 activations; a GGUF's F16/BF16 linears) and
// `bf16_pairs_linear` (panels of k pairs, bf16 activations; the model's bf16 linears), which runs
// vdpbf16ps where the CPU has AVX512-BF16 and FMAs in its order elsewhere.

#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdlib>

#include "panel_gemm.h"

namespace {

using convoy::panel::kPanel;
using convoy::panel::Weight;

// (N, K) bf16 or fp16 -> (ceil(N / 16), K, 16) of the same dtype, zero-padded past N.
at::Tensor pack_bf16_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 &&
                  (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kHalf),
              "(N, K) bf16 or fp16 weight");
  return convoy::panel::pack<uint16_t>(weight);
}

// x (M, K) bf16 or fp32, packed from pack_bf16_weight (bf16 or fp16), bias (N,) or none ->
// (M, N) in x's dtype.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2, "x must be (M, K)");
  const bool half = packed.scalar_type() == at::kHalf;
  TORCH_CHECK(packed.dim() == 3 && (half || packed.scalar_type() == at::kBFloat16) &&
                  packed.is_contiguous(),
              "packed weight expected");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && packed.size(2) == kPanel && (N + kPanel - 1) / kPanel == P,
              "weight shape does not match input");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, xf.options());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  if (half) {
    convoy::panel::gemm<Weight::F16>(xf.data_ptr<float>(), M, K, wp, P, out.data_ptr<float>(), N);
  } else {
    convoy::panel::gemm<Weight::BF16>(xf.data_ptr<float>(), M, K, wp, P, out.data_ptr<float>(), N);
  }
  if (bias.has_value() && bias->defined()) out.add_(bias->to(at::kFloat));
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// (N, K) bf16 -> k pairs, (ceil(N / 16), ceil(K / 2), 32) bf16 (panel_gemm.h's BF16_PAIRS).
at::Tensor pack_bf16_pairs(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "(N, K) bf16 weight");
  return (convoy::panel::pack<uint16_t, 2>(weight));
}

// Whether this build and CPU run vdpbf16ps; CONVOY_CPU_VDPBF16PS=0 says no (the tests' way to
// run the AVX-512 FMA loops on a CPU that has it).
bool has_vdpbf16ps() {
#ifdef CONVOY_PANEL_AVX512
  static const bool has = [] {
    const char* off = std::getenv("CONVOY_CPU_VDPBF16PS");
    return __builtin_cpu_supports("avx512bf16") && !(off && off[0] == '0');
  }();
  return has;
#else
  return false;
#endif
}

// x (M, K) bf16 (fp32 is rounded to bf16 first), packed from pack_bf16_pairs, bias (N,) or none
// -> (M, N) in x's dtype. Both factors are bf16, so every product is exact and vdpbf16ps (where
// this build and CPU have it) gives the bits of the FMA loops in its order.
at::Tensor bf16_pairs_linear(const at::Tensor& x, const at::Tensor& packed,
                             const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2, "x must be (M, K)");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == 2 * kPanel,
              "packed weight pairs expected");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), K2 = packed.size(1);
  TORCH_CHECK(K2 == (K + 1) / 2 && (N + kPanel - 1) / kPanel == P,
              "weight shape does not match input");
  at::Tensor xb = x.to(at::kBFloat16);
  if (K % 2) xb = at::constant_pad_nd(xb, {0, 1});  // the pad's weights are zeros
  xb = xb.contiguous();
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  bool native = has_vdpbf16ps();
#ifdef CONVOY_PANEL_AVX512
  if (native) {
    convoy::panel::gemm<Weight::BF16_DP>(reinterpret_cast<const uint16_t*>(xb.data_ptr()), M,
                                         2 * K2, wp, P, out.data_ptr<float>(), N);
  }
#endif
  if (!native) {
    const at::Tensor xf = xb.to(at::kFloat);  // exact
    convoy::panel::gemm<Weight::BF16_PAIRS>(xf.data_ptr<float>(), M, 2 * K2, wp, P,
                                            out.data_ptr<float>(), N);
  }
  if (bias.has_value() && bias->defined()) out.add_(bias->to(at::kFloat));
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(convoy, m) {
  m.def("pack_bf16_weight(Tensor weight) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("pack_bf16_pairs(Tensor weight) -> Tensor");
  m.def("bf16_pairs_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(convoy, CPU, m) {
  m.impl("pack_bf16_weight", &pack_bf16_weight);
  m.impl("bf16_linear", &bf16_linear);
  m.impl("pack_bf16_pairs", &pack_bf16_pairs);
  m.impl("bf16_pairs_linear", &bf16_pairs_linear);
}
