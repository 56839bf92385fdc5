"""The compiled decode-attention kernel equals the torch path on the same paged cache."""

from __future__ import annotations

import pytest
import torch

from convoy import kernels
from convoy.models.attention import AttentionMetadata, _decode_attention

# builds the kernels; skips only without a C++ compiler (tests/unit/conftest.py)
pytestmark = pytest.mark.usefixtures("cpu_kernels")


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "window"),
    [
        (9, 3, 64, 16, None),  # SmolLM2-135M
        (4, 1, 256, 16, None),  # Gemma 3 270M, global layer
        (4, 1, 256, 16, 7),  # Gemma 3 sliding layer, window shorter than most contexts
        (8, 8, 32, 4, None),  # no GQA, tiny blocks
        (6, 2, 48, 8, 1),  # window of one key
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_matches_torch_path(
    heads, kv_heads, head_dim, block_size, window, dtype
) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    num_blocks = 64
    slots = num_blocks * block_size
    k_cache = torch.randn(kv_heads, slots, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, slots, head_dim, generator=gen).to(dtype)
    lens = torch.tensor([1, 2, block_size, block_size + 1, 5 * block_size - 3, 9])
    b = lens.numel()
    nb = (int(lens.max()) + block_size - 1) // block_size
    # scattered, distinct blocks per sequence, padded with block 0 as the runner does
    perm = torch.randperm(num_blocks, generator=gen)[: b * nb].view(b, nb)
    for i, n in enumerate(lens.tolist()):
        perm[i, (n + block_size - 1) // block_size :] = 0
    q = torch.randn(b, heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(
        block_size=block_size,
        slot_mapping=torch.empty(0, dtype=torch.long),
        positions=torch.empty(0, dtype=torch.long),
        prefills=[],
        decode_idx=None,
        decode_blocks=perm.reshape(-1),
        decode_len_max=nb * block_size,
        decode_lens=lens,
    )
    scale = head_dim**-0.5
    want = _decode_attention(q, k_cache, v_cache, meta, scale, window)
    meta.native_decode = True
    got = _decode_attention(q, k_cache, v_cache, meta, scale, window)
    assert got.shape == (b, heads, head_dim) and got.dtype == dtype
    # bf16: the torch path rounds scores and probabilities to bf16, the kernel keeps them in fp32
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # the first sequence sees one key: its output is that key's value row, per KV head
    first_slot = int(perm[0, 0]) * block_size
    group = heads // kv_heads
    for h in range(heads):
        torch.testing.assert_close(got[0, h], v_cache[h // group, first_slot])


def test_decode_kernel_rejects_out_of_range_blocks() -> None:
    k_cache = torch.zeros(1, 32, 8)
    q = torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.decode_attention(
            q, k_cache, k_cache, torch.tensor([[99]]), torch.tensor([3]), 16, 1.0, 0
        )
