"""Loading rejects bad files with an error that names the file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from convoy.models.gguf_convert import ModelLoadError
from convoy.models.resolve import embedded_gguf_path, resolve_model


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVOY_CACHE_DIR", str(tmp_path / "cache"))


def test_corrupt_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelLoadError, match="corrupt.gguf"):
        resolve_model(str(bad))


def test_truncated_gguf(tmp_path: Path) -> None:
    full = embedded_gguf_path("smollm2-135m-instruct").read_bytes()
    cut = tmp_path / "truncated.gguf"
    cut.write_bytes(full[: len(full) // 2])
    with pytest.raises(ModelLoadError, match="truncated.gguf"):
        resolve_model(str(cut))


def test_unknown_gguf_architecture(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "mystery.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba9")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"mystery.gguf.*unsupported architecture 'mamba9'"):
        resolve_model(str(path))


def test_unknown_hf_architecture(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    cfg = {"architectures": ["FooForCausalLM"], "model_type": "foo", "vocab_size": 8,
           "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 1}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ModelLoadError, match=r"config.json.*unsupported architecture 'FooForCausalLM'"
    ):
        resolve_model(str(folder))


def test_unknown_model_name() -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model("no-such-model-anywhere")
