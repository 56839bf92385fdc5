"""Prepacked linears for the CPU: bf16 through our kernel, a GGUF's 16-bit and block-quantized
weights through ours (Gguf16Linear, QuantLinear); fp32's are in packed_linear.py.

bf16 on the CPU: without AVX512-BF16 torch emulates bf16 matmuls (~16 GFLOP/s on two cores at
64x576x3072); with it oneDNN is fast but caches a primitive per input shape (#29's memory
growth). `Bf16PackedLinear` runs kernels/csrc/bf16_linear.cpp instead on every CPU: bf16 weights
repacked into 16-wide panels of k pairs, vdpbf16ps where the CPU has it and fp32 FMAs in its order
elsewhere (the same bits), output rounded to bf16; on AVX2 measured 5-8x faster than torch's bf16
and on par with oneDNN fp32 (106-136 GFLOP/s at M=16..64).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from convoy import kernels
from convoy.kernels.ops import (
    PANEL_ROWS,
    QUANT_BLOCKS,
    QUANT_KIND_Q3,
    QUANT_KIND_Q4,
    QUANT_KIND_Q4D,
    QUANT_KIND_Q5,
    QUANT_KIND_Q6,
    QUANT_KIND_Q8,
    QUANT_KIND_Q8M,
    QUANT_KIND_Q8S,
    QUANT_TYPES,
    QUANT_TYPES_8BIT,
    SUPERBLOCK_BASE,
    quant_dequant_rows,
    quant_linear,
    quant_linear_out,
    quant_pack,
)

Q2_K = 10  # GGML type id
# A GGUF's 16-bit linear types (GGML type id -> torch dtype), run by csrc/bf16_linear.cpp as stored
SIXTEEN_BIT_TYPES: dict[int, torch.dtype] = {1: torch.float16, 30: torch.bfloat16}


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


class Bf16PackedLinear(_PrepackedLinear):
    """bf16 on the CPU: 16-wide panels of k pairs for kernels/csrc/bf16_linear.cpp's
    `bf16_pairs_linear` (vdpbf16ps with AVX512-BF16, FMAs in its order elsewhere: the same bits)."""

    kind = "bf16-kernel"

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        if not kernels.available():
            raise RuntimeError("the bf16 linear kernel could not be built (see the log)")
        return kernels.pack_bf16_pairs(weight.to(torch.bfloat16))

    def _linear_2d(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.bf16_pairs_linear(x, self.packed, self.bias, self.out_features)


class Gguf16Linear(_PrepackedLinear):
    """A GGUF's F16 or BF16 linear kept 16-bit: the rows (of one or more tensors, joined) are
    repacked into bf16_linear.cpp's 16-wide panels of their own dtype and widened to fp32 in
    registers; never an fp32 copy of the weight in memory."""

    def __init__(
        self, parts: Sequence[tuple[int, torch.Tensor]], in_features: int, bias: torch.Tensor | None
    ) -> None:
        nn.Module.__init__(self)
        qtypes = {q for q, _ in parts}
        if len(qtypes) != 1 or not qtypes <= SIXTEEN_BIT_TYPES.keys():
            raise ValueError(f"one 16-bit GGUF type expected, not {sorted(qtypes)}")
        dtype = SIXTEEN_BIT_TYPES[qtypes.pop()]
        rows = [b.reshape(b.shape[0], -1).view(torch.uint8).view(dtype) for _, b in parts]
        if any(r.shape[1] != in_features for r in rows):
            raise ValueError(f"rows of {[r.shape[1] for r in rows]} values, not {in_features}")
        if not kernels.available():
            raise RuntimeError("the bf16 linear kernel could not be built (see the log)")
        self.in_features = in_features
        self.out_features = sum(int(r.shape[0]) for r in rows)
        self.kind = f"{'f16' if dtype == torch.float16 else 'bf16'}-kernel"
        weight = rows[0] if len(rows) == 1 else torch.cat(rows)
        self.packed = kernels.pack_bf16_weight(weight)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def _linear_2d(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.bf16_linear(x, self.packed, self.bias, self.out_features)


class QuantLinear(_PrepackedLinear):
    """GGUF block-quantized weights (the types of `QUANT_TYPES`), repacked once into the 8-row
    panels of csrc/quant_linear.cpp (the GGUF blocks are not kept) and run on int8-quantized
    activations; input cast to fp32 and the output back to the input's dtype.

    `from_parts` joins several GGUF tensors as consecutive row ranges (a fused qkv or gate_up
    projection), also of different types: they are packed into the one panel kind that holds all,
    or where only an 8-bit kind would (Q4_K_M's Q4_K q and k beside its Q6_K v), into a two-part
    layout that keeps each run of parts in its own narrow kind (`panel_layout`).
    """

    def __init__(
        self, blocks: torch.Tensor, qtype: int, in_features: int, bias: torch.Tensor | None
    ) -> None:
        nn.Module.__init__(self)
        self._setup([(qtype, blocks)], in_features, bias)

    @classmethod
    def from_parts(
        cls, parts: Sequence[tuple[int, torch.Tensor]], in_features: int, bias: torch.Tensor | None
    ) -> QuantLinear:
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(parts, in_features, bias)
        return self

    def _setup(
        self, parts: Sequence[tuple[int, torch.Tensor]], in_features: int, bias: torch.Tensor | None
    ) -> None:
        if not parts:
            raise ValueError("no quantized weight")
        for i, (qtype, blocks) in enumerate(parts):
            if qtype not in QUANT_TYPES:
                raise ValueError(f"unsupported quantized weight type {qtype}")
            elems, nbytes = QUANT_BLOCKS[qtype]
            if in_features % elems:
                raise ValueError(f"type {qtype} needs in_features divisible by {elems}")
            if blocks.dim() != 2 or blocks.shape[1] != in_features // elems * nbytes:
                raise ValueError(f"{tuple(blocks.shape)} bytes do not hold rows of {in_features}")
            if i < len(parts) - 1 and blocks.shape[0] % PANEL_ROWS:
                raise ValueError(f"a joined part needs a multiple of {PANEL_ROWS} rows")
        self.in_features = in_features
        self.out_features = sum(int(b.shape[0]) for _, b in parts)
        self.qtypes = tuple(q for q, _ in parts)
        self.panel_kind, part_kinds = panel_layout(parts)
        names = "|".join(dict.fromkeys(map(str, part_kinds)))
        self.kind = f"ggml types {'+'.join(map(str, self.qtypes))}, panels {names}"
        packed = [
            quant_pack(b, q, kind, in_features)
            for (q, b), kind in zip(parts, part_kinds, strict=True)
        ]
        if self.panel_kind & TWO_PART:  # each part's panels back to back, one run of bytes
            self.packed = torch.cat([p.reshape(-1) for p in packed])
        else:
            self.packed = packed[0] if len(packed) == 1 else torch.cat(packed)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: the decode step calls this ~4x a layer; at one sequence each Python-level torch
        # call (~3 us here) is a visible share of the step, so the common case is one op call.
        if x.dim() == 2 and x.dtype == torch.float32:
            return quant_linear(x, self.packed, self.panel_kind, self.out_features, self.bias)
        return super().forward(x)

    def _linear_2d(self, x: torch.Tensor) -> torch.Tensor:
        y = quant_linear(x.float(), self.packed, self.panel_kind, self.out_features, self.bias)
        return y.to(x.dtype)

    def forward_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """x (M, in_features) -> `out`, a contiguous (M, out_features) fp32 tensor; returns it."""
        return quant_linear_out(
            x.float(), self.packed, self.panel_kind, self.out_features, self.bias, out
        )

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Weight rows `ids` (T,) int64, dequantized: (T, in_features) fp32 (an embedding lookup
        for a tied head)."""
        return quant_dequant_rows(self.packed, self.panel_kind, self.in_features, ids)


def _narrow_kind(qtypes: Sequence[int]) -> int | None:
    """The panel kind narrower than int8 quants (or the types' own 8-bit kind) that holds weights
    of all these GGUF types exactly, if there is one."""
    kinds = {QUANT_TYPES[q] for q in qtypes}
    if len(kinds) == 1:
        return kinds.pop()
    kinds = {SUPERBLOCK_BASE.get(k, k) for k in kinds}  # a superblock's scales are the file's own
    if len(kinds) == 1:
        return kinds.pop()
    # Q3_K's q + 4 with offsets -4 d fits 4 bits; a one-scale block is a two-scale one with equal
    # halves; 4-bit quants are 5-bit ones; Q3_K's q + 32 is a 6-bit quant
    for narrow, holds in (
        (QUANT_KIND_Q4D, {QUANT_KIND_Q4, QUANT_KIND_Q4D, QUANT_KIND_Q3}),
        (QUANT_KIND_Q5, {QUANT_KIND_Q4, QUANT_KIND_Q5}),
        (QUANT_KIND_Q6, {QUANT_KIND_Q3, QUANT_KIND_Q6}),
    ):
        if kinds <= holds:
            return narrow
    return None


# A two-part layout's kind argument (csrc/quant_linear.cpp Panels): panels [0, split) of kind a,
# then panels of kind b, back to back in one 1-D uint8 tensor
TWO_PART = 1 << 40


def two_part_kind(a: int, b: int, split: int) -> int:
    """The kind argument of a two-part layout: panels [0, split) of kind a, the rest of kind b."""
    if not (0 <= a < 16 and 0 <= b < 16 and 0 < split < 1 << 32):
        raise ValueError(f"no two-part layout of kinds {a}, {b} split at panel {split}")
    return TWO_PART | a | b << 4 | split << 8


def panel_layout(parts: Sequence[tuple[int, torch.Tensor]]) -> tuple[int, list[int]]:
    """The kind argument for a linear joined from `parts` (GGUF type, (rows, bytes) blocks) and
    the panel kind of each part: the one kind that holds them all where a narrow one does, else
    a two-part layout of two runs of parts each in its own narrow kind (the weights read are the
    file's: Q4_K_M's Q4_K q, k and Q6_K v read 4.6 and 6.6 bits a weight, not kQ8M's 9.5), else
    the 8-bit kind that holds them all (`panel_kind`)."""
    qtypes = [q for q, _ in parts]
    kind = _narrow_kind(qtypes)
    if kind is not None:
        return kind, [kind] * len(parts)
    for cut in range(1, len(parts)):
        a, b = _narrow_kind(qtypes[:cut]), _narrow_kind(qtypes[cut:])
        rows = sum(int(blocks.shape[0]) for _, blocks in parts[:cut])
        if a is not None and b is not None and rows % PANEL_ROWS == 0:
            return two_part_kind(a, b, rows // PANEL_ROWS), [a] * cut + [b] * (len(parts) - cut)
    kind = panel_kind(qtypes)
    return kind, [kind] * len(parts)


def panel_kind(qtypes: Sequence[int]) -> int:
    """The panel kind that holds weights of all these GGUF types exactly; ValueError where none
    does (Q2_K's two offsets a block beside a type of int8 quants)."""
    kind = _narrow_kind(qtypes)
    if kind is not None:
        return kind
    if Q2_K in qtypes:
        raise ValueError(f"no panel kind holds GGUF types {sorted(set(qtypes))} together")
    eight = {QUANT_TYPES_8BIT[q] for q in qtypes}
    if QUANT_KIND_Q8M in eight:
        return QUANT_KIND_Q8M
    if eight == {QUANT_KIND_Q8S}:
        return QUANT_KIND_Q8S
    return QUANT_KIND_Q8  # Q6_K's two scales per block hold a one-scale type's too


QuantParts = list[tuple[int, torch.Tensor]]  # (GGML type id, (rows, bytes) uint8 blocks), in order


def use_quantized(model: nn.Module, weights: dict[str, QuantParts]) -> int:
    """Replace the `nn.Linear` named by each key with a QuantLinear of its parts (a Gguf16Linear
    for F16 or BF16 parts); returns how many were replaced (a tied lm_head stops sharing the
    embedding's weight)."""
    count = 0
    for name, parts in weights.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr)
        rows = sum(int(b.shape[0]) for _, b in parts)
        if isinstance(old, nn.Linear) and rows == old.out_features:
            if parts[0][0] in SIXTEEN_BIT_TYPES:
                new: nn.Module = Gguf16Linear(parts, old.in_features, old.bias)
            else:
                new = QuantLinear.from_parts(parts, old.in_features, old.bias)
            setattr(parent, attr, new)
            count += 1
    return count


Q4_1, Q8_0 = 3, 8  # GGML type ids of the blocks bf16/fp32 weights are quantized into at load


def quantize_blocks(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """(N, K) float weight -> (N, K / 32 * block bytes) uint8 GGUF blocks of Q8_0 or Q4_1, as
    llama.cpp's reference quantizers make them (Q8_0: scale amax / 127, round to nearest; Q4_1:
    offset = the block's min, scale (max - min) / 15, q = floor((x - min) / scale + 0.5) <= 15)."""
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"in_features {k} is not a multiple of 32")
    w = weight.detach().float().reshape(n, k // 32, 32)
    if qtype == Q8_0:
        d = w.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        qs = torch.round(w * inv).to(torch.int8).view(torch.uint8)
    elif qtype == Q4_1:
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = torch.floor((w - lo) * inv + 0.5).clamp(0, 15).to(torch.uint8)
        offset = lo.to(torch.float16).view(torch.uint8)
        qs = torch.cat([offset, q[..., :16] | (q[..., 16:] << 4)], dim=-1)
    else:
        raise ValueError(f"cannot quantize to type {qtype}")
    scale = d.to(torch.float16).view(torch.uint8)  # (n, k / 32, 2)
    return torch.cat([scale, qs], dim=-1).reshape(n, -1).contiguous()


def quantize_linears(model: nn.Module, bits: int) -> int:
    """Quantize every `nn.Linear` (in_features a multiple of 32) of a loaded model to Q8_0
    (bits 8) or Q4_1 (bits 4; the lm_head in Q8_0, as llama.cpp keeps the output layer above 4
    bits); returns how many were replaced."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    count = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear) or child.in_features % 32:
                continue
            full = f"{name}.{child_name}" if name else child_name
            qtype = Q8_0 if bits == 8 or full.endswith("lm_head") else Q4_1
            blocks = quantize_blocks(child.weight, qtype)
            setattr(module, child_name, QuantLinear(blocks, qtype, child.in_features, child.bias))
            count += 1
    return count
