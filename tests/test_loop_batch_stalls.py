"""``batch_residual`` halting with the damped solver stops on stalls batch-wide, as FPRM's inference
(nilskiKonjIzDunava/fprm ``FixedPointReasoningModel_ACTV1.forward`` in eval mode: the batch halts when
``residues.max() < fp_thresh`` or ``stepsize.max() < 1e-3``, every sample iterating until then).

Oracle: the reference's ``FixedPointOptimizer.step`` written out in float64 over the whole batch, with
its batch halting test after every step."""

from __future__ import annotations

import torch

from loopformer.loop import LoopConfig, run_loop

GAMMA, PATIENCE, MIN_STEP, TOL = 0.5, 1, 0.3, 1e-6


def _map(z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Per sample: z <- a z + 1 (a = -1.5: the undamped map oscillates and grows; damped at a step size
    below 0.8 it contracts to 1 / (1 - a); a >= 1.5: no fixed point the damped map reaches)."""
    return a[:, None, None] * z + 1.0


def _reference(z: torch.Tensor, a: torch.Tensor, max_steps: int) -> tuple[torch.Tensor, int]:
    b = z.shape[0]
    eta, best = torch.ones(b, dtype=z.dtype), torch.full((b,), torch.inf, dtype=z.dtype)
    patience = torch.full((b,), float(PATIENCE), dtype=z.dtype)
    for t in range(max_steps):
        fz = _map(z, a)
        res = ((z - fz).abs().amax(-1) / (fz.abs().amax(-1) + 1e-8)).amax(-1)
        z = fz * eta[:, None, None] + z * (1 - eta[:, None, None])
        improved = res < best
        best = torch.where(improved, res, best)
        patience = torch.where(improved, float(PATIENCE), patience - 1)
        adapt = (patience <= 0) & (res >= TOL)
        patience = torch.where(adapt, float(PATIENCE), patience)
        eta = eta * torch.where(adapt, GAMMA, 1.0)
        if res.max() < TOL or eta.max() < MIN_STEP:
            return z, t + 1
    return z, max_steps


def _loop(halting: str, max_steps: int) -> LoopConfig:
    return LoopConfig(solver="damped", halting=halting, max_steps=max_steps, tol=TOL, residual_norm="rel_sup",
                      plugins={"damped": {"gamma": GAMMA, "patience": PATIENCE, "min_step": MIN_STEP}})  # fmt: skip


def test_a_stalled_sample_keeps_iterating_until_the_whole_batch_stops() -> None:
    a = torch.tensor([-1.5, 1.5, 0.5], dtype=torch.float64)  # 0 stalls at step 3, 1 never settles
    z0 = torch.zeros(3, 2, 4, dtype=torch.float64)
    expected, n = _reference(z0, a, 40)
    assert n == 40  # the batch never halts: sample 1 neither converges nor stalls
    out = run_loop(_map, z0, _loop("batch_residual", 40), ctx=(a,))
    assert out.steps.tolist() == [40, 40, 40]
    torch.testing.assert_close(out.state, expected, rtol=1e-12, atol=1e-12)
    # per-sample residual halting stops the stalled sample on its own, at another iterate
    per_sample = run_loop(_map, z0, _loop("residual", 40), ctx=(a,))
    assert int(per_sample.steps[0]) == 3 and not torch.allclose(per_sample.state[0], expected[0])
    assert torch.allclose(out.state[0], torch.full_like(out.state[0], 0.4))  # it kept going and settled


def test_the_batch_stops_when_every_sample_has_stalled() -> None:
    a = torch.tensor([2.0, 3.0], dtype=torch.float64)  # each stalls on its own (steps 55 and 36)
    z0 = torch.zeros(2, 3, 4, dtype=torch.float64)
    expected, n = _reference(z0, a, 60)
    assert n == 55
    out = run_loop(_map, z0, _loop("batch_residual", 60), ctx=(a,))
    assert out.steps.tolist() == [n, n] and not out.converged.any()
    torch.testing.assert_close(out.state, expected, rtol=1e-12, atol=1e-12)
    alone = [
        run_loop(lambda z, i=i: _map(z, a[i : i + 1]), z0[i : i + 1], _loop("residual", 60)) for i in (0, 1)
    ]
    assert [int(r.steps) for r in alone] == [55, 36]  # sample 1 stalled earlier and went on
