"""/v1/embeddings through the real server (the session's fp32 SmolLM2) with the official client:
every input form, float and base64, dimensions, usage, a batch of 64 and beside a running stream
against the same text alone, LangChain's OpenAIEmbeddings, the Batch API's embedding lines, an
input as long as the context, and hostile input answered with a 400 naming the field."""

from __future__ import annotations

import base64
import io
import json
import threading

import httpx
import numpy as np
import openai
import pytest
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.e2e.helpers import API_KEY, MODEL, error_object

TEXTS = ["The capital of France is Paris.", "def add(a, b):\n    return a + b", "Hello there"]
DIM = 576  # SmolLM2-135M's hidden size


def _vec(values: list[float]) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def test_every_input_form_and_usage(client: OpenAI, http: httpx.Client) -> None:
    one = client.embeddings.create(model=MODEL, input=TEXTS[0])
    assert one.object == "list" and one.model == MODEL and len(one.data) == 1
    assert one.data[0].object == "embedding" and one.data[0].index == 0
    first = _vec(one.data[0].embedding)
    assert first.shape == (DIM,) and abs(float(np.linalg.norm(first)) - 1) < 1e-5
    ids = [http.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS]
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids[0])

    many = client.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.index for d in many.data] == [0, 1, 2]
    assert many.usage.prompt_tokens == sum(len(i) for i in ids)
    by_ids = client.embeddings.create(model=MODEL, input=ids)
    single_ids = client.embeddings.create(model=MODEL, input=ids[0])
    for a, b in zip(many.data, by_ids.data, strict=True):
        np.testing.assert_allclose(_vec(a.embedding), _vec(b.embedding), atol=1e-6)
    np.testing.assert_allclose(_vec(single_ids.data[0].embedding), first, atol=1e-6)
    assert not np.allclose(_vec(many.data[0].embedding), _vec(many.data[1].embedding), atol=1e-2)


def test_base64_and_dimensions(client: OpenAI, http: httpx.Client) -> None:
    floats = _vec(client.embeddings.create(model=MODEL, input=TEXTS[1]).data[0].embedding)
    raw = http.post(
        "/v1/embeddings", json={"model": MODEL, "input": TEXTS[1], "encoding_format": "base64"}
    ).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, floats, atol=1e-6)
    # the official client asks for base64 by default when the caller gives no format, and decodes
    short = client.embeddings.create(model=MODEL, input=TEXTS[1], dimensions=64)
    head = _vec(short.data[0].embedding)
    assert head.shape == (64,) and abs(float(np.linalg.norm(head)) - 1) < 1e-5
    np.testing.assert_allclose(head, floats[:64] / np.linalg.norm(floats[:64]), atol=1e-6)


def test_batch_of_64_and_beside_generation(client: OpenAI, server: Server) -> None:
    alone = [_vec(client.embeddings.create(model=MODEL, input=t).data[0].embedding) for t in TEXTS]
    mixed = [f"Filler text number {i}, about something else." for i in range(61)]
    batch = client.embeddings.create(model=MODEL, input=[*TEXTS, *mixed])  # 64 inputs
    assert len(batch.data) == 64
    for i, a in enumerate(alone):
        np.testing.assert_allclose(_vec(batch.data[i].embedding), a, atol=1e-5)
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 48, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                      headers=server.headers, timeout=60) as stream:  # fmt: skip
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")  # generation is running now
        beside = client.embeddings.create(model=MODEL, input=TEXTS)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    for d, a in zip(beside.data, alone, strict=True):
        np.testing.assert_allclose(_vec(d.embedding), a, atol=1e-5)


def test_concurrent_clients_get_their_own_vectors(server: Server) -> None:
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
    want = {t: _vec(client.embeddings.create(model=MODEL, input=t).data[0].embedding) for t in TEXTS}
    got: dict[str, np.ndarray] = {}

    def one(text: str) -> None:
        got[text] = _vec(client.embeddings.create(model=MODEL, input=text).data[0].embedding)

    threads = [threading.Thread(target=one, args=(t,)) for t in TEXTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for text, vec in want.items():
        np.testing.assert_allclose(got[text], vec, atol=1e-5)


def test_langchain_openai_embeddings(server: Server, client: OpenAI) -> None:
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(
        model=MODEL, base_url=f"{server.base_url}/v1", api_key=API_KEY,  # type: ignore[arg-type]
        check_embedding_ctx_length=False,  # its tiktoken ids are OpenAI's vocabulary, not ours
    )  # fmt: skip
    docs = emb.embed_documents(TEXTS[:2])
    query = emb.embed_query(TEXTS[0])
    want = _vec(client.embeddings.create(model=MODEL, input=TEXTS[0]).data[0].embedding)
    assert len(docs) == 2 and len(docs[0]) == DIM
    np.testing.assert_allclose(_vec(query), want, atol=1e-5)
    np.testing.assert_allclose(_vec(docs[0]), want, atol=1e-5)


def test_batch_api_embedding_lines(client: OpenAI) -> None:
    lines = [
        {"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": MODEL, "input": text}}
        for i, text in enumerate(TEXTS)
    ]  # fmt: skip
    upload = io.BytesIO("".join(json.dumps(line) + "\n" for line in lines).encode())
    file = client.files.create(file=("emb.jsonl", upload), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    import time

    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)  # polling interval, not synchronisation
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts is not None
    assert batch.request_counts.completed == len(TEXTS) and batch.output_file_id
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    by_id = {o["custom_id"]: o["response"]["body"] for o in out}
    for i, text in enumerate(TEXTS):
        want = _vec(client.embeddings.create(model=MODEL, input=text).data[0].embedding)
        body = by_id[f"e{i}"]
        assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 0
        np.testing.assert_allclose(_vec(body["data"][0]["embedding"]), want, atol=1e-5)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": ["x"] * 2049}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": [-1]}, "input"),
        ({"input": "word " * 9000}, "input"),
        ({"input": {"text": "hi"}}, "input"),
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": "hi", "dimensions": DIM + 1}, "dimensions"),
        ({"input": "hi", "dimensions": "64"}, "dimensions"),
        ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
        ({}, "input"),
    ],
)
def test_hostile_input_is_a_400_naming_the_field(
    http: httpx.Client, body: dict[str, object], param: str
) -> None:
    response = http.post("/v1/embeddings", json={"model": MODEL, **body})
    err = error_object(response, 400)
    assert err["param"] == param, err
    assert http.get("/health").status_code == 200


def test_an_input_may_fill_the_context(client: OpenAI, http: httpx.Client) -> None:
    """Nothing is generated after an embedding's input: max_model_len tokens are embedded, one
    more is a 400 that speaks of the input alone."""
    max_len = http.get(f"/v1/models/{MODEL}").json()["max_model_len"]
    full = client.embeddings.create(model=MODEL, input=[[100] * max_len])
    assert full.usage.prompt_tokens == max_len and len(full.data[0].embedding) == DIM
    err = error_object(http.post("/v1/embeddings",
                                 json={"model": MODEL, "input": [[100] * (max_len + 1)]}), 400)
    assert err["param"] == "input" and f"has {max_len + 1} tokens" in err["message"]
    assert "completion" not in err["message"] and "generate" not in err["message"]


def test_unknown_model_is_a_404(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="hi")
