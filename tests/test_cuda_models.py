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

Both devices start from the same initial iterate, drawn on the CPU (FPRM's is random: after one
``manual_seed`` the CUDA and CPU generators draw different numbers), and TRM-DEQ's Jacobian term reads one
fixed probe instead of the device's random one.

Tolerances (the CPU float32 run is the oracle): CUDA float32 (TF32 off) logits and final state to
atol 1e-4 / rtol 1e-3, gradients rtol 1e-3 in norm; bf16 autocast logits within 5e-2 relative
(Frobenius) of the float32 ones and finite gradients; compiled within 1e-4 of eager CUDA float32. A value
that misses its tolerance still passes when it is no further from the same model's float64 CPU run than
twice the CPU float32 run is: a model whose float32 computation is itself that far from exact (TRM-DEQ's
reference Anderson adds 1e-4 to a raw Gram matrix whose zero slots make it near-singular: its float32 logits
are 2.8e-2 from float64 on the CPU, while with the engine's Anderson or Picard they are within 1.3e-5)
cannot agree across devices to better than its own error. ``test_cuda_suite_dry.py`` runs the same
comparison CPU against CPU in the default test run, so the suite's code is exercised without a GPU.
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


def _run(model: torch.nn.Module, loop, x: torch.Tensor, y: torch.Tensor, z0: torch.Tensor) -> tuple:
    model.zero_grad(set_to_none=True)
    out = model(x, loop=loop, state=z0)
    loss = loss_of(out, y)
    loss.backward()
    grads = {n: p.grad.detach().double().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().double().cpu(), out.state.detach().double().cpu(), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _as_exact_as_the_cpu(got: torch.Tensor, cpu: torch.Tensor, exact: torch.Tensor, distance) -> bool:
    """``got`` is no further from the float64 run than twice the CPU float32 run is."""
    return distance(got, exact) <= 2 * distance(cpu, exact)


def _with_probe(model: torch.nn.Module, z0: torch.Tensor, device: str, dtype: torch.dtype) -> None:
    """TRM-DEQ's Jacobian term (``AttractorPuzzle.jacobian_probe``): one fixed probe of the latent's shape."""
    if hasattr(model, "jacobian_probe"):
        probe = torch.randn(z0[:, 1].shape, generator=torch.Generator().manual_seed(1))
        model.jacobian_probe = probe.to(device=device, dtype=dtype)


def compare_devices(name: str, solver: str, halting: str, grad: str, device: str) -> dict[str, float]:
    """The case on ``device`` against the CPU in float32, and both against float64 on the CPU (see the
    module docstring); bf16 autocast and ``torch.compile`` only when ``device`` is ``cuda``. Returns how
    far the CPU float32 run is from the float64 one (logits: max abs; gradients: the largest relative)."""
    torch.manual_seed(0)
    model, loop = model_and_loop(name, "puzzle", grad)
    loop = dataclasses.replace(loop, solver=solver, halting=halting)
    x, y = batch("puzzle")
    with torch.no_grad():  # one initial iterate for every run, drawn on the CPU
        z0 = model.init_state(model.embed(x), torch.Generator().manual_seed(0))
    exact_model, _ = model_and_loop(name, "puzzle", grad)
    exact_model.load_state_dict(model.state_dict())
    exact_model.double()
    _with_probe(exact_model, z0, "cpu", torch.float64)
    exact = _run(exact_model, loop, x, y, z0.double())
    _with_probe(model, z0, "cpu", torch.float32)
    cpu = _run(model, loop, x, y, z0)
    model.to(device)
    _with_probe(model, z0, device, torch.float32)
    xd, yd, zd = x.to(device), y.to(device), z0.to(device)
    got = _run(model, loop, xd, yd, zd)
    for i, what in ((0, "logits"), (1, "state")):
        if not torch.allclose(got[i], cpu[i], atol=1e-4, rtol=1e-3):
            assert _as_exact_as_the_cpu(got[i], cpu[i], exact[i], _max_abs), (
                f"{what}: {device} - cpu max {_max_abs(got[i], cpu[i]):.2e}; from float64: {device} "
                f"{_max_abs(got[i], exact[i]):.2e}, cpu {_max_abs(cpu[i], exact[i]):.2e}"
            )
    assert got[2].keys() == cpu[2].keys()
    for k in cpu[2]:
        if _rel(got[2][k], cpu[2][k]) > 1e-3:
            assert _as_exact_as_the_cpu(got[2][k], cpu[2][k], exact[2][k], _rel), (
                f"grad {k}: {device} vs cpu {_rel(got[2][k], cpu[2][k]):.2e}; from float64: {device} "
                f"{_rel(got[2][k], exact[2][k]):.2e}, cpu {_rel(cpu[2][k], exact[2][k]):.2e}"
            )
    cpu_error = {
        "logits": _max_abs(cpu[0], exact[0]),
        "grads": max((_rel(cpu[2][k], exact[2][k]) for k in cpu[2]), default=0.0),
    }
    if device != "cuda":
        return cpu_error
    with torch.autocast("cuda", dtype=torch.bfloat16):
        bf = _run(model, loop, xd, yd, zd)
    assert _rel(bf[0], cpu[0]) <= 5e-2 or _as_exact_as_the_cpu(bf[0], cpu[0], exact[0], _rel)
    assert all(torch.isfinite(g).all() for g in bf[2].values())
    model.step = torch.compile(model.step)  # as the trainer compiles it (train.compile)
    compiled = _run(model, loop, xd, yd, zd)
    if not torch.allclose(compiled[0], got[0], atol=1e-4, rtol=1e-3):
        assert _as_exact_as_the_cpu(compiled[0], cpu[0], exact[0], _max_abs)
    return cpu_error


@pytest.fixture(autouse=True)
def _no_tf32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.mark.parametrize(("name", "solver", "halting", "grad"), _cases())
def test_forward_backward_on_cuda_matches_cpu(name: str, solver: str, halting: str, grad: str) -> None:
    compare_devices(name, solver, halting, grad, "cuda")
