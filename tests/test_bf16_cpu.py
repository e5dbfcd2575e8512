"""bf16 autocast on the CPU (``bf16: true``): every solver x halting rule x gradient mode runs a real model
forward + backward under ``torch.autocast("cpu", bfloat16)`` without dtype errors, with finite losses and
gradients and the loop state kept in float32; and the residual tolerance each solver reaches in bf16 on a
contractive map, beside float32 (the bf16 floor is set by bf16's 8-bit mantissa, 2**-8 ~ 3.9e-3)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from loopformer.loop import GRADS, HALTINGS, SOLVERS, LoopConfig, run_loop
from loopformer.models import build_model
from loopformer.nn import autocast

COMBOS = [
    (s, h, g)
    for s, h, g in itertools.product(SOLVERS, HALTINGS, GRADS)
    if h != "act" or (s == "picard" and g == "bptt")  # ACT (Graves) is defined for Picard + BPTT only
]


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    fprm = build_model("fprm", vocab_size=6, seq_len=16, d_model=32, n_heads=2, conv="grid2d", grid=(4, 4))
    act = build_model("ut_act", vocab_size=6, seq_len=16, d_model=32, n_heads=2)
    return {"fprm": fprm, "ut_act": act}


def test_autocast_switch() -> None:
    assert torch.is_autocast_enabled("cpu") is False
    with autocast("cpu", True):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with autocast("cpu", "auto"):  # auto: CUDA only, the CPU stays float32
        assert not torch.is_autocast_enabled("cpu")
    with autocast("cpu", False):
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("solver,halting,grad", COMBOS, ids=["-".join(c) for c in COMBOS])
def test_every_combination_under_cpu_bf16(models, solver, halting, grad) -> None:
    model = models["ut_act" if halting == "act" else "fprm"]
    cfg = LoopConfig(solver=solver, halting=halting, grad=grad, max_steps=6, tol=1e-2, grad_steps=2,
                     plugins={"kl_entropy": {"kl_threshold": 1e-2, "entropy_threshold": 5.0}, "ift": {"max_steps": 20, "tol": 1e-3}})  # fmt: skip
    g = torch.Generator().manual_seed(1)
    inputs = torch.randint(1, 6, (4, 16), generator=g)
    targets = torch.randint(2, 6, (4, 16), generator=g)
    model.zero_grad(set_to_none=True)
    with autocast("cpu", True):
        out = model(inputs, loop=cfg, generator=torch.Generator().manual_seed(2))
        loss = F.cross_entropy(out.logits.float().reshape(-1, 6), targets.reshape(-1))
        if out.aux_loss is not None:
            loss = loss + out.aux_loss.float()
    assert out.logits.dtype == torch.bfloat16  # the head ran in bf16: autocast was really on
    assert out.state.dtype == torch.float32, "the loop state must stay float32 (residual stream precision)"
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(gr.dtype == torch.float32 and torch.isfinite(gr).all() for gr in grads)
    assert (out.loop.steps >= 1).all() and (out.loop.steps <= 6).all()


TOLS = (1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 1e-5, 1e-6)


def smallest_tolerance(solver: str, bf16: bool) -> float:
    """The smallest tol in TOLS at which every sample converges (rel_l2 residual) on a contractive map
    z <- 0.5 tanh(W z) + x, W a linear layer (bf16 under autocast), x and z in float32."""
    torch.manual_seed(3)
    layer = torch.nn.Linear(64, 64)
    with torch.no_grad():
        layer.weight.mul_(0.9 / torch.linalg.matrix_norm(layer.weight, 2))
    x = torch.randn(8, 16, 64)

    def step(z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * torch.tanh(layer(z)) + x

    best = float("nan")
    for tol in TOLS:
        cfg = LoopConfig(solver=solver, halting="residual", tol=tol, max_steps=400)
        with torch.no_grad(), autocast("cpu", bf16):
            res = run_loop(step, torch.zeros_like(x), cfg, ctx=(x,))
        assert res.state.dtype == torch.float32
        if not bool(res.converged.all()):
            break
        best = tol
    return best


def test_residual_tolerance_reached_in_bf16(capsys) -> None:
    # the engine's own solvers (a plug-in reproducing another codebase, e.g. the Attractor puzzle model's
    # anderson_trmdeq, keeps that code's numerics: it reaches 1e-6 in float32 but only 0.1 in bf16 here)
    own = [s for s in SOLVERS if SOLVERS.get(s).__module__.startswith("loopformer.loop")]
    reached = {s: (smallest_tolerance(s, False), smallest_tolerance(s, True)) for s in own}
    with capsys.disabled():
        print("\nsmallest residual tolerance reached (float32, bf16 autocast on CPU):")
        for s, (f32, b16) in reached.items():
            print(f"  {s:9s} float32 {f32:g}  bf16 {b16:g}")
    for s, (f32, b16) in reached.items():
        assert f32 <= 1e-5, f"{s}: float32 should reach 1e-5, reached {f32}"
        assert b16 <= 1e-2, f"{s}: bf16 should reach 1e-2 (its precision floor is ~4e-3), reached {b16}"
        assert b16 >= f32  # bf16 never beats float32
