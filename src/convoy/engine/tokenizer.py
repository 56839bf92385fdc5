"""Tokenizer and chat template of a model folder (a converted GGUF keeps its tokenizer there too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
        from transformers import AutoTokenizer

        self._tok: Any = AutoTokenizer.from_pretrained(str(model_dir))
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
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        if self.chat_template is None:
            raise TemplateError("this model has no chat template; use /v1/completions")
        try:
            text: str = self._tok.apply_chat_template(
                messages,
                chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except Exception as e:  # jinja errors, raise_exception() in templates
            raise TemplateError(f"chat template failed: {e}") from e
        return text
