"""POST /v1/completions through the official client: prompt lists batch without changing results."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from tests.e2e.helpers import MAX_TOKENS, MODEL, PROMPTS, complete, texts


@pytest.fixture(scope="module")
def alone(client: OpenAI) -> list[tuple[str, int, int]]:
    """(text, prompt tokens, completion tokens) of each prompt sent in its own request."""
    results = []
    for prompt in PROMPTS:
        completion = complete(client, prompt)
        assert completion.usage is not None
        choice = completion.choices[0]
        results.append(
            (choice.text, completion.usage.prompt_tokens, completion.usage.completion_tokens)
        )
    return results


def test_prompt_list_equals_each_prompt_alone(
    client: OpenAI, alone: list[tuple[str, int, int]]
) -> None:
    batch = complete(client, PROMPTS)
    assert batch.object == "text_completion" and batch.model == MODEL
    assert texts(batch) == [text for text, _, _ in alone]
    assert all(c.finish_reason in ("stop", "length") for c in batch.choices)
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == sum(p for _, p, _ in alone)
    assert batch.usage.completion_tokens == sum(c for _, _, c in alone)
    assert batch.usage.total_tokens == batch.usage.prompt_tokens + batch.usage.completion_tokens


def test_token_id_prompts_equal_text_prompts(
    client: OpenAI, http: httpx.Client, alone: list[tuple[str, int, int]]
) -> None:
    ids = [http.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in PROMPTS[:4]]
    batch = complete(client, ids)
    assert texts(batch) == [text for text, _, _ in alone[:4]]
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == sum(len(i) for i in ids)
    single = complete(client, ids[0])  # one prompt as a flat list of token ids
    assert texts(single) == [alone[0][0]]


def test_n_times_prompts_orders_choices_by_prompt_then_sample(client: OpenAI) -> None:
    prompts, n = PROMPTS[:3], 2
    sampling = {"n": n, "temperature": 0.9, "seed": 11}
    each = [complete(client, p, **sampling) for p in prompts]
    batch = complete(client, prompts, **sampling)
    # index = prompt_idx * n + j, and each prompt's samples are the ones it gets alone
    assert texts(batch) == [text for completion in each for text in texts(completion)]
    assert batch.usage is not None
    assert batch.usage.completion_tokens == sum(c.usage.completion_tokens for c in each if c.usage)
    assert batch.usage.prompt_tokens == sum(c.usage.prompt_tokens for c in each if c.usage)


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(client: OpenAI) -> None:
    sampling = {"temperature": 1.0, "top_p": 0.95, "seed": 1234}
    first = texts(complete(client, PROMPTS[1], **sampling))
    again = texts(complete(client, PROMPTS[1], **sampling))
    batch = texts(complete(client, [PROMPTS[0], PROMPTS[1], PROMPTS[2]], **sampling))
    assert first == again == [batch[1]]
    other_seed = texts(complete(client, PROMPTS[1], **{**sampling, "seed": 99}))
    assert other_seed != first  # the seed is what makes it reproducible
    extreme = {**sampling, "seed": -(2**63)}  # any int64 is a valid seed
    assert texts(complete(client, PROMPTS[1], **extreme)) == texts(
        complete(client, PROMPTS[1], **extreme)
    )


def test_echo_scores_the_prompt_with_exact_text_offsets(client: OpenAI) -> None:
    prompt = "The capital of France is Paris. The capital of Italy is Rome."
    scored = complete(client, prompt, echo=True, logprobs=2, max_tokens=0)
    choice = scored.choices[0]
    assert choice.text == prompt
    assert scored.usage is not None and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.text_offset
    assert len(lp.tokens) == scored.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs is not None
    assert lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    _assert_offsets_exact(choice.text, lp.tokens, lp.text_offset)
    # "Rome" after "The capital of Italy is" is far likelier than the first token of the text
    assert lp.token_logprobs[-2] is not None and lp.token_logprobs[-2] > -3


def test_echo_with_generation_covers_prompt_and_completion(client: OpenAI) -> None:
    prompt = PROMPTS[0]
    plain = complete(client, prompt)
    echoed = complete(client, prompt, echo=True, logprobs=1)
    choice = echoed.choices[0]
    assert choice.text == prompt + plain.choices[0].text
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.text_offset and echoed.usage is not None
    assert len(lp.tokens) == echoed.usage.prompt_tokens + echoed.usage.completion_tokens
    _assert_offsets_exact(choice.text, lp.tokens, lp.text_offset)


def _assert_offsets_exact(text: str, tokens: list[str], offsets: list[int]) -> None:
    assert "".join(tokens) == text
    for token, offset in zip(tokens, offsets, strict=True):
        assert text[offset : offset + len(token)] == token


def test_generated_logprobs_are_consistent_with_greedy_choice(client: OpenAI) -> None:
    completion = complete(client, PROMPTS[2], logprobs=3)
    lp = completion.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert completion.usage is not None
    assert len(lp.tokens) == completion.usage.completion_tokens
    _assert_offsets_exact(completion.choices[0].text, lp.tokens, lp.text_offset or [])
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top is not None and 3 <= len(top) <= 4
        assert token_lp is not None
        assert token_lp == pytest.approx(max(top.values()), abs=1e-5)  # greedy took the best


def test_stop_string_truncates_the_text(client: OpenAI, alone: list[tuple[str, int, int]]) -> None:
    full = alone[0][0]
    stop = full.strip().split()[1]  # a word from the middle of the greedy text
    completion = complete(client, PROMPTS[0], stop=[stop, "never-matches"])
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == full[: full.index(stop)]


def test_max_tokens_gives_length_finish(client: OpenAI) -> None:
    completion = complete(client, PROMPTS[4], max_tokens=3, extra_body={"ignore_eos": True})
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 3


def test_best_of_returns_the_n_best_choices_and_bills_every_candidate(client: OpenAI) -> None:
    completion = complete(
        client, PROMPTS[5], n=2, best_of=3, temperature=0.8, seed=5, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in completion.choices] == [0, 1]
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 3 * MAX_TOKENS  # as OpenAI bills best_of


def test_return_tokens_as_token_ids(http: httpx.Client) -> None:
    """vLLM's return_tokens_as_token_ids: logprobs name each token `token_id:<id>` (completions'
    tokens and top keys, chat's token and top tokens); the ids spell the text, the offsets and
    logprobs are those of the plain answer."""
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0, "logprobs": 2}  # fmt: skip
    plain = http.post("/v1/completions", json=body).json()["choices"][0]
    as_ids = http.post("/v1/completions",
                       json={**body, "return_tokens_as_token_ids": True}).json()["choices"][0]  # fmt: skip
    tokens = as_ids["logprobs"]["tokens"]
    assert all(t.startswith("token_id:") for t in tokens)
    ids = [int(t.split(":")[1]) for t in tokens]
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == plain["text"]
    assert as_ids["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]
    assert as_ids["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    assert all(k.startswith("token_id:") for top in as_ids["logprobs"]["top_logprobs"]
               for k in top)  # fmt: skip
    chat = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}).json()
    entries = chat["choices"][0]["logprobs"]["content"]
    assert all(e["token"].startswith("token_id:") for e in entries)
    assert all(t["token"].startswith("token_id:") for e in entries for t in e["top_logprobs"])
