"""The two embedded GGUF models against transformers' own GGUF loader (the reference), fp32."""

from __future__ import annotations

import copy
from typing import Any

import gguf
import pytest
import torch

from convoy.engine.tokenizer import Tokenizer
from convoy.kernels.packed_linear import onednn_linear_available, pack_linears
from convoy.models.loader import load_model
from convoy.models.resolve import resolve_model
from tests.models.harness import convoy_greedy, reference_greedy

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
]
# fp32 prefill logits: different summation order in attention/matmul only.
LOGIT_ATOL = 1e-3
STEPS = 16  # greedy tokens a prompt: the first differing argmax would derail the rest


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma3-270m"])
def pair(request):
    from transformers import AutoModelForCausalLM

    resolved = resolve_model(request.param)
    ours = load_model(resolved, torch.float32, torch.device("cpu"))
    # NOTE: transformers reads the GGUF's metadata twice (config, then weights), element by
    # element through numpy: 40 s a read for Gemma's 262k-token vocabulary here. The second read
    # gets the first's reader (read-only, the same file), so the reference is unchanged.
    readers: dict[str, gguf.GGUFReader] = {}
    real_reader = gguf.GGUFReader

    def read_once(path: str, *args: Any, **kwargs: Any) -> gguf.GGUFReader:
        key = repr((str(path), args, sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", read_once)
        ref = AutoModelForCausalLM.from_pretrained(
            str(resolved.weights_path.parent),
            gguf_file=resolved.weights_path.name,
            dtype=torch.float32,
        ).eval()
    tok = Tokenizer(resolved.model_dir)
    return resolved, ours, ref, tok


def test_converted_weights_equal_reference(pair) -> None:
    from safetensors.torch import load_file

    resolved, _, ref, _ = pair
    converted = load_file(str(resolved.model_dir / "model.safetensors"))
    ref_state = ref.state_dict()
    assert set(converted) <= set(ref_state)
    for name, tensor in converted.items():
        assert torch.equal(tensor, ref_state[name]), name


@pytest.fixture(scope="module")
def reference(pair):
    _, _, ref, tok = pair
    prompts = [tok.encode(p) for p in PROMPTS]
    return prompts, [reference_greedy(ref, prompt, steps=STEPS) for prompt in prompts]


@pytest.mark.parametrize("path", ["torch", "cpu-fast"])
def test_prefill_and_greedy_parity_batched(request, pair, reference, path: str) -> None:
    """torch: plain linears, gathered attention. cpu-fast: what the Worker runs for fp32 on the
    CPU (prepacked oneDNN linears, compiled decode-attention kernel)."""
    resolved, ours, _, _ = pair
    if path == "cpu-fast":
        if not onednn_linear_available(torch.device("cpu"), torch.float32):
            pytest.skip("no oneDNN")
        request.getfixturevalue("cpu_kernels")  # skips only without a C++ compiler
        ours = copy.deepcopy(ours)
        assert pack_linears(ours) > 0
    prompts, refs = reference
    assert len({len(p) for p in prompts}) > 1
    logits, tokens = convoy_greedy(
        ours, resolved.config, prompts, steps=STEPS, native_decode=path == "cpu-fast"
    )
    for our_logits, our_tokens, (ref_logits, ref_tokens) in zip(logits, tokens, refs, strict=True):
        assert our_logits.shape == ref_logits.shape
        assert (our_logits - ref_logits).abs().max().item() < LOGIT_ATOL
        assert our_tokens == ref_tokens


def test_bf16_cpu_kernels_as_accurate_as_reference_bf16(cpu_kernels, pair, reference) -> None:
    """bf16 on a CPU without native bf16 runs our kernels (kernels/csrc): widened to fp32 in
    registers with fp32 accumulation. Measured against the fp32 reference, its prefill logits must
    be about as close as transformers' own bf16 run (measured: mean |err| 0.154 vs 0.170 smollm2,
    0.059 vs 0.068 gemma3; max 1.45 vs 1.34, 0.53 vs 0.61)."""
    resolved, _, ref, _ = pair
    prompts, refs = reference
    ref16 = copy.deepcopy(ref).to(torch.bfloat16)
    ref16_logits = [reference_greedy(ref16, p, steps=1)[0] for p in prompts]
    del ref16
    ours = load_model(resolved, torch.bfloat16, torch.device("cpu"))
    assert pack_linears(ours, "bf16-kernel") > 0
    logits, _ = convoy_greedy(ours, resolved.config, prompts, steps=4, native_decode=True)
    ours_max = max((o.float() - r[0]).abs().max().item() for o, r in zip(logits, refs, strict=True))
    hf_max = max((h - r[0]).abs().max().item() for h, r in zip(ref16_logits, refs, strict=True))
    ours_mean = sum(
        (o.float() - r[0]).abs().mean().item() for o, r in zip(logits, refs, strict=True)
    )
    hf_mean = sum((h - r[0]).abs().mean().item() for h, r in zip(ref16_logits, refs, strict=True))
    assert ours_mean <= 1.25 * hf_mean
    assert ours_max <= 1.5 * hf_max
