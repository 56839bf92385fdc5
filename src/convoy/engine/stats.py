"""EngineStats: a snapshot of the engine's counters (for /metrics and tests). A leaf module."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineStats:
    num_running: int  # sequences
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_prompt_tokens: int  # totals since start
    num_generation_tokens: int
    num_preemptions: int
    num_prefix_cache_hit_tokens: int = 0  # prompt tokens served from the prefix cache
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified
    num_accepted_draft_tokens: int = 0  # of which kept
    num_side_steps: int = 0  # newcomers' steps run between two layers of a step (EngineCore)
