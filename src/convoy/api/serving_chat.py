"""POST /v1/chat/completions: messages -> chat template -> one engine request with n choices.

With a reasoning model (reasoning.py) each choice's text is split into reasoning and content
first, and a constraint applies to the content after the think block. With tools (mode auto /
required / a named function) the content is split into content and tool calls (tool_format):
whole, or as it streams, in OpenAI's delta shape.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from convoy.api.chat_template import apply_template
from convoy.api.engine_client import EngineClient, Prompt
from convoy.api.logprobs import chat_logprobs
from convoy.api.protocol_chat import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
)
from convoy.api.protocol_tools import (
    ChatMessageParam,
    DeltaFunctionCall,
    DeltaToolCall,
    ToolCall,
    new_call_id,
)
from convoy.api.reasoning import (
    ReasoningStream,
    ThinkStart,
    check_reasons,
    num_reasoning_tokens,
    split_reasoning,
    think_start,
)
from convoy.api.serving_base import Job, Outputs, ServingBase, finish_reason, is_empty_delta
from convoy.api.structured_reasoning import constrain_after_think
from convoy.api.tool_format import CallDelta, ToolCallStream, parse_tool_calls, split_reply
from convoy.engine.request import Priority
from convoy.outputs import CompletionOutput, FinishReason, RequestOutput
from convoy.sampling_params import SamplingParams
from convoy.structured.params import StructuredOutputsError, StructuredOutputsParams

if TYPE_CHECKING:
    from convoy.engine.request import EngineRequest

_Job = Job[ChatCompletionRequest]


def chat_text(
    client: EngineClient,
    messages: list[ChatMessageParam],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
) -> str:
    """The model's chat template applied to the messages and tools (TemplateError -> 400)."""
    return apply_template(client.tokenizer, messages, add_generation_prompt, tools,
                          template_kwargs, continue_final_message)  # fmt: skip


def render_chat(client: EngineClient, request: ChatCompletionRequest) -> Prompt:
    """The templated prompt, tokenized as is.

    NOTE: the template already holds the special tokens (BOS, turn markers), so they are not
    added a second time.
    """
    add_generation_prompt = request.add_generation_prompt is not False
    tools = request.tools_for_prompt() if request.tools else None
    text = chat_text(client, request.messages, add_generation_prompt, tools,
                     request.template_kwargs(), bool(request.continue_final_message))  # fmt: skip
    if request.truncate_prompt_tokens is not None:  # the text's end, what think_start reads, stays
        ids, _ = client.encode_truncated(text, request.truncate_prompt_tokens, False)
        return Prompt(text, ids)
    return Prompt(text, client.encode_prompt(text, "messages", add_special_tokens=False))


class ChatServing(ServingBase[ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk]):
    id_prefix = "chatcmpl"
    prompt_param = "messages"
    chunk_type = ChatCompletionChunk

    def prompts(self, request: ChatCompletionRequest) -> list[Prompt]:
        if request.reasoning_effort is not None:
            check_reasons(self.client.tokenizer.chat_template, "reasoning_effort")
        return [render_chat(self.client, request)]

    def logprobs_param(self, request: ChatCompletionRequest, params: SamplingParams) -> str:
        return "top_logprobs" if request.top_logprobs else "logprobs"

    def think_start(self, prompts: list[Prompt]) -> ThinkStart:
        """Where the replies start relative to a think block (reasoning.py)."""
        client = self.client
        return think_start(
            client.reasoning_parser, client.tokenizer.chat_template, prompts[0].text or ""
        )

    def adapt(self, params: SamplingParams, prompts: list[Prompt]) -> None:
        """A reasoning model's constraint applies to the content after its think block."""
        constrain_after_think(params, self.think_start(prompts))

    def _prepare(
        self,
        request: ChatCompletionRequest,
        params: SamplingParams,
        api_id: str,
        priority: Priority,
    ) -> tuple[list[Prompt], list[EngineRequest], int]:
        try:
            return super()._prepare(request, params, api_id, priority)
        except StructuredOutputsError as e:
            if e.param != "tools":
                raise
            raise self._tool_error(request, e) from None

    def _tool_error(
        self, request: ChatCompletionRequest, error: StructuredOutputsError
    ) -> StructuredOutputsError:
        """The tools' grammar did not compile: the compile error of the first function whose
        parameters schema does not compile on its own, naming it; else the grammar's error."""
        compiler = self.client.grammars
        for index, name, schema in request.constrained_functions():
            try:
                compiler.compile(StructuredOutputsParams(json=schema, param="tools"))
            except StructuredOutputsError as e:
                return StructuredOutputsError(f"tools[{index}] ({name}): {e}", "tools")
        return error

    def _logprobs(self, job: _Job, c: CompletionOutput) -> ChatChoiceLogprobs | None:
        if not job.request.logprobs:
            return None
        positions = c.logprobs or []
        num_top = job.request.top_logprobs or 0
        return ChatChoiceLogprobs(content=chat_logprobs(job.names, c.token_ids, positions, num_top))

    def _num_reasoning_tokens(self, job: _Job, token_ids: list[int], split: ReasoningStream) -> int:
        skip = job.request.skip_special_tokens is not False
        return num_reasoning_tokens(self.client.tokenizer, token_ids, split, skip)

    async def collect(self, job: _Job, outputs: Outputs) -> ChatCompletionResponse:
        final: RequestOutput | None = None
        async with aclosing(outputs):
            async for _, out in outputs:
                final = out
        assert final is not None, "the engine ended a request without output"
        start = self.think_start(job.prompts)
        choices: list[ChatCompletionChoice] = []
        num_reasoning = None if start == ThinkStart.OFF else 0
        echo = job.request.echo_text()
        for c in sorted(final.outputs, key=lambda c: c.index):
            reasoning, content, split = split_reasoning(start, c.text)
            message, finish = _message(job.request, c, content, reasoning)
            if echo:
                message.content = echo + (message.content or "")
            choices.append(
                ChatCompletionChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._logprobs(job, c),
                    finish_reason=finish,
                )
            )
            if num_reasoning is not None:
                num_reasoning += self._num_reasoning_tokens(job, c.token_ids, split)
        return ChatCompletionResponse(
            id=job.api_id,
            created=job.created,
            model=self.client.served_model_name,
            choices=choices,
            usage=self.usage(job, final.num_generated_tokens, num_reasoning),
        )

    async def stream(
        self, job: _Job, outputs: Outputs
    ) -> AsyncGenerator[ChatCompletionChunk, None]:
        """A role delta per choice first (then `echo`'s text), then content deltas, each
        choice's finish, usage."""
        for j in range(job.n):
            role = DeltaMessage(role="assistant", content="")
            yield self.chunk(job, [ChatStreamChoice(index=j, delta=role)])
        if echo := job.request.echo_text():
            for j in range(job.n):
                yield self.chunk(job, [ChatStreamChoice(index=j, delta=DeltaMessage(content=echo))])
        num_completion_tokens = 0
        is_tool_reply = job.request.tool_mode != "none"
        parsers = {j: ToolCallStream() for j in range(job.n)} if is_tool_reply else {}
        start = self.think_start(job.prompts)
        is_split = start != ThinkStart.OFF
        splits = {j: ReasoningStream(start) for j in range(job.n)} if is_split else {}
        token_ids: dict[int, list[int]] = {j: [] for j in splits}
        async with aclosing(outputs):
            async for _, out in outputs:
                for c in out.outputs:
                    num_completion_tokens += len(c.token_ids)
                    job.record.num_completion_tokens = num_completion_tokens
                    if is_split:
                        token_ids[c.index] += c.token_ids
                    if is_empty_delta(c):
                        continue
                    delta, finish = _delta(parsers.get(c.index), splits.get(c.index), c)
                    logprobs = self._logprobs(job, c)
                    if delta is None and finish is None and logprobs is None:
                        continue  # text held back (a call's head, perhaps the marker)
                    choice = ChatStreamChoice(
                        index=c.index,
                        delta=delta or DeltaMessage(),
                        logprobs=logprobs,
                        finish_reason=finish,
                    )
                    yield self.chunk(job, [choice])
                job.record.num_completion_tokens = num_completion_tokens
        num_reasoning = None
        if is_split:
            num_reasoning = sum(
                self._num_reasoning_tokens(job, token_ids[j], split) for j, split in splits.items()
            )
        if (last := self.usage_chunk(job, num_completion_tokens, num_reasoning)) is not None:
            yield last


def _message(
    request: ChatCompletionRequest, c: CompletionOutput, text: str, reasoning: str | None
) -> tuple[ChatMessage, str | None]:
    """A choice's message and finish reason: its calls when it wrote any, with the text before
    them as content (finish `tool_calls` when it stopped after complete calls; a call cut by
    max_tokens keeps its truncated arguments, as the stream sent them), else its text (the
    content after any think block) as content."""
    if request.tool_mode != "none":
        content, calls = split_reply(text)
        if calls:
            message = ChatMessage(
                content=content,
                tool_calls=[ToolCall.of(x) for x in calls],
                reasoning_content=reasoning,
                reasoning=reasoning,
            )
            return message, _calls_finish(c, text)
    content = text if reasoning is None else text or None  # all reasoning: no content
    message = ChatMessage(content=content, reasoning_content=reasoning, reasoning=reasoning)
    return message, finish_reason(c)


def _calls_finish(c: CompletionOutput, text: str) -> str | None:
    """`tool_calls` when the choice stopped after complete calls, else its own finish."""
    if c.finish_reason == FinishReason.STOP and parse_tool_calls(text) is not None:
        return "tool_calls"
    return finish_reason(c)


def _delta(
    parser: ToolCallStream | None, split: ReasoningStream | None, c: CompletionOutput
) -> tuple[DeltaMessage | None, str | None]:
    """A choice's next delta (None: nothing to send yet) and finish reason; with a split, the
    reasoning apart; with a parser, content and tool-call deltas (a call's id and name first,
    then its arguments as they come). The finish is `tool_calls` when the whole content
    parses as calls, as in `_message`."""
    is_last = c.finish_reason is not None
    reasoning, text = None, c.text
    if split is not None:
        part = split.feed(c.text, is_last)
        reasoning, text = part.reasoning or None, part.content
    if parser is None:
        if split is not None and not text and reasoning is None:
            return None, finish_reason(c)
        content: str | None = text if split is None or text else None
        return _delta_message(content, reasoning), finish_reason(c)
    content, calls = parser.feed(text)
    finish = finish_reason(c)
    if is_last:
        content += parser.finish()
        if parser.num_calls:
            finish = _calls_finish(c, parser.text)
    if not content and not calls and reasoning is None:
        return None, finish
    tool_calls = [_delta_call(d) for d in calls] or None
    return _delta_message(content or None, reasoning, tool_calls), finish


def _delta_message(
    content: str | None, reasoning: str | None, tool_calls: list[DeltaToolCall] | None = None
) -> DeltaMessage:
    return DeltaMessage(
        content=content, tool_calls=tool_calls, reasoning_content=reasoning, reasoning=reasoning
    )


def _delta_call(d: CallDelta) -> DeltaToolCall:
    if d.name is None:
        return DeltaToolCall(index=d.index, function=DeltaFunctionCall(arguments=d.arguments))
    return DeltaToolCall(
        index=d.index, id=new_call_id(), type="function",
        function=DeltaFunctionCall(name=d.name, arguments=d.arguments),
    )  # fmt: skip
