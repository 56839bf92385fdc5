"""POST /v1/chat/completions: messages -> chat template -> one engine request with n choices."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

from fastapi.responses import StreamingResponse

from convoy.api.engine_client import EngineClient, Prompt, new_id
from convoy.api.logprobs import TokenNames, chat_logprobs
from convoy.api.metrics import RequestRecord
from convoy.api.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatMessageParam,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
)
from convoy.api.sse import sse_response
from convoy.outputs import CompletionOutput, RequestOutput

Outputs = AsyncGenerator[tuple[int, RequestOutput], None]  # (prompt index, output)


@dataclass(slots=True)
class _Job:
    api_id: str
    created: int
    request: ChatCompletionRequest
    n: int
    record: RequestRecord
    names: TokenNames


def render_chat(
    client: EngineClient, messages: list[ChatMessageParam], add_generation_prompt: bool
) -> Prompt:
    """Apply the model's chat template (TemplateError -> 400) and tokenize its text as is.

    NOTE: the template already holds the special tokens (BOS, turn markers), so they are not
    added a second time.
    """
    tokenizer = client.tokenizer
    text = tokenizer.apply_chat_template([m.to_template() for m in messages], add_generation_prompt)
    return Prompt(text, tokenizer.encode(text, add_special_tokens=False))


class ChatServing:
    def __init__(self, client: EngineClient) -> None:
        self.client = client

    async def create(
        self, request: ChatCompletionRequest, record: RequestRecord
    ) -> ChatCompletionResponse | StreamingResponse:
        """Validate everything, render the conversation, then run it in the engine."""
        self.client.check_model(request.model)
        request.check()
        params = request.to_sampling_params()
        prompt = render_chat(
            self.client, request.messages, request.add_generation_prompt is not False
        )
        self.client.validate([prompt], params, "messages")
        self.client.check_capacity()
        job = _Job(
            api_id=new_id("chatcmpl"),
            created=int(time.time()),
            request=request,
            n=params.n,
            record=record,
            names=TokenNames(self.client.tokenizer),
        )
        record.api_id, record.num_prompts = job.api_id, 1
        record.num_prompt_tokens = len(prompt.token_ids)
        outputs = self.client.generate(job.api_id, [prompt], params, record)
        if request.stream:
            return sse_response(self._stream(job, outputs), job.api_id)
        return await self._collect(job, outputs)

    def _logprobs(self, job: _Job, c: CompletionOutput) -> ChatChoiceLogprobs | None:
        if not job.request.logprobs:
            return None
        positions = c.logprobs or []
        num_top = job.request.top_logprobs or 0
        return ChatChoiceLogprobs(content=chat_logprobs(job.names, c.token_ids, positions, num_top))

    async def _collect(self, job: _Job, outputs: Outputs) -> ChatCompletionResponse:
        final: RequestOutput | None = None
        async with aclosing(outputs):
            async for _, out in outputs:
                final = out
        assert final is not None, "the engine ended a request without output"
        choices = [
            ChatCompletionChoice(
                index=c.index,
                message=ChatMessage(content=c.text),
                logprobs=self._logprobs(job, c),
                finish_reason=_finish(c),
            )
            for c in sorted(final.outputs, key=lambda c: c.index)
        ]
        num_completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        job.record.num_completion_tokens = num_completion_tokens
        return ChatCompletionResponse(
            id=job.api_id,
            created=job.created,
            model=self.client.served_model_name,
            choices=choices,
            usage=UsageInfo.of(job.record.num_prompt_tokens, num_completion_tokens),
        )

    async def _stream(
        self, job: _Job, outputs: Outputs
    ) -> AsyncGenerator[ChatCompletionChunk, None]:
        """A role delta per choice first, then content deltas, each choice's finish, usage."""
        for j in range(job.n):
            delta = DeltaMessage(role="assistant", content="")
            yield self._chunk(job, [ChatStreamChoice(index=j, delta=delta)])
        num_completion_tokens = 0
        async with aclosing(outputs):
            async for _, out in outputs:
                for c in out.outputs:
                    num_completion_tokens += len(c.token_ids)
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    choice = ChatStreamChoice(
                        index=c.index,
                        delta=DeltaMessage(content=c.text),
                        logprobs=self._logprobs(job, c),
                        finish_reason=_finish(c),
                    )
                    yield self._chunk(job, [choice])
                job.record.num_completion_tokens = num_completion_tokens
        if job.request.include_usage:
            usage = UsageInfo.of(job.record.num_prompt_tokens, num_completion_tokens)
            yield self._chunk(job, [], usage)

    def _chunk(
        self, job: _Job, choices: list[ChatStreamChoice], usage: UsageInfo | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=job.api_id,
            created=job.created,
            model=self.client.served_model_name,
            choices=choices,
            usage=usage,
        )


def _finish(c: CompletionOutput) -> str | None:
    return None if c.finish_reason is None else str(c.finish_reason)
