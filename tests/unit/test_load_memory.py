"""The load's peak memory (issue #24: <= 1.15x the file): gather_in_huge_pages moves every
quantized weight's panels into one buffer without holding a module's panels twice, and a layer's
experts are packed with each expert's pages of the mapped file dropped once packed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from convoy.kernels.huge_pages import gather_in_huge_pages
from convoy.kernels.linear import QuantLinear
from convoy.models.gguf_index import MappedPages
from convoy.models.moe import QuantExperts
from tests.unit.test_quant_linear import T, _blocks

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="huge-page advice and /proc are Linux's"
)


class _Panels(nn.Module):
    """A module whose tensors the gather moves (as QuantExperts' gate_up and down)."""

    panel_attrs = ("a", "b")

    def __init__(self, mib: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.a = torch.randint(0, 256, (mib << 20,), dtype=torch.uint8, generator=gen)
        self.b = torch.randint(0, 256, (3, 1000, 77), dtype=torch.uint8, generator=gen)


def _kib(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]


@pytest.mark.usefixtures("cpu_kernels")
def test_the_panels_move_into_one_buffer_with_the_same_bytes() -> None:
    blocks, _ = _blocks(40, 256, T.Q4_K, seed=1)
    model = nn.Sequential(QuantLinear(blocks, int(T.Q4_K), 256, None), _Panels(3, seed=2))
    x = torch.randn(5, 256)
    before = model[0](x)
    copies = [model[0].packed.clone(), model[1].a.clone(), model[1].b.clone()]
    moved = gather_in_huge_pages(model)
    now = [model[0].packed, model[1].a, model[1].b]
    assert moved >= sum(t.numel() for t in copies)
    for old, new in zip(copies, now, strict=True):
        assert new.shape == old.shape and torch.equal(new, old)
    storages = {t.untyped_storage().data_ptr() for t in now}
    assert len(storages) == 1  # one buffer
    assert torch.equal(model[0](x), before)


def test_the_move_holds_no_module_twice() -> None:
    """Peak resident memory during the gather stays near what the panels take once: each copied
    run of the old memory leaves the resident set as soon as it is copied (before: the largest
    module's panels twice)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        pytest.skip("this kernel does not let a process reset its peak RSS")
    model = nn.Sequential(_Panels(96, seed=3), _Panels(64, seed=4))
    ref = [model[0].a[:: 1 << 16].clone(), model[1].a[-4096:].clone()]
    Path("/proc/self/clear_refs").write_text("5")
    base = _kib("VmRSS")
    gather_in_huge_pages(model)
    peak = _kib("VmHWM") - base
    assert peak < 40 << 10, f"peak {peak >> 10} MiB over the panels already resident"
    assert torch.equal(model[0].a[:: 1 << 16], ref[0])
    assert torch.equal(model[1].a[-4096:], ref[1])


def test_a_tensor_held_elsewhere_is_copied_and_left_intact() -> None:
    """Memory something else still holds (another reference to the tensor, or a view of it) is
    never dropped: only copied."""
    model = nn.Sequential(_Panels(8, seed=5), _Panels(8, seed=6))
    held = (model[0].a,)  # as a cached argument tuple would hold it
    view = model[1].a[100:]
    want = [held[0].clone(), view.clone()]
    gather_in_huge_pages(model)
    assert torch.equal(held[0], want[0]) and torch.equal(view, want[1])
    assert torch.equal(model[0].a, want[0]) and torch.equal(model[1].a[100:], want[1])


def _mapping_rss_kib(path: Path) -> int:
    """This process's resident KiB of its mappings of `path` (/proc/self/smaps)."""
    target, total, inside = str(path.resolve()), 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
            inside = head[-1] == target
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_released_pages_of_a_mapped_file_leave_the_resident_set_and_read_the_same(
    tmp_path: Path,
) -> None:
    path = tmp_path / "blocks.bin"
    want = np.random.default_rng(7).integers(0, 256, 16 << 20, dtype=np.uint8)
    want.tofile(path)
    data = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="r"))
    assert int(data.sum()) == int(want.sum())  # every page resident
    resident = _mapping_rss_kib(path)
    assert resident >= 15 << 10
    pages = MappedPages(path)
    pages.release(data[: 8 << 20])
    assert _mapping_rss_kib(path) <= resident - (8 << 10) + 8  # half of it went
    assert torch.equal(data, torch.from_numpy(want))  # mapped back from the page cache
    other = torch.from_numpy(want.copy())  # memory outside the file's mappings
    pages.release(other)
    assert torch.equal(other, torch.from_numpy(want))


@pytest.mark.usefixtures("cpu_kernels")
def test_a_layers_experts_are_packed_with_each_experts_pages_released(tmp_path: Path) -> None:
    """QuantExperts calls `release` with each expert's blocks once it is packed, and what it
    packed is what it packs without it (the loader's release drops the file's pages)."""
    experts, rows, k = 6, 64, 256
    gu, _ = _blocks(experts * 2 * rows, k, T.Q4_0, seed=8)
    dn, _ = _blocks(experts * k, rows, T.Q4_0, seed=9)
    gu, dn = gu.view(experts, 2 * rows, -1), dn.view(experts, k, -1)
    released: list[int] = []
    ex = QuantExperts(
        [(int(T.Q4_0), gu)], [(int(T.Q4_0), dn)], k, rows, "silu",
        release=lambda t: released.append(t.data_ptr()),
    )  # fmt: skip
    plain = QuantExperts([(int(T.Q4_0), gu)], [(int(T.Q4_0), dn)], k, rows, "silu")
    assert released == [gu[e].data_ptr() for e in range(experts)] + [
        dn[e].data_ptr() for e in range(experts)
    ]
    assert torch.equal(ex.gate_up, plain.gate_up) and torch.equal(ex.down, plain.down)
