"""A tiny random Phi-3 with LongRoPE through the whole engine (scheduler, chunked prefill,
prefix cache, preemption): greedy tokens equal transformers' one-shot prefill then decode, for
prompts below, across and past the short/long switch (tests/models/test_parity_phi3.py has the
model-level checks). The tokenizer is the embedded SmolLM2's; prompts are token ids."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from convoy import LLM, SamplingParams
from convoy.config import EngineConfig
from convoy.engine.async_engine import AsyncEngine
from convoy.sampling_params import RequestOutputKind
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


def test_phi3_through_the_server_engine_with_side_steps(tmp_path: Path) -> None:
    """The server's engine passes every step's forward the side-step hook (EngineCore): Phi-3's
    forward, which re-indexes positions for LongRoPE first, takes it on; requests that come
    while others run (side steps or not) get transformers' tokens, across the switch too."""
    ref = _phi3_folder(tmp_path)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (20, 40, 12, 30)]
    params = SamplingParams(
        temperature=0, max_tokens=STEPS, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    config = EngineConfig.from_kwargs(
        model=str(tmp_path), dtype="float32", block_size=4, side_step_ms=1e-3
    )

    async def scenario() -> list[list[int]]:
        engine = AsyncEngine(config)
        await engine.start()

        async def tokens(i: int, prompt: list[int]) -> list[int]:
            await asyncio.sleep(0.002 * i)  # one after the other, into the steps of the others
            req = engine.frontend.inputs.process(prompt, params, f"r{i}")
            outs = [o async for o in engine.generate(req)]
            return list(outs[-1].outputs[0].token_ids)

        try:
            return await asyncio.wait_for(
                asyncio.gather(*(tokens(i, p) for i, p in enumerate(prompts))), 120
            )
        finally:
            await engine.shutdown()

    ours = asyncio.run(scenario())
    for prompt, got in zip(prompts, ours, strict=True):
        assert got == reference_greedy(ref, prompt, steps=STEPS)[1], len(prompt)
