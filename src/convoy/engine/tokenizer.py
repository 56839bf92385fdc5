"""Tokenizer and chat template of a model folder (a converted GGUF keeps its tokenizer there too)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Normalizers that never make the text shorter than this factor: the Unicode compositions turn at
# most 4 code points into one (e.g. U+1F86, alpha with three marks; max len(NFD(c)) is 4), doubled
# for safety; Lowercase, Prepend and Replace(pattern -> content no shorter) never shrink it.
_COMPOSING_NORMALIZERS = frozenset({"NFC", "NFKC", "NFD", "NFKD"})
_COMPOSITION_SHRINK = 8


class TemplateError(ValueError):
    """The model has no chat template, or the template rejects the messages."""


class Tokenizer:
    """Thin wrapper over a Hugging Face fast tokenizer: encode, decode, special ids, chat.

    Safe to share between threads (the server encodes in worker threads while the engine thread
    decodes): every call only reads the Rust tokenizer. transformers' own `encode` re-applies its
    truncation / padding settings to the shared Rust object, a mutable borrow that raises
    "Already borrowed" while another thread is inside encode or decode; so `encode` calls the
    Rust tokenizer directly, with those settings turned off once here.
    """

    def __init__(self, model_dir: Path, default_chat_template: str | None = None) -> None:
        """`default_chat_template`: the model family's, for files that carry none (base models)."""
        memo_path = _memo_path(model_dir)
        memo = _read_memo(memo_path)
        cls = None if memo is None else _memo_class(memo)
        if cls is not None:
            self._tok: Any = cls.from_pretrained(str(model_dir))
        else:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(str(model_dir))
        self._backend: Any = self._tok.backend_tokenizer
        # What transformers' encode sets before each call (no truncation, no padding, special
        # tokens in the text kept whole), set once, before any other thread can see it.
        self._backend.no_truncation()
        self._backend.no_padding()
        self._backend.encode_special_tokens = bool(
            getattr(self._tok, "split_special_tokens", False)
        )
        self.chat_template: str | None = self._tok.chat_template or default_chat_template
        self.bos_token_id: int | None = self._tok.bos_token_id
        self.eos_token_id: int | None = self._tok.eos_token_id
        if cls is not None and memo is not None:
            self._max_chars_per_token: int = memo["max_chars_per_token"]
        else:
            self._max_chars_per_token = _max_chars_per_token(self._backend)
            _write_memo(memo_path, type(self._tok), self._max_chars_per_token)

    @property
    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer underneath (read only: llguidance builds its view of the
        vocabulary from it)."""
        return self._tok

    def min_tokens(self, text: str) -> int:
        """A lower bound on the number of tokens `text` encodes to (0 when none is known), cheap
        enough to reject a 32 MiB prompt without tokenizing it: building the Python list of its
        6 million ids and freeing the Rust encoding each hold the GIL for a large fraction of a
        second, which stalls every stream and /health."""
        if not self._max_chars_per_token:
            return 0
        return len(text) // self._max_chars_per_token

    def tail(self, text: str, num_tokens: int) -> str:
        """An end of `text` long enough for its last `num_tokens` tokens and another 1,024
        (the merges at the cut change only tokens near it): what left truncation needs
        tokenized of a text too long to tokenize whole (the text itself when no bound is
        known)."""
        if not self._max_chars_per_token:
            return text
        return text[-(num_tokens + 1024) * self._max_chars_per_token :]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`.

        NOTE: `encode_batch` releases the GIL while the Rust code works and `encode` does not, so
        a long text tokenized in a worker thread would still stall the event loop with `encode`
        (measured: /health waited 14 s behind an 8 MiB prompt; with `encode_batch`, 40 ms).
        """
        batch = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
        ids: list[int] = batch[0].ids
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        text: str = self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return text

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        tokens: list[str] = self._tok.convert_ids_to_tokens(token_ids)
        return tokens

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """`tools`: function definitions, for a template that renders them itself;
        `template_kwargs`: more variables for the template (e.g. enable_thinking; names of the
        call's own arguments and special tokens are the caller's to refuse);
        `continue_final_message`: the text ends inside the last message (its end-of-turn cut),
        for the model to go on writing it (transformers' option, vLLM's field)."""
        if self.chat_template is None:
            raise TemplateError("this model has no chat template; use /v1/completions")
        try:
            text: str = self._tok.apply_chat_template(
                messages,
                tools=tools,
                chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **(template_kwargs or {}),
            )
        except Exception as e:  # jinja errors, raise_exception() in templates
            raise TemplateError(f"chat template failed: {e}") from e
        return text


# What a model folder's tokenizer load found, remembered per folder contents (see `_memo_path`):
# AutoTokenizer's choice of class and the prompt-length bound. AutoTokenizer reads the model's
# config through AutoConfig, whose import chain (torch.distributed, sympy) cost ~1.5 s of each
# server start here, and the bound serializes and parses the whole tokenizer (3.3 s for Gemma 3's
# 262k vocabulary). The class named by the memo is what AutoTokenizer returned for the same files
# under the same library versions, so loading through it gives the same tokenizer.
_MEMO_FORMAT = 1
_WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".gguf", ".pt", ".pth", ".h5", ".onnx"})
_HASHED_FILE_BYTES = 256 << 20  # larger files (none a tokenizer reads) count by size and mtime


def _memo_path(model_dir: Path) -> Path | None:
    """The memo file for this folder as it is now: keyed by the library versions, the folder's
    path (AutoTokenizer matches some checkpoint names) and every non-weight file in it (the
    tokenizer files, config.json). None when the folder cannot be read."""
    import tokenizers
    import transformers

    from convoy.models.resolve import cache_dir  # here: it imports torch

    h = hashlib.sha256()
    h.update(f"{_MEMO_FORMAT}|{transformers.__version__}|{tokenizers.__version__}".encode())
    h.update(str(model_dir.resolve()).encode())
    try:
        for path in sorted(model_dir.iterdir()):
            if not path.is_file() or path.suffix in _WEIGHT_SUFFIXES:
                continue
            st = path.stat()
            h.update(f"\0{path.name}\0{st.st_size}\0".encode())
            if st.st_size > _HASHED_FILE_BYTES:
                h.update(str(st.st_mtime_ns).encode())
            else:
                h.update(path.read_bytes())
    except OSError:
        return None
    return cache_dir() / "tokenizers" / f"{h.hexdigest()[:32]}.json"


def _read_memo(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        memo = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if (
        not isinstance(memo, dict)
        or not isinstance(memo.get("module"), str)
        or not isinstance(memo.get("name"), str)
        or type(memo.get("max_chars_per_token")) is not int
    ):
        return None
    return memo


def _memo_class(memo: dict[str, Any]) -> Any:
    """The tokenizer class the memo names, or None (only transformers' own classes)."""
    module = memo["module"]
    if module != "transformers" and not module.startswith("transformers."):
        return None
    try:
        cls = getattr(importlib.import_module(module), memo["name"], None)
    except ImportError:
        return None
    return cls if isinstance(cls, type) and hasattr(cls, "from_pretrained") else None


def _write_memo(path: Path | None, cls: type, max_chars: int) -> None:
    """Best effort: a cache that cannot be written costs the next start time, nothing else."""
    if path is None or not cls.__module__.startswith("transformers."):
        return
    memo = {"module": cls.__module__, "name": cls.__qualname__, "max_chars_per_token": max_chars}
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(memo, f)
        os.replace(tmp, path)
    except OSError as e:
        logger.debug("tokenizer memo not written (%s)", e)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _max_chars_per_token(backend: Any) -> int:
    """The most characters of input text one token can stand for, or 0 when no safe bound is
    known. Only for BPE models: each token is a run of the normalized text's characters (byte-level
    vocabularies spell one byte per character, which is no fewer than the text's characters), so
    it covers at most the longest vocabulary string, times what the normalizer can shrink. A
    fused unknown token covers any run of characters, and other normalizers (Strip, StripAccents,
    BERT's control-character removal) can remove any amount of text: no bound then."""
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return 0
    if (
        model.get("unk_token") is not None
        and model.get("fuse_unk")
        and not model.get("byte_fallback")
    ):
        return 0
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if not shrink:
        return 0
    longest = max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=0)
    return longest * shrink if longest else 0


def _normalizer_shrink(normalizer: dict[str, Any] | None) -> int:
    """How many times shorter the normalizer can make a text (0: unbounded or unknown)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers") or []:
            part_factor = _normalizer_shrink(part)
            if not part_factor:
                return 0
            factor *= part_factor
        return factor
    if kind in _COMPOSING_NORMALIZERS:
        return _COMPOSITION_SHRINK
    if kind in ("Lowercase", "Prepend"):
        return 1
    if kind == "Replace":
        pattern = (normalizer.get("pattern") or {}).get("String")
        content = normalizer.get("content") or ""
        return 1 if pattern is not None and len(content) >= len(pattern) else 0
    return 0
