"""Models, tokenizer, health, version, metrics and docs routes."""

from __future__ import annotations

import httpx
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.e2e.helpers import MODEL, complete


def test_models_list_and_retrieve(client: OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model" and model.owned_by == "convoy"


def test_tokenize_and_detokenize_round_trip(http: httpx.Client) -> None:
    text = "Hello world, this is Convoy."
    tokenized = http.post(
        "/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}
    )
    body = tokenized.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 0
    assert body["max_model_len"] > 0
    detokenized = http.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert detokenized.json() == {"prompt": text}


def test_health_version_and_docs(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
    schema = http.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(schema["paths"])
    assert http.get("/docs").status_code == 200


def test_metrics_count_requests_and_tokens(
    server: Server, http: httpx.Client, client: OpenAI
) -> None:
    before = server.metric("convoy_generation_tokens_total")
    completion = complete(client, "Count to five:", max_tokens=4, extra_body={"ignore_eos": True})
    assert completion.usage is not None
    assert server.metric("convoy_generation_tokens_total") == before + 4
    text = http.get("/metrics").text
    for name in (
        'convoy_http_requests_total{method="POST",route="/v1/completions",status="200"}',
        "convoy_num_requests_running",
        "convoy_num_requests_waiting",
        "convoy_kv_blocks_used",
        "convoy_prompt_tokens_total",
        "convoy_time_to_first_token_seconds_bucket",
        "convoy_e2e_request_latency_seconds_bucket",
    ):
        assert name in text, name


def test_responses_carry_a_request_id(http: httpx.Client) -> None:
    assert http.get("/v1/models").headers["x-request-id"]
