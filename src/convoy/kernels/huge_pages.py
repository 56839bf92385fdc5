"""Where the quantized weights live after the load: every module's panels moved into one buffer
backed by 2 MiB pages (`gather_in_huge_pages`), and pages of memory nothing will read again
dropped from the resident set (`drop_pages`: the copied panels here, a GGUF file's mapped pages
in models/gguf_index.py). Linux's madvise; elsewhere nothing is advised or dropped."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import Any

import torch
from torch import nn

from convoy.kernels.linear import QuantLinear

PAGE = 4096
_MADV_DONTNEED = 4


@functools.cache
def _libc() -> Any:
    """The C library, to call madvise; None off Linux or where it cannot be loaded."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def drop_pages(start: int, length: int) -> None:
    """Take the pages of [start, start + length) (page-aligned) out of the resident set
    (`madvise(MADV_DONTNEED)`): a file's mapped pages come back from the page cache when touched
    again, anonymous ones as zeros, so only memory nothing reads again may be passed."""
    libc = _libc()
    if libc is not None and length > 0:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_DONTNEED)


HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_SLICE_ALIGN = 64


def gather_in_huge_pages(model: nn.Module) -> int:
    """Move every quantized weight's panels (a QuantLinear's `packed`, and any module's tensors
    it names in `panel_attrs`: the experts') into one buffer that the kernel may back with 2 MiB
    pages (`madvise(MADV_HUGEPAGE)`, Linux; transparent huge pages are often "madvise" only);
    returns its bytes, 0 where nothing moved.

    A decode step streams all the weights once, a few hundred KB a linear: with 4 KiB pages every
    4 KiB is a TLB miss on top of the DRAM latency. Each tensor is copied in a few MiB at a time,
    and where nothing else holds its memory the pages already copied leave the resident set at
    once (`_move`), so the load's peak holds no module's panels twice (an OLMoE layer's experts
    are ~250 MB).
    """
    slots: list[tuple[nn.Module, str]] = []
    for m in model.modules():
        attrs = ("packed",) if isinstance(m, QuantLinear) else getattr(m, "panel_attrs", ())
        slots += [(m, a) for a in attrs]
    sizes = [
        (getattr(m, a).numel() + _SLICE_ALIGN - 1) // _SLICE_ALIGN * _SLICE_ALIGN for m, a in slots
    ]
    total = sum(sizes)
    if not sys.platform.startswith("linux") or total < HUGE_PAGE:
        return 0
    arena = torch.empty(total + HUGE_PAGE, dtype=torch.uint8)  # untouched: not yet in RAM
    base = arena.data_ptr()
    start = (base + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE - base
    libc = _libc()
    if libc is not None:  # else ordinary pages, same results
        length = (total + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
        libc.madvise(ctypes.c_void_p(base + start), ctypes.c_size_t(length), _MADV_HUGEPAGE)
    offset = start
    for (module, attr), size in zip(slots, sizes, strict=True):
        new = arena[offset : offset + getattr(module, attr).numel()]
        _move(module, attr, new)
        offset += size
    return total


_MOVE_CHUNK = 4 << 20


def _move(module: nn.Module, attr: str, dst: torch.Tensor) -> None:
    """module.<attr> (contiguous uint8) copied into dst (1-D, as many bytes) and replaced by it,
    `_MOVE_CHUNK` bytes at a time. Where the old tensor's memory is held by nothing else (one
    tensor on its storage), each copied run of whole pages is dropped (`MADV_DONTNEED`) right
    after its copy: the old tensor is freed when this returns, and its pages are never read
    again. The allocator's own bookkeeping sits outside those pages (before the data and past
    its end), so freeing it afterwards is an ordinary free."""
    old = getattr(module, attr)
    # Alone: the tensor is referenced only by the module's attribute and `old` (and getrefcount's
    # argument), and its storage only by `old` and the storage object asked here
    alone = (
        _libc() is not None
        and sys.getrefcount(old) <= 3
        and torch._C._storage_Use_Count(old.untyped_storage()._cdata) <= 2
    )
    src = old.view(-1)
    n = src.numel()
    ptr = src.data_ptr()
    done = 0
    while done < n:
        # chunks end on page boundaries of the old memory, so each copied chunk's pages are whole
        end = min(n, (ptr + done + _MOVE_CHUNK) // PAGE * PAGE - ptr)
        dst[done:end].copy_(src[done:end])
        if alone:
            lo = (ptr + done + PAGE - 1) // PAGE * PAGE
            hi = (ptr + end) // PAGE * PAGE
            if hi > lo:
                drop_pages(lo, hi - lo)
        done = end
    setattr(module, attr, dst.view(old.shape))
