"""One Tokenizer shared by threads: the server encodes in worker threads while the engine thread
decodes. Concurrent calls must neither raise ("Already borrowed") nor change any result."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from convoy.engine.tokenizer import Tokenizer
from convoy.models.resolve import resolve_model

TEXTS = [
    "Hello world",
    "  leading spaces and\ttabs\n\n",
    "<|im_start|>user\nspecial tokens in text<|im_end|>",
    "ünïcödé 日本語 🙂",
    "def f(x):\n    return x * 2\n",
    "The quick brown fox jumps over the lazy dog. " * 2000,  # long: holds a borrow for a while
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model(None).model_dir


def test_encode_matches_transformers(model_dir: Path) -> None:
    reference = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer = Tokenizer(model_dir)
    for text in TEXTS:
        for special in (True, False):
            assert tokenizer.encode(text, special) == reference.encode(
                text, add_special_tokens=special
            ), (text[:40], special)


def test_concurrent_encode_and_decode(model_dir: Path) -> None:
    tokenizer = Tokenizer(model_dir)
    expected = [(tokenizer.encode(t), tokenizer.encode(t, False)) for t in TEXTS]
    decoded = [tokenizer.decode(ids) for ids, _ in expected]

    def work(worker: int) -> None:
        for round_ in range(20):
            i = (worker + round_) % len(TEXTS)
            assert tokenizer.encode(TEXTS[i]) == expected[i][0]
            assert tokenizer.encode(TEXTS[i], False) == expected[i][1]
            assert tokenizer.decode(expected[i][0]) == decoded[i]
            assert len(tokenizer.convert_ids_to_tokens(expected[i][1])) == len(expected[i][1])

    with ThreadPoolExecutor(max_workers=8) as pool:
        for future in [pool.submit(work, w) for w in range(8)]:
            future.result()  # re-raises anything a thread raised
