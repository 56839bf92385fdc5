"""`convoy serve` with default flags: the embedded GGUF runs quantized (int8 kernels, fp16 KV),
and the OpenAI surface works the same through it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from openai import OpenAI

from tests.e2e.conftest import Server, start_server, stop_server
from tests.e2e.helpers import API_KEY, MODEL


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory, cpu_kernels: None) -> Iterator[Server]:
    args = ["--kv-cache-memory", "128MiB", "--log-level", "info"]  # otherwise default flags
    server = start_server(args, tmp_path_factory.mktemp("default"))
    try:
        yield server
    finally:
        stop_server(server)


def test_default_server_runs_quantized_and_answers(default_server: Server) -> None:
    assert "linears quantized" in default_server.log()
    assert " 0 linears quantized" not in default_server.log()
    client = OpenAI(base_url=f"{default_server.base_url}/v1", api_key=API_KEY, max_retries=0)
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    out = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.finish_reason == "length" and c.text for c in out.choices)
    assert out.usage is not None and out.usage.completion_tokens == 16
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=6,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_embeddings_in_the_quantized_default(default_server: Server, client: OpenAI) -> None:
    """/v1/embeddings on quantized weights: a text's vector alone and inside a batch beside
    other inputs agree, and point where the exact mode's (the session's fp32 server) do."""
    import numpy as np

    quantized = OpenAI(base_url=f"{default_server.base_url}/v1", api_key=API_KEY, max_retries=0)
    texts = ["The capital of France is Paris.", "def add(a, b): return a + b", "Good morning"]
    fillers = [f"Another sentence, number {i}, about the weather." for i in range(13)]

    def vectors(c: OpenAI, inputs: list[str]) -> list[np.ndarray]:
        out = c.embeddings.create(model=MODEL, input=inputs)
        return [np.asarray(d.embedding, dtype=np.float64) for d in out.data]

    alone = [vectors(quantized, [t])[0] for t in texts]
    batched = vectors(quantized, texts + fillers)
    exact = vectors(client, texts)
    for a, b, e in zip(alone, batched, exact, strict=False):
        assert abs(np.linalg.norm(a) - 1) < 1e-5
        np.testing.assert_allclose(b, a, atol=1e-4)
        assert float(a @ e) > 0.97  # cosine: unit vectors
