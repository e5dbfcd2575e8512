"""``anderson_trmdeq`` (the Attractor puzzle model's solve as jacobfa/Attractor's ``_anderson_solve``):
its bordered least-squares weights, and the reference's ``except RuntimeError: break`` when the system
is singular (the whole batch stops and returns the buffer's last slot)."""

from __future__ import annotations

import torch

import loopformer.models.attractor_solvers as trmdeq
from loopformer.loop import LoopConfig, run_loop
from loopformer.loop.solvers import gram_weights


def _loop(max_steps: int = 7) -> LoopConfig:
    return LoopConfig(solver="anderson_trmdeq", halting="residual", tol=1e-12, max_steps=max_steps,
                      plugins={"anderson_trmdeq": {"m": 5, "reg": 1e-4, "beta": 1.0}})  # fmt: skip


def test_bordered_weights_are_the_regularised_least_squares_weights() -> None:
    g = torch.Generator().manual_seed(0)
    r = torch.randn(3, 4, 10, generator=g, dtype=torch.float64)
    gram = r @ r.transpose(1, 2)
    a, singular = trmdeq.bordered_weights(gram, 1e-4)
    assert not singular.any()
    torch.testing.assert_close(a, gram_weights(gram, 1e-4, relative=False), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(a.sum(-1), torch.ones(3, dtype=torch.float64))


def test_bordered_weights_flag_a_singular_system() -> None:
    big = torch.full((2, 2), 1e8)  # identical residual rows: + 1e-4 is below float32's resolution at 1e8
    gram = torch.stack([big, torch.eye(2)])
    _, singular = trmdeq.bordered_weights(gram, 1e-4)
    assert singular.tolist() == [True, False]


def test_singular_mix_stops_the_solve_and_returns_the_last_slot() -> None:
    """f(z) = z + c: every residual is c, so the first mix (2 evaluations) faces identical Gram rows.
    The reference breaks there and returns its buffer's last slot, never written yet: zeros."""
    c = torch.full((2, 3, 4), 3e3)
    z0 = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1))
    res = run_loop(lambda z: z + c, z0, _loop())
    assert res.steps.tolist() == [2, 2]
    assert not res.converged.any()
    torch.testing.assert_close(res.state, torch.zeros_like(z0))


def test_a_regular_contraction_runs_to_the_step_cap() -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(4, 4, generator=g, dtype=torch.float64) * 0.1
    b = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    res = run_loop(lambda z: z @ w + b, torch.zeros(2, 3, 4, dtype=torch.float64), _loop(5))
    assert res.steps.tolist() == [5, 5]  # tol 1e-12 is not reached in 5 steps, nothing is singular
    fixed = torch.linalg.solve(torch.eye(4, dtype=torch.float64) - w.T, b.reshape(-1, 4).T).T.reshape(b.shape)
    assert (res.state - fixed).norm() < (torch.zeros_like(b) - fixed).norm()
