"""A GGUF file's linear weights in their quantized blocks, named as this model's modules.

    blk.N.attn_q/k/v  -> model.layers.N.self_attn.qkv_proj   (rows concatenated; family row order)
    blk.N.ffn_gate/up -> model.layers.N.mlp.gate_up_proj
    output (or the tied token_embd) -> lm_head

A module is returned, as its parts in row order, only when all its parts have one of the wanted
block types (they may differ: Gemma's q/k are Q5_0 and its v Q8_0); the rest stay dequantized. Rows are reordered with the family's own GGUF hook (llama's Q/K un-permutation is a
row permutation), applied to row indices: a hook that does more than permute rows rules it out.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import numpy as np
import torch

from convoy import kernels
from convoy.kernels.linear import SIXTEEN_BIT_TYPES, panel_kind
from convoy.kernels.ops import PANEL_ROWS
from convoy.models.gguf_convert import field, hf_tensor_name
from convoy.models.gguf_index import read_gguf_index
from convoy.models.registry import gguf_family

logger = logging.getLogger(__name__)

# Types a linear may have without being a loss to dequantize: plain float tensors.
_FLOAT_TYPES = {0}  # F32

QuantWeight = tuple[int, torch.Tensor]  # (GGML type id, (N, row bytes) uint8 blocks)
QuantParts = list[QuantWeight]  # one module's GGUF tensors, in row order


def quantized_linears(gguf_path: Path, model_dir: Path, types: set[int]) -> dict[str, QuantParts]:
    """Module name -> its quantized weight, for every linear whose GGUF tensors all have a type
    in `types`, or all one 16-bit type (F16 or BF16: rows of 2-byte values, for
    kernels.linear.Gguf16Linear; not for expert tensors). `model_dir` is the converted folder (its
    config.json gives the head counts)."""
    sixteen = set(SIXTEEN_BIT_TYPES) if kernels.available() else set()
    reader = read_gguf_index(gguf_path)  # tensors and scalars only: no vocabulary arrays
    arch = field(reader, "general.architecture")
    family = gguf_family(arch)
    assert family is not None, arch
    cfg = json.loads((model_dir / "config.json").read_text())
    fused = family.packed_modules
    parts: dict[str, dict[int, QuantWeight | None]] = {}
    tensors: dict[str, list[tuple[str, int]]] = {}  # module -> its (GGUF tensor name, type)
    for t in reader.tensors:
        name = hf_tensor_name(t.name, family)
        if t.name == "token_embd.weight" and cfg.get("tie_word_embeddings"):
            name = "lm_head.weight"
        if name is None or not name.endswith(".weight") or "norm" in name or "embed" in name:
            continue
        base = name[: -len(".weight")]
        module, piece = base.rsplit(".", 1) if "." in base else ("", base)
        target, shard = fused.get(piece, (piece, 0))
        key = f"{module}.{target}" if module else target
        qtype = int(t.tensor_type)
        blocks = None
        tensors.setdefault(key, []).append((t.name, qtype))
        if qtype in types and t.data.ndim == 3:  # (experts, rows, bytes): never reordered
            blocks = _rows(t.data, None)
        elif qtype in types or (qtype in sixteen and t.data.ndim == 2):
            rows = _row_order(family, arch, name, int(t.data.shape[0]), cfg)
            if rows is not None:
                blocks = _rows(t.data, rows)
        parts.setdefault(key, {})[shard] = None if blocks is None else (qtype, blocks)
    out = {key: w for key, shards in parts.items() if (w := _joined(shards)) is not None}
    # (GGUF tensor name, type) of the linears left dequantized: a type not kept, or parts of one
    # module that no panel kind holds together, or rows the family reorders beyond a permutation
    unkept = [
        (name, qtype)
        for key, named in tensors.items()
        if key not in out
        for name, qtype in named
        if qtype not in _FLOAT_TYPES
    ]
    if unkept:
        _warn_unkept(gguf_path, unkept)
    return out


def _row_order(family: type, arch: str, name: str, n: int, cfg: dict) -> torch.Tensor | None:
    index = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    rows = family.gguf_tensor(arch, name, index, cfg)[:, 0]  # type: ignore[attr-defined]
    order = rows.round().long()
    if not torch.equal(order.sort().values, torch.arange(n)) or not torch.equal(
        rows, order.double()
    ):
        return None
    return order


def _rows(data: np.ndarray, order: torch.Tensor | None) -> torch.Tensor:
    """The blocks in `order`: a view of the mapped file when the order is the file's (None; the
    repacking only reads them), else a reordered copy."""
    if order is None or torch.equal(order, torch.arange(len(order))):
        with warnings.catch_warnings():  # read-only memory map: nothing writes to it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(data)
    return torch.from_numpy(np.ascontiguousarray(data[order.numpy()]))


def _joined(shards: dict[int, QuantWeight | None]) -> QuantParts | None:
    ordered = [shards.get(i) for i in range(len(shards))]
    parts = [s for s in ordered if s is not None]
    if len(parts) != len(ordered):
        return None
    qtypes = {q for q, _ in parts}
    if qtypes & SIXTEEN_BIT_TYPES.keys():  # 16-bit rows join as they are, but of one type
        return parts if len(qtypes) == 1 else None
    # Joined parts stack whole 8-row panels (kernels.linear.QuantLinear.from_parts).
    if any(b.shape[-2] % PANEL_ROWS for _, b in parts[:-1]):  # an expert tensor's rows: dim 1
        return None
    try:
        panel_kind([q for q, _ in parts])
    except ValueError:  # no panel kind holds these types together (Q2_K beside int8 quants)
        return None
    return parts


def _warn_unkept(gguf_path: Path, unkept: list[tuple[str, int]]) -> None:
    """One warning line: the linears whose GGUF types Convoy cannot keep quantized (they load
    dequantized to the model's dtype: more memory, slower decode), a count per type and a few
    tensor names."""
    import gguf

    def type_name(qtype: int) -> str:
        try:
            return gguf.GGMLQuantizationType(qtype).name
        except ValueError:
            return f"type {qtype}"

    counts: dict[str, int] = {}
    for _, qtype in unkept:
        counts[type_name(qtype)] = counts.get(type_name(qtype), 0) + 1
    per_type = ", ".join(f"{n} {name}" for name, n in sorted(counts.items()))
    examples = ", ".join(f"{name} ({type_name(q)})" for name, q in unkept[:3])
    more = f", ... {len(unkept) - 3} more" if len(unkept) > 3 else ""
    logger.warning(
        "%s: %d linear tensors have types not kept quantized (%s); loading them dequantized: %s%s",
        gguf_path, len(unkept), per_type, examples, more,
    )  # fmt: skip
