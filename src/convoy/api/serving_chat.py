"""POST /v1/chat/completions: messages -> chat template -> one engine request with n choices."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

from convoy.api.engine_client import EngineClient, Prompt
from convoy.api.logprobs import chat_logprobs
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
)
from convoy.api.serving_base import Job, Outputs, ServingBase, finish_reason, is_empty_delta
from convoy.outputs import CompletionOutput, RequestOutput

_Job = Job[ChatCompletionRequest]


def chat_text(
    client: EngineClient, messages: list[ChatMessageParam], add_generation_prompt: bool
) -> str:
    """The model's chat template applied to the messages (TemplateError -> 400)."""
    return client.tokenizer.apply_chat_template(
        [m.to_template() for m in messages], add_generation_prompt
    )


def render_chat(
    client: EngineClient, messages: list[ChatMessageParam], add_generation_prompt: bool
) -> Prompt:
    """The templated prompt, tokenized as is.

    NOTE: the template already holds the special tokens (BOS, turn markers), so they are not
    added a second time.
    """
    text = chat_text(client, messages, add_generation_prompt)
    return Prompt(text, client.encode_prompt(text, "messages", add_special_tokens=False))


class ChatServing(ServingBase[ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk]):
    id_prefix = "chatcmpl"
    prompt_param = "messages"
    chunk_type = ChatCompletionChunk

    def prompts(self, request: ChatCompletionRequest) -> list[Prompt]:
        add_generation_prompt = request.add_generation_prompt is not False
        return [render_chat(self.client, request.messages, add_generation_prompt)]

    def _logprobs(self, job: _Job, c: CompletionOutput) -> ChatChoiceLogprobs | None:
        if not job.request.logprobs:
            return None
        positions = c.logprobs or []
        num_top = job.request.top_logprobs or 0
        return ChatChoiceLogprobs(content=chat_logprobs(job.names, c.token_ids, positions, num_top))

    async def collect(self, job: _Job, outputs: Outputs) -> ChatCompletionResponse:
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
                finish_reason=finish_reason(c),
            )
            for c in sorted(final.outputs, key=lambda c: c.index)
        ]
        return ChatCompletionResponse(
            id=job.api_id,
            created=job.created,
            model=self.client.served_model_name,
            choices=choices,
            usage=self.usage(job, final.num_generated_tokens),
        )

    async def stream(
        self, job: _Job, outputs: Outputs
    ) -> AsyncGenerator[ChatCompletionChunk, None]:
        """A role delta per choice first, then content deltas, each choice's finish, usage."""
        for j in range(job.n):
            delta = DeltaMessage(role="assistant", content="")
            yield self.chunk(job, [ChatStreamChoice(index=j, delta=delta)])
        num_completion_tokens = 0
        async with aclosing(outputs):
            async for _, out in outputs:
                for c in out.outputs:
                    num_completion_tokens += len(c.token_ids)
                    if is_empty_delta(c):
                        continue
                    choice = ChatStreamChoice(
                        index=c.index,
                        delta=DeltaMessage(content=c.text),
                        logprobs=self._logprobs(job, c),
                        finish_reason=finish_reason(c),
                    )
                    yield self.chunk(job, [choice])
                job.record.num_completion_tokens = num_completion_tokens
        if (last := self.usage_chunk(job, num_completion_tokens)) is not None:
            yield last
