"""A tiny random Phi-3 with LongRoPE through the whole engine (scheduler, chunked prefill,
prefix cache, preemption): greedy tokens equal transformers' one-shot prefill then decode, for
prompts below, across and past the short/long switch (tests/models/test_parity_phi3.py has the
model-level checks). The tokenizer is the embedded SmolLM2's; prompts are token ids."""

from __future__ import annotations

from pathlib import Path

import torch

from convoy import LLM, SamplingParams
from tests.models.harness import copy_embedded_tokenizer, reference_greedy

VOCAB = 49152  # SmolLM2's tokenizer
STEPS = 10


def _phi3_folder(path: Path):
    import transformers as tf

    gen = torch.Generator().manual_seed(3)
    scaling = dict(
        rope_type="longrope",
        short_factor=(1 + torch.rand(8, generator=gen)).tolist(),
        long_factor=(1 + 4 * torch.rand(8, generator=gen)).tolist(),
    )
    cfg = tf.Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        original_max_position_embeddings=32, initializer_range=0.2, rope_scaling=scaling,
        pad_token_id=0, eos_token_id=2, bos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    ref.save_pretrained(path)
    copy_embedded_tokenizer(path)
    return ref


def test_phi3_engine_chunked_prefill_and_prefix_cache(tmp_path: Path) -> None:
    """A 12-token budget chunks every prompt and mixes chunks with decodes; a 40-token prompt
    shares its first 24 tokens with a 24-token one (the long one must not reuse the short one's
    cached blocks: they hold short-factor keys)."""
    ref = _phi3_folder(tmp_path)
    gen = torch.Generator().manual_seed(1)
    base = torch.randint(3, VOCAB, (60,), generator=gen).tolist()
    prompts = [base[:24], base[:40], base[:30], base[5:55]]
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    llm = LLM(str(tmp_path), dtype="float32", max_num_batched_tokens=12, block_size=4)
    first = llm.generate([prompts[0]], params)  # cached before the long prompt sharing it
    rest = llm.generate(prompts[1:], params)
    ours = [o.outputs[0].token_ids for o in first + rest]
    for prompt, tokens in zip(prompts, ours, strict=True):
        assert list(tokens) == reference_greedy(ref, prompt, steps=STEPS)[1], len(prompt)
    assert llm.core.block_manager.num_hit_tokens > 0  # the 30-token prompt reused the 24's
