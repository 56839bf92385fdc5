"""OpenAI's predicted outputs (`prediction`) and prompt-lookup drafting through the official
client: the same answers as without, faster tokens per step, and the usage details."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.e2e.helpers import GEMMA, MODEL

CODE = (
    "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n"
    "            out.append(b[j])\n            j += 1\n    return out + a[i:] + b[j:]\n"
)
ASK = [{"role": "user", "content": f"Rename the function to merge_sorted. The code:\n\n{CODE}"}]


def _chat(client: OpenAI, model: str = MODEL, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=model, messages=ASK, temperature=0, max_tokens=120, **extra
    )


def _content(prediction: str) -> dict[str, Any]:
    return {"type": "content", "content": prediction}


def test_a_prediction_changes_nothing_but_the_usage_details(client: OpenAI, server: Server) -> None:
    plain = _chat(client)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None  # no prediction: no details
    drafted = server.metric("convoy_spec_decode_draft_tokens_total")
    kept = server.metric("convoy_spec_decode_accepted_tokens_total")
    exact = _chat(client, prediction=_content(text))
    assert exact.choices[0].message.content == text
    details = exact.usage.completion_tokens_details
    assert details is not None
    # every token but the end-of-turn one (not in the predicted text)
    assert details.accepted_prediction_tokens >= exact.usage.completion_tokens - 1
    assert details.rejected_prediction_tokens == 0
    assert server.metric("convoy_spec_decode_accepted_tokens_total") - kept > 50
    assert server.metric("convoy_spec_decode_draft_tokens_total") > drafted
    # the original code as the prediction (an edit answer differs from it in places)
    edit = _chat(client, prediction=_content(CODE))
    assert edit.choices[0].message.content == text
    details = edit.usage.completion_tokens_details
    assert details is not None and details.accepted_prediction_tokens > 0
    assert details.rejected_prediction_tokens > 0


def test_a_streamed_prediction_and_text_parts(client: OpenAI) -> None:
    text = _chat(client).choices[0].message.content
    parts = [{"type": "text", "text": text[:40]}, {"type": "text", "text": text[40:]}]
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=120, stream=True,
        stream_options={"include_usage": True},
        prediction={"type": "content", "content": parts},
    )  # fmt: skip
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details is not None
    accepted = usage.completion_tokens_details.accepted_prediction_tokens
    assert accepted >= usage.completion_tokens - 1
    # several tokens a chunk: fewer content chunks than tokens
    assert (
        sum(1 for c in chunks if c.choices and c.choices[0].delta.content) < usage.completion_tokens
    )


def test_completions_take_a_prediction_too(client: OpenAI) -> None:
    prompt = f"{CODE}\n# The same function again:\n"
    plain = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=80)
    out = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=80,
        extra_body={"prediction": _content(CODE)},
    )  # fmt: skip
    assert out.choices[0].text == plain.choices[0].text
    assert out.usage is not None and out.usage.completion_tokens_details is not None
    assert out.usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_the_quantized_default_gives_the_same_answers(gemma: OpenAI) -> None:
    """Gemma 3 in its default mode (quantized linears, fp16 K/V): prompt lookup and a prediction
    leave every greedy answer as it is."""
    plain = _chat(gemma, GEMMA)
    text = plain.choices[0].message.content
    again = _chat(gemma, GEMMA, prediction=_content(text))
    assert again.choices[0].message.content == text
    details = again.usage.completion_tokens_details
    assert (
        details is not None and details.accepted_prediction_tokens == again.usage.completion_tokens
    )


@pytest.mark.parametrize(
    "prediction",
    [
        {"type": "text", "content": "x"},
        {"type": "content"},
        {"type": "content", "content": 5},
        {"type": "content", "content": [{"type": "image_url", "text": "x"}]},
        {"type": "content", "content": "x" * (256 * 1024 + 1)},
        "just a string",
    ],
)
def test_a_bad_prediction_is_a_400_naming_it(http: httpx.Client, prediction: Any) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2, "prediction": prediction}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prediction"
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "prediction": prediction}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prediction"
