"""Fairness with the real engine: a small request is not stuck behind a big one."""

from __future__ import annotations

from convoy import LLM, SamplingParams
from convoy.outputs import RequestOutput
from convoy.sampling_params import RequestOutputKind


def _add(
    llm: LLM, req_id: str, group: str, prompt: str, max_tokens: int, sink: list[RequestOutput]
) -> None:
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    ids = llm.tokenizer.encode(prompt)
    llm.frontend.add(llm.frontend.inputs.process(ids, params, req_id, prompt, group), sink.append)


def test_small_request_gets_a_token_within_a_few_steps() -> None:
    llm = LLM(dtype="float32", max_num_seqs=8)
    big: list[RequestOutput] = []
    for i in range(200):  # one API request with 200 prompts: far more than fit in a step
        _add(llm, f"big-{i}", "big", f"Item {i}: describe it.", 16, big)
    for _ in range(3):
        llm.frontend.step()
    small: list[RequestOutput] = []
    _add(llm, "small", "small", "Hello!", 4, small)
    steps = 0
    while not small:
        llm.frontend.step()
        steps += 1
    assert steps <= 2
    assert sum(1 for o in big if o.finished) < 200  # the big request was still running
    while not (small and small[-1].finished):
        llm.frontend.step()
    assert "".join(o.outputs[0].text for o in small)
