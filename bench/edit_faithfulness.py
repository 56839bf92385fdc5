"""How much of a model's answer to an edit request copies the original: the ceiling on what a
`prediction` (the original as the draft) can give speculative decoding (issue #28's edit goal).

    python bench/edit_faithfulness.py                       # smollm2, 6 pieces of code
    python bench/edit_faithfulness.py --model gemma3-270m
    python bench/edit_faithfulness.py --kind prose           # paragraphs of Convoy's docs

For each instruction below, the model's greedy answer (offline `LLM`, no drafts) to each of
--files pieces of Convoy's source (bench/spec.py's `code_pieces`), or of its docs' prose
(`prose_pieces`, with --kind prose), is compared with the piece,
token by token (difflib's matching blocks): the share of the answer's tokens that lie in runs
shared with the original. A faithful edit ("add a line at the top") would be ~100%; drafts of
the prediction can only be kept where the answer copies. Opt-in, never in CI; figures in
bench/README.md ("Speculative decoding").
"""

from __future__ import annotations

import argparse
import difflib
import time
from collections.abc import Callable

from convoy import LLM, SamplingParams
from spec import code_pieces, prose_pieces

Messages = list[dict[str, str]]

INSTRUCTIONS: dict[str, Callable[[str], Messages]] = {
    # bench/spec.py's edit workload
    "spec.py's": lambda p: [{"role": "user", "content": (
        "Add the line `# Reviewed.` at the top of this code and reply with the whole code,"
        f" nothing else.\n\n{p}")}],
    "code first": lambda p: [{"role": "user", "content": (
        f"```python\n{p}```\n\nRepeat the code above exactly, with the line `# Reviewed.` added"
        " at the top. Reply with the code only.")}],
    "system prompt": lambda p: [
        {"role": "system", "content": (
            "You are a code editor. You reply with the complete edited file and nothing else."
            " You never change anything you were not asked to change.")},
        {"role": "user", "content": (
            f"Add the comment `# Reviewed.` as the first line of this file.\n\n```python\n{p}```")},
    ],
    "rename": lambda p: [{"role": "user", "content": (
        f"Here is a Python file:\n\n```python\n{p}```\n\nCopy this file exactly, but change every"
        " `self` to `me`. Reply with the whole file in a code block.")}],
}  # fmt: skip


PROSE: dict[str, Callable[[str], Messages]] = {
    # bench/spec.py's prose edit workload
    "add a sentence": lambda p: [{"role": "user", "content": (
        "Add the sentence \"This was reviewed.\" at the end of this text and reply with the"
        f" whole text, nothing else.\n\n{p}")}],
    "text first": lambda p: [{"role": "user", "content": (
        f"{p}\nRepeat the text above exactly, word for word, with the sentence \"This was"
        " reviewed.\" added at the end. Reply with the text only.")}],
    "system prompt": lambda p: [
        {"role": "system", "content": (
            "You are a copy editor. You reply with the complete edited text and nothing else."
            " You never change anything you were not asked to change.")},
        {"role": "user", "content": (
            f"Add the sentence \"This was reviewed.\" at the end of this text.\n\n{p}")},
    ],
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--files", type=int, default=6)
    parser.add_argument("--kind", choices=["code", "prose"], default="code")
    args = parser.parse_args()
    llm = LLM(args.model, speculative="off")
    tok = llm.tokenizer
    pieces = (code_pieces if args.kind == "code" else prose_pieces)(args.files, 0)
    for name, make in (INSTRUCTIONS if args.kind == "code" else PROSE).items():
        prompts = [tok.apply_chat_template(make(p)) for p in pieces]
        params = [SamplingParams(temperature=0, max_tokens=len(p) // 3 + 48) for p in pieces]
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        shares = []
        for piece, out in zip(pieces, outs, strict=True):
            answer = list(out.outputs[0].token_ids)
            original = tok.encode(piece, add_special_tokens=False)
            blocks = difflib.SequenceMatcher(None, answer, original, autojunk=False)
            copied = sum(b.size for b in blocks.get_matching_blocks())
            shares.append(copied / max(1, len(answer)))
        each = ", ".join(f"{s:.0%}" for s in shares)
        print(f"{name}: {sum(shares) / len(shares):.0%} of the answers' tokens copy the original"
              f" ({each}); {time.perf_counter() - t:.1f} s", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
