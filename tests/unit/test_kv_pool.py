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


def test_a_pool_in_a_process_with_a_freed_heap_is_not_written_either() -> None:
    """A long-lived process (a test worker, a server that loaded and dropped a model) may hold
    a large free region in its heap whose pages were given back (malloc_trim): calloc reuses
    such a region and writes its zeros, page after page. The pool must not come from there."""
    import ctypes
    import ctypes.util

    path = ctypes.util.find_library("c")
    if path is None or "libc" not in path:
        pytest.skip("not glibc")
    libc = ctypes.CDLL(path)
    if not hasattr(libc, "malloc_trim"):
        pytest.skip("no malloc_trim (not glibc)")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    # a freed 16 MiB mapping raises glibc's mmap threshold to it: 4 MiB blocks come from the heap
    libc.free(libc.malloc(16 << 20))
    blocks = [libc.malloc(4 << 20) for _ in range(160)]  # 640 MiB of heap, written
    for b in blocks:
        libc.memset(b, 1, 4 << 20)
    fence = libc.malloc(4 << 20)  # after the run: keeps it off the heap's top (sbrk keeps it)
    for b in blocks:
        libc.free(b)
    libc.malloc_trim(0)  # the free run's pages given back: not resident, still the heap's
    try:
        before = _rss_bytes()
        kv = allocate_kv_cache(_config(8, 4, 128), 1024, 16, torch.float32, torch.device("cpu"))
        grown = _rss_bytes() - before
        assert grown < 32 << 20, f"RSS grew {grown >> 20} MiB at allocation"
        assert not kv.k[3].any() and not kv.v[7].any()
    finally:
        libc.free(fence)
