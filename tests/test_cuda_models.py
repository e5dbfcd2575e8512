"""CUDA suite, models (``pytest -m cuda``; skipped without CUDA): every registered model family x
solver x halting rule x gradient mode, forward and backward on CUDA in float32, under bf16 autocast
and with the looped body ``torch.compile``d, against the same model in float32 on the CPU.

The cases come from the registries (``loopformer.models.MODELS``, ``loopformer.loop.solvers.SOLVERS``,
``loopformer.loop.halting.HALTINGS``, the families' gradient modes in tests/test_models_common.py),
so a new plug-in is covered as soon as it is registered; a combination that ``LoopConfig`` rejects
(e.g. ACT halting with a non-Picard solver) is left out at collection. Solvers and halting rules
are crossed on the fixed-point families (FPRM, Attractor); the others run their own loop.

The first case of each family with its own loop carries the id prefix ``smoke-``: tools/gpu_check.sh runs those
(``-k smoke``) in its default check and the whole grid with ``--full``.

Tolerances (the CPU float32 run is the oracle): CUDA float32 (TF32 off) logits and final state to
atol 1e-4 / rtol 1e-3, gradients rtol 1e-3 in norm; bf16 autocast logits within 5e-2 relative
(Frobenius) of the float32 ones and finite gradients; compiled within 1e-4 of eager CUDA float32.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_models_common import GRAD_MODES, batch, loss_of, model_and_loop

from loopformer.loop.halting import HALTINGS
from loopformer.loop.solvers import SOLVERS
from loopformer.models import MODELS, make_config

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
FIXED_POINT = ("fprm", "attractor")


def _valid(name: str, **changes: str) -> bool:
    try:
        dataclasses.replace(make_config(name).loop, **changes)
    except (ValueError, TypeError, KeyError):
        return False
    return True


def _cases() -> list:
    cases = []
    for name in MODELS:
        default = make_config(name).loop
        for grad in GRAD_MODES.get(name, ("bptt", default.grad)):
            combos = [(default.solver, default.halting)]
            if name in FIXED_POINT:
                combos = [(s, h) for s in SOLVERS.names() for h in HALTINGS.names()]
            for solver, halting in combos:
                if _valid(name, solver=solver, halting=halting, grad=grad):
                    # the family's own loop is its smoke case (tools/gpu_check.sh runs -k smoke by default)
                    own = (solver, halting, grad) == (default.solver, default.halting, default.grad)
                    prefix = (
                        "smoke-" if own and not any(name in c.id for c in cases if "smoke" in c.id) else ""
                    )
                    cases.append(
                        pytest.param(
                            name, solver, halting, grad, id=f"{prefix}{name}-{solver}-{halting}-{grad}"
                        )
                    )
    return cases


def _run(model: torch.nn.Module, loop, x: torch.Tensor, y: torch.Tensor) -> tuple:
    model.zero_grad(set_to_none=True)
    out = model(x, loop=loop)
    loss = loss_of(out, y)
    loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().float().cpu(), out.state.detach().float().cpu(), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.fixture(autouse=True)
def _no_tf32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.mark.parametrize(("name", "solver", "halting", "grad"), _cases())
def test_forward_backward_on_cuda_matches_cpu(name: str, solver: str, halting: str, grad: str) -> None:
    model, loop = model_and_loop(name, "puzzle", grad)
    loop = dataclasses.replace(loop, solver=solver, halting=halting)
    x, y = batch("puzzle")
    torch.manual_seed(0)
    cpu = _run(model, loop, x, y)
    model.cuda()
    torch.manual_seed(0)
    gpu = _run(model, loop, x.cuda(), y.cuda())
    torch.testing.assert_close(gpu[0], cpu[0], atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(gpu[1], cpu[1], atol=1e-4, rtol=1e-3)
    assert gpu[2].keys() == cpu[2].keys()
    for k in cpu[2]:
        assert _rel(gpu[2][k], cpu[2][k]) <= 1e-3, k
    with torch.autocast("cuda", dtype=torch.bfloat16):
        bf = _run(model, loop, x.cuda(), y.cuda())
    assert _rel(bf[0], cpu[0]) <= 5e-2
    assert all(torch.isfinite(g).all() for g in bf[2].values())
    model.step = torch.compile(model.step)  # as the trainer compiles it (train.compile)
    compiled = _run(model, loop, x.cuda(), y.cuda())
    torch.testing.assert_close(compiled[0], gpu[0], atol=1e-4, rtol=1e-3)
