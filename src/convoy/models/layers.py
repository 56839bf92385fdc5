"""Small building blocks shared by the model files: RMSNorm, rotary embedding, activations."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32. Gemma stores the scale as an offset from one: y = x_hat * (1 + w)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0.0 else torch.zeros(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma: scale in fp32, then cast
            return (x32 * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)  # Llama: cast, then scale


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) rotary embedding with a precomputed cos/sin table."""

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
        self.register_buffer("cos", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the fp32 cos/sin table; the loader calls this after materialising the model."""
        if self.cos.is_meta:
            return
        d = self.head_dim
        arange = torch.arange(0, d, 2, dtype=torch.int64, device=self.cos.device)
        inv_freq = _scale_inv_freq(1.0 / (self.base ** (arange.float() / d)), self.scaling)
        pos = torch.arange(self.max_positions, dtype=torch.float32, device=self.cos.device)
        freqs = torch.outer(pos, inv_freq)  # (P, D/2)
        self.cos = freqs.cos()
        self.sin = freqs.sin()

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: (T, H, D), k: (T, Hkv, D), positions: (T,)
        # NOTE: one instance serves every layer with the same base; the step's positions tensor is
        # shared by all layers, so cos/sin are gathered once per step.
        if positions is not self._memo_positions or q.dtype != self._memo_cos.dtype:
            self._memo_cos = self.cos[positions].to(q.dtype).repeat(1, 2).unsqueeze(1)  # (T, 1, D)
            self._memo_sin = self.sin[positions].to(q.dtype).repeat(1, 2).unsqueeze(1)
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


def activation(name: str) -> Any:
    if name in ("silu", "swish"):
        return F.silu
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise NotImplementedError(f"activation {name!r} is not supported")
