"""Paged KV cache tensors: one K and one V tensor of slots per layer, sized from a memory budget."""

from __future__ import annotations

import contextlib
import math
import mmap
from dataclasses import dataclass

import torch

from convoy.model_config import ModelConfig


@dataclass(slots=True)
class KVCache:
    k: torch.Tensor  # (num_layers, Hkv, num_blocks * block_size, D): head-major slots
    v: torch.Tensor
    num_blocks: int
    block_size: int

    def layer(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[idx], self.v[idx]


_KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """CacheConfig.kv_cache_dtype -> the cache's dtype; "auto" is the model's."""
    return model_dtype if name == "auto" else _KV_DTYPES[name]


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for block_size tokens."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize


def num_blocks_for_budget(
    cfg: ModelConfig, budget_bytes: int, block_size: int, dtype: torch.dtype
) -> int:
    return max(1, budget_bytes // bytes_per_block(cfg, block_size, dtype))


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> KVCache:
    shape = (cfg.num_layers, cfg.num_kv_heads, num_blocks * block_size, cfg.head_dim)
    return KVCache(
        k=_zeros(shape, dtype, device),
        v=_zeros(shape, dtype, device),
        num_blocks=num_blocks,
        block_size=block_size,
    )


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose pages are touched when first written, not at start-up (CPU).

    torch.zeros writes every byte: the default 2 GiB pool took 0.5 s to start on a fresh host and
    8-15 s a GiB on a VM once the process had touched ~2 GiB (pages the host had never backed;
    two engines in one test process took 28 s for the second). A private anonymous mapping is the
    kernel's zero pages, mapped in as the cache fills: the same zeros, paid for by the blocks
    used, page-aligned. (Not calloc: in a process whose heap holds a large free region, calloc
    reuses it and writes the zeros itself, which a test process with a 4 GB history showed.)
    Transparent huge pages are asked for, as numpy does for its large arrays."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            region.madvise(mmap.MADV_HUGEPAGE)
    # NOTE: the tensor holds a reference to the mapping, which is unmapped when the last goes.
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)
