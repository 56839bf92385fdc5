"""The KV pool's tensors: zeros of the asked shape and dtype, 64-byte aligned, whose pages are
touched as the cache fills, not at start-up (a 2 GiB pool is a 2 GiB write otherwise)."""

from __future__ import annotations

import resource

import pytest
import torch

from convoy.model_config import ModelConfig
from convoy.worker.kv_cache import allocate_kv_cache


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _config(layers: int, kv_heads: int, head_dim: int) -> ModelConfig:
    cfg = ModelConfig.__new__(ModelConfig)
    for name, value in (("num_layers", layers), ("num_kv_heads", kv_heads), ("head_dim", head_dim)):
        object.__setattr__(cfg, name, value)
    return cfg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pool_is_aligned_zeros_of_its_shape(dtype: torch.dtype) -> None:
    kv = allocate_kv_cache(_config(3, 2, 64), 5, 16, dtype, torch.device("cpu"))
    for t in (kv.k, kv.v):
        assert t.shape == (3, 2, 80, 64) and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % 64 == 0 and not t.any()
    kv.k[1, 0, 7] = 1.0  # writable, and k and v are separate memory
    assert kv.k.sum() == 64 and not kv.v.any()


def test_a_large_pool_is_not_written_at_allocation() -> None:
    try:
        open("/proc/self/statm").close()
    except OSError:
        pytest.skip("no /proc/self/statm")
    before = _rss_bytes()
    # 2 x 256 MiB: K and V of 8 layers x 4 heads x 16384 slots x 128 dims, fp32
    kv = allocate_kv_cache(_config(8, 4, 128), 1024, 16, torch.float32, torch.device("cpu"))
    grown = _rss_bytes() - before
    assert kv.k.numel() * 4 == 256 << 20
    assert grown < 32 << 20, f"RSS grew {grown >> 20} MiB at allocation"
    kv.k[0].fill_(1.0)  # the first layer's K written: its pages are now resident
    assert _rss_bytes() - before >= (kv.k[0].numel() * 4) * 3 // 4
