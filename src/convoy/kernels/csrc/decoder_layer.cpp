// One Llama-family decoder layer for a step of decode tokens, in one call: at one sequence the
// layer's kernels take a few microseconds each and the Python between them (module calls, splits,
// views, ~10 op dispatches of ~4 us) was as long as all of them together (SmolLM2: ~80 us a layer,
// 2.5 ms of a 15 ms step). The same kernels run here, on the same inputs and in the same order
// as in models/llama.py, so the result is the same bits (tested).
//
//   h = norm(residual (+= delta)); q, k, v = split(qkv(h)); rotary + cache write;
//   o = attention(q, cache); h = norm(residual += o_proj(o)); delta = down(act(gate) * up)(h)
//
// Returns the layer's output still to add (delta); `residual` is updated in place. Quantized
// linears (csrc/quant_linear.cpp) and fp32 activations only; the caller checks.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "ops.h"

namespace {

at::Tensor llama_decode_layer(
    const std::optional<at::Tensor>& delta, at::Tensor residual, const at::Tensor& in_norm,
    const at::Tensor& post_norm, double eps, const at::Tensor& qkv_w, int64_t qkv_kind,
    const std::optional<at::Tensor>& qkv_bias, const at::Tensor& o_w, int64_t o_kind,
    const at::Tensor& gate_up_w, int64_t gate_up_kind, const at::Tensor& down_w,
    int64_t down_kind, int64_t H, int64_t Hkv, int64_t D, int64_t inter, int64_t act,
    const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& lens, int64_t block_size, double scale,
    int64_t window) {
  TORCH_CHECK(residual.dim() == 2 && residual.scalar_type() == at::kFloat,
              "llama_decode_layer: residual (T, hidden) fp32");
  const int64_t T = residual.size(0), hidden = residual.size(1);
  const int64_t q_size = H * D, kv_size = Hkv * D;
  at::Tensor h = delta.has_value() && delta->defined()
                     ? convoy::add_rms_norm(*delta, residual, in_norm, eps, 0.0)
                     : convoy::rms_norm(residual, in_norm, eps, 0.0);
  const at::Tensor qkv = convoy::quant_linear(h, qkv_w, qkv_kind, q_size + 2 * kv_size, qkv_bias);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({T, H, D});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, Hkv, D});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, Hkv, D});
  convoy::rotary_cache(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping);
  const at::Tensor o = convoy::decode_attention(q, k_cache, v_cache, block_tables, lens,
                                                block_size, scale, window);
  const at::Tensor attn = convoy::quant_linear(o.view({T, q_size}), o_w, o_kind, hidden,
                                               std::nullopt);
  h = convoy::add_rms_norm(attn, residual, post_norm, eps, 0.0);
  const at::Tensor gate_up =
      convoy::quant_linear(h, gate_up_w, gate_up_kind, 2 * inter, std::nullopt);
  const at::Tensor out = convoy::quant_linear(convoy::act_and_mul(gate_up, act), down_w,
                                              down_kind, hidden, std::nullopt);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(convoy, m) {
  m.def(
      "llama_decode_layer(Tensor? delta, Tensor(a!) residual, Tensor in_norm, Tensor post_norm, "
      "float eps, Tensor qkv_w, int qkv_kind, Tensor? qkv_bias, Tensor o_w, int o_kind, "
      "Tensor gate_up_w, int gate_up_kind, Tensor down_w, int down_kind, int H, int Hkv, int D, "
      "int inter, int act, Tensor positions, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor lens, "
      "int block_size, float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(convoy, CPU, m) { m.impl("llama_decode_layer", &llama_decode_layer); }
