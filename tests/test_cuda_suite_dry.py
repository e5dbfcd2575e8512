"""The CUDA model suite's comparison (tests/test_cuda_models.py, ``compare_devices``) run CPU against CPU in
the default test run: its code (the CPU-drawn initial iterate, TRM-DEQ's fixed Jacobian probe, the float64
oracle) runs without a GPU, so a GPU check does not first find a broken test. The float32 comparison of
identical runs must agree, and the float64 oracle must be the same model: within 1e-5 of the float32 run,
except TRM-DEQ with its authors' Anderson, whose float32 error the oracle exists to measure."""

from __future__ import annotations

import pytest
from test_cuda_models import _cases, compare_devices

SMOKE = [c for c in _cases() if c.id.startswith("smoke-")]


@pytest.mark.parametrize(("name", "solver", "halting", "grad"), SMOKE)
def test_the_cuda_comparison_runs_cpu_against_cpu(name: str, solver: str, halting: str, grad: str) -> None:
    error = compare_devices(name, solver, halting, grad, "cpu")
    if name == "attractor_puzzle":  # the reference Anderson's near-singular Gram solve (test_cuda_models.py)
        assert error["logits"] > 1e-3, error
    else:  # an oracle that is not the same model would let any device pass
        assert error["logits"] < 1e-5 and error["grads"] < 1e-4, error
