"""Drive a Convoy model through the paged KV cache without the engine, and a transformers reference."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch
from torch import nn

from convoy.model_config import ModelConfig
from convoy.models.resolve import resolve_model
from convoy.sampling_params import SamplingParams
from convoy.worker.batch import PromptScoring, SamplerRow, ScheduledSeq
from convoy.worker.kv_cache import allocate_kv_cache
from convoy.worker.model_runner import ModelRunner

# The runner only asks whether a sequence samples; the sampler is not used here.
_GREEDY = SamplerRow(SamplingParams(temperature=0), None, [], [], [], need_logprob=False)


def convoy_greedy(
    model: nn.Module,
    cfg: ModelConfig,
    prompts: list[list[int]],
    steps: int,
    block_size: int = 4,
    native_decode: bool = False,
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """All prompts prefilled together in one forward pass, then decoded together.

    Returns each prompt's prefill logits (len, vocab) and its greedy continuation. Blocks are handed
    out from a shuffled free list so every sequence's block table is scattered through the cache.
    """
    max_len = max(len(p) for p in prompts) + steps
    per_seq = (max_len + block_size - 1) // block_size
    num_blocks = per_seq * len(prompts) + 1
    embed = model.model.embed_tokens  # type: ignore[union-attr]
    dtype = embed.dtype if hasattr(embed, "dtype") else embed.weight.dtype  # QuantEmbedding: .dtype
    kv = allocate_kv_cache(cfg, num_blocks, block_size, dtype, torch.device("cpu"))
    runner = ModelRunner(model, kv, torch.device("cpu"), native_decode)
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range(per_seq)] for _ in prompts]
    seqs = [  # logits of every prompt position (scoring from position 1), and a sample row
        ScheduledSeq(f"s{i}", list(p), 0, tables[i], _GREEDY, PromptScoring(1, p[1:], 0))
        for i, p in enumerate(prompts)
    ]
    out = runner.execute(seqs)
    prefill_logits = [runner.compute_logits(h) for h in out.prompt_hidden if h is not None]
    tokens = [[int(t)] for t in out.logits.argmax(-1)]
    for _ in range(steps - 1):
        seqs = [
            ScheduledSeq(f"s{i}", [toks[-1]], len(p) + len(toks) - 1, tables[i], _GREEDY)
            for i, (p, toks) in enumerate(zip(prompts, tokens, strict=True))
        ]
        nxt = runner.execute(seqs).logits.argmax(-1)
        for toks, t in zip(tokens, nxt, strict=True):
            toks.append(int(t))
    return prefill_logits, tokens


@torch.inference_mode()
def reference_greedy(
    hf_model: nn.Module, prompt: list[int], steps: int
) -> tuple[torch.Tensor, list[int]]:
    """transformers: prefill logits (len, vocab) and a greedy continuation, one prompt alone."""
    from transformers import DynamicCache

    ids = torch.tensor([prompt])
    cache = DynamicCache()
    out = hf_model(input_ids=ids, past_key_values=cache, use_cache=True)
    prefill = out.logits[0].float()
    tokens = [int(prefill[-1].argmax())]
    for _ in range(steps - 1):
        out = hf_model(
            input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True
        )
        tokens.append(int(out.logits[0, -1].argmax()))
    return prefill, tokens


def copy_embedded_tokenizer(folder: Path) -> None:
    """Give a tiny random model's folder the embedded SmolLM2's tokenizer (49152 tokens)."""
    tokenizer_dir = resolve_model("smollm2-135m-instruct").model_dir
    for f in tokenizer_dir.glob("*"):
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder / f.name)
