"""What a model will take of the machine's memory, checked before anything big is allocated.

`plan_memory` estimates the weights' resident bytes from the file's tensor table (a GGUF's
index, a folder's safetensors headers: nothing is read but headers), sizes the KV pool (the
--kv-cache-memory budget, --num-kv-blocks, or by default a budget that adapts to the memory
left after the weights) and raises `ModelTooLargeError`, naming the sizes, where weights + KV
pool + the runtime's own share do not fit in the memory available (MemAvailable, or the cgroup
limit where that is lower). Device memory (CUDA) is not checked here: only host loads.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from convoy.model_config import ModelConfig
from convoy.models.gguf_convert import ModelLoadError
from convoy.worker.kv_cache import bytes_per_block

logger = logging.getLogger(__name__)

GiB = 1 << 30
DEFAULT_KV_BUDGET = 2 << 30  # the most the adaptive default takes
MIN_KV_BUDGET = 64 << 20  # the adaptive default's floor, memory allowing
KV_SHARE = 0.5  # of the memory left after weights and runtime
RUNTIME_RESERVE = 768 << 20  # torch, Python, tokenizer, activations and a step's buffers


class ModelTooLargeError(ModelLoadError):
    """The model (with its KV pool) does not fit in the memory this machine has available."""


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    weights: int  # estimated resident bytes of the loaded weights
    kv_blocks: int
    kv_bytes: int
    available: int | None  # bytes available before the load (None: unknown)
    source: str  # how the KV pool was sized: "num-kv-blocks", "kv-cache-memory" or "auto"

    def describe(self) -> str:
        avail = "unknown" if self.available is None else _gib(self.available)
        return (
            f"KV pool {_gib(self.kv_bytes)} ({self.kv_blocks} blocks, {self.source}); weights "
            f"~{_gib(self.weights)}; memory available {avail}"
        )


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def available_memory() -> int | None:
    """Bytes this process may still take: MemAvailable, or the cgroup (v2 or v1) limit less the
    group's usage where that is lower; None where neither can be read."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max" or v1's huge "no limit"
            found.append(max(0, int(limit) - usage))
        break
    return min(found) if found else None


def weights_bytes(weights_path: Path, dtype: torch.dtype, keep_types: set[int] | None) -> int:
    """Estimated resident bytes of the loaded weights: a GGUF's tensors in `keep_types` at their
    block size, the rest (and every tensor of a folder) at `dtype`'s element size."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if weights_path.suffix == ".gguf":
        from convoy.kernels.linear import SIXTEEN_BIT_TYPES
        from convoy.models.gguf_index import read_gguf_index

        index = read_gguf_index(weights_path)
        names = {t.name for t in index.tensors}
        total = 0
        for t in index.tensors:
            qtype = int(t.tensor_type)
            kept = keep_types is not None and qtype in keep_types
            # F16/BF16 linears stay 16-bit (Gguf16Linear); a 16-bit embedding loads dense, and a
            # head tied to it gets its own 16-bit copy
            sixteen = keep_types is not None and qtype in SIXTEEN_BIT_TYPES and len(t.shape) == 2
            if sixteen and t.name == "token_embd.weight":
                total += t.n_elements * itemsize + (0 if "output.weight" in names else t.n_bytes)
                continue
            # F32 norms stay F32 whatever the dtype: small either way
            total += t.n_bytes if kept or sixteen else t.n_elements * itemsize
        return total
    from safetensors import safe_open

    folder = weights_path if weights_path.is_dir() else weights_path.parent
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                total += math.prod(st.get_slice(name).get_shape()) * itemsize
    return total


def auto_kv_budget(available: int | None, weights: int) -> int:
    """The default KV budget: KV_SHARE of what is left after the weights and the runtime's
    reserve, between MIN_KV_BUDGET (if that much is left) and DEFAULT_KV_BUDGET."""
    if available is None:
        return DEFAULT_KV_BUDGET
    left = available - weights - RUNTIME_RESERVE
    return int(max(min(MIN_KV_BUDGET, max(left, 0)), min(DEFAULT_KV_BUDGET, left * KV_SHARE)))


def plan_memory(
    cfg: ModelConfig,
    weights_path: Path,
    dtype: torch.dtype,
    keep_types: set[int] | None,
    kv_dtype: torch.dtype,
    block_size: int,
    kv_cache_memory: int | None,
    num_kv_blocks: int | None,
    check_host: bool = True,
) -> MemoryPlan:
    """The KV pool's size and the weights' estimate; ModelTooLargeError where they do not fit in
    the memory available (check_host False: a device load, nothing checked)."""
    per_block = bytes_per_block(cfg, block_size, kv_dtype)
    weights = weights_bytes(weights_path, dtype, keep_types)
    available = available_memory() if check_host else None
    if num_kv_blocks is not None:
        source, budget = "num-kv-blocks", num_kv_blocks * per_block
    elif kv_cache_memory is not None:
        source, budget = "kv-cache-memory", kv_cache_memory
    else:
        source, budget = "auto", auto_kv_budget(available, weights)
    blocks = num_kv_blocks or max(1, budget // per_block)
    plan = MemoryPlan(weights, blocks, blocks * per_block, available, source)
    if available is not None and weights + plan.kv_bytes + RUNTIME_RESERVE > available:
        hint = (
            "a smaller --kv-cache-memory or --num-kv-blocks"
            if source != "auto" and weights + RUNTIME_RESERVE < available
            else "a smaller or more quantized file, or a machine with more memory"
        )
        raise ModelTooLargeError(
            f"{weights_path}: too large for this machine: the weights need ~{_gib(weights)} "
            f"(file {_gib(_file_size(weights_path))}), the KV pool {_gib(plan.kv_bytes)} "
            f"({source}) and the runtime ~{_gib(RUNTIME_RESERVE)}, but only "
            f"{_gib(available)} of memory is available; try {hint}"
        )
    return plan


def _file_size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return path.stat().st_size
