"""Wire types of structured outputs: chat's `response_format` (OpenAI's shapes), vLLM's
`structured_outputs` object and its older `guided_*` fields; and the one constraint a request
may set with them (two are a 400 naming the second).

Lengths and counts are bounded on the fields (so /openapi.json states them); a schema's size and
depth are checked when StructuredOutputsParams is built, its compiling in the engine's front
door. Every rejection names the field the constraint came from.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from convoy.api.protocol_base import RequestModel
from convoy.sampling_params import SamplingParamsError
from convoy.structured.params import (
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_REGEX_CHARS,
    StructuredOutputsParams,
)

JsonSchema = dict[str, Any] | str  # a JSON schema, or its JSON text
Regex = Annotated[str, Field(min_length=1, max_length=MAX_REGEX_CHARS)]
Choices = Annotated[
    list[Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]],
    Field(min_length=1, max_length=MAX_CHOICES),
]
Grammar = Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)]
Constraint = tuple[str, dict[str, Any]]  # (request field, StructuredOutputsParams keywords)


class StructuredOutputsRequest(RequestModel):
    """vLLM's `structured_outputs`: exactly one of these. `grammar` is llguidance's Lark
    dialect (a `start:` rule), or a GBNF grammar (a `root ::=` rule), converted."""

    json_: JsonSchema | None = Field(default=None, alias="json")
    regex: Regex | None = None
    choice: Choices | None = None
    grammar: Grammar | None = None
    json_object: bool | None = None

    def spec(self) -> dict[str, Any]:
        return {
            "json": self.json_,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "json_object": self.json_object,
        }


class JsonSchemaFormat(RequestModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormatText(RequestModel):
    type: Literal["text"]

    def spec(self) -> dict[str, Any] | None:
        return None


class ResponseFormatJsonObject(RequestModel):
    type: Literal["json_object"]

    def spec(self) -> dict[str, Any] | None:
        return {"json_object": True}


class ResponseFormatJsonSchema(RequestModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat

    def spec(self) -> dict[str, Any] | None:
        if self.json_schema.schema_ is None:
            raise SamplingParamsError(
                "response_format.json_schema.schema is required", "response_format"
            )
        return {"json": self.json_schema.schema_}


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
    Field(discriminator="type"),
]


def guided_constraints(
    structured_outputs: StructuredOutputsRequest | None, guided: dict[str, Any]
) -> list[Constraint]:
    """The constraints set by `structured_outputs` and the `guided_*` fields (by their kind:
    json, regex, choice, grammar), in that order."""
    found: list[Constraint] = []
    if structured_outputs is not None:
        found.append(("structured_outputs", structured_outputs.spec()))
    for kind, value in guided.items():
        if value is not None:
            found.append((f"guided_{kind}", {kind: value}))
    return found


def one_constraint(found: list[Constraint]) -> StructuredOutputsParams | None:
    """The request's constraint, checked and bounded (StructuredOutputsError naming its field);
    more than one is a 400 naming the second."""
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(param for param, _ in found)
        raise SamplingParamsError(
            f"a request may set one output constraint; this one sets {names}", found[1][0]
        )
    param, spec = found[0]
    return StructuredOutputsParams(**spec, param=param)
