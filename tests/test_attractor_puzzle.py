"""The Attractor puzzle model (TRM-DEQ): oracle forward / gradient, Jacobian regulariser, registry, training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loopformer.config import load_config
from loopformer.models.attractor_puzzle import AttractorPuzzle, AttractorPuzzleConfig, paper_config
from loopformer.models.registry import build_model

ROOT = Path(__file__).resolve().parent.parent


def _tiny(**kw) -> AttractorPuzzle:
    torch.manual_seed(0)
    fields = dict(
        vocab_size=5,
        seq_len=6,
        d_model=8,
        n_heads=2,
        n_layers=1,
        deq_max_iter=4,
        deq_min_iter=2,
        bptt_through=2,
        jacobian_samples=0,
    )
    fields.update(kw)
    return build_model("attractor_puzzle", **fields).double()  # type: ignore[return-value]


def _oracle_logits(model: AttractorPuzzle, tokens: torch.Tensor) -> torch.Tensor:
    """The reference's procedure written out by hand (trm_deq.py, TRMDEQ_Inner.forward with a Picard
    inner solve of deq_max_iter - 1 iterations): H_cycles - 1 cycles without gradient, then one with;
    in each, the solve without gradient and bptt_through differentiable applications of the net."""
    cfg = model.config
    x = model.embedding(tokens)
    B, L, d = x.shape
    y, z = model.y_init.expand(B, L, d), model.z_init.expand(B, L, d)

    def cycle(y: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            for _ in range(cfg.deq_max_iter - 1):
                z = model.net(z, y + x)
        for _ in range(cfg.bptt_through):
            z = model.net(z, y + x)
        return model.net(y, z), z

    with torch.no_grad():
        for _ in range(cfg.loop.max_steps - 1):
            y, z = cycle(y, z)
    y, z = cycle(y, z)
    return model.lm_head(y)


def test_forward_and_gradients_match_the_written_out_procedure() -> None:
    model = _tiny(deq_solver="picard", deq_halting="fixed")
    tokens = torch.randint(0, 5, (3, 6), generator=torch.Generator().manual_seed(1))
    out = model(tokens)
    ref = _oracle_logits(model, tokens)
    torch.testing.assert_close(out.logits, ref, rtol=1e-12, atol=1e-12)
    g1 = torch.autograd.grad(out.logits.pow(2).sum(), list(model.parameters()), allow_unused=True)
    g2 = torch.autograd.grad(ref.pow(2).sum(), list(model.parameters()), allow_unused=True)
    for a, b in zip(g1, g2):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert out.aux_loss is None  # jacobian_samples=0: no regulariser


def test_anderson_solve_reaches_the_fixed_point_and_stops_per_sample() -> None:
    model = _tiny(deq_solver="anderson", deq_max_iter=30, deq_min_iter=2, deq_tol=1e-8, deq_anderson_reg_relative=True)
    model.eval()
    tokens = torch.randint(0, 5, (3, 6), generator=torch.Generator().manual_seed(2))
    x = model.embedding(tokens)
    B, L, d = x.shape
    latent = model.z_init.expand(B, L, d)
    inj = model.y_init.expand(B, L, d) + x
    with torch.no_grad():
        z = model.solve_latent(latent, inj)
        resid = (model.net(z, inj) - z).flatten(1).norm(dim=1) / z.flatten(1).norm(dim=1)
    assert bool(model.last_inner.converged.all())
    assert float(resid.max()) < 1e-6


def test_jacobian_term_equals_the_explicit_jacobian() -> None:
    model = _tiny(jacobian_samples=1)
    model.train()
    B, L, d = 2, 6, 8
    g = torch.Generator().manual_seed(3)
    z = torch.randn(B, L, d, generator=g, dtype=torch.float64)
    inj = torch.randn(B, L, d, generator=g, dtype=torch.float64)
    v = torch.randn(B, L, d, generator=g, dtype=torch.float64)
    model.jacobian_probe = v
    term = model.jacobian_term(z, inj)
    J = torch.autograd.functional.jacobian(lambda t: model.net(t, inj), z)  # [B, L, d, B, L, d]
    jtv = torch.einsum("abcijk,abc->ijk", J, v)
    torch.testing.assert_close(term.double(), jtv.pow(2).mean(), rtol=1e-5, atol=0)
    grads = torch.autograd.grad(term, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
    assert any(gr is not None and float(gr.abs().sum()) > 0 for gr in grads)  # differentiable in the weights


def test_jacobian_term_has_the_double_backward_value_and_gradient() -> None:
    """The ``torch.func.vjp`` form (traceable by torch.compile) against the reference's form, double backward at
    ``z.detach().requires_grad_()``: the same value and the same gradient in the weights and the injection
    (float64)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = _tiny(jacobian_samples=1)
    model.train()
    g = torch.Generator().manual_seed(5)
    z, inj, v = (torch.randn(2, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    inj.requires_grad_(True)
    model.jacobian_probe = v
    weights = [p for p in model.parameters() if p.requires_grad]
    new = model.jacobian_term(z, inj)
    z_in = z.detach().requires_grad_(True)
    with sdpa_kernel(SDPBackend.MATH):
        (jtv,) = torch.autograd.grad((v * model.net(z_in, inj)).sum(), z_in, create_graph=True)
    old = jtv.pow(2).mean()
    torch.testing.assert_close(new.double(), old, rtol=1e-12, atol=0)
    for a, b in zip(torch.autograd.grad(new, [*weights, inj], allow_unused=True),
                    torch.autograd.grad(old, [*weights, inj], allow_unused=True)):  # fmt: skip
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)


def test_compiled_step_draws_the_probes_the_eager_step_draws() -> None:
    """``training_draws`` from the step's generator gives the probes an eager forward draws from it."""
    model = _tiny(jacobian_samples=2).float()
    model.train()
    tokens = torch.randint(0, 5, (3, 6))
    drawn = model.training_draws(tokens, torch.Generator().manual_seed(7))["probes"]
    seen = []
    term = model.jacobian_term
    model.jacobian_term = lambda z, inj: (seen.append(model._probes), term(z, inj))[1]  # type: ignore[method-assign]
    model(tokens, generator=torch.Generator().manual_seed(7))
    assert drawn.shape == (2, 3, 6, 8) and torch.equal(seen[0], drawn)
    model.eval()
    assert model.training_draws(tokens, None) == {}


def test_aux_loss_only_in_training_mode() -> None:
    model = _tiny(jacobian_samples=1)
    tokens = torch.randint(0, 5, (2, 6))
    model.train()
    assert model(tokens).aux_loss is not None
    model.eval()
    assert model(tokens).aux_loss is None


def test_paper_size_and_registry() -> None:
    from loopformer.commands.models import model_rows

    rows = {r["name"]: r for r in model_rows()}
    assert rows["attractor_puzzle"]["paper"] is not None and 25e6 < rows["attractor_puzzle"]["paper"] < 28e6
    assert isinstance(paper_config(), AttractorPuzzleConfig)


def test_bad_settings_are_errors() -> None:
    with pytest.raises(ValueError, match="deq_max_iter"):
        _tiny(deq_max_iter=1)
    with pytest.raises(ValueError, match="bptt_through"):
        _tiny(bptt_through=0)


def test_trains_through_the_trainer(tmp_path: Path) -> None:
    from loopformer.train import Trainer

    cfg = load_config(
        ROOT / "recipes" / "attractor_puzzle_sudoku4.yaml",
        [
            "model.d_model=16",
            "model.n_heads=2",
            "train.steps=2",
            "train.batch_size=4",
            "train.warmup_steps=1",
            "train.eval_every=0",
            "train.checkpoint_every=0",
            "train.progress=false",
            "train.threads=1",
            "data.train_size=16",
            "data.eval_size=4",
            "train.max_segments=2",
            "eval.segments=2",
            "device=cpu",
            f"out_dir={tmp_path / 'run'}",
        ],
    )
    summary = Trainer(cfg).fit()
    assert summary["steps"] == 2
    assert summary["train"]["ponder"] > 0  # the Jacobian regulariser reached the loss
