"""POST /v1/completions: prompt forms -> engine requests -> one response or one SSE stream.

Choice order is OpenAI's and vLLM's: `index = prompt_idx * n + j`. Usage counts each prompt's
tokens once and sums the completion tokens of every returned choice.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import cast

from fastapi.responses import StreamingResponse

from convoy.api.engine_client import EngineClient, Prompt, new_id
from convoy.api.errors import APIError
from convoy.api.logprobs import TokenNames, legacy_logprobs, token_texts
from convoy.api.metrics import RequestRecord
from convoy.api.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    PromptInput,
    UsageInfo,
)
from convoy.api.sse import sse_response
from convoy.outputs import CompletionOutput, PositionLogprobs, RequestOutput

Outputs = AsyncGenerator[tuple[int, RequestOutput], None]  # (prompt index, output)


@dataclass(slots=True)
class _Job:
    """One validated completion request, ready to run."""

    api_id: str
    created: int
    request: CompletionRequest
    prompts: list[Prompt]
    n: int
    record: RequestRecord
    names: TokenNames

    @property
    def echo(self) -> bool:
        return bool(self.request.echo)


@dataclass(slots=True)
class _ChoiceState:
    """What a streamed choice has sent so far: tokens as context, text length for offsets."""

    token_ids: list[int] = field(default_factory=list)
    text_len: int = 0
    started: bool = False


class CompletionServing:
    def __init__(self, client: EngineClient) -> None:
        self.client = client

    async def create(
        self, request: CompletionRequest, record: RequestRecord
    ) -> CompletionResponse | StreamingResponse:
        """Validate everything, then run every prompt in the engine at once."""
        self.client.check_model(request.model)
        request.check()
        params = request.to_sampling_params()
        prompts = self._prompts(request.prompt)
        self.client.validate(prompts, params, "prompt")
        self.client.check_capacity()
        job = _Job(
            api_id=new_id("cmpl"),
            created=int(time.time()),
            request=request,
            prompts=prompts,
            n=params.n,
            record=record,
            names=TokenNames(self.client.tokenizer),
        )
        record.api_id, record.num_prompts = job.api_id, len(prompts)
        record.num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        outputs = self.client.generate(job.api_id, prompts, params, record)
        if request.stream:
            return sse_response(self._stream(job, outputs), job.api_id)
        return await self._collect(job, outputs)

    def _prompts(self, prompt: PromptInput) -> list[Prompt]:
        """Normalise the four prompt forms to token ids (text is tokenized with special tokens)."""
        tokenizer = self.client.tokenizer
        items: list[str | list[int]]
        if isinstance(prompt, str):
            items = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [cast(list[int], prompt)]  # one prompt as token ids
        else:
            items = list(cast(list[str] | list[list[int]], prompt))
        if not items:
            raise APIError(400, "prompt must not be an empty list", param="prompt")
        limit = self.client.limits.max_prompts_per_request
        if len(items) > limit:
            raise APIError(
                400, f"{len(items)} prompts is more than the limit of {limit}", param="prompt"
            )
        return [
            Prompt(item, tokenizer.encode(item)) if isinstance(item, str) else Prompt(None, item)
            for item in items
        ]

    def _echo_text(self, prompt: Prompt) -> str:
        """The prompt as echoed: as sent, or decoded once for a token-id prompt."""
        if prompt.text is None:
            prompt.text = self.client.tokenizer.decode(prompt.token_ids)
        return prompt.text

    async def _collect(self, job: _Job, outputs: Outputs) -> CompletionResponse:
        finals: dict[int, RequestOutput] = {}
        async with aclosing(outputs):
            async for i, out in outputs:
                finals[i] = out
        choices: list[CompletionChoice] = []
        for i, prompt in enumerate(job.prompts):
            out = finals[i]
            for c in sorted(out.outputs, key=lambda c: c.index):
                choices.append(self._choice(job, i, prompt, out, c))
        num_completion_tokens = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
        job.record.num_completion_tokens = num_completion_tokens
        return CompletionResponse(
            id=job.api_id,
            created=job.created,
            model=self.client.served_model_name,
            choices=choices,
            usage=UsageInfo.of(job.record.num_prompt_tokens, num_completion_tokens),
        )

    def _choice(
        self, job: _Job, i: int, prompt: Prompt, out: RequestOutput, c: CompletionOutput
    ) -> CompletionChoice:
        prefix = self._echo_text(prompt) if job.echo else ""
        logprobs = None
        if job.request.logprobs is not None:
            logprobs = self._prompt_logprobs(job, prompt, out) if job.echo else None
            generated = self._generated_logprobs(job, prompt.token_ids, c, len(prefix))
            if logprobs is None:
                logprobs = generated
            else:
                logprobs.extend(generated)
        return CompletionChoice(
            text=prefix + c.text,
            index=i * job.n + c.index,
            logprobs=logprobs,
            finish_reason=_finish(c),
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

    async def _stream(
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
                    state = states.setdefault(i * job.n + c.index, _ChoiceState())
                    choice = self._delta(job, i, prompt_logprobs.get(i, out), c, state)
                    if choice is not None:
                        yield self._chunk(job, [choice])
                job.record.num_completion_tokens = num_completion_tokens
        if job.request.include_usage:
            usage = UsageInfo.of(job.record.num_prompt_tokens, num_completion_tokens)
            yield self._chunk(job, [], usage)

    def _delta(
        self, job: _Job, i: int, out: RequestOutput, c: CompletionOutput, state: _ChoiceState
    ) -> CompletionChoice | None:
        prompt = job.prompts[i]
        text, logprobs = "", None
        if not state.started and job.echo:
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
        if not text and not c.token_ids and c.finish_reason is None:
            return None  # nothing new for this choice in this step
        return CompletionChoice(
            text=text, index=i * job.n + c.index, logprobs=logprobs, finish_reason=_finish(c)
        )

    def _chunk(
        self, job: _Job, choices: list[CompletionChoice], usage: UsageInfo | None = None
    ) -> CompletionStreamResponse:
        return CompletionStreamResponse(
            id=job.api_id,
            created=job.created,
            model=self.client.served_model_name,
            choices=choices,
            usage=usage,
        )


def _joined(first: CompletionLogProbs, second: CompletionLogProbs) -> CompletionLogProbs:
    first.extend(second)
    return first


def _finish(c: CompletionOutput) -> str | None:
    return None if c.finish_reason is None else str(c.finish_reason)
