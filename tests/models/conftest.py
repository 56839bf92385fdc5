from __future__ import annotations

import pytest
import torch

torch.manual_seed(0)


@pytest.fixture(scope="session", autouse=True)
def _threads() -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
