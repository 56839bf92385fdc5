"""`convoy serve --device cuda` (marked `gpu`, skipped without a CUDA device): a sampled
completion and a streamed chat through the official client, in the dtype CUDA gets by default
(bfloat16). CONVOY_TEST_DEVICE=cpu runs it on the CPU instead (a check of the test only)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from openai import OpenAI

from tests.e2e.conftest import served_client
from tests.e2e.helpers import MODEL, complete, texts
from tests.engine.test_gpu import DEVICE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="no CUDA device"
    ),
]


@pytest.fixture(scope="module")
def gpu_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAI]:
    args = [MODEL, "--device", DEVICE, "--kv-cache-memory", "256MiB", "--log-level", "info"]
    with served_client(args, tmp_path_factory.mktemp("gpu"), f" on {DEVICE}") as client:
        yield client


def test_sampled_completion_on_the_device(gpu_client: OpenAI) -> None:
    """Seeded sampling (n=2): the step that failed on CUDA when sampling tensors were on the
    CPU; reproducible on the same device."""
    kwargs = dict(n=2, temperature=0.8, top_p=0.9, seed=7, extra_body={"ignore_eos": True})
    out = complete(gpu_client, "The capital of France is", **kwargs)
    assert all(c.finish_reason == "length" and c.text for c in out.choices)
    assert out.usage is not None and out.usage.completion_tokens == 2 * 10
    assert texts(complete(gpu_client, "The capital of France is", **kwargs)) == texts(out)


def test_streamed_chat_on_the_device(gpu_client: OpenAI) -> None:
    stream = gpu_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0.7,
        seed=3,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices[0].finish_reason in ("length", "stop")
