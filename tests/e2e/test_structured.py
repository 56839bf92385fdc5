"""Structured outputs through the real server with the official client (and LangChain): parse()
into a pydantic model, json_object, vLLM's constraint fields and their guided_* aliases, a
constrained stream, Batch API lines, and hostile constraints (400 naming the field, or an error
for that request alone when one fails mid-generation; the server serves on). A suite of 50
schemas runs concurrently on SmolLM2 and 10 of them on Gemma 3."""

from __future__ import annotations

import asyncio
import enum
import json
import re
from typing import Annotated, Any

import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI, OpenAI
from pydantic import BaseModel, Field

from tests.e2e.conftest import Server
from tests.e2e.helpers import API_KEY, GEMMA, MODEL, error_object
from tests.e2e.test_batches import completion_line, results, submit, wait
from tests.structured_schemas import make_schemas

FORMATS = jsonschema.FormatChecker(formats=["date", "email", "uuid", "ipv4"])
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["Paris", "London", "Rome"]
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
    "required": ["x", "y"],
    "additionalProperties": False,
}


class Genre(enum.Enum):
    FICTION = "fiction"
    POETRY = "poetry"
    HISTORY = "history"


class Author(BaseModel):
    name: str = Field(max_length=24)
    born: int = Field(ge=1000, le=2024)


class Book(BaseModel):
    title: str = Field(max_length=32)
    author: Author
    genre: Genre
    tags: list[Annotated[str, Field(max_length=12)]] = Field(max_length=3)
    subtitle: str | None = Field(default=None, max_length=24)


BOOK_PROMPT = [{"role": "user", "content": "Describe a classic novel."}]


def parse_book(client: OpenAI, model: str) -> Book:
    completion = client.chat.completions.parse(
        model=model, messages=BOOK_PROMPT, response_format=Book, temperature=0, max_tokens=200
    )  # type: ignore[call-overload]
    message = completion.choices[0].message
    assert message.refusal is None and isinstance(message.parsed, Book), message.content
    return message.parsed


def test_parse_returns_the_pydantic_object(client: OpenAI) -> None:
    book = parse_book(client, MODEL)
    assert isinstance(book.author, Author) and isinstance(book.genre, Genre)


def test_langchain_with_structured_output(server: Server) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{server.base_url}/v1", api_key=API_KEY, model=MODEL, temperature=0,
        max_tokens=200, max_retries=0,
    )  # type: ignore[call-arg]  # fmt: skip
    book = llm.with_structured_output(Book).invoke("Describe a classic novel.")
    assert isinstance(book, Book)


def test_json_object(client: OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=100, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Reply in JSON with the keys name and age for a cat."}],
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)


def _complete(
    client: OpenAI, prompt: str, extra: dict[str, Any], max_tokens: int = 40
) -> tuple[str, str]:
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra
    ).choices[0]
    return out.text, str(out.finish_reason)


@pytest.mark.parametrize(
    ("spec", "alias", "check"),
    [
        ({"regex": PHONE}, "guided_regex", lambda t: re.fullmatch(PHONE, t)),
        ({"choice": CHOICES}, "guided_choice", lambda t: t in CHOICES),
        ({"json": POINT}, "guided_json", lambda t: jsonschema.validate(json.loads(t), POINT) or 1),
        (
            {"grammar": 'root ::= "The answer is " [0-9]+ "."'},
            "guided_grammar",  # GBNF
            lambda t: re.fullmatch(r"The answer is [0-9]+\.", t),
        ),
        (
            {"grammar": 'start: "x = " NUM\nNUM: /[0-9]{1,4}/'},
            "guided_grammar",  # Lark
            lambda t: re.fullmatch(r"x = [0-9]{1,4}", t),
        ),
    ],
)
def test_completions_constraints_and_their_aliases(
    client: OpenAI, spec: dict[str, Any], alias: str, check: Any
) -> None:
    prompt = "Answer with a phone number, a capital, a point or a number:"
    text, finish = _complete(client, prompt, {"structured_outputs": spec})
    assert finish == "stop" and check(text), text
    kind = next(iter(spec))
    extra = {alias: spec[kind], "guided_decoding_backend": "xgrammar"}  # the backend is ignored
    assert _complete(client, prompt, extra) == (text, finish)


def test_a_constrained_stream_reassembles(client: OpenAI) -> None:
    args: Any = {
        "model": MODEL, "messages": [{"role": "user", "content": "Give me a point."}],
        "temperature": 0, "max_tokens": 60,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": POINT}},
    }  # fmt: skip
    whole = client.chat.completions.create(**args).choices[0].message.content
    chunks = list(client.chat.completions.create(**args, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole and len(chunks) > 3
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(streamed), POINT)


def test_batch_lines_carry_constraints(client: OpenAI) -> None:
    lines = [completion_line(0, guided_choice=CHOICES), completion_line(1, guided_regex="a(b")]
    batch = wait(client, submit(client, lines).id)
    out, err = results(client, batch.output_file_id), results(client, batch.error_file_id)
    assert out["req-0"]["response"]["body"]["choices"][0]["text"] in CHOICES
    assert err["req-1"]["response"]["body"]["error"]["param"] == "guided_regex"


BAD = [
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_regex": "(a{1000}){1000}"}, "guided_regex"),  # too complex: a limit, in ms
    ({"guided_regex": "a" * 5000}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"guided_json": {"type": "nosuch"}}, "guided_json"),
    ({"guided_json": {"type": "string", "format": "no-such"}}, "guided_json"),
    (
        {"guided_json": {"properties": {f"p{i}": {"type": "string"} for i in range(4000)}}},
        "guided_json",
    ),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
]


@pytest.mark.parametrize(("change", "param"), BAD)
def test_bad_constraints_are_400_naming_the_field(
    http: httpx.Client, change: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **change}
    assert error_object(http.post("/v1/completions", json=body), 400)["param"] == param


def test_bad_response_formats_are_400(http: httpx.Client) -> None:
    for response_format in (
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nosuch"}}},
        {"type": "json_schema", "json_schema": {"name": "x"}},
        {"type": "xml"},
    ):
        body = {"model": MODEL, "messages": BOOK_PROMPT, "response_format": response_format}
        assert error_object(http.post("/v1/chat/completions", json=body), 400)["param"] == (
            "response_format"
        )
    body = {"model": MODEL, "messages": BOOK_PROMPT, "response_format": {"type": "json_object"},
            "guided_regex": "a"}  # fmt: skip
    assert error_object(http.post("/v1/chat/completions", json=body), 400)["param"] == (
        "guided_regex"
    )


def test_a_constraint_failing_mid_generation_ends_only_its_request(
    http: httpx.Client, client: OpenAI
) -> None:
    """`zq(c{1000}){1000}` compiles (its probe takes the `a` branch) and blows the lexer's state
    limit once the output starts with z, q (forced by logit_bias): that request ends with a 400
    naming its field, or an error frame when streaming; a neighbour is untouched."""
    ids = http.post("/tokenize", json={"prompt": "zq", "add_special_tokens": False}).json()
    body = {"model": MODEL, "prompt": "Say something:", "max_tokens": 8,
            "guided_regex": "a|zq(c{1000}){1000}",
            "logit_bias": {str(t): 100 for t in ids["tokens"]}}  # fmt: skip

    async def run() -> tuple[httpx.Response, Any]:
        async with httpx.AsyncClient(base_url=str(http.base_url), headers=http.headers) as h:
            failing = h.post("/v1/completions", json=body, timeout=60)
            neighbour = asyncio.to_thread(_complete, client, "Hello", {}, 8)
            return await asyncio.gather(failing, neighbour)

    failed, (text, finish) = asyncio.run(run())
    error = error_object(failed, 400)
    assert error["param"] == "guided_regex" and "constraint" in error["message"], error
    assert finish == "length" and text
    stream = http.post("/v1/completions", json={**body, "stream": True})
    frames = [x for x in stream.text.splitlines() if x]
    assert stream.status_code == 200 and frames[-1] == "data: [DONE]"
    assert json.loads(frames[-2].removeprefix("data: "))["error"]["param"] == "guided_regex"
    assert _complete(client, "Hello", {}, 8) == (text, finish)  # the server serves on


async def _run_suite(aclient: AsyncOpenAI, model: str, count: int) -> tuple[int, int, int]:
    """(valid, cut by max_tokens, total): every output that stops must validate."""
    suite = make_schemas(count)

    async def one(prompt: str, schema: dict[str, Any]) -> tuple[str, str | None]:
        out = await aclient.chat.completions.create(
            model=model, temperature=0, max_tokens=200,
            messages=[{"role": "user", "content": prompt}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "answer", "schema": schema}},
        )  # fmt: skip
        return out.choices[0].message.content or "", out.choices[0].finish_reason

    outs = await asyncio.gather(*(one(p, s) for p, s in suite))
    valid = cut = 0
    for (_, schema), (text, finish) in zip(suite, outs, strict=True):
        if finish == "length":
            cut += 1
            continue
        assert finish == "stop"
        jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)
        valid += 1
    print(f"{model}: {valid}/{count} valid, {cut} cut by max_tokens")  # the report's figure
    return valid, cut, count


def test_fifty_schemas_at_once(aclient: AsyncOpenAI) -> None:
    valid, cut, total = asyncio.run(_run_suite(aclient, MODEL, 50))
    assert valid + cut == total and cut <= total // 10


def test_gemma_parse_and_ten_schemas(gemma: OpenAI) -> None:
    aclient = AsyncOpenAI(base_url=str(gemma.base_url), api_key=API_KEY, max_retries=0, timeout=120)

    async def both() -> tuple[Book, tuple[int, int, int]]:  # in one batch
        return await asyncio.gather(
            asyncio.to_thread(parse_book, gemma, GEMMA), _run_suite(aclient, GEMMA, 10)
        )

    _, (valid, cut, total) = asyncio.run(both())
    assert valid + cut == total and cut <= 2
