"""keep_gguf_quantized: the GGUF's Q4_1 / Q8_0 linears run in their blocks (int8 kernels).

Accuracy is stated against the dequantized fp32 path (perplexity of a fixed text), and greedy
output must not depend on what else is in the batch.
"""

from __future__ import annotations

import math

import pytest

from convoy import LLM, SamplingParams
from tests.engine.conftest import prompts16

TEXT = (
    "The history of the lighthouse begins in the ancient world, when fires were lit on hilltops "
    "to guide ships into harbour. The most famous of these was the Pharos of Alexandria, built in "
    "the third century BC, which stood for more than a thousand years. In the modern era, "
    "lighthouses were fitted with lenses that could project a beam of light many miles out to sea."
)


@pytest.fixture(scope="module")
def quantized(cpu_kernels: None) -> LLM:
    return LLM(dtype="float32", keep_gguf_quantized=True)


def _perplexity(llm: LLM) -> float:
    out = llm.generate([TEXT], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert out.prompt_logprobs is not None
    ids = out.prompt_token_ids
    lps = [pos[t] for pos, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True) if pos]
    return math.exp(-sum(lps) / len(lps))


def test_every_linear_runs_quantized(quantized: LLM) -> None:
    cfg = quantized.core.worker.model_config
    assert quantized.core.worker.quantized_linears == 4 * cfg.num_layers + 1  # + the tied head


def test_perplexity_within_one_percent_of_the_dequantized_path(quantized: LLM, llm: LLM) -> None:
    exact, quant = _perplexity(llm), _perplexity(quantized)
    assert abs(quant / exact - 1) < 0.01, (exact, quant)


def test_batched_equals_alone(quantized: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = prompts16()[:8]
    alone = [quantized.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    batch = quantized.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in batch] == alone
