"""Wire types of tool calling: chat messages (with `role: "tool"` and assistant `tool_calls`),
the request's `tools` / `tool_choice` / `parallel_tool_calls`, and the tool calls of responses
and stream deltas (the official client's shapes).

`ToolsRequest` checks the fields against each other (400 naming the field) and turns them into
the request's output constraint: a Lark grammar (tool_format.tools_grammar) named `tools`, which
the engine's front door compiles like any other.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import Field

from convoy.api.protocol_base import OpenAIModel, RequestModel, is_none
from convoy.api.protocol_structured import Constraint
from convoy.api.tool_format import ParsedCall, tools_grammar
from convoy.sampling_params import SamplingParamsError
from convoy.structured.params import (
    MAX_GRAMMAR_CHARS,
    StructuredOutputsError,
    StructuredOutputsParams,
)

MAX_TOOLS = 128  # functions in one request (OpenAI's bound)
MAX_TOOL_CALLS = 128  # calls in one assistant message of the history
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
# A function without parameters takes none (OpenAI: "an empty parameter list").
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


# -- messages ----------------------------------------------------------------------------------


class ContentPart(RequestModel):
    type: str
    text: str | None = None
    refusal: str | None = None  # an assistant turn's refusal part (OpenAI's), its text


class ToolCallFunctionParam(RequestModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallParam(RequestModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunctionParam


class ChatMessageParam(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = Field(default=None, max_length=MAX_TOOL_CALLS)
    tool_call_id: str | None = None  # role tool: the call this result answers
    # an assistant turn's thinking (vLLM's fields; a template that renders it gets it)
    reasoning_content: str | None = None
    reasoning: str | None = None

    def text(self) -> str:
        """The content as one text string (text parts joined by newlines)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.type == "refusal" and self.role == "assistant" and part.refusal is not None:
                texts.append(part.refusal)
                continue
            if part.type != "text" or part.text is None:
                raise SamplingParamsError(
                    f"content part type {part.type!r} is not supported; only text parts are",
                    "messages",
                )
            texts.append(part.text)
        return "\n".join(texts)

    def check(self) -> None:
        """Fields that belong to one role only."""
        if self.tool_calls and self.role != "assistant":
            raise SamplingParamsError("only assistant messages may carry tool_calls", "messages")
        if self.role == "tool" and not self.tool_call_id:
            raise SamplingParamsError("a tool message needs its tool_call_id", "messages")


# -- request fields ----------------------------------------------------------------------------


class FunctionDefinition(RequestModel):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of type object
    strict: bool | None = None  # the schema is always enforced


class ToolParam(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(RequestModel):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1, max_length=MAX_TOOLS)


class AllowedToolChoice(RequestModel):
    """OpenAI's `allowed_tools`: every tool stays in the prompt, calls may name only these."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolChoice


class ToolsRequest(RequestModel):
    """Chat's tool fields. Mode: `none` (tools only described in the prompt), `auto` (text, or
    calls after the opening marker), `required` (calls only); a named function is `required`
    with that function alone; `allowed_tools` its mode with calls to its functions alone (the
    prompt lists every tool). Default: `auto` with tools, else `none`."""

    tools: list[ToolParam] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True

    @property
    def tool_mode(self) -> str:
        if not self.tools:
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "required"
        if isinstance(self.tool_choice, AllowedToolChoice):
            return self.tool_choice.allowed_tools.mode
        return self.tool_choice or "auto"

    def allowed_names(self) -> set[str] | None:
        """The functions a call may name when tool_choice narrows them (None: every tool)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return {choice.function.name}
        if isinstance(choice, AllowedToolChoice):
            return {t.function.name for t in choice.allowed_tools.tools}
        return None

    def check_tools(self) -> None:
        """Cross-field rules and each function's parameters schema (the structured-outputs
        bounds, and all of them together at most one grammar's size); raises
        SamplingParamsError naming the field."""
        names = [t.function.name for t in self.tools or []]
        if not names and self.tool_choice not in (None, "none"):
            raise SamplingParamsError("tool_choice requires tools", "tool_choice")
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise SamplingParamsError(f"two tools are named {dup!r}", "tools")
        for name in sorted(self.allowed_names() or ()):
            if name not in names:
                raise SamplingParamsError(
                    f"tool_choice names the function {name!r}, which is not in tools",
                    "tool_choice",
                )
        size = 0
        for i, tool in enumerate(self.tools or []):
            size += _checked_size(i, tool.function)
            _check_grammar_size(size)

    def tools_for_prompt(self) -> list[dict[str, Any]]:
        """The tools as the prompt lists them (and chat templates take them)."""
        return [
            {"type": "function", "function": t.function.model_dump(exclude_none=True,
                                                                   exclude={"strict"})}
            for t in self.tools or []
        ]  # fmt: skip

    def constrained_functions(self) -> list[tuple[int, str, dict[str, Any]]]:
        """(index in tools, name, parameters schema) of each function a call may name: all of
        them, or those tool_choice names."""
        allowed = self.allowed_names()
        return [
            (i, t.function.name, _object_schema(t.function))
            for i, t in enumerate(self.tools or [])
            if allowed is None or t.function.name in allowed
        ]

    def tool_constraint(self) -> Constraint | None:
        """The `tools` grammar of calls to the allowed functions, None in mode `none`."""
        mode = self.tool_mode
        if mode == "none":
            return None
        functions = [(name, schema) for _, name, schema in self.constrained_functions()]
        grammar = tools_grammar(functions, mode, self.parallel_tool_calls is not False)
        _check_grammar_size(len(grammar))
        return ("tools", {"grammar": grammar})


def _object_schema(function: FunctionDefinition) -> dict[str, Any]:
    """The function's parameters schema, of type object."""
    if function.parameters is None:
        return NO_PARAMETERS
    return {"type": "object", **function.parameters}


def _checked_size(index: int, function: FunctionDefinition) -> int:
    """The size of the function's parameters schema (compact JSON), checked by the
    structured-outputs bounds (size, depth, JSON data); errors name `tools`."""
    where = f"tools[{index}] ({function.name}): "
    schema = _object_schema(function)
    if schema.get("type") != "object":
        raise SamplingParamsError(f"{where}parameters must be a schema of type object", "tools")
    try:
        spec = StructuredOutputsParams(json=schema, param="tools")
    except StructuredOutputsError as e:
        raise SamplingParamsError(where + str(e), "tools") from None
    return len(spec.cache_key[1])


def _check_grammar_size(size: int) -> None:
    if size > MAX_GRAMMAR_CHARS:
        raise SamplingParamsError(
            "the tools' parameter schemas are too large together (their grammar may hold at"
            f" most {MAX_GRAMMAR_CHARS} characters)",
            "tools",
        )


# -- responses ---------------------------------------------------------------------------------


class FunctionCall(OpenAIModel):
    name: str
    arguments: str


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    @classmethod
    def of(cls, call: ParsedCall) -> ToolCall:
        return cls(
            id=new_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments)
        )


class DeltaFunctionCall(OpenAIModel):
    name: str | None = Field(default=None, exclude_if=is_none)
    arguments: str


class DeltaToolCall(OpenAIModel):
    """A call's first delta carries its id, type and name (arguments ""), later ones only
    arguments. NOTE: absent, not null: the client's accumulator would overwrite `type`."""

    index: int
    id: str | None = Field(default=None, exclude_if=is_none)
    type: Literal["function"] | None = Field(default=None, exclude_if=is_none)
    function: DeltaFunctionCall


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
