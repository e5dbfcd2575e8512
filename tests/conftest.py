"""Shared pytest settings: deterministic, fast CPU math for every test."""

import pytest
import torch

torch.set_flush_denormal(True)
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
