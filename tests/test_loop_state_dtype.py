"""LoopConfig.state_dtype: the FPRM reference's bf16 state, injected input and damping arithmetic.

The reference (nilskiKonjIzDunava/fprm ``models/fixed_point_reasoning/model_utils.py``
``FixedPointOptimizer``) keeps the iterate, its step size and every damping operation in the forward
dtype (bf16): the decay factor is rounded to bf16 before it multiplies the step size, so 0.996 and
0.997 are both 0.99609375 and the step size falls below 1e-3 after 1277 decays instead of 1724 / 2300.
The oracles below recompute that arithmetic independently with ``torch.bfloat16`` scalars.
"""

from __future__ import annotations

import math

import pytest
import torch

from loopformer.config import ConfigError, build_config
from loopformer.loop import LoopConfig, run_loop
from loopformer.loop.solvers import Damped

BF16 = torch.bfloat16


def _bf16_step_sizes(gamma: float, n: int) -> list[float]:
    """eta_k = eta_{k-1} * bf16(gamma), every product rounded to bf16 (the reference's arithmetic)."""
    eta, g, out = torch.tensor(1.0, dtype=BF16), torch.tensor(gamma, dtype=BF16), []
    for _ in range(n):
        eta = eta * g
        out.append(eta.item())
    return out


def _decays_to(gamma: float, floor: float, lowp: bool) -> int:
    eta, k = (torch.tensor(1.0, dtype=BF16), 0) if lowp else (1.0, 0)
    g = torch.tensor(gamma, dtype=BF16) if lowp else gamma
    while float(eta) >= floor:
        eta, k = eta * g, k + 1
    return k


def _drive(state_dtype: str, gamma: float, n_decays: int) -> torch.Tensor:
    """The damped solver's step size after ``n_decays`` decays (patience 1, a residual that never improves)."""
    cfg = LoopConfig(solver="damped", plugins={"damped": {"gamma": gamma, "patience": 1}}, tol=0.1, state_dtype=state_dtype)
    solver = Damped(cfg)
    dtype = BF16 if state_dtype == "bfloat16" else torch.float32
    z = torch.zeros(2, 3, dtype=dtype)
    state = solver.init(z)
    res = torch.full((2,), 0.5)  # >= tol: every update after the first one (r < inf) decays the step
    for _ in range(n_decays + 1):
        _, state, _ = solver.update(z, z, res, state)
    return state["eta"]


@pytest.mark.parametrize("gamma", [0.996, 0.997, 0.99, 0.9])
def test_bf16_step_size_is_the_bf16_closed_form_and_differs_from_float32(gamma: float) -> None:
    n = 300
    expected = _bf16_step_sizes(gamma, n)[-1]
    eta = _drive("bfloat16", gamma, n)
    assert eta.dtype == BF16
    assert eta.tolist() == [expected, expected]  # bit for bit
    eta32 = _drive("auto", gamma, n)
    assert eta32.dtype == torch.float32
    assert eta32[0].item() == pytest.approx(gamma**n, rel=1e-5)
    assert eta32[0].item() != expected


def test_the_reference_decays_reach_the_floor_sooner() -> None:
    """0.996 and 0.997 round to the same bf16 factor: 1277 decays to 1e-3, against 1724 / 2300 in float32."""
    assert torch.tensor(0.996, dtype=BF16).item() == torch.tensor(0.997, dtype=BF16).item() == 0.99609375
    assert _decays_to(0.997, 1e-3, lowp=True) == _decays_to(0.996, 1e-3, lowp=True) == 1277
    assert _decays_to(0.997, 1e-3, lowp=False) == math.ceil(math.log(1e-3) / math.log(0.997)) == 2300
    assert _decays_to(0.996, 1e-3, lowp=False) == 1724
    # the solver itself: below min_step (stalled) after exactly 1277 decays
    assert _drive("bfloat16", 0.997, 1276)[0].item() >= 1e-3 > _drive("bfloat16", 0.997, 1277)[0].item()


def test_engine_keeps_iterate_and_context_in_bf16_with_the_reference_update() -> None:
    """z, the injected x and every step's output are bf16; the update is f(z) eta + z (1 - eta) in bf16."""
    g = torch.Generator().manual_seed(0)
    z0, x = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    scale = torch.full((8,), -0.75)  # a float32 parameter: the step's output promotes to float32
    seen = []

    def step(z: torch.Tensor, xx: torch.Tensor) -> torch.Tensor:
        seen.append((z.dtype, xx.dtype))
        return scale * z + xx

    cfg = LoopConfig(solver="damped", plugins={"damped": {"gamma": 0.997, "patience": 1}}, tol=1e-6, halting="residual",
                     residual_norm="rel_sup", max_steps=4, state_dtype="bfloat16")  # fmt: skip
    out = run_loop(step, z0, cfg, ctx=(x,))
    assert set(seen) == {(BF16, BF16)} and out.state.dtype == BF16
    # independently: the reference's FixedPointOptimizer.step on bf16 tensors
    zb, xb, e = z0.to(BF16), x.to(BF16), torch.ones(2, 1, 1, dtype=BF16)  # the step size per sample
    best = torch.full((2,), float("inf"), dtype=BF16)
    patience, residuals = torch.ones(2), []
    for _ in range(4):
        fz = (scale * zb + xb).to(BF16)
        r = ((zb - fz).abs().amax(-1) / (fz.abs().amax(-1) + 1e-8)).amax(1)
        residuals.append(r)
        zb = fz * e + zb * (1 - e)
        improved = r < best
        best = torch.where(improved, r, best)
        patience = torch.where(improved, 1.0, patience - 1)
        adapt = (patience <= 0) & (r >= 1e-6)
        patience = torch.where(adapt, 1.0, patience)
        e = e * torch.where(adapt, 0.997, 1).to(BF16).view(-1, 1, 1)
    assert torch.equal(out.residuals, torch.stack(residuals).float())
    assert torch.equal(out.state, zb)
    assert torch.equal(out.stats["eta"], e.view(-1)) and out.stats["eta"].dtype == BF16
    assert (e < 1).any()  # the decay fired


def test_auto_keeps_the_float32_state() -> None:
    z0 = torch.randn(2, 3, 4)
    cfg = LoopConfig(solver="damped", max_steps=3)
    assert run_loop(lambda z: 0.5 * z, z0, cfg).state.dtype == torch.float32
    assert run_loop(lambda z: 0.5 * z, z0.double(), cfg).state.dtype == torch.float64
    with pytest.raises(ValueError, match="state_dtype='half' is not one of"):
        LoopConfig(state_dtype="half")


def test_fprm_trains_and_evaluates_with_a_bf16_state_under_autocast() -> None:
    from loopformer.models.fprm import FPRM, FPRMConfig

    torch.manual_seed(0)
    model = FPRM(FPRMConfig(vocab_size=6, seq_len=16, d_model=32, n_heads=2, grid=(4, 4), conv="grid2d",
                            puzzle_emb_len=2, num_puzzle_ids=1, puzzle_emb_dim=32))  # fmt: skip
    inputs = torch.randint(0, 6, (3, 16))
    train = LoopConfig(solver="damped", halting="fixed", max_steps=3, grad="truncated", grad_steps=3,
                       residual_norm="rel_sup", tol=0.1, state_dtype="bfloat16")  # fmt: skip
    with torch.autocast("cpu", dtype=BF16):
        out = model(inputs, loop=train)
        assert out.state.dtype == BF16 and torch.isfinite(out.logits.float()).all()
        out.logits.float().logsumexp(-1).mean().backward()
    assert model.residual_logit_a1.grad is not None and torch.isfinite(model.residual_logit_a1.grad).all()
    assert model.embedding.tokens.weight.grad is not None
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        default = model(inputs, loop=LoopConfig(solver="damped", halting="residual", max_steps=3))
    assert default.state.dtype == torch.float32


def test_a_bf16_state_needs_bf16_autocast(tmp_path) -> None:
    with pytest.raises(ConfigError, match="loop_eval.state_dtype=bfloat16 .* set bf16: true"):
        build_config({"out_dir": str(tmp_path), "bf16": False, "loop_eval": {"state_dtype": "bfloat16"}})
    cfg = build_config({"out_dir": str(tmp_path), "bf16": True, "loop_eval": {"state_dtype": "bfloat16"}})
    assert cfg.loop_config(cfg.model_config().loop, "eval").state_dtype == "bfloat16"
