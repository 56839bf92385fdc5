"""Tokenizer.min_tokens: a lower bound on a text's token count, used to reject a prompt that is
certainly too long without tokenizing it. It must never exceed the real count, or a valid prompt
would be refused."""

from __future__ import annotations

import random
import unicodedata

import pytest

from convoy.engine.tokenizer import Tokenizer, _normalizer_shrink
from convoy.models.resolve import resolve_model


def _adversarial_texts(tokenizer: Tokenizer) -> list[str]:
    """Texts that pack as many characters as possible into each token: runs of the longest
    vocabulary entries, whitespace runs, decomposed characters an NFC normalizer would compose,
    and seeded random Unicode."""
    vocab = tokenizer._backend.get_vocab(with_added_tokens=True)
    longest = sorted(vocab, key=len)[-20:]
    texts = [piece.replace("\u2581", " ") * 50 for piece in longest]
    texts += [c * 5000 for c in (" ", "\n", "\t", "#", "=", "-", "a")]
    decomposed = "".join(unicodedata.normalize("NFD", chr(c)) for c in range(0x1F80, 0x1FB0))
    texts.append(decomposed * 100)
    rng = random.Random(0)
    for _ in range(20):
        texts.append("".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(2000)))
    return texts


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "gemma3-270m"])
def test_min_tokens_never_exceeds_the_real_count(model: str) -> None:
    tokenizer = Tokenizer(resolve_model(model).model_dir)
    assert tokenizer.min_tokens("x" * 100_000) > 0  # both models' tokenizers have a bound
    for text in _adversarial_texts(tokenizer):
        for special in (True, False):
            count = len(tokenizer.encode(text, add_special_tokens=special))
            assert tokenizer.min_tokens(text) <= count, (text[:40], count)


def test_normalizers_that_can_drop_text_give_no_bound() -> None:
    assert _normalizer_shrink(None) == 1
    assert _normalizer_shrink({"type": "Strip", "left": True, "right": True}) == 0
    assert _normalizer_shrink({"type": "StripAccents"}) == 0
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    assert _normalizer_shrink(replace) == 1
    shrinking = {"type": "Replace", "pattern": {"String": "  "}, "content": " "}
    assert _normalizer_shrink(shrinking) == 0
    nfc = {"type": "NFC"}
    assert _normalizer_shrink({"type": "Sequence", "normalizers": [replace, nfc]}) == 8
    assert _normalizer_shrink({"type": "Sequence", "normalizers": [nfc, shrinking]}) == 0
