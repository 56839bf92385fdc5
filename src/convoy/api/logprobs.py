"""Engine logprobs ({token_id: logprob} per position) in OpenAI's two shapes.

Legacy completions want `text_offset` exact in the returned text, so each token's string is the
text it *adds* when decoded after the tokens before it (incremental detokenization, as the engine
does), not the token decoded alone: decoded alone, a SentencePiece word loses its leading space
and half of a UTF-8 character becomes U+FFFD. A token that only completes a character later
contributes "" and the token that completes it carries the whole character.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from convoy.api.protocol_chat import ChatLogprobToken, TopLogprob
from convoy.api.protocol_completions import CompletionLogProbs
from convoy.outputs import PositionLogprobs

if TYPE_CHECKING:
    from convoy.engine.tokenizer import Tokenizer

# Tokens of left context decoded with each new token: enough for any merge a tokenizer makes.
_CONTEXT_TOKENS = 6


def token_texts(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    context_ids: Sequence[int] = (),
    skip_special_tokens: bool = True,
) -> list[str]:
    """The text each of `token_ids` adds to the decoded string, after `context_ids`."""
    ids = list(context_ids[-_CONTEXT_TOKENS:]) + list(token_ids)
    prefix_offset, read_offset = 0, len(ids) - len(token_ids)
    texts: list[str] = []
    for end in range(read_offset + 1, len(ids) + 1):
        prefix_text = tokenizer.decode(ids[prefix_offset:read_offset], skip_special_tokens)
        new_text = tokenizer.decode(ids[prefix_offset:end], skip_special_tokens)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            texts.append(new_text[len(prefix_text) :])
            prefix_offset, read_offset = read_offset, end
        else:
            texts.append("")
    return texts


class TokenNames:
    """Decodes single token ids (the keys of top logprobs), caching them for the request;
    `as_ids` (vLLM's return_tokens_as_token_ids): names them `token_id:<id>` instead, where a
    token's text may not be its own (half a character, a merge)."""

    def __init__(self, tokenizer: Tokenizer, as_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self.as_ids = as_ids

    def __call__(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        name = self._cache.get(token_id)
        if name is None:
            name = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = name
        return name


def legacy_logprobs(
    names: TokenNames,
    texts: list[str],
    token_ids: Sequence[int],
    positions: Sequence[PositionLogprobs | None],
    start_offset: int,
) -> CompletionLogProbs:
    """Legacy completions shape; a position without logprobs (the first prompt token) is null."""
    out = CompletionLogProbs()
    offset = start_offset
    for text, token_id, position in zip(texts, token_ids, positions, strict=True):
        out.tokens.append(names(token_id) if names.as_ids else text)  # offsets: the text's
        out.text_offset.append(offset)
        offset += len(text)
        if position is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(position.get(token_id))
        out.top_logprobs.append({names(t): lp for t, lp in position.items()})
    return out


def chat_logprobs(
    names: TokenNames,
    token_ids: Sequence[int],
    positions: Sequence[PositionLogprobs],
    num_top: int,
) -> list[ChatLogprobToken]:
    """Chat shape: each sampled token with exactly `num_top` alternatives, best first."""
    entries = []
    for token_id, position in zip(token_ids, positions, strict=True):
        top = [_top(names(t), lp) for t, lp in list(position.items())[:num_top]]
        entry = _top(names(token_id), position.get(token_id, float("-inf")))
        entries.append(ChatLogprobToken(**entry.model_dump(), top_logprobs=top))
    return entries


def _top(token: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))
