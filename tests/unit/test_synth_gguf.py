"""bench/synth_gguf.py's random blocks: the weights of every type it writes have mean 0 and the
stated spread. A nonzero mean is a direction every layer's output shares: the synthetic MoE
files once routed every row of a step to the same experts, which flattered batched MoE figures."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "synth_gguf.py"


def _synth():
    spec = importlib.util.spec_from_file_location("synth_gguf", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


TYPES = [T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.Q3_K, T.IQ4_XS, T.IQ4_NL]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_blocks_have_mean_zero_and_the_stated_spread(qtype: T) -> None:
    synth = _synth()
    blocks = synth.random_blocks(np.random.default_rng(1), qtype, 20000)
    w = dequantize(blocks, qtype).astype(np.float64)
    # a shared offset of 1% of the spread already adds up over 2,048 inputs (0.01 * sqrt(2048))
    assert abs(w.mean()) < 0.003 * w.std(), (qtype.name, w.mean() / w.std())
    assert abs(w.std() / synth.SIGMA - 1) < 0.05, (qtype.name, w.std() / synth.SIGMA)
