"""/v1/chat/completions wire types: the request (SamplingRequest's fields, messages and tools),
the assistant message with its logprobs and reasoning, the response and its stream chunks. The
messages and tool calls themselves: protocol_tools.py; shared rules: protocol_common.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from convoy.api.chat_template import check_continuation, check_template_kwargs
from convoy.api.protocol_base import OpenAIModel, is_none
from convoy.api.protocol_common import MAX_INT32, SamplingRequest, UsageInfo, refuse_set
from convoy.api.protocol_structured import ResponseFormat
from convoy.api.protocol_tools import ChatMessageParam, DeltaToolCall, ToolCall, ToolsRequest
from convoy.api.reasoning import effort_thinks
from convoy.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError

# -- /v1/chat/completions ----------------------------------------------------------------------


_DEPRECATED = "(deprecated by OpenAI) is not supported; pass the functions as tools (and tool_choice)"
_UNSUPPORTED_CHAT = {
    "audio": "audio output is not supported",
    "web_search_options": "web search is not supported",
    "functions": f"functions {_DEPRECATED}",
    "function_call": f"function_call {_DEPRECATED}",
}


# `echo` sends the last message once a choice: at most this many characters in all, what one
# request body may hold (32 MiB), so a long message and n = 128 cannot make a response of GBs
MAX_ECHO_CHARS = 32 << 20


class ChatCompletionRequest(SamplingRequest, ToolsRequest):
    messages: list[ChatMessageParam] = Field(min_length=1)
    logprobs: bool | None = False
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    response_format: ResponseFormat | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more template variables
    reasoning_effort: str | None = None  # a thinking model's enable_thinking (reasoning.py)
    # vLLM's: the prompt ends inside the last message (an assistant turn the model goes on with)
    continue_final_message: bool | None = False
    # vLLM's: the reply starts with the last message's text when that message is the assistant's
    # (the reply's role), so a continued message comes back whole
    echo: bool | None = False
    # OpenAI's, for outputs this server has no model for: a 400 naming them, not a text reply
    # the client would read as the audio or search it asked for
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[Any] | None = None  # OpenAI's deprecated form of tools
    function_call: str | dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if any(m != "text" for m in self.modalities or []):
            raise SamplingParamsError("only text output is supported", "modalities")
        refuse_set(self, _UNSUPPORTED_CHAT)
        for message in self.messages:
            message.check()
        if self.chat_template_kwargs:
            check_template_kwargs(self.chat_template_kwargs)
        if self.reasoning_effort is not None:
            effort_thinks(self.reasoning_effort, "reasoning_effort")
        check_continuation(self.continue_final_message, self.add_generation_prompt)
        if (size := len(self.echo_text()) * (self.n or 1)) > MAX_ECHO_CHARS:
            raise SamplingParamsError(
                f"echo would send the last message {self.n or 1} times ({size} characters),"
                f" more than the limit of {MAX_ECHO_CHARS}",
                "echo",
            )
        self.check_tools()
        if self.top_logprobs is not None and not self.logprobs:
            raise SamplingParamsError("top_logprobs requires logprobs to be true", "top_logprobs")

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs, with `reasoning_effort` as enable_thinking (and under its own
        name, for a template that reads it) unless they set them."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        kwargs = {"enable_thinking": effort_thinks(self.reasoning_effort, "reasoning_effort"),
                  "reasoning_effort": self.reasoning_effort}  # fmt: skip
        return {**kwargs, **(self.chat_template_kwargs or {})}

    def echo_text(self) -> str:
        """What `echo` puts before the reply: the last message's text if it is the assistant's
        (text parts joined by newlines, as vLLM's), else nothing."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    def constraints(self) -> list[tuple[str, dict[str, Any]]]:
        found = super().constraints()
        spec = None if self.response_format is None else self.response_format.spec()
        tools = self.tool_constraint()
        first = [] if spec is None else [("response_format", spec)]
        return first + found + ([] if tools is None else [tools])

    def to_sampling_params(self) -> SamplingParams:
        """Engine parameters; max_completion_tokens wins over the deprecated max_tokens."""
        max_tokens = self.max_completion_tokens or self.max_tokens
        return SamplingParams(
            **self._sampling_kwargs(),
            max_tokens=max_tokens,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
        )


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIModel):
    content: list[ChatLogprobToken] | None = None


# A reasoning model's think block (reasoning.py): vLLM's `reasoning_content` and `reasoning`,
# its newer name, both set; omitted for other models.
Reasoning = Annotated[str | None, Field(default=None, exclude_if=is_none)]


class ChatMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None  # OpenAI's field (never set here); parse() reads it
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=is_none)
    reasoning_content: Reasoning = None
    reasoning: Reasoning = None


class ChatCompletionChoice(OpenAIModel):
    index: int
    message: ChatMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=is_none)
    reasoning_content: Reasoning = None
    reasoning: Reasoning = None


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
