"""The tiny parity models (test_parity_tiny.py) with the CPU kernels on: fused norms, rotary +
cache writes, gated activations and decode attention still give transformers' greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from convoy.models.loader import load_model, resolve_model
from tests.models.harness import convoy_greedy, reference_greedy
from tests.models.test_parity_tiny import LOGIT_ATOL, _config

pytestmark = pytest.mark.usefixtures("cpu_kernels")


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_tiny_parity_native_kernels(kind: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(_config(kind), attn_implementation="eager").eval()
    ref.save_pretrained(tmp_path)
    resolved = resolve_model(str(tmp_path))
    ours = load_model(resolved, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (3, 9, 17, 30)]
    logits, tokens = convoy_greedy(ours, resolved.config, prompts, steps=32, native_decode=True)
    assert all(m.native for m in ours.modules() if type(m).__name__ == "RMSNorm")
    for prompt, our_logits, our_tokens in zip(prompts, logits, tokens, strict=True):
        ref_logits, ref_tokens = reference_greedy(ref, prompt, steps=32)
        assert (our_logits - ref_logits).abs().max().item() < LOGIT_ATOL
        assert our_tokens == ref_tokens
