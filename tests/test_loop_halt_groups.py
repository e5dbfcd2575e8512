"""``LoopConfig.halt_group``: a batch-wide halting rule (``batch_residual``) decides per group of that many
consecutive rows. The Attractor LM's solver stops when the largest residual of its 32-sequence micro-batch is
below tol (github jacobfa/Attractor ``attractor/models/attractor/solvers.py`` ``anderson_solve``:
``rel.max() < tol`` over the batch it is given, ``launch_configs/attractor-small-140m.yaml``
``micro_batch_size: 32``), not the whole 256-sequence batch.

Oracle: per-sample maps ``z <- a z + 1`` whose residual sequence is written out in float64; a group stops at
the first step where all its samples are below tol, and every sample of it keeps iterating until then."""

from __future__ import annotations

import pytest
import torch

from loopformer.loop import LoopConfig, run_loop
from loopformer.loop.halting import group_all

TOL = 1e-6


def _map(z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return a[:, None] * z + 1.0


def _nonlinear(z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """A contraction Anderson does not solve in a few steps (it does an affine map)."""
    return a[:, None] * torch.sin(z * torch.arange(1, 4, dtype=z.dtype)) + 1.0


def _written_out(a: torch.Tensor, group: int, max_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(steps, final state) per sample: Picard iteration, each group of ``group`` rows stopping together."""
    b = a.shape[0]
    z = torch.zeros(b, 3, dtype=torch.float64)
    steps = torch.full((b,), max_steps)
    out = torch.zeros_like(z)
    running = torch.ones(b, dtype=torch.bool)
    for t in range(max_steps):
        fz = _map(z, a)
        res = (fz - z).norm(dim=1) / (fz.norm(dim=1) + 1e-8)
        z = torch.where(running[:, None], fz, z)
        for g in range(0, b, group):
            rows = slice(g, g + group)
            if bool(running[rows].all()) and bool((res[rows] < TOL).all()):
                steps[rows], out[rows], running[rows] = t + 1, z[rows], False
    out[running] = z[running]
    return steps, out


@pytest.mark.parametrize("compaction", [True, False])
def test_batch_residual_halts_per_group_of_rows(compaction: bool) -> None:
    a = torch.tensor(
        [0.1, 0.2, 0.9, 0.3, 0.5, 0.6], dtype=torch.float64
    )  # groups of 2 converge at different steps
    z0 = torch.zeros(6, 3, dtype=torch.float64)
    steps, state = _written_out(a, 2, 200)
    cfg = LoopConfig(halting="batch_residual", tol=TOL, max_steps=200, halt_group=2, compaction=compaction)
    out = run_loop(_map, z0, cfg, ctx=(a,))
    assert out.steps.tolist() == steps.tolist()
    assert len(set(steps.tolist())) == 3  # three groups, three stopping steps
    torch.testing.assert_close(out.state, state, rtol=0, atol=0)
    whole = run_loop(_map, z0, LoopConfig(halting="batch_residual", tol=TOL, max_steps=200), ctx=(a,))
    assert whole.steps.tolist() == [int(steps.max())] * 6  # without groups the slowest sample holds everyone
    ragged = run_loop(
        _map, z0, LoopConfig(halting="batch_residual", tol=TOL, max_steps=200, halt_group=4), ctx=(a,)
    )
    assert ragged.steps.tolist() == _written_out(a, 4, 200)[0].tolist()  # the last group is the 2 rows left


def test_the_attractor_lm_solver_stops_and_returns_per_group() -> None:
    """``anderson_attractor`` returns ``f(x_k)`` at the step its own group stops (the reference's per-call stop)."""
    a = torch.tensor([0.1, 0.2, 0.8, 0.7], dtype=torch.float64)
    z0 = torch.zeros(4, 3, dtype=torch.float64)
    import loopformer.models.attractor_solvers  # noqa: F401  (registers the solver)

    cfg = dict(solver="anderson_attractor", halting="batch_residual", tol=1e-8, min_steps=2, max_steps=60)
    grouped = run_loop(_nonlinear, z0, LoopConfig(**cfg, halt_group=2), ctx=(a,))
    first = run_loop(
        _nonlinear, z0[:2], LoopConfig(**cfg), ctx=(a[:2],)
    )  # each group alone is one whole batch
    second = run_loop(_nonlinear, z0[2:], LoopConfig(**cfg), ctx=(a[2:],))
    assert grouped.steps.tolist() == first.steps.tolist() + second.steps.tolist()
    assert first.steps[0] != second.steps[0]
    torch.testing.assert_close(grouped.state, torch.cat([first.state, second.state]), rtol=0, atol=0)


def test_group_all_renumbers_the_running_rows() -> None:
    groups = torch.tensor([0, 0, 3, 7, 7, 9])  # what is left of groups 0..9 after compaction
    mask = torch.tensor([True, True, False, True, True, True])
    assert group_all(mask, groups).tolist() == [True, True, False, True, True, True]
    assert group_all(torch.tensor([True, False, True]), None).tolist() == [False, False, False]
    with pytest.raises(ValueError, match="halt_group"):
        LoopConfig(halt_group=-1)
