"""The two embedded GGUF models against transformers' own GGUF loader (the reference), fp32."""

from __future__ import annotations

import pytest
import torch

from convoy.engine.tokenizer import Tokenizer
from convoy.models.loader import load_model, resolve_model
from tests.models.harness import convoy_greedy, reference_greedy

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
]
# fp32 prefill logits: different summation order in attention/matmul only.
LOGIT_ATOL = 1e-3


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma3-270m"])
def pair(request):
    from transformers import AutoModelForCausalLM

    resolved = resolve_model(request.param)
    ours = load_model(resolved, torch.float32, torch.device("cpu"))
    ref = AutoModelForCausalLM.from_pretrained(
        str(resolved.weights_path.parent), gguf_file=resolved.weights_path.name, dtype=torch.float32
    ).eval()
    tok = Tokenizer(resolved.model_dir, resolved.config.model_type)
    return resolved, ours, ref, tok


def test_converted_weights_equal_reference(pair) -> None:
    from safetensors.torch import load_file

    resolved, _, ref, _ = pair
    converted = load_file(str(resolved.model_dir / "model.safetensors"))
    ref_state = ref.state_dict()
    assert set(converted) <= set(ref_state)
    for name, tensor in converted.items():
        assert torch.equal(tensor, ref_state[name]), name


def test_prefill_and_greedy_parity_batched(pair) -> None:
    resolved, ours, ref, tok = pair
    prompts = [tok.encode(p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) > 1
    logits, tokens = convoy_greedy(ours, resolved.config, prompts, steps=32)
    for prompt, our_logits, our_tokens in zip(prompts, logits, tokens, strict=True):
        ref_logits, ref_tokens = reference_greedy(ref, prompt, steps=32)
        assert our_logits.shape == ref_logits.shape
        assert (our_logits - ref_logits).abs().max().item() < LOGIT_ATOL
        assert our_tokens == ref_tokens
