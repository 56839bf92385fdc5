"""LongRoPE and the prefix cache (no model): a prompt longer than the original context computes
every position with the long factors, so its blocks must not be shared with a shorter prompt's
of the same prefix; prompts on the same side of the switch still share theirs."""

from __future__ import annotations

from convoy.config import SchedulerConfig
from convoy.engine.block_manager import BlockManager
from convoy.engine.request import Request
from convoy.engine.scheduler import Scheduler
from convoy.model_config import ModelConfig
from convoy.sampling_params import SamplingParams

BS = 4


def _hashes(sched: Scheduler, n: int) -> list[bytes]:
    params = SamplingParams(max_tokens=4)
    req = Request(f"r{n}", list(range(n)), params, group_id="g", arrival=0.0)
    return sched._hashes(req)


def test_long_prompts_hash_apart_from_short_ones() -> None:
    sched = Scheduler(SchedulerConfig(8, 64), BlockManager(64, BS), 128)
    assert _hashes(sched, 40)[:5] == _hashes(sched, 20)[:5]  # no switch: shared
    sched.rope_switch_len = 32
    short, at, long, longer = (_hashes(sched, n) for n in (20, 32, 33, 40))
    assert short[:5] == at[:5]  # both take the short factors below 32
    assert long[:5] == longer[:5]  # both long
    assert not set(short) & set(long)


def test_rope_switch_len_from_config() -> None:
    raw = dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=8, hidden_size=8,
        intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=128, original_max_position_embeddings=32,
        rope_scaling={"type": "su", "short_factor": [1.0] * 2, "long_factor": [2.0] * 2},
    )  # fmt: skip
    assert ModelConfig.from_dict(raw).rope_switch_len() == 32
    assert ModelConfig.from_dict({**raw, "rope_scaling": None}).rope_switch_len() is None


def test_scheduled_chunks_carry_the_prompt_length() -> None:
    """Every prefill chunk (and later decode) tells the model its request's prompt length, the
    LongRoPE switch of phi3.py (AttentionMetadata.prompt_lens)."""
    sched = Scheduler(SchedulerConfig(8, 16), BlockManager(64, BS), 128)
    params = SamplingParams(max_tokens=4)
    sched.add_request(Request("r", list(range(40)), params, group_id="g", arrival=0.0))
    out = sched.schedule()
    assert [(len(s.token_ids), s.prompt_len) for s in out.seqs] == [(16, 40)]
