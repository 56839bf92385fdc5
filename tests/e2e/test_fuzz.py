"""Schemathesis against a real server: a seeded run of 250+ cases generated from /openapi.json
(valid and invalid bodies for the generation routes, /v1/responses among them, and the
tokenizer's). No case may get a 5xx, a non-OpenAI error, a broken stream or no answer; afterwards
the server serves a normal request and every KV block is free. bench/fuzz.py runs the same for 10,000+ cases.
On the same short-context server: a previous_response_id chain ends in a 400 naming input,
and with `truncation: auto` it drops the oldest items instead."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import Server, start_server, stop_server
from tests.e2e.fuzzing import FUZZ_THREADS, SERVE_ARGS, check_after_fuzzing, fuzz

NUM_CASES = 250
SEED = 20240610


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with pytest.MonkeyPatch.context() as env:  # the server process inherits it
        env.setenv("OMP_NUM_THREADS", str(FUZZ_THREADS))
        server = start_server(SERVE_ARGS, tmp_path_factory.mktemp("fuzz"))
    try:
        yield server
    finally:
        stop_server(server)


def test_fuzzed_requests_never_break_the_server(fuzz_server: Server) -> None:
    report = fuzz(fuzz_server.base_url, fuzz_server.headers, NUM_CASES, SEED)
    print(report.table())
    assert report.num_cases >= NUM_CASES
    assert not report.failures, "\n".join(report.failures[:20])
    assert any(key.endswith(" 200") for key in report.statuses)  # valid cases were served too
    check_after_fuzzing(fuzz_server.base_url, fuzz_server.headers)
    fuzz_server.wait_for_metric("convoy_kv_blocks_used", 0)
    fuzz_server.wait_for_metric("convoy_engine_requests_in_flight", 0)


def test_a_chain_of_responses_ends_at_the_context(fuzz_server: Server) -> None:
    """previous_response_id chains (up to 10,000 links tried) grow the conversation until it no
    longer fits the context (48 tokens here): then a 400 naming input, the chain intact."""
    import httpx

    url = f"{fuzz_server.base_url}/v1/responses"
    body: dict[str, object] = {"input": "ok", "max_output_tokens": 1, "temperature": 0}
    ids: list[str] = []
    with httpx.Client(headers=fuzz_server.headers, timeout=60) as http:
        for _ in range(10_000):
            r = http.post(url, json={**body, **({"previous_response_id": ids[-1]} if ids else {})})
            if r.status_code != 200:
                break
            ids.append(r.json()["id"])
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
        assert 1 <= len(ids) < 10_000
        last = http.get(f"{url}/{ids[-1]}").json()
        assert last["id"] == ids[-1] and last["status"] in ("completed", "incomplete")
        huge = http.post(url, json={**body, "input": [{"role": "user", "content": "x"}] * 5000})
        assert huge.status_code == 400 and huge.json()["error"]["param"] == "input"
    fuzz_server.wait_for_metric("convoy_kv_blocks_used", 0)


def test_truncation_auto_drops_the_oldest_items(fuzz_server: Server) -> None:
    """`truncation: auto` (48-token context here): a conversation past the context loses items
    from its start until it fits, where `disabled` (the default) is a 400 naming input; a
    previous_response_id chain goes on past where a disabled one ends."""
    import httpx

    url = f"{fuzz_server.base_url}/v1/responses"
    turns = [{"role": "user", "content": str(i)} for i in range(30)]
    body: dict[str, object] = {"input": turns, "max_output_tokens": 2, "temperature": 0}
    with httpx.Client(headers=fuzz_server.headers, timeout=60) as http:
        refused = http.post(url, json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "input"
        kept = http.post(url, json={**body, "truncation": "auto"})
        assert kept.status_code == 200, kept.text
        r = kept.json()
        assert r["truncation"] == "auto" and 0 < r["usage"]["input_tokens"] <= 48 - 2
        stored = http.get(f"{url}/{r['id']}/input_items", params={"limit": 100}).json()
        assert len(stored["data"]) == len(turns)  # stored whole; only the model's input is cut
        alone = http.post(url, json={**body, "input": turns[-1:]}).json()  # the last turn only
        assert r["usage"]["input_tokens"] > alone["usage"]["input_tokens"]  # more than one kept
        ids: list[str] = []
        for _ in range(12):  # a disabled chain of these ends within a few links (the test above)
            link = {"input": "ok", "max_output_tokens": 1, "temperature": 0, "truncation": "auto"}
            if ids:
                link["previous_response_id"] = ids[-1]
            answer = http.post(url, json=link)
            assert answer.status_code == 200, answer.text
            ids.append(answer.json()["id"])
    fuzz_server.wait_for_metric("convoy_kv_blocks_used", 0)


def test_truncate_prompt_tokens(fuzz_server: Server) -> None:
    """vLLM's truncate_prompt_tokens (48-token context here): a prompt keeps its last k tokens,
    the same as sending those ids (completions, with echo showing what ran; chat; embeddings);
    -1 keeps what the context holds, also of a 2 MB text (cut before it is tokenized, the same
    ids as the whole text's last ones); 0 is a 400 naming it."""
    import httpx

    text = " ".join(f"w{i}" for i in range(300))
    with httpx.Client(base_url=fuzz_server.base_url, headers=fuzz_server.headers,
                      timeout=60) as http:  # fmt: skip
        ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
        assert len(ids) > 48
        body = {"max_tokens": 3, "temperature": 0}
        cut = http.post("/v1/completions", json={**body, "prompt": text, "echo": True,
                                                 "truncate_prompt_tokens": 10}).json()  # fmt: skip
        assert cut["usage"]["prompt_tokens"] == 10
        same = http.post("/v1/completions", json={**body, "prompt": ids[-10:], "echo": True}).json()
        assert cut["choices"][0]["text"] == same["choices"][0]["text"]
        assert http.post("/v1/completions", json={**body, "prompt": text}).status_code == 400
        as_ids = http.post("/v1/completions", json={**body, "prompt": ids,
                                                    "truncate_prompt_tokens": 10}).json()  # fmt: skip
        plain = http.post("/v1/completions", json={**body, "prompt": ids[-10:]}).json()
        assert as_ids["choices"][0]["text"] == plain["choices"][0]["text"]
        chat = http.post("/v1/chat/completions", json={
            **body, "messages": [{"role": "user", "content": text}], "truncate_prompt_tokens": 20})
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 20
        huge = "hello world " * 170_000  # 2 MB: certainly past the context
        vec = http.post("/v1/embeddings", json={"input": huge, "truncate_prompt_tokens": -1}).json()
        assert vec["usage"]["prompt_tokens"] == 48
        tail = http.post("/tokenize", json={"prompt": "hello world " * 200}).json()["tokens"][-48:]
        exact = http.post("/v1/embeddings", json={"input": [tail]}).json()
        assert vec["data"][0]["embedding"] == exact["data"][0]["embedding"]
        zero = http.post("/v1/embeddings", json={"input": "hi", "truncate_prompt_tokens": 0})
        assert zero.status_code == 400
        assert zero.json()["error"]["param"] == "truncate_prompt_tokens"
    fuzz_server.wait_for_metric("convoy_kv_blocks_used", 0)
