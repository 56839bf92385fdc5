"""A tiny scripted "reasoning model": a Qwen3 folder with a Qwen3-style thinking template whose
greedy reply is known in advance, so the server's reasoning split is tested without forcing
the output.

Its layers add nothing (o_proj and down_proj zero), so the next token depends on the last one
only: the model is a bigram table. `lm_head` maps each token of a script to the next, the
script's last token to EOS, all other rows zero. Two scripts, by where the prompt ends:

    `<|im_start|>assistant\\n`          (thinking on)  -> THINKING: a think block, then content
    `...<think>\\n\\n</think>\\n\\n`     (enable_thinking false) -> PLAIN: content only

A script's tokens are all different (a bigram table cannot repeat one), so the texts are
spelled with distinct tokens of SmolLM2's vocabulary (`_spell`). THINKING's `</think>` ends
with a `>` token of its own, so where a constraint refuses the content's first token (tools
`required`), the model still closes the block and the grammar takes it from there.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.models.harness import copy_embedded_tokenizer

THINKING_PARTS = ("<think>'Hi' is a greeting.</think", ">", "42")
THINKING = "".join(THINKING_PARTS)
REASONING = "'Hi' is a greeting."  # THINKING's think block
CONTENT = "42"  # THINKING's content: JSON (the json_schema test's enum)
PLAIN = "Fine."
EOS, VOCAB = 2, 49152  # SmolLM2's <|im_end|> and vocabulary

# Qwen3's template in short: its generation prompt, `enable_thinking`, earlier turns' thinking
# dropped.
TEMPLATE = """{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' }}
{%- if message.role == 'assistant' and '</think>' in (message.content or '') %}
{{- message.content.split('</think>')[-1].lstrip('\\n') }}
{%- else %}
{{- message.content or '' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}"""


@dataclass(frozen=True)
class Script:
    token_ids: list[int]  # the reply's tokens, EOS not included
    pieces: list[str]  # their texts

    @property
    def num_reasoning_tokens(self) -> int:
        """The tokens up to and including the one that completes `</think>`."""
        return next(n for n in range(len(self.pieces) + 1)
                    if "</think>" in "".join(self.pieces[:n]))  # fmt: skip


def build_thinking_model(folder: Path) -> dict[str, Script]:
    """Write the model, the embedded tokenizer and the template into `folder`; the replies'
    scripts by name (`thinking`, `plain`)."""
    import transformers as tf

    from convoy.engine.tokenizer import Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    copy_embedded_tokenizer(folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    tokenizer = Tokenizer(folder)
    starts = [
        tokenizer.encode(text, add_special_tokens=False)[-1]
        for text in ("<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ]
    pieces = _pieces(tokenizer)
    thinking: list[int] = []
    for part in THINKING_PARTS:  # the lone `>` kept for its own part
        reserved = set() if part == ">" else {pieces[">"]}
        thinking += _spell(part, pieces, set(starts) | set(thinking) | reserved)
    plain = _spell(PLAIN, pieces, set(starts) | set(thinking))
    cfg = tf.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=EOS,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for start, script in zip(starts, (thinking, plain), strict=True):
            chain = [start, *script, EOS]
            for token, following in itertools.pairwise(chain):
                head[following] += 10 * emb[token] / emb[token].norm()
    model.save_pretrained(folder)
    names = {token_id: text for text, token_id in pieces.items()}
    scripts = {"thinking": thinking, "plain": plain}
    return {k: Script(ids, [names[t] for t in ids]) for k, ids in scripts.items()}


def _pieces(tokenizer: Any) -> dict[str, int]:
    """Each plain ASCII token's text (newlines allowed) -> its id (special tokens and partial
    characters left out)."""
    out: dict[str, int] = {}
    for token_id in range(3, VOCAB):
        text = tokenizer.decode([token_id])
        if text and text.isascii() and text.replace("\n", "").isprintable():
            out.setdefault(text, token_id)
    return out


def _spell(text: str, pieces: dict[str, int], used: set[int]) -> list[int]:
    """`text` as tokens all different from each other and from `used`, longest pieces first
    (depth-first)."""

    def search(pos: int, taken: list[int]) -> list[int] | None:
        if pos == len(text):
            return taken
        for end in range(len(text), pos, -1):
            token_id = pieces.get(text[pos:end])
            if token_id is None or token_id in used or token_id in taken:
                continue
            found = search(end, [*taken, token_id])
            if found is not None:
                return found
        return None

    found = search(0, [])
    assert found is not None, f"no spelling of {text!r} in distinct tokens"
    return found


if __name__ == "__main__":  # build one to look at: python -m tests.e2e.thinking_model DIR
    import sys

    built = build_thinking_model(Path(sys.argv[1]))
    print(json.dumps({k: v.pieces for k, v in built.items()}))
