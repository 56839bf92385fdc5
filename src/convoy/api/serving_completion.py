"""POST /v1/completions: prompt forms -> engine requests -> one response or one SSE stream.

Choice order is OpenAI's and vLLM's: `index = prompt_idx * n + j`. Usage counts each prompt's
tokens once and every generated token (best_of candidates that are not returned too).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import cast

from convoy.api.engine_client import EngineClient, Prompt
from convoy.api.errors import APIError
from convoy.api.logprobs import legacy_logprobs, token_texts
from convoy.api.protocol_common import PromptInput
from convoy.api.protocol_completions import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from convoy.api.serving_base import (
    Job,
    Outputs,
    ServingBase,
    finish_reason,
    is_empty_delta,
)
from convoy.outputs import CompletionOutput, PositionLogprobs, RequestOutput


@dataclass(slots=True)
class _ChoiceState:
    """What a streamed choice has sent so far: tokens as context, text length for offsets."""

    token_ids: list[int] = field(default_factory=list)
    text_len: int = 0
    started: bool = False


_Job = Job[CompletionRequest]


class CompletionServing(
    ServingBase[CompletionRequest, CompletionResponse, CompletionStreamResponse]
):
    id_prefix = "cmpl"
    prompt_param = "prompt"
    chunk_type = CompletionStreamResponse

    def prompts(self, request: CompletionRequest) -> list[Prompt]:
        """Normalise the four prompt forms to token ids (text is tokenized with special tokens)."""
        limit = self.client.limits.max_prompts_per_request
        return encode_prompts(self.client, request.prompt, "prompt", limit,
                              request.truncate_prompt_tokens)  # fmt: skip

    def _echo_text(self, prompt: Prompt) -> str:
        """The prompt as echoed: as sent, or decoded once for a token-id prompt."""
        if prompt.text is None:
            prompt.text = self.client.tokenizer.decode(prompt.token_ids)
        return prompt.text

    async def collect(self, job: _Job, outputs: Outputs) -> CompletionResponse:
        finals: dict[int, RequestOutput] = {}
        async with aclosing(outputs):
            async for i, out in outputs:
                finals[i] = out
        choices: list[CompletionChoice] = []
        for i, prompt in enumerate(job.prompts):
            out = finals[i]
            for c in sorted(out.outputs, key=lambda c: c.index):
                choices.append(self._choice(job, i, prompt, out, c))
        num_completion_tokens = sum(o.num_generated_tokens for o in finals.values())
        return CompletionResponse(
            id=job.api_id,
            created=job.created,
            model=self.client.served_model_name,
            choices=choices,
            usage=self.usage(job, num_completion_tokens),
        )

    def _choice(
        self, job: _Job, i: int, prompt: Prompt, out: RequestOutput, c: CompletionOutput
    ) -> CompletionChoice:
        prefix = self._echo_text(prompt) if job.request.echo else ""
        logprobs = None
        if job.request.logprobs is not None:
            logprobs = self._prompt_logprobs(job, prompt, out) if job.request.echo else None
            generated = self._generated_logprobs(job, prompt.token_ids, c, len(prefix))
            if logprobs is None:
                logprobs = generated
            else:
                logprobs.extend(generated)
        return CompletionChoice(
            text=prefix + c.text,
            index=i * job.n + c.index,
            logprobs=logprobs,
            finish_reason=finish_reason(c),
        )

    def _prompt_logprobs(self, job: _Job, prompt: Prompt, out: RequestOutput) -> CompletionLogProbs:
        """Scores of the prompt's own tokens (echo); the first token has nothing to predict it."""
        ids = prompt.token_ids
        positions: list[PositionLogprobs | None] = [None] * len(ids)
        if out.prompt_logprobs:
            positions = list(out.prompt_logprobs)
        texts = token_texts(self.client.tokenizer, ids)
        return legacy_logprobs(job.names, texts, ids, positions, 0)

    def _generated_logprobs(
        self, job: _Job, context_ids: list[int], c: CompletionOutput, start_offset: int
    ) -> CompletionLogProbs:
        skip = job.request.skip_special_tokens is not False
        texts = token_texts(self.client.tokenizer, c.token_ids, context_ids, skip)
        positions: list[PositionLogprobs | None] = [None] * len(c.token_ids)
        if c.logprobs:
            positions = list(c.logprobs)
        return legacy_logprobs(job.names, texts, c.token_ids, positions, start_offset)

    async def stream(
        self, job: _Job, outputs: Outputs
    ) -> AsyncGenerator[CompletionStreamResponse, None]:
        """One chunk per choice delta, interleaved across prompts; then the usage chunk."""
        states: dict[int, _ChoiceState] = {}
        prompt_logprobs: dict[int, RequestOutput] = {}
        num_completion_tokens = 0
        async with aclosing(outputs):
            async for i, out in outputs:
                if out.prompt_logprobs is not None:
                    prompt_logprobs.setdefault(i, out)
                for c in out.outputs:
                    num_completion_tokens += len(c.token_ids)
                    job.record.num_completion_tokens = num_completion_tokens
                    state = states.setdefault(i * job.n + c.index, _ChoiceState())
                    choice = self._delta(job, i, prompt_logprobs.get(i, out), c, state)
                    if choice is not None:
                        yield self.chunk(job, [choice])
                job.record.num_completion_tokens = num_completion_tokens
        if (last := self.usage_chunk(job, num_completion_tokens)) is not None:
            yield last

    def _delta(
        self, job: _Job, i: int, out: RequestOutput, c: CompletionOutput, state: _ChoiceState
    ) -> CompletionChoice | None:
        prompt = job.prompts[i]
        text, logprobs = "", None
        if not state.started and job.request.echo:
            text = self._echo_text(prompt)
            if job.request.logprobs is not None:
                logprobs = self._prompt_logprobs(job, prompt, out)
        state.started = True
        if job.request.logprobs is not None:
            context = prompt.token_ids + state.token_ids
            generated = self._generated_logprobs(job, context, c, state.text_len + len(text))
            logprobs = generated if logprobs is None else _joined(logprobs, generated)
        text += c.text
        state.token_ids.extend(c.token_ids)
        state.text_len += len(text)
        if not text and is_empty_delta(c):
            return None
        return CompletionChoice(
            text=text, index=i * job.n + c.index, logprobs=logprobs, finish_reason=finish_reason(c)
        )


def _joined(first: CompletionLogProbs, second: CompletionLogProbs) -> CompletionLogProbs:
    first.extend(second)
    return first


def encode_prompts(
    client: EngineClient, prompt: PromptInput, param: str, limit: int, keep: int | None = None
) -> list[Prompt]:
    """The four prompt forms (a string, strings, token ids, lists of token ids) as Prompts, text
    tokenized with special tokens; 400 naming `param` for none or more than `limit`. `keep`:
    truncate_prompt_tokens (a truncated text's Prompt has no text: echo decodes what ran)."""
    items: list[str | list[int]]
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [cast(list[int], prompt)]  # one prompt as token ids
    else:
        items = list(cast(list[str] | list[list[int]], prompt))
    if not items:
        raise APIError(400, f"{param} must not be an empty list", param=param)
    if len(items) > limit:
        raise APIError(400, f"{len(items)} prompts is more than the limit of {limit}", param=param)
    prompts = []
    for item in items:
        if not isinstance(item, str):
            prompts.append(Prompt(None, client.truncated(item, keep)))
        elif keep is None:
            prompts.append(Prompt(item, client.encode_prompt(item, param)))
        else:
            ids, cut = client.encode_truncated(item, keep)
            prompts.append(Prompt(None if cut else item, ids))
    return prompts
