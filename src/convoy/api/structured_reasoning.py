"""A reasoning model's output constraint: it applies to the content after the think block.

The constraint is compiled with a think block before it (StructuredOutputsParams.think:
llguidance matches `<think>` free text `</think>` then the constraint, see
structured/compiler.py): optional where the reply may open a block, required where the prompt
opened one, none where thinking is off. A regex or grammar that itself spells `</think>`
constrains the whole reply, its think block included, so it is left as it is.
"""

from __future__ import annotations

import dataclasses

from convoy.api.reasoning import THINK_CLOSE, ThinkStart
from convoy.sampling_params import SamplingParams


def constrain_after_think(params: SamplingParams, start: ThinkStart) -> None:
    """Set the request's constraint (if any) to start after the think block `start` implies."""
    spec = params.structured_outputs
    if spec is None or start == ThinkStart.OFF:
        return
    if spec.kind in ("regex", "grammar") and THINK_CLOSE in spec.cache_key[1]:
        return
    params.structured_outputs = dataclasses.replace(spec, think=start.value)
