// One decoder layer (Llama family or Gemma 3) for a step of decode tokens, in one call: at one
// sequence the layer's kernels take a few microseconds each and the Python between them (module
// calls, splits, views, ~10 op dispatches of ~4 us) was as long as all of them together
// (SmolLM2: ~80 us a layer, 2.5 ms of a 15 ms step). The same kernels run here, on the same inputs
// and in the same order as in models/llama.py and models/gemma3.py, so the result is the same
// bits (tested).
//
//   h = in_norm(residual += delta); q, k, v = split(qkv(h)); [q, k = q_norm(q), k_norm(k)]
//   rotary + cache write; a = o_proj(attention(q, cache)); [a = attn_out_norm(a)]
//   h = ff_in_norm(residual += a); out = down(act(gate) * up)(h); [out = ff_out_norm(out)]
//
// (Llama: ff_in_norm is its post_attention_layernorm and no bracketed norm; Gemma 3 has them
// all, (1 + w) scaled: norm_offset 1; Gemma 2 too, without q/k norms, with attention scores
// soft-capped: softcap > 0.) Returns the layer's output still to add; `residual` is
// updated in place. Quantized linears (csrc/quant_linear.cpp) and fp32 activations only.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "ops.h"

namespace {

using OptTensor = std::optional<at::Tensor>;

inline bool given(const OptTensor& t) { return t.has_value() && t->defined(); }

// The layer up to its feed-forward: returns ff_in_norm(residual += attention) (residual updated).
at::Tensor attention_half(
    const OptTensor& delta, at::Tensor& residual, double eps, double norm_offset,
    const at::Tensor& in_norm, const OptTensor& q_norm, const OptTensor& k_norm,
    const OptTensor& attn_out_norm, const at::Tensor& ff_in_norm, const at::Tensor& qkv_w,
    int64_t qkv_kind, const OptTensor& qkv_bias, const at::Tensor& o_w, int64_t o_kind,
    int64_t H, int64_t Hkv, int64_t D, const at::Tensor& positions, const at::Tensor& cos,
    const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& lens,
    int64_t block_size, double scale, int64_t window, double softcap) {
  TORCH_CHECK(residual.dim() == 2 && residual.scalar_type() == at::kFloat,
              "decode_layer: residual (T, hidden) fp32");
  TORCH_CHECK(given(q_norm) == given(k_norm), "decode_layer: q_norm and k_norm together");
  const int64_t T = residual.size(0), hidden = residual.size(1);
  const int64_t q_size = H * D, kv_size = Hkv * D;
  at::Tensor h = given(delta) ? convoy::add_rms_norm(*delta, residual, in_norm, eps, norm_offset)
                              : convoy::rms_norm(residual, in_norm, eps, norm_offset);
  const at::Tensor qkv = convoy::quant_linear(h, qkv_w, qkv_kind, q_size + 2 * kv_size, qkv_bias);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({T, H, D});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, Hkv, D});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, Hkv, D});
  if (given(q_norm)) {
    q = convoy::rms_norm(q, *q_norm, eps, norm_offset);
    k = convoy::rms_norm(k, *k_norm, eps, norm_offset);
  }
  convoy::rotary_cache(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping);
  const at::Tensor o = convoy::decode_attention(q, k_cache, v_cache, block_tables, lens,
                                                block_size, scale, window, softcap);
  at::Tensor attn =
      convoy::quant_linear(o.view({T, q_size}), o_w, o_kind, hidden, std::nullopt);
  if (given(attn_out_norm)) attn = convoy::rms_norm(attn, *attn_out_norm, eps, norm_offset);
  return convoy::add_rms_norm(attn, residual, ff_in_norm, eps, norm_offset);
}

at::Tensor gated_mlp(const at::Tensor& h, const at::Tensor& gate_up_w, int64_t gate_up_kind,
                     const at::Tensor& down_w, int64_t down_kind, int64_t inter, int64_t act) {
  const at::Tensor gate_up =
      convoy::quant_linear(h, gate_up_w, gate_up_kind, 2 * inter, std::nullopt);
  return convoy::quant_linear(convoy::act_and_mul(gate_up, act), down_w, down_kind, h.size(1),
                              std::nullopt);
}

at::Tensor decode_layer(
    const OptTensor& delta, at::Tensor residual, double eps, double norm_offset,
    const at::Tensor& in_norm, const OptTensor& q_norm, const OptTensor& k_norm,
    const OptTensor& attn_out_norm, const at::Tensor& ff_in_norm, const OptTensor& ff_out_norm,
    const at::Tensor& qkv_w, int64_t qkv_kind, const OptTensor& qkv_bias, const at::Tensor& o_w,
    int64_t o_kind, const at::Tensor& gate_up_w, int64_t gate_up_kind, const at::Tensor& down_w,
    int64_t down_kind, int64_t H, int64_t Hkv, int64_t D, int64_t inter, int64_t act,
    const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& lens, int64_t block_size, double scale,
    int64_t window, double softcap) {
  const at::Tensor h = attention_half(
      delta, residual, eps, norm_offset, in_norm, q_norm, k_norm, attn_out_norm, ff_in_norm,
      qkv_w, qkv_kind, qkv_bias, o_w, o_kind, H, Hkv, D, positions, cos, sin, k_cache, v_cache,
      slot_mapping, block_tables, lens, block_size, scale, window, softcap);
  at::Tensor out = gated_mlp(h, gate_up_w, gate_up_kind, down_w, down_kind, inter, act);
  if (given(ff_out_norm)) out = convoy::rms_norm(out, *ff_out_norm, eps, norm_offset);
  return out;
}

// A mixture-of-experts layer (models/moe.py SparseMoe, Llama attention): the attention half as
// above, then router logits (dense_linear), top-k (moe_topk), every routed expert in one call
// (moe_experts) and, where given, the shared expert scaled by sigmoid(its gate):
//   out = experts(h) + sigmoid(h @ shared_gate.T) * shared(h)
at::Tensor decode_moe_layer(
    const OptTensor& delta, at::Tensor residual, double eps, double norm_offset,
    const at::Tensor& in_norm, const OptTensor& q_norm, const OptTensor& k_norm,
    const at::Tensor& ff_in_norm, const at::Tensor& qkv_w, int64_t qkv_kind,
    const OptTensor& qkv_bias, const at::Tensor& o_w, int64_t o_kind, int64_t H, int64_t Hkv,
    int64_t D, int64_t act, const at::Tensor& router_w, int64_t top_k, bool normalize,
    const at::Tensor& experts_gate_up, int64_t experts_gate_up_kind,
    const at::Tensor& experts_down, int64_t experts_down_kind, int64_t expert_inter,
    const OptTensor& shared_gate_up, int64_t shared_gate_up_kind, const OptTensor& shared_down,
    int64_t shared_down_kind, int64_t shared_inter, const OptTensor& shared_gate,
    const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& lens, int64_t block_size, double scale,
    int64_t window, double softcap) {
  TORCH_CHECK(given(shared_gate_up) == given(shared_down) && given(shared_down) == given(shared_gate),
              "decode_moe_layer: the shared expert's gate_up, down and gate together");
  const at::Tensor h = attention_half(
      delta, residual, eps, norm_offset, in_norm, q_norm, k_norm, std::nullopt, ff_in_norm,
      qkv_w, qkv_kind, qkv_bias, o_w, o_kind, H, Hkv, D, positions, cos, sin, k_cache, v_cache,
      slot_mapping, block_tables, lens, block_size, scale, window, softcap);
  const auto [weights, ids] = convoy::moe_topk(convoy::dense_linear(h, router_w), top_k, normalize);
  at::Tensor out = convoy::moe_experts(h, ids, weights, experts_gate_up, experts_gate_up_kind,
                                       experts_down, experts_down_kind, expert_inter, act);
  if (given(shared_gate_up)) {
    const at::Tensor shared = gated_mlp(h, *shared_gate_up, shared_gate_up_kind, *shared_down,
                                        shared_down_kind, shared_inter, act);
    const at::Tensor gate = convoy::sigmoid_gate(h, *shared_gate);
    out = out.add(gate.mul(shared));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(convoy, m) {
  m.def(
      "decode_layer(Tensor? delta, Tensor(a!) residual, float eps, float norm_offset, "
      "Tensor in_norm, Tensor? q_norm, Tensor? k_norm, Tensor? attn_out_norm, Tensor ff_in_norm, "
      "Tensor? ff_out_norm, Tensor qkv_w, int qkv_kind, Tensor? qkv_bias, Tensor o_w, "
      "int o_kind, Tensor gate_up_w, int gate_up_kind, Tensor down_w, int down_kind, int H, "
      "int Hkv, int D, int inter, int act, Tensor positions, Tensor cos, Tensor sin, "
      "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, Tensor block_tables, "
      "Tensor lens, int block_size, float scale, int window, float softcap) -> Tensor");
}

TORCH_LIBRARY_FRAGMENT(convoy, m) {
  m.def(
      "decode_moe_layer(Tensor? delta, Tensor(a!) residual, float eps, float norm_offset, "
      "Tensor in_norm, Tensor? q_norm, Tensor? k_norm, Tensor ff_in_norm, Tensor qkv_w, "
      "int qkv_kind, Tensor? qkv_bias, Tensor o_w, int o_kind, int H, int Hkv, int D, int act, "
      "Tensor router_w, int top_k, bool normalize, Tensor experts_gate_up, "
      "int experts_gate_up_kind, Tensor experts_down, int experts_down_kind, int expert_inter, "
      "Tensor? shared_gate_up, int shared_gate_up_kind, Tensor? shared_down, "
      "int shared_down_kind, int shared_inter, Tensor? shared_gate, Tensor positions, "
      "Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor lens, int block_size, float scale, int window, "
      "float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(convoy, CPU, m) {
  m.impl("decode_layer", &decode_layer);
  m.impl("decode_moe_layer", &decode_moe_layer);
}
