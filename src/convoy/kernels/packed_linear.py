"""The packed fp32 linears for the CPU (Convoy's kernel, `Fp32KernelLinear`, and oneDNN's,
`PackedLinear`, kept for a quantized model's few fp32 linears and hosts without the kernels), the
oneDNN row padding (also native bf16's), and which packed linear a device/dtype gets
(`linear_packing`, `pack_linears`; the bf16 kernel's is linear.py's Bf16PackedLinear).

`F.linear` in fp32 goes to MKL sgemm with the weight in its plain (out, in) layout and repacks it
on every call. oneDNN can take the weight reordered once into its blocked layout; on this AVX2 host
that runs the decode shapes 1.4-2.6x faster (measured, 2 threads, smollm2 shapes, M=16: the
per-step sum of all linears 79 -> 46 ms; M=64: 224 -> 140 ms; the 49152-wide lm_head 30 -> 11 ms
at M=16). The packed weight is an opaque mkldnn tensor, so this runs after the weights are loaded
and placed, and only for fp32 on the CPU: bf16 reorders need AVX512-BF16 or AVX-NE-CONVERT, and
on CUDA cuBLAS is already the right kernel.

Results differ from `F.linear` only by summation order (max |diff| ~1e-4 on unit-scale inputs).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from convoy import kernels
from convoy.kernels.linear import Bf16PackedLinear, _PrepackedLinear

# Batch-size hint for the reorder; measured on 576x3072: the chosen layout serves M=1..300 alike.
_PACK_HINT = 64
# Row counts up to this go to oneDNN as they are (decode steps: one row a sequence).
EXACT_ROWS = 64


def padded_rows(num_rows: int) -> int:
    """The row count a oneDNN linear of `num_rows` rows runs at: exact up to EXACT_ROWS, above
    it rounded up to 16 steps an octave (at most 6.25% more rows; 176 sizes up to 8192 rows).

    oneDNN creates (and caches, 1024 entries by default) a primitive per distinct input shape,
    and a step's row count takes any value up to the token budget: every new one built a
    primitive, evicted another, and left the heap more fragmented (issue #29: the fp32 server's
    RSS grew ~76 KB a request without a plateau; 2,000 linears at random row counts 1-1000 grew
    1.26 GB, padded to these sizes 0.29 GB, flat after the first 1,000).
    """
    if num_rows <= EXACT_ROWS:
        return num_rows
    step = 1 << (num_rows.bit_length() - 5)
    return -(-num_rows // step) * step


def linear_packing(device: torch.device, dtype: torch.dtype) -> str | None:
    """Which packed linear this device/dtype gets: "fp32-kernel" (fp32, Convoy's kernel), "onednn"
    (fp32 where the kernels cannot be built), "bf16-kernel" (bf16, Convoy's k-pair kernel: vdpbf16ps
    where the CPU has AVX512-BF16, the same bits by FMAs elsewhere), "bf16-padded" (bf16 where the
    kernels cannot be built but the CPU has native bf16: oneDNN through `F.linear`) or None."""
    if device.type == "cpu" and dtype == torch.float32 and kernels.available():
        return "fp32-kernel"
    if onednn_linear_available(device, dtype):
        return "onednn"
    if device.type == "cpu" and dtype == torch.bfloat16:
        if kernels.available():
            return "bf16-kernel"
        if torch.cpu._is_avx512_bf16_supported():
            return "bf16-padded"
    return None


def onednn_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(_PrepackedLinear):
    """fp32 on the CPU, weight reordered for oneDNN."""

    kind = "onednn"

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_HINT)

    def _linear_2d(self, x: torch.Tensor) -> torch.Tensor:
        num_rows = x.shape[0]
        rows = padded_rows(num_rows)
        if rows == num_rows:
            return onednn_linear(x, self.packed, self.bias)
        return onednn_linear(_padded_input(x, rows), self.packed, self.bias)[:num_rows]


class Fp32KernelLinear(_PrepackedLinear):
    """fp32 on the CPU: 16-wide weight panels for kernels/csrc/fp32_linear.cpp. No per-shape
    state, where oneDNN's two primitive caches grew the fp32 server in steps for as long as new
    row counts came (#29), and batch invariant; 1.2-2x oneDNN's speed at <= 66 rows, 0.93-1.05x
    at 258-702 (SmolLM2's shapes, AVX2 and AVX-512)."""

    kind = "fp32-kernel"

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        if not kernels.available():
            raise RuntimeError("the fp32 linear kernel could not be built (see the log)")
        return kernels.pack_fp32_weight(weight.float())

    def _linear_2d(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.fp32_linear(x, self.packed, self.bias, self.out_features)


class PaddedBf16Linear(_PrepackedLinear):
    """bf16 on a CPU with native bf16: `F.linear` (oneDNN's bf16 GEMM) at the padded row counts.
    Without them its per-shape primitive cache grew the bf16 server ~60 KB a request (#29)."""

    kind = "bf16-padded"

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.to(torch.bfloat16).contiguous()

    def _linear_2d(self, x: torch.Tensor) -> torch.Tensor:
        num_rows = x.shape[0]
        rows = padded_rows(num_rows)
        if rows == num_rows:
            return F.linear(x, self.packed, self.bias)
        return F.linear(_padded_input(x, rows), self.packed, self.bias)[:num_rows]


_scratch = threading.local()


def _padded_input(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x's rows, then filler, `rows` in all, in a buffer this thread keeps per input width and
    reuses (a fresh one each call was a fresh mmap above glibc's threshold: page faults, ~4% of
    a 700-row linear). The filler rows are zeros or an earlier call's rows: a GEMM's output row
    depends on its input row alone, and the caller drops the filler's outputs."""
    buffers: dict[int, torch.Tensor] = _scratch.__dict__.setdefault("buffers", {})
    width = x.shape[1]
    buf = buffers.get(width)
    if buf is None or buf.shape[0] < rows or buf.dtype != x.dtype:
        buf = buffers[width] = x.new_zeros((rows, width))
    buf[: x.shape[0]].copy_(x)
    return buf[:rows]


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, in) fp32 contiguous @ a `_reorder_linear_weight` weight (+ bias) -> (M, out)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_BY_KIND: dict[str, type[_PrepackedLinear]] = {
    c.kind: c for c in (PackedLinear, Fp32KernelLinear, Bf16PackedLinear, PaddedBf16Linear)
}


def pack_linears(model: nn.Module, kind: str = "onednn") -> int:
    """Replace every `nn.Linear` in `model` by a packed one; returns how many were replaced.

    kind: "fp32-kernel" (`Fp32KernelLinear`), "onednn" (`PackedLinear`, fp32), "bf16-kernel" (`Bf16PackedLinear`) or "bf16-padded"
    (`PaddedBf16Linear`).

    A tied lm_head gets its own packed copy; the embedding keeps the plain weight it indexes.
    """
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, _BY_KIND[kind](child))
                count += 1
    return count
