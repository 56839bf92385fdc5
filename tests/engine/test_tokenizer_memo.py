"""The tokenizer memo: a server start loads the class AutoTokenizer chose for the same files (and
the prompt-length bound it computed) without AutoConfig's import chain; any change to the
folder's files, or a memo that is unreadable or names a foreign class, means AutoTokenizer again."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from convoy.engine.tokenizer import Tokenizer
from convoy.models.resolve import resolve_model

TEXTS = ["Hello world", "<|im_start|>user\nhi<|im_end|>", "ünïcödé 日本語 🙂", "x = 1\n" * 50]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the default model's tokenizer files (no weights: the tokenizer reads none)."""
    source = resolve_model(None).model_dir
    out = tmp_path_factory.mktemp("tok")
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
    return out


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CONVOY_CACHE_DIR", str(tmp_path))
    return tmp_path / "tokenizers"


def _memos(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.json")) if cache.exists() else []


def test_memo_names_autotokenizers_class_and_gives_the_same_tokenizer(
    folder: Path, cache: Path
) -> None:
    reference = AutoTokenizer.from_pretrained(str(folder))
    first = Tokenizer(folder)
    (memo_path,) = _memos(cache)
    memo = json.loads(memo_path.read_text())
    assert (memo["module"], memo["name"]) == (type(reference).__module__, type(reference).__name__)
    assert memo["max_chars_per_token"] == first._max_chars_per_token
    second = Tokenizer(folder)
    assert _memos(cache) == [memo_path]  # read, not rewritten under another key
    assert type(second.hf_tokenizer) is type(reference)
    assert second._max_chars_per_token == first._max_chars_per_token > 0
    for text in TEXTS:
        expected = reference.encode(text)
        assert first.encode(text) == second.encode(text) == expected, text
        assert second.decode(expected) == reference.decode(expected, skip_special_tokens=True)
    assert (second.bos_token_id, second.eos_token_id) == (reference.bos_token_id,
                                                          reference.eos_token_id)  # fmt: skip
    assert second.chat_template == reference.chat_template


def test_the_memo_is_what_the_next_load_uses(folder: Path, cache: Path) -> None:
    Tokenizer(folder)
    (memo_path,) = _memos(cache)
    memo = json.loads(memo_path.read_text())
    # Another transformers class that loads these files: the next load must be of that class.
    memo.update(module="transformers.models.gpt2.tokenization_gpt2", name="GPT2Tokenizer",
                max_chars_per_token=7)  # fmt: skip
    memo_path.write_text(json.dumps(memo))
    loaded = Tokenizer(folder)
    assert type(loaded.hf_tokenizer).__name__ == "GPT2Tokenizer"
    assert loaded.min_tokens("a" * 70) == 10


@pytest.mark.parametrize(
    "bad",
    [
        "not json",
        json.dumps({"module": "os", "name": "path", "max_chars_per_token": 1}),
        json.dumps({"module": "transformers", "name": "NoSuchTokenizer", "max_chars_per_token": 1}),
        json.dumps({"module": "transformers", "name": "AutoTokenizer"}),
    ],
)
def test_a_memo_that_cannot_be_trusted_falls_back_to_autotokenizer(
    folder: Path, cache: Path, bad: str
) -> None:
    expected = Tokenizer(folder)
    (memo_path,) = _memos(cache)
    memo_path.write_text(bad)
    loaded = Tokenizer(folder)
    assert type(loaded.hf_tokenizer) is type(expected.hf_tokenizer)
    assert loaded._max_chars_per_token == expected._max_chars_per_token
    assert json.loads(memo_path.read_text())["name"] == type(expected.hf_tokenizer).__name__


def test_changed_files_get_a_new_memo(folder: Path, cache: Path, tmp_path: Path) -> None:
    changed = tmp_path / "changed"
    shutil.copytree(folder, changed)
    Tokenizer(changed)
    config = json.loads((changed / "tokenizer_config.json").read_text())
    config["model_max_length"] = 4096
    (changed / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = Tokenizer(changed)
    assert len(_memos(cache)) == 2
    assert loaded.hf_tokenizer.model_max_length == 4096


def test_an_unwritable_cache_only_costs_time(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")  # the cache root is a file: no folder can be made under it
    monkeypatch.setenv("CONVOY_CACHE_DIR", str(blocker))
    loaded = Tokenizer(folder)
    assert loaded.encode("Hello world") == AutoTokenizer.from_pretrained(str(folder)).encode(
        "Hello world"
    )
    assert blocker.read_text() == ""
