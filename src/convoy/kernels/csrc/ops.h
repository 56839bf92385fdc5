// The kernels' entry points, for C++ callers in this library (decoder_layer.cpp): the functions
// the `convoy::` torch ops run, so a fused caller runs the same code as the per-op path.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace convoy {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset);
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps, double offset);
void rotary_cache(at::Tensor& q, at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                  const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                  at::Tensor& v_cache, const at::Tensor& slot_mapping);
at::Tensor act_and_mul(const at::Tensor& x, int64_t act);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& lens, int64_t block_size, double scale,
                            int64_t window, double softcap);
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t kind, int64_t N,
                        const std::optional<at::Tensor>& bias);
// MoE routed experts on stacked quant_linear panels (quant_linear.cpp): x (T, H) fp32, ids and
// weights (T, k) int64 / fp32 -> (T, H) fp32, sum_j weights[:, j] * expert_{ids[:, j]}(x).
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                       const at::Tensor& gate_up, int64_t gate_up_kind, const at::Tensor& down,
                       int64_t down_kind, int64_t inter, int64_t act);
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w);
at::Tensor sigmoid_gate(const at::Tensor& x, const at::Tensor& w);
std::tuple<at::Tensor, at::Tensor> moe_topk(const at::Tensor& logits, int64_t k, bool normalize);

}  // namespace convoy
