"""Mixture-of-experts families: Qwen2-MoE (routed experts + a gated shared expert), Qwen3-MoE and
Mixtral. Attention is Llama's (Qwen2's qkv bias, Qwen3's q/k norms); the feed-forward of a MoE
layer is a router, top-k experts and, for Qwen2-MoE, a shared expert:

    p = softmax(router(x)) (fp32); w, e = top_k(p) [w /= sum(w) where norm_topk_prob]
    y = sum_j w_j * expert_{e_j}(x)  [+ sigmoid(shared_gate(x)) * shared_expert(x)]

A step groups its rows by expert and runs each expert once over all the rows routed to it, so at
many streams each expert's weights are read once a step, and one stream reads only its k experts
(`Experts`: exact, torch; `QuantExperts`: the GGUF blocks, csrc kernels). The router runs in
fixed-order fp32 dots where the kernels are on (`Router`), so a row's experts never depend on
which other rows share its step.

Checkpoints keep one tensor per expert (`mlp.experts.3.gate_proj.weight`; Mixtral's
`block_sparse_moe.experts.3.w1`); the loader stacks them into the 3-D tensors the GGUF holds
(`ffn_gate_exps`: experts x rows x columns), gate and up joined: `mlp.experts.gate_up_proj.weight`
(E, 2I, H) and `mlp.experts.down_proj.weight` (E, H, I).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from convoy import kernels
from convoy.kernels.linear import QuantLinear, QuantParts, panel_kind, quantize_blocks
from convoy.kernels.ops import PANEL_ROWS, quant_linear, quant_pack
from convoy.model_config import ModelConfig
from convoy.models.layers import (
    CausalLM,
    RMSNorm,
    RotaryEmbedding,
    activation,
    native_activation,
    token_embedding,
)
from convoy.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, moe_config


class ExpertWeight(nn.Module):
    """One projection of every expert: weight (E, out, in)."""

    def __init__(self, experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))


def group_by_expert(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, list[int]]:
    """ids (T, k) -> (the (t, j) slots sorted by expert, stable: flat indices t * k + j; each
    expert's slot count)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts).tolist()
    return order, counts


class Experts(nn.Module):
    """The routed experts, unquantized: each expert with rows runs once over all of them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts, self.intermediate, self.act_name = e, i, cfg.hidden_act
        self.gate_up_proj = ExpertWeight(e, 2 * i, h)
        self.down_proj = ExpertWeight(e, h, i)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (T, H), ids / weights (T, k) -> sum_j weights[:, j] * expert_{ids[:, j]}(x)."""
        k = ids.shape[1]
        order, counts = group_by_expert(ids, self.num_experts)
        out = torch.zeros_like(x)
        start = 0
        gu, dn = self.gate_up_proj.weight, self.down_proj.weight
        for e, n in enumerate(counts):
            if n == 0:
                continue
            slots = order[start : start + n]
            start += n
            rows = slots // k
            gate, up = F.linear(x[rows], gu[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, dn[e])
            w = weights.reshape(-1)[slots].unsqueeze(1).to(y.dtype)
            out.index_add_(0, rows, y * w)
        return out


class QuantExperts(nn.Module):
    """The routed experts in GGUF blocks, repacked into csrc/quant_linear.cpp's 8-row panels:
    every expert's gate|up panels stacked (expert e: panels [e * Gu, (e + 1) * Gu)), and its down
    panels likewise. Each expert runs the quantized linears once over all its rows of the step;
    the same kernels as a dense QuantLinear, so every output element is reduced in a fixed order
    whatever else the step holds (batch invariant)."""

    panel_attrs = ("gate_up", "down")  # kernels.huge_pages.gather_in_huge_pages moves them

    def __init__(
        self,
        gate_up: QuantParts,
        down: QuantParts,
        hidden: int,
        intermediate: int,
        act: str,
        release: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """`release`, where given, is called with each expert's blocks (of each part) once they
        are packed: the loader drops their pages of the mapped file then, so a layer's experts
        are never resident twice (kernels.huge_pages.gather_in_huge_pages does the same for the
        panels' move)."""
        super().__init__()
        act_id = native_activation(act)
        if act_id is None:
            raise ValueError(f"activation {act!r} has no quantized-expert kernel")
        if intermediate % PANEL_ROWS or hidden % 32 or intermediate % 32:
            raise ValueError(f"expert shapes {hidden}x{intermediate} are not multiples of 32")
        self.act_id, self.hidden, self.intermediate = act_id, hidden, intermediate
        self.num_experts = int(gate_up[0][1].shape[0])
        self.gate_up_kind = panel_kind([q for q, _ in gate_up])
        self.down_kind = panel_kind([q for q, _ in down])
        self.qtypes = tuple(q for q, _ in (*gate_up, *down))
        self.gate_up = _pack_experts(gate_up, self.gate_up_kind, hidden, release)
        self.down = _pack_experts(down, self.down_kind, intermediate, release)
        self.gate_up_panels = self.gate_up.shape[0] // self.num_experts
        self.down_panels = self.down.shape[0] // self.num_experts

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (T, H), ids / weights (T, k) -> (T, H) fp32: `kernels.moe_experts`, one call for
        all experts; the same bits as `forward_loop`."""
        return kernels.moe_experts(
            x.float().contiguous(), ids.contiguous(), weights.float().contiguous(),
            self.gate_up, self.gate_up_kind, self.down, self.down_kind, self.intermediate,
            self.act_id,
        )  # fmt: skip

    def forward_loop(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The reference `forward` is tested against: each expert's quant_linear, act_and_mul and
        quant_linear over its rows, then the ranks combined in order."""
        x = x.float().contiguous()
        t, k = ids.shape
        order, counts = group_by_expert(ids, self.num_experts)
        ys = torch.empty(t * k, self.hidden)
        start = 0
        gu, dn, i2 = self.gate_up_panels, self.down_panels, 2 * self.intermediate
        for e, n in enumerate(counts):
            if n == 0:
                continue
            slots = order[start : start + n]
            start += n
            g = quant_linear(x[slots // k], self.gate_up[e * gu : (e + 1) * gu],
                             self.gate_up_kind, i2, None)  # fmt: skip
            a = kernels.act_and_mul(g, self.act_id)
            ys[slots] = quant_linear(a, self.down[e * dn : (e + 1) * dn], self.down_kind,
                                     self.hidden, None)  # fmt: skip
        ys = ys.view(t, k, self.hidden)
        w = weights.float()
        out = w[:, 0:1] * ys[:, 0]
        for j in range(1, k):  # in rank order: a row's sum never depends on its step
            out = out + w[:, j : j + 1] * ys[:, j]
        return out

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}, "
            f"ggml types {'+'.join(map(str, sorted(set(self.qtypes))))}"
        )


def _pack_experts(
    parts: QuantParts,
    kind: int,
    in_features: int,
    release: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """(E, rows, bytes) blocks of each part -> every expert's panels, parts joined, stacked;
    `release(blocks[e])` after each expert's part is packed."""
    out: torch.Tensor | None = None
    experts, row = int(parts[0][1].shape[0]), 0
    for e in range(experts):  # packed into one buffer as it goes: no second copy of the layer
        for q, blocks in parts:
            one = quant_pack(blocks[e].contiguous(), q, kind, in_features)
            if out is None:
                out = torch.empty((experts * sum(int(b.shape[1]) for _, b in parts) // PANEL_ROWS,
                                   *one.shape[1:]), dtype=one.dtype)  # fmt: skip
            out[row : row + one.shape[0]] = one
            row += one.shape[0]
            if release is not None:
                release(blocks[e])
    assert out is not None and row == out.shape[0]
    return out


def quantize_experts(model: nn.Module, bits: int) -> int:
    """Replace every `Experts` of a loaded model by `QuantExperts` in Q8_0 (bits 8) or Q4_1
    (bits 4), as kernels.linear.quantize_linears does for the linears; returns how many."""
    qtype = 8 if bits == 8 else 3
    count = 0
    for module in list(model.modules()):
        experts = getattr(module, "experts", None)
        if not isinstance(experts, Experts):
            continue
        gu, dn = experts.gate_up_proj.weight, experts.down_proj.weight
        e = gu.shape[0]
        blocks_gu = torch.stack([quantize_blocks(gu[i], qtype) for i in range(e)])
        blocks_dn = torch.stack([quantize_blocks(dn[i], qtype) for i in range(e)])
        module.experts = QuantExperts(
            [(qtype, blocks_gu)], [(qtype, blocks_dn)], int(gu.shape[2]),
            experts.intermediate, experts.act_name,
        )  # fmt: skip
        count += 1
    return count


class Router(nn.Module):
    """The router (or Qwen2-MoE's shared-expert gate): logits = x @ weight.T, weight (E, H).

    Not an nn.Linear, so no linear packing or quantization replaces it: with the kernels on it is
    `kernels.dense_linear`, every logit reduced in a fixed order (batch invariant)."""

    native = False  # CausalLM.use_native_kernels

    def __init__(self, experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.dtype == torch.float32:
            return kernels.dense_linear(x.contiguous(), self.weight.float().contiguous())
        return F.linear(x, self.weight)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        """sigmoid(self(x)); with the kernels on, each element in scalar code (torch.sigmoid's
        vector body and scalar tail would make a row's bits depend on its place in the step)."""
        if self.native and x.dtype == torch.float32:
            return kernels.sigmoid_gate(x.contiguous(), self.weight.float().contiguous())
        return torch.sigmoid(self.forward(x))


class SparseMoe(nn.Module):
    """A MoE layer's feed-forward: router, top-k experts, an optional gated shared expert."""

    native = False  # CausalLM.use_native_kernels

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Router(cfg.num_experts, cfg.hidden_size)
        self.experts: nn.Module = Experts(cfg)
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: Router | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(cfg, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Router(1, cfg.hidden_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (T, k) in x's dtype, expert ids (T, k)), as transformers computes them."""
        logits = self.gate.forward(x)
        if self.native and logits.dtype == torch.float32:
            return kernels.moe_topk(logits.contiguous(), self.top_k, self.norm_topk)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.experts.forward(x, ids, weights)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = self.shared_expert_gate.sigmoid(x)
            out = out + gate.to(out.dtype) * self.shared_expert.forward(x).to(out.dtype)
        return out.to(x.dtype)


class MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's layer with a MoE feed-forward where the config has one at this layer."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer_idx, rotary)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = SparseMoe(cfg)  # type: ignore[assignment]

    def fused_kernel(self) -> Callable[..., torch.Tensor]:
        return kernels.decode_moe_layer if isinstance(self.mlp, SparseMoe) else kernels.decode_layer

    def fused_weights(self) -> tuple[Any, ...] | None:
        if not isinstance(self.mlp, SparseMoe):
            return super().fused_weights()
        if self._fused is None:
            self._fused = _fused_moe_weights(self) or False
        return self._fused or None


def _fused_moe_weights(layer: MoeDecoderLayer) -> tuple[Any, ...] | None:
    """kernels.decode_moe_layer's weights for a MoE layer whose linears and experts are all
    quantized (the shared expert's too) and whose norms are fp32 of one eps; else None."""
    attn, moe = layer.self_attn, layer.mlp
    assert isinstance(moe, SparseMoe)
    experts, shared, shared_gate = moe.experts, moe.shared_expert, moe.shared_expert_gate
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    norms += [n for n in (attn.q_norm, attn.k_norm) if n is not None]
    linears: list[nn.Module] = [attn.qkv_proj, attn.o_proj]
    if shared is not None:
        linears += [shared.gate_up_proj, shared.down_proj]
    if (
        not isinstance(experts, QuantExperts)
        or not all(isinstance(m, QuantLinear) for m in linears)
        or any(m.bias is not None for m in linears[1:])  # type: ignore[union-attr]
        or (shared is not None and shared.act_id != experts.act_id)
        or any(n.weight.dtype != torch.float32 for n in norms)
        or moe.gate.weight.dtype != torch.float32
        or (shared_gate is not None and shared_gate.weight.dtype != torch.float32)
        or len({(n.eps, n.offset) for n in norms}) != 1
    ):
        return None
    qkv, o = attn.qkv_proj, attn.o_proj
    assert isinstance(qkv, QuantLinear) and isinstance(o, QuantLinear)
    shared_args: tuple[Any, ...] = (None, 0, None, 0, 0, None)
    if shared is not None and shared_gate is not None:
        gu, dn = shared.gate_up_proj, shared.down_proj
        assert isinstance(gu, QuantLinear) and isinstance(dn, QuantLinear)
        shared_args = (gu.packed, gu.panel_kind, dn.packed, dn.panel_kind, gu.out_features // 2,
                       shared_gate.weight.contiguous())  # fmt: skip
    in_norm = layer.input_layernorm
    return (
        in_norm.eps, in_norm.offset, in_norm.weight,
        None if attn.q_norm is None else attn.q_norm.weight,
        None if attn.k_norm is None else attn.k_norm.weight,
        layer.post_attention_layernorm.weight, qkv.packed, qkv.panel_kind, qkv.bias, o.packed,
        o.panel_kind, attn.num_heads, attn.num_kv_heads, attn.head_dim, experts.act_id,
        moe.gate.weight.contiguous(), moe.top_k, moe.norm_topk, experts.gate_up,
        experts.gate_up_kind, experts.down, experts.down_kind, experts.intermediate,
        *shared_args,
    )  # fmt: skip


class MoeModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = token_embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.layers = nn.ModuleList(MoeDecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# Checkpoint names -> this layout: Mixtral's block and expert names, then per-expert tensors.
_MIXTRAL_NAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
)
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_up_proj|down_proj)\.weight$")


class MoeForCausalLM(LlamaForCausalLM):
    gguf_architectures = {
        "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
        "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    }

    def __init__(self, cfg: ModelConfig) -> None:
        CausalLM.__init__(self, cfg, MoeModel(cfg))

    @classmethod
    def checkpoint_name(cls, name: str) -> str:
        if ".block_sparse_moe." in name:
            for old, new in _MIXTRAL_NAMES:
                name = name.replace(old, new)
        return name

    @classmethod
    def stack_experts(cls, state: dict[str, torch.Tensor]) -> None:
        """Per-expert 2-D tensors (gate|up already joined) -> one (E, rows, cols) tensor each."""
        groups: dict[str, dict[int, torch.Tensor]] = {}
        for name in [n for n in state if _PER_EXPERT.match(n)]:
            m = _PER_EXPERT.match(name)
            assert m is not None
            groups.setdefault(f"{m[1]}.{m[3]}.weight", {})[int(m[2])] = state.pop(name)
        for name, experts in groups.items():
            state[name] = torch.stack([experts[i] for i in range(len(experts))])

    @classmethod
    def gguf_config(cls, arch: str, cfg: dict[str, Any], get: Callable[..., Any]) -> None:
        moe_config(arch, cfg, get)

    @classmethod
    def gguf_tensor(
        cls, arch: str, hf_name: str, w: torch.Tensor, cfg: dict[str, Any]
    ) -> torch.Tensor:
        if hf_name.endswith("shared_expert_gate.weight") and w.dim() == 1:
            return w.unsqueeze(0)  # some converters store the (1, H) gate as (H,)
        return super().gguf_tensor(arch, hf_name, w, cfg)
