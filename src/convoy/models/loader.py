"""Weight loading: a resolved model (resolve.py) built and filled with its weights.

A dequantized load (`load_model` without `quant_types`) reads the folder's safetensors: for a
GGUF, the fp32 model.safetensors that `ensure_hf_weights` writes into its cache folder once. A
quantized load (`quant_types`) never writes or reads it: the model is built on the meta device,
the linears kept quantized are installed from the GGUF's blocks (`QuantLinear`), the token
embedding looks its rows up from the tied head's blocks (`QuantEmbedding`), and only the
remaining tensors (norms, biases, linears of other block types) are dequantized, one at a time,
straight from the GGUF.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from convoy.kernels.huge_pages import gather_in_huge_pages
from convoy.kernels.linear import SIXTEEN_BIT_TYPES, QuantLinear, QuantParts, use_quantized
from convoy.models.gguf_convert import CONFIG_TENSORS, ModelLoadError, field, hf_tensor_name
from convoy.models.gguf_index import MappedPages, drop_mapped_pages, read_gguf_index
from convoy.models.gguf_quant import quantized_linears
from convoy.models.layers import CausalLM, QuantEmbedding
from convoy.models.moe import Experts, QuantExperts
from convoy.models.registry import model_class
from convoy.models.resolve import ResolvedModel, ensure_hf_weights

__all__ = ["load_model"]


def load_model(
    resolved: ResolvedModel,
    dtype: torch.dtype,
    device: torch.device,
    quant_types: Collection[int] | None = None,
) -> CausalLM:
    """Build the model for `resolved` and fill it with its weights in `dtype` on `device`.

    quant_types (a GGUF only): GGML block types kept quantized. Every linear whose GGUF tensors all
    have one of them becomes a `QuantLinear` of its blocks, and so does the token embedding (the
    tied head's module, or its own); their dequantized weights are never materialised.
    """
    if quant_types is not None:
        if resolved.weights_path.suffix != ".gguf":
            raise ModelLoadError(f"{resolved.weights_path}: only a GGUF is kept quantized")
        return _load_quantized(resolved, dtype, device, set(quant_types))
    ensure_hf_weights(resolved)
    cls = model_class(resolved.config.architecture)
    assert cls is not None
    with torch.device("meta"):
        model = cls(resolved.config)
    model = model.to(dtype).to_empty(device=device)
    state = _read_weights(resolved.model_dir, model)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if resolved.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ModelLoadError(
            f"{resolved.model_dir}: weights do not match {resolved.config.architecture}: "
            f"missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    if resolved.config.tie_word_embeddings:  # NOTE: to_empty() allocates tied parameters apart
        model.lm_head.weight = model.model.embed_tokens.weight  # type: ignore[union-attr]
    for module in model.modules():
        init = getattr(module, "init_buffers", None)
        if init is not None:
            init()
    return model.eval()


def _load_quantized(
    resolved: ResolvedModel, dtype: torch.dtype, device: torch.device, types: set[int]
) -> CausalLM:
    cfg = resolved.config
    cls = model_class(cfg.architecture)
    assert cls is not None
    with torch.device("meta"):
        model = cls(cfg).to(dtype)
    quant = quantized_linears(resolved.weights_path, resolved.model_dir, types)
    experts = _quantized_experts(model, quant)
    quant = {k: v for k, v in quant.items() if _is_linear_of(model, k, v)}
    embed: QuantLinear | None = None  # an untied embedding's own quantized rows
    if not cfg.tie_word_embeddings:
        embed = _embedding_blocks(resolved.weights_path, cfg.hidden_size, types)
    # a tied head kept 16-bit (Gguf16Linear) cannot serve the embedding's rows: those load dense
    head = quant.get("lm_head")
    is_embed_quantized = embed is not None or (
        cfg.tie_word_embeddings and head is not None and head[0][0] not in SIXTEEN_BIT_TYPES
    )
    skip = {f"{name}.weight" for name in quant}
    skip |= {f"{name}.{proj}.weight" for name in experts for proj in ("gate_up_proj", "down_proj")}
    if is_embed_quantized:
        skip.add("model.embed_tokens.weight")
    state = _gguf_tensors(resolved, cls, skip)
    _materialize(model, state, skip, device, resolved.weights_path)
    # One module at a time: its GGUF blocks (views of the mapped file) are repacked, then the
    # file's pages leave the resident set, so the load never holds the weights twice.
    path = resolved.weights_path
    drop_mapped_pages(path)
    for name in list(quant):
        use_quantized(model, {name: quant.pop(name)})
        drop_mapped_pages(path)
    for name in list(experts):
        gate_up, down = experts.pop(name)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, QuantExperts(
            gate_up, down, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act,
            release=MappedPages(path).release,
        ))  # fmt: skip
        del gate_up, down
        drop_mapped_pages(path)
    if is_embed_quantized:
        rows = embed if embed is not None else model.lm_head
        model.model.embed_tokens = QuantEmbedding(
            rows, cfg.vocab_size, cfg.hidden_size, dtype, is_tied=embed is None
        )
    for module in model.modules():
        init = getattr(module, "init_buffers", None)
        if init is not None:
            init()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ModelLoadError(f"{resolved.weights_path}: no weights for {left[:5]}")
    gather_in_huge_pages(model)
    _release_free_memory()
    return model.eval()


def _release_free_memory() -> None:
    """Hand the loading's freed memory back to the OS: the GGUF readers (their memory maps, and
    their parsed metadata: ~160 MB for a 49k-token vocabulary) and the GGUF block copies freed
    once repacked. glibc keeps freed chunks below the top of its heaps mapped (measured, SmolLM2:
    +89 MB of RSS after the load without the trim, +6 MB with it)."""
    gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _quantized_experts(
    model: nn.Module, quant: dict[str, list[tuple[int, torch.Tensor]]]
) -> dict[str, tuple[QuantParts, QuantParts]]:
    """Experts module name -> (gate|up parts, down parts) of `quant`'s 3-D expert tensors (taken
    out of it), for every `Experts` whose projections are both kept quantized."""
    found: dict[str, tuple[QuantParts, QuantParts]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, Experts):
            continue
        gate_up, down = quant.pop(f"{name}.gate_up_proj", None), quant.pop(f"{name}.down_proj", None)
        if gate_up is not None and down is not None:
            found[name] = (gate_up, down)
    return found


def _is_linear_of(model: nn.Module, name: str, parts: list[tuple[int, torch.Tensor]]) -> bool:
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return False
    rows = sum(int(blocks.shape[0]) for _, blocks in parts)
    return isinstance(module, nn.Linear) and rows == module.out_features


def _embedding_blocks(path: Path, hidden: int, types: set[int]) -> QuantLinear | None:
    """An untied token embedding kept in its blocks, if its type is one of `types`."""
    reader = read_gguf_index(path)
    t = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if t is None or int(t.tensor_type) not in types:
        return None
    blocks = torch.from_numpy(t.data.copy()).view(torch.uint8).reshape(int(t.data.shape[0]), -1)
    return QuantLinear(blocks, int(t.tensor_type), hidden, None)


def _gguf_tensors(
    resolved: ResolvedModel, family: type[CausalLM], skip: set[str]
) -> dict[str, torch.Tensor]:
    """The GGUF's tensors but those named in `skip`, dequantized to fp32 one at a time, renamed to
    the model's parameters (packed shards concatenated), as the converter writes them."""
    import gguf
    import numpy as np

    reader = read_gguf_index(resolved.weights_path)
    arch = field(reader, "general.architecture")
    cfg: dict[str, Any] = json.loads((resolved.model_dir / "config.json").read_text())
    packed: dict[str, tuple[str, int]] = family.packed_modules
    state: dict[str, torch.Tensor] = {}
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for t in reader.tensors:
        if t.name.startswith(CONFIG_TENSORS):
            continue  # in config.json
        hf_name = hf_tensor_name(t.name, family)
        if hf_name is None:
            raise ModelLoadError(f"{resolved.weights_path}: unexpected tensor {t.name!r}")
        piece = hf_name.split(".")[-2] if "." in hf_name else ""
        target, idx = packed.get(piece, (piece, -1))
        name = _renamed(hf_name, piece, target) if idx >= 0 else hf_name
        if name in skip:
            continue
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        data = np.asarray(data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        w = family.gguf_tensor(arch, hf_name, torch.from_numpy(data.copy()), cfg).contiguous()
        if idx >= 0:
            shards.setdefault(name, {})[idx] = w
        else:
            state[name] = w
    for name, parts in shards.items():
        state[name] = _join_shards(parts)
    return state


def _materialize(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    skip: set[str],
    device: torch.device,
    source: Path,
) -> None:
    """Give the meta model's parameters their tensors from `state` (in each parameter's dtype, on
    `device`; `state` is emptied as it goes) but those in `skip`, and its buffers empty storage.
    A tied parameter is filled once and stays shared."""
    done: dict[int, nn.Parameter] = {}
    missing: list[str] = []
    for prefix, module in model.named_modules():
        for key, p in list(module._parameters.items()):
            name = f"{prefix}.{key}" if prefix else key
            if p is None or name in skip:
                continue
            if id(p) in done:
                module._parameters[key] = done[id(p)]
                continue
            w = state.pop(name, None)
            if w is None or w.shape != p.shape:
                missing.append(name)
                continue
            new = nn.Parameter(w.to(device=device, dtype=p.dtype), requires_grad=False)
            module._parameters[key] = done[id(p)] = new
        for key, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[key] = torch.empty(b.shape, dtype=b.dtype, device=device)
    if missing or state:
        raise ModelLoadError(
            f"{source}: weights do not match the model: missing or misshapen {missing[:5]}, "
            f"unexpected {sorted(state)[:5]}"
        )


def _read_weights(folder: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint tensors renamed to the model's parameters; packed shards joined, per-expert
    tensors stacked."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights")
    family = type(model)
    packed: dict[str, tuple[str, int]] = getattr(model, "packed_modules", {})
    rename = getattr(family, "checkpoint_name", lambda n: n)
    state: dict[str, torch.Tensor] = {}
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = f.get_tensor(key)
                name = rename(key)
                piece = name.split(".")[-2] if "." in name else ""
                if piece in packed:
                    target, idx = packed[piece]
                    shards.setdefault(_renamed(name, piece, target), {})[idx] = tensor
                else:
                    state[name] = tensor
    for name, parts in shards.items():
        state[name] = _join_shards(parts)
    getattr(family, "stack_experts", lambda _: None)(state)
    return state


def _renamed(name: str, piece: str, target: str) -> str:
    """`name` with its module piece (the next to last part) replaced by `target`."""
    head, _, last = name.rpartition(".")
    return f"{head.rpartition('.')[0]}.{target}.{last}" if "." in head else f"{target}.{last}"


def _join_shards(parts: dict[int, torch.Tensor]) -> torch.Tensor:
    """A fused module's shards in order, joined along their rows (an expert tensor's dim 1)."""
    ordered = [parts[i] for i in sorted(parts)]
    return torch.cat(ordered, dim=1 if ordered[0].dim() == 3 else 0)
