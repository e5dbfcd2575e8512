"""A gradient mode defined outside the package: one class, registered, used by run_loop and training.

The worked example of docs/extending.md (gradient mode): an exact
implicit gradient for small states, which builds each sample's Jacobian J^T with one
vector-Jacobian product per state coordinate and solves (I - J^T) u = v densely instead of
iterating. On a float64 linear map it must equal the closed form (I - W)^-T c to round-off.
"""

from __future__ import annotations

import pytest
import torch
from extending_common import linear_problem, train_tiny_fprm

from loopformer.loop import GRADS, ImplicitGradMode, LoopConfig, run_loop


class DenseIFT(ImplicitGradMode):
    """u = (I - J^T)^-1 v by a dense per-sample solve (the state must be small)."""

    name = "dense_ift"
    calls = 0

    def adjoint(self, v, vjp):
        type(self).calls += 1
        b, d = v.shape[0], v[0].numel()
        eye = torch.eye(d, dtype=v.dtype, device=v.device)
        cols = [vjp(eye[i].expand(b, d).reshape(v.shape)).reshape(b, d) for i in range(d)]
        jt = torch.stack(cols, dim=2)  # [B, d, d]: column i is J^T e_i
        u = torch.linalg.solve(eye - jt, v.reshape(b, d, 1))
        return u.reshape(v.shape)


@pytest.fixture(autouse=True)
def registered():
    GRADS.register(DenseIFT)
    yield
    GRADS.unregister("dense_ift")


def test_the_new_mode_gives_the_closed_form_implicit_gradient() -> None:
    w, x, z_star = linear_problem(lo=-0.95, hi=0.95)
    w = w.clone().requires_grad_()
    x = x.clone().requires_grad_()
    c = torch.randn_like(z_star)
    eye = torch.eye(w.shape[0], dtype=w.dtype)
    u_ref = torch.linalg.solve((eye - w.detach()).T, c.T).T
    cfg = LoopConfig(solver="anderson", halting="residual", tol=1e-13, max_steps=500, grad="dense_ift")
    res = run_loop(lambda z, x: z @ w.T + x, torch.zeros_like(z_star), cfg, ctx=(x,))
    gw, gx = torch.autograd.grad((c * res.state).sum(), [w, x])
    torch.testing.assert_close(gx, u_ref, rtol=0, atol=1e-11)
    torch.testing.assert_close(gw, u_ref.T @ z_star, rtol=1e-10, atol=1e-10)  # d<c, z*>/dW = sum_b u z*^T
    assert res.converged.all() and "dense_ift" in GRADS.names()


def test_training_runs_the_new_mode_from_the_config(tmp_path) -> None:
    DenseIFT.calls = 0
    train_tiny_fprm(
        tmp_path,
        "loop_train.grad=dense_ift",
        "loop_train.halting=residual",
        "loop_train.max_steps=4",
        "loop_eval.max_steps=4",
    )
    assert DenseIFT.calls == 2  # one backward per training step
