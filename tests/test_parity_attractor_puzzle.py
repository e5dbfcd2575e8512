"""Attractor puzzle model parity: loopformer's ``attractor_puzzle`` against jacobfa/Attractor's TRM-DEQ
(``experiments/attractor_puzzles/trm/trm_deq.py``; fixtures written by ``tools/parity/attractor.py``, see
docs/fidelity.md). No reference code is needed to run these tests."""

from __future__ import annotations

import pytest
import torch
from parity_recursive import LOGIT_ATOL, LOSS_RTOL, STEP_ATOL, Loaded, check_loss_and_grads

from loopformer.convert.recursive import permute_qkv
from loopformer.loop import run_loop
from loopformer.train.losses import accuracy, q_halt_loss, sequence_loss
from loopformer.train.optim import build_optimizer, set_lr

NAME = "attractor_puzzle"
NAMES = ["attractor_puzzle", "attractor_puzzle_deq6"]  # deq_max_iter 3 and 6 (the reference's rolled history)


def _loaded(name: str = NAME) -> Loaded:
    return Loaded("attractor", name)


@pytest.mark.parametrize("name", NAMES)
def test_parity_attractor_puzzle_eval_logits(name: str) -> None:
    """The reference's evaluation (halt_max_steps segments from the initial carry) == chained forwards."""
    f = _loaded(name)
    model = f.model.eval()
    ref_logits, state = f.tensors["eval.logits"], None
    with torch.no_grad():
        for s in range(ref_logits.shape[0]):
            out = model(f.inputs, state=state, puzzle_ids=f.puzzle_ids)
            state = out.state
            torch.testing.assert_close(out.logits, ref_logits[s], rtol=0, atol=LOGIT_ATOL, check_dtype=False)
            torch.testing.assert_close(out.q_logits, f.tensors["eval.q_halt"][s], rtol=0, atol=LOGIT_ATOL,
                                       check_dtype=False)


@pytest.mark.parametrize("name", NAMES)
def test_parity_attractor_puzzle_solver_iterates(name: str) -> None:
    """The inner Anderson solve from the initial carry: loopformer's iterates == the reference's (the
    reference's solver rounds its iterates to float32)."""
    f = _loaded(name)
    model = f.model.eval()
    with torch.no_grad():
        x = model.embedding(f.inputs, f.puzzle_ids)
        B, L, d = x.shape
        inj = model.y_init.expand(B, L, d) + x
        seen = [model.z_init.expand(B, L, d).clone()]
        run_loop(
            model.net,
            seen[0],
            model.solve_loop,
            ctx=(inj,),
            callback=lambda t, z, idx: seen.append(z.clone()),
        )
    ref = f.tensors["solver.iterates"]
    assert len(seen) == ref.shape[0] - 1  # the reference also evaluates f at its last iterate
    for t, z in enumerate(seen):
        torch.testing.assert_close(z, ref[t].double(), rtol=0, atol=1e-5, msg=f"iterate {t}")
    torch.testing.assert_close(seen[-1], ref[-1].double(), rtol=0, atol=1e-5)  # the returned solution


@pytest.mark.parametrize("name", NAMES)
def test_parity_attractor_puzzle_train_loss_grads_and_step(name: str) -> None:
    f = _loaded(name)
    model = f.model.train()
    model.jacobian_probe = f.tensors["train.jacobian_probe"]
    out = model(f.inputs, puzzle_ids=f.puzzle_ids)
    task = sequence_loss(out.logits, f.labels, f.config.train.loss)
    q = q_halt_loss(out.q_logits, accuracy(out.logits, f.labels).exact)
    torch.testing.assert_close(
        out.aux_loss.double(), f.tensors["train.jacobian_reg"].reshape(()).double(), rtol=LOSS_RTOL, atol=0
    )
    tc = f.config.train
    loss = task + tc.q_loss_weight * q + tc.ponder_weight * out.aux_loss  # Trainer._loss
    check_loss_and_grads(f, loss, {"lm_loss": task, "q_halt_loss": q})
    opt = f.meta["optimizer"]
    optimizer = build_optimizer(
        model,
        opt["lr"],
        opt["weight_decay"],
        (opt["beta1"], opt["beta2"]),
        kind=tc.optimizer,
        decay_all=tc.decay_all,
        puzzle_emb=(opt["puzzle_emb_lr"], opt["puzzle_emb_weight_decay"]),
    )
    set_lr(optimizer, opt["lr"])
    optimizer.step()
    n_heads = f.config.model_config().n_heads
    for name, p in model.named_parameters():
        ref = f.tensors[f"step.{f.ref_name(name)}"]
        if name.endswith("mix.qkv.weight"):
            ref = permute_qkv(ref, n_heads)
        if name.startswith("q_proj"):
            ref = ref[: p.shape[0]]
        torch.testing.assert_close(p.detach(), ref, rtol=0, atol=STEP_ATOL, msg=name)
    assert LOGIT_ATOL == 1e-5


def test_parity_attractor_convert_then_eval_cli(tmp_path) -> None:
    from click.testing import CliRunner

    from loopformer.cli import cli
    from loopformer.convert.fixtures import FIXTURE_DIR

    out = tmp_path / "run"
    folder = FIXTURE_DIR / NAME
    runner = CliRunner()
    res = runner.invoke(
        cli,
        [
            "convert",
            "attractor",
            str(folder / "step_1"),
            "--config",
            str(folder / "all_config.yaml"),
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli, ["eval", str(out), "--set", "data.eval_size=8"])
    assert res.exit_code == 0, res.output
    assert "held-out evaluation" in res.output
