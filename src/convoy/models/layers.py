"""Small building blocks shared by the model files: the family base, RMSNorm, rotary embedding,
activations."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from convoy import kernels
from convoy.kernels.linear import QuantLinear
from convoy.model_config import ModelConfig
from convoy.models.attention import AttentionMetadata


class CausalLM(nn.Module):
    """Base of a model family's top module, and the facts about the family the engine needs.

    A family file subclasses it with its decoder (`model`: embed_tokens, layers, norm);
    `forward(input_ids, positions, attn_metadata)` runs a step's flat tokens, `compute_logits`
    projects only the rows that sample.
    """

    # HF checkpoint name piece -> (our fused module, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    default_chat_template: str | None = None  # for files of this family that carry none
    extra_stop_tokens: tuple[str, ...] = ()  # single-token texts that end generation like EOS
    # GGUF conversion (gguf_convert.py): llama.cpp architecture -> (HF model_type, HF class name)
    gguf_architectures: dict[str, tuple[str, str]] = {}
    gguf_ffn_norm = "post_attention_layernorm"  # where llama.cpp's blk.N.ffn_norm belongs
    gguf_layer_names: dict[str, str] = {}  # blk.N pieces named otherwise in this family (phi3)

    def __init__(self, cfg: ModelConfig, model: nn.Module) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = model
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = model.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        between_layers: Callable[[int, int], None] | None = None,
    ) -> torch.Tensor:
        """(T,) token ids of all sequences, flat -> (T, hidden) final hidden states.

        `between_layers(done, total)`, if given, is called before each layer but the first,
        with the layers done so far (the engine may run a step of its own there: nothing of
        this forward is held but its local tensors).

        The residual stream is carried between layers with each sublayer's output still to add
        (`delta`): the next norm adds it (`RMSNorm.add_forward`), in one kernel call when native.

        NOTE: in the per-step path the families call submodules by `.forward`: `nn.Module`'s
        `__call__` looks for hooks first (none are used here), ~1-2 us a call, ~10 calls a layer.
        """
        residual = self.embed(input_ids)
        delta: torch.Tensor | None = None
        layers = self.model.layers
        for i, layer in enumerate(layers):
            if between_layers is not None and i:
                between_layers(i, len(layers))
            delta, residual = layer.forward(delta, residual, positions, attn_metadata)
        return self.model.norm.add_forward(delta, residual)[0]

    def use_native_kernels(self, on: bool) -> None:
        """Run norms, rotary + cache writes and gated activations by convoy.kernels (CPU, fp32 or
        bf16 activations; the caller checked `kernels.available()`), or by torch ops."""
        for module in self.modules():
            if isinstance(getattr(type(module), "native", None), bool):
                module.native = on  # type: ignore[assignment]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(N, hidden) rows that sample -> (N, vocab) fp32 logits, written into `out` (a contiguous
        (N, vocab) fp32 buffer the caller reuses) where the head can, else a new tensor; soft-capped
        (cap * tanh(logits / cap), Gemma 2) where the config says so, before any sampling."""
        head = self.lm_head
        if out is not None and isinstance(head, QuantLinear):
            logits = head.forward_into(hidden, out)
        else:
            logits = head(hidden).float()
        cap = self.cfg.final_logit_softcapping
        if cap:  # in place, in transformers' order: a division, tanh, then the product
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    @classmethod
    def checkpoint_name(cls, name: str) -> str:
        """A checkpoint tensor's name in this layout (before fused shards are joined)."""
        return name

    @classmethod
    def stack_experts(cls, state: dict[str, torch.Tensor]) -> None:
        """Join per-expert tensors of `state` (in place) into the family's 3-D expert weights."""

    @classmethod
    def gguf_config(cls, arch: str, cfg: dict[str, Any], get: Callable[..., Any]) -> None:
        """Add the family's config.json keys, read from GGUF metadata by `get(key, default)`."""

    @classmethod
    def gguf_tensor(
        cls, arch: str, hf_name: str, w: torch.Tensor, cfg: dict[str, Any]
    ) -> torch.Tensor:
        """Undo llama.cpp's storage conventions for one dequantized tensor."""
        return w


def token_embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """The decoder's `embed_tokens`, left uninitialised: the loader builds the model on the meta
    device and fills it (or replaces it by a `QuantEmbedding`). NOTE: nn.Embedding's own random
    init on the meta device runs torch._refs.normal_, which imports torch._dynamo and sympy (818
    modules, +68 MB of RSS, measured) for nothing."""
    return nn.Embedding(
        num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim)
    )


class QuantizedRows(Protocol):
    """A quantized weight that dequantizes rows on demand (kernels.linear.QuantLinear)."""

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor: ...


class QuantEmbedding(nn.Module):
    """Token embedding whose table stays quantized: each step dequantizes only its tokens' rows.

    `rows` is a QuantLinear: the tied lm_head's own (`is_tied`: referred to, not registered here,
    so the module keeps its one name `lm_head` and the table is held once, in its blocks) or the
    embedding's own. Rows come out fp32 and are cast to `dtype`, as the dequantized embedding of
    that dtype gives them.
    """

    def __init__(
        self,
        rows: nn.Module,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype,
        is_tied: bool,
    ) -> None:
        super().__init__()
        if not callable(getattr(rows, "dequantize_rows", None)):
            raise TypeError(f"{type(rows).__name__} cannot dequantize rows")
        if is_tied:
            object.__setattr__(self, "rows", rows)  # NOTE: not a submodule: lm_head owns it
        else:
            self.rows = rows
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.is_tied = is_tied

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows: QuantizedRows = self.rows  # type: ignore[assignment]
        x = rows.dequantize_rows(input_ids.reshape(-1).long())
        return x.to(self.dtype).view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, quantized" + (
            ", rows of lm_head" if self.is_tied else ""
        )


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32. Gemma stores the scale as an offset from one: y = x_hat * (1 + w)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0.0 else torch.zeros(dim))
        self.eps = eps
        self.offset = offset

    native = False  # csrc kernel (CausalLM.use_native_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.dtype == self.weight.dtype:
            return kernels.rms_norm(x, self.weight, self.eps, self.offset)
        return self._forward_torch(x)

    def add_forward(
        self, x: torch.Tensor | None, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); x None: nothing to add. Native: one kernel call
        that updates `residual` in place (the caller owns it: the embedding output, then this)."""
        if x is None:
            return self(residual), residual
        if self.native and x.dtype == residual.dtype == self.weight.dtype:
            return kernels.add_rms_norm(x, residual, self.weight, self.eps, self.offset), residual
        residual = residual + x
        return self._forward_torch(residual), residual

    def _forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma: scale in fp32, then cast
            return (x32 * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)  # Llama: cast, then scale


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) rotary embedding with a cos/sin table grown on demand.

    The table covers the positions seen so far, in chunks of `CHUNK` positions, each computed by
    itself with the same shapes: a position's values never depend on how far the table has grown
    (a whole-context table is 67 MB of fp32 for Gemma 3's two ropes at 32k positions).
    """

    CHUNK = 1024

    def __init__(
        self, head_dim: int, max_positions: int, base: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.base, self.scaling = (
            head_dim,
            max_positions,
            base,
            scaling,
        )
        self._memo_positions: torch.Tensor | None = None
        self._memo_cos = self._memo_sin = torch.empty(0)
        self._table_positions: torch.Tensor | None = None
        rows = min(max_positions, self.CHUNK)
        self.register_buffer("cos", torch.empty(rows, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(rows, head_dim // 2), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the fp32 cos/sin table; the loader calls this after materialising the model."""
        if self.cos.is_meta:
            return
        self.cos, self.sin = self._chunks(0, self.cos.shape[0])

    def _chunks(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.head_dim
        device = self.cos.device
        arange = torch.arange(0, d, 2, dtype=torch.int64, device=device)
        inv_freq = _scale_inv_freq(1.0 / (self.base ** (arange.float() / d)), self.scaling)
        cos, sin = [], []
        for c in range(start, end, self.CHUNK):
            pos = torch.arange(c, c + self.CHUNK, dtype=torch.float32, device=device)
            freqs = torch.outer(pos, inv_freq)  # (CHUNK, D/2)
            cos.append(freqs.cos())
            sin.append(freqs.sin())
        n = end - start
        return torch.cat(cos)[:n], torch.cat(sin)[:n]

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) tables covering `positions` (grown once per new positions tensor: a step's
        positions are shared by every layer)."""
        if positions is not self._table_positions:
            self._table_positions = positions
            have = self.cos.shape[0]
            need = int(positions.max()) + 1 if positions.numel() else 0
            if need > have:
                end = min(self.max_positions, max(need, 2 * have))  # beyond: indexing fails
                start = have - have % self.CHUNK  # recompute a partial last chunk whole
                cos, sin = self._chunks(start, end)
                self.cos = torch.cat([self.cos[:start], cos])
                self.sin = torch.cat([self.sin[:start], sin])
        return self.cos, self.sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: (T, H, D), k: (T, Hkv, D), positions: (T,)
        # NOTE: one instance serves every layer with the same base; the step's positions tensor is
        # shared by all layers, so cos/sin are gathered once per step.
        if positions is not self._memo_positions or q.dtype != self._memo_cos.dtype:
            cos_t, sin_t = self.tables(positions)
            self._memo_cos = cos_t[positions].to(q.dtype).repeat(1, 2).unsqueeze(1)  # (T, 1, D)
            self._memo_sin = sin_t[positions].to(q.dtype).repeat(1, 2).unsqueeze(1)
            self._memo_positions = positions
        cos, sin = self._memo_cos, self._memo_sin
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any] | None) -> torch.Tensor:
    if not scaling:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(is_mid, mid, scaled)
    raise NotImplementedError(f"rope scaling type {kind!r} is not supported")


def native_activation(name: str) -> int | None:
    """The act id of `kernels.act_and_mul` for an activation name, None where it has none."""
    if name in ("silu", "swish"):
        return kernels.ACT_SILU
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return kernels.ACT_GELU_TANH
    return None


def activation(name: str) -> Any:
    if name in ("silu", "swish"):
        return F.silu
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise NotImplementedError(f"activation {name!r} is not supported")
