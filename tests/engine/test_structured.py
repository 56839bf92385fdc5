"""Structured outputs in the real engine (SmolLM2, exact fp32 mode, greedy): JSON schema, regex
and choice outputs match; constrained and unconstrained sequences share a batch without
changing each other's tokens; preemption keeps every matcher in step; the constraint wins over
min_tokens, ignore_eos and logit_bias; max_tokens still cuts with `length`."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from convoy import LLM, RequestOutput, SamplingParams
from convoy.structured.params import StructuredOutputsParams
from tests.engine.conftest import prompts16
from tests.structured_schemas import make_schemas

SCHEMAS = make_schemas(8, small=True)  # with 8 free prompts of every length: a batch of 16
FREE = prompts16()[::2]
FORMATS = jsonschema.FormatChecker(formats=["date", "email", "uuid", "ipv4"])
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PHONE = r"\(\d{3}\) \d{3}-\d{4}"


def chat(llm: LLM, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def constrained(spec: dict[str, Any], max_tokens: int = 200, **extra: Any) -> SamplingParams:
    """Greedy unless `extra` says otherwise, constrained by `spec` (StructuredOutputsParams)."""
    return SamplingParams(
        **{"temperature": 0, "max_tokens": max_tokens, **extra},
        structured_outputs=StructuredOutputsParams(**spec),
    )


def assert_valid(out: RequestOutput, schema: dict[str, Any]) -> None:
    c = out.outputs[0]
    assert str(c.finish_reason) == "stop", c.text
    jsonschema.validate(json.loads(c.text), schema, format_checker=FORMATS)


def schema_requests(llm: LLM) -> tuple[list[str], list[SamplingParams]]:
    return [chat(llm, p) for p, _ in SCHEMAS], [constrained({"json": s}) for _, s in SCHEMAS]


@pytest.fixture(scope="module")
def schemas_alone(llm: LLM) -> list[RequestOutput]:
    """The 16 schema requests in one batch of their own: the reference."""
    return llm.generate(*schema_requests(llm))


def test_json_schema_regex_and_choice_outputs_match(
    llm: LLM, schemas_alone: list[RequestOutput]
) -> None:
    for (_, schema), out in zip(SCHEMAS, schemas_alone, strict=True):
        assert_valid(out, schema)
    choices = ["yes", "no", "it depends"]
    phone, answer = llm.generate(
        [chat(llm, "Give me a phone number."), chat(llm, "Is the sky green?")],
        [constrained({"regex": PHONE}, 30), constrained({"choice": choices}, 30)],
    )
    assert re.fullmatch(PHONE, phone.outputs[0].text), phone.outputs[0].text
    assert answer.outputs[0].text in choices
    assert [str(o.outputs[0].finish_reason) for o in (phone, answer)] == ["stop", "stop"]


def test_constrained_neighbours_change_no_token(
    llm: LLM, schemas_alone: list[RequestOutput]
) -> None:
    free = llm.generate(FREE, GREEDY)
    prompts, params = schema_requests(llm)
    mixed = llm.generate(
        [p for pair in zip(FREE, prompts, strict=True) for p in pair],
        [p for pair in zip([GREEDY] * len(FREE), params, strict=True) for p in pair],
    )
    assert [o.outputs[0].token_ids for o in mixed[0::2]] == [o.outputs[0].token_ids for o in free]
    assert [o.outputs[0].token_ids for o in mixed[1::2]] == [
        o.outputs[0].token_ids for o in schemas_alone
    ]


def test_preemption_and_recompute_keep_the_matchers_in_step(
    schemas_alone: list[RequestOutput],
) -> None:
    # 12 blocks of 16 tokens cannot hold 8 sequences of ~60 tokens: preemption by recompute.
    small = LLM(dtype="float32", num_kv_blocks=12)
    outs = small.generate(*schema_requests(small))
    assert small.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in schemas_alone]
    assert small.core.block_manager.num_used_blocks == 0


def test_the_constraint_wins_over_min_tokens_ignore_eos_and_logit_bias(llm: LLM) -> None:
    yes, no = (llm.tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no"))
    schema = SCHEMAS[0][1]
    outs = llm.generate(
        [chat(llm, "Is the sky green?"), chat(llm, "Pick a number."), chat(llm, SCHEMAS[0][0])],
        [
            constrained({"choice": ["yes", "no"]}, min_tokens=8, logit_bias={yes: -100, no: -100}),
            constrained({"regex": "[0-9]{1,3}"}, min_tokens=10, ignore_eos=True),
            constrained({"json": schema}, ignore_eos=True, min_tokens=150),
        ],
    )
    assert outs[0].outputs[0].text in ("yes", "no")
    assert re.fullmatch("[0-9]{1,3}", outs[1].outputs[0].text)
    assert_valid(outs[2], schema)
    assert all(str(o.outputs[0].finish_reason) == "stop" for o in outs)


def test_max_tokens_cuts_a_constrained_output_with_length(llm: LLM) -> None:
    prompt, schema = SCHEMAS[1]
    out = llm.generate([chat(llm, prompt)], constrained({"json": schema}, 5))[0].outputs[0]
    assert str(out.finish_reason) == "length" and len(out.token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_every_child_of_n_matches_on_its_own_and_seeds_stay_batch_invariant(llm: LLM) -> None:
    params = constrained({"regex": PHONE}, 30, n=4, temperature=1.0, seed=7)
    prompt = chat(llm, "Give me four phone numbers.")
    out = llm.generate([prompt], params)[0]
    assert len(out.outputs) == 4 and len({c.text for c in out.outputs}) > 1
    for c in out.outputs:
        assert re.fullmatch(PHONE, c.text) and str(c.finish_reason) == "stop", c.text
    beside = llm.generate([prompts16()[0], prompt], [GREEDY, params])[1]
    assert [c.token_ids for c in beside.outputs] == [c.token_ids for c in out.outputs]
