"""Prepacked linears for the CPU: fp32 through oneDNN, bf16 through our kernel on AVX2 hosts.

`F.linear` in fp32 goes to MKL sgemm with the weight in its plain (out, in) layout and repacks it
on every call. oneDNN can take the weight reordered once into its blocked layout; on this AVX2 host
that runs the decode shapes 1.4-2.6x faster (measured, 2 threads, smollm2 shapes, M=16: the
per-step sum of all linears 79 -> 46 ms; M=64: 224 -> 140 ms; the 49152-wide lm_head 30 -> 11 ms
at M=16). The packed weight is an opaque mkldnn tensor, so this runs after the weights are loaded
and placed, and only for fp32 on the CPU: bf16 reorders need AVX512-BF16 or AVX-NE-CONVERT, and
on CUDA cuBLAS is already the right kernel.

Results differ from `F.linear` only by summation order (max |diff| ~1e-4 on unit-scale inputs).

bf16 on CPUs without AVX512-BF16: torch emulates bf16 matmuls (~16 GFLOP/s on two cores at
64x576x3072). `Bf16PackedLinear` runs kernels/csrc/bf16_linear.cpp instead: bf16 weights
repacked into 16-wide K-major panels, widened in registers, fp32 FMAs, output rounded to bf16;
measured 5-8x faster than torch's bf16 and on par with oneDNN fp32 (106-136 GFLOP/s at M=16..64).
"""

from __future__ import annotations

import torch
from torch import nn

from convoy import kernels
from convoy.kernels.ops import QUANT_BLOCK_BYTES, quant_linear

# Batch-size hint for the reorder; measured on 576x3072: the chosen layout serves M=1..300 alike.
_PACK_HINT = 64


def linear_packing(device: torch.device, dtype: torch.dtype) -> str | None:
    """Which packed linear this device/dtype gets: "onednn" (fp32), "bf16-kernel" or None."""
    if onednn_linear_available(device, dtype):
        return "onednn"
    if (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and not torch.cpu._is_avx512_bf16_supported()
        and kernels.available()
    ):
        return "bf16-kernel"
    return None


def onednn_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class _PrepackedLinear(nn.Module):
    """Inference-only drop-in for an `nn.Linear`: the weight is packed once, at construction."""

    kind = ""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed = self._pack(linear.weight.detach())
        self.bias: torch.Tensor | None = (
            None if linear.bias is None else linear.bias.detach().contiguous()
        )

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _linear_2d(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self._linear_2d(x.reshape(-1, shape[-1]).contiguous())
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


class PackedLinear(_PrepackedLinear):
    """fp32 on the CPU, weight reordered for oneDNN."""

    kind = "onednn"

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_HINT)

    def _linear_2d(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Bf16PackedLinear(_PrepackedLinear):
    """bf16 on a CPU without native bf16: 16-wide weight panels for kernels/csrc/bf16_linear.cpp."""

    kind = "bf16-kernel"

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        if not kernels.available():
            raise RuntimeError("the bf16 linear kernel could not be built (see the log)")
        return kernels.pack_bf16_weight(weight.to(torch.bfloat16))

    def _linear_2d(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.bf16_linear(x, self.packed, self.bias, self.out_features)


_BY_KIND: dict[str, type[_PrepackedLinear]] = {c.kind: c for c in (PackedLinear, Bf16PackedLinear)}


def pack_linears(model: nn.Module, kind: str = "onednn") -> int:
    """Replace every `nn.Linear` in `model` by a packed one; returns how many were replaced.

    kind: "onednn" (`PackedLinear`, fp32) or "bf16-kernel" (`Bf16PackedLinear`).

    A tied lm_head gets its own packed copy; the embedding keeps the plain weight it indexes.
    """
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, _BY_KIND[kind](child))
                count += 1
    return count


class QuantLinear(_PrepackedLinear):
    """A GGUF block-quantized weight kept as its bytes (Q4_0, Q4_1, Q8_0), run by
    `kernels.quant_linear` on fp32 activations (cast from and back to the input's dtype)."""

    def __init__(
        self, blocks: torch.Tensor, qtype: int, in_features: int, bias: torch.Tensor | None
    ) -> None:
        nn.Module.__init__(self)
        if qtype not in QUANT_BLOCK_BYTES or in_features % 32:
            raise ValueError(f"unsupported quantized weight: type {qtype}, {in_features} inputs")
        if blocks.shape[1] != in_features // 32 * QUANT_BLOCK_BYTES[qtype]:
            raise ValueError(f"{blocks.shape[1]} bytes per row do not hold {in_features} weights")
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self.qtype, self.kind = qtype, f"ggml type {qtype}"
        self.packed = blocks.contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def _linear_2d(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x.float(), self.packed, self.qtype, self.bias).to(x.dtype)


def use_quantized(model: nn.Module, weights: dict[str, tuple[int, torch.Tensor]]) -> int:
    """Replace the `nn.Linear` named by each key with a QuantLinear of its blocks; returns how
    many were replaced (a tied lm_head stops sharing the embedding's weight)."""
    count = 0
    for name, (qtype, blocks) in weights.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr)
        if isinstance(old, nn.Linear) and blocks.shape[0] == old.out_features:
            setattr(parent, attr, QuantLinear(blocks, qtype, old.in_features, old.bias))
            count += 1
    return count
