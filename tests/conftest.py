"""Shared pytest settings: deterministic, fast CPU math for every test."""

import pytest
import torch

torch.set_flush_denormal(True)
torch.set_num_threads(1)  # tiny test models: one thread is fastest, and leaves a core for xdist


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
