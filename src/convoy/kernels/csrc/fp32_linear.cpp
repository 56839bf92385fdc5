// fp32 linear layers on the CPU, in place of oneDNN's (issue #29).
//
// oneDNN builds and caches a primitive (its JIT code, 0.4-1.8 MB) per input shape, in its own
// cache and ideep's, and a serving step's row count takes any value up to the token budget: the
// fp32 server's RSS rose in steps for as long as new row counts came (7-8 KB a request over
// 20,000 requests, padded counts and all), and was flat with both caches off (at ~12% of its
// throughput: every call rebuilt). This kernel (panel_gemm.h) has no per-shape state at all, and
// is batch invariant with the same bits on every ISA path. Against oneDNN on SmolLM2's shapes
// (2 cores): 1.2-2x at <= 66 rows, 0.93-1.05x at 258-702 (AVX2 and AVX-512 alike).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "panel_gemm.h"

namespace {

using convoy::panel::kPanel;
using convoy::panel::Weight;

// (N, K) fp32 -> (ceil(N / 16), K, 16), zero-padded past N.
at::Tensor pack_fp32_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "(N, K) fp32 weight");
  return convoy::panel::pack<float>(weight);
}

// x (M, K) fp32, packed from pack_fp32_weight, bias (N,) or none -> (M, N) fp32.
at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be (M, K) fp32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous(),
              "packed weight expected");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && packed.size(2) == kPanel && (N + kPanel - 1) / kPanel == P,
              "weight shape does not match input");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, xc.options());
  convoy::panel::gemm<Weight::F32>(xc.data_ptr<float>(), M, K, packed.data_ptr<float>(), P,
                                   out.data_ptr<float>(), N);
  if (bias.has_value() && bias->defined()) out.add_(bias->to(at::kFloat));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(convoy, m) {
  m.def("pack_fp32_weight(Tensor weight) -> Tensor");
  m.def("fp32_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(convoy, CPU, m) {
  m.impl("pack_fp32_weight", &pack_fp32_weight);
  m.impl("fp32_linear", &fp32_linear);
}
