"""FPRM against the authors' code (nilskiKonjIzDunava/fprm), through fixtures of their model's outputs.

The fixtures (``tests/fixtures/parity/fprm_*``, written by ``tools/parity/fprm.py`` from a checkout of
the authors' repository) hold a tiny reference model's weights, a batch, and what the reference
computed: one deep-supervision training segment (iterates, residuals, logits, Q logits, loss,
gradients), one AdamW step, the next segment, and the full inference procedure. Each test loads the
weights into loopformer's FPRM through the ``loopformer convert fprm`` key mapping and compares.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import Tensor

from loopformer.config import build_config
from loopformer.convert import converter
from loopformer.convert.fixtures import fixture_dtype, load_fixture, prefixed
from loopformer.models.registry import build_model
from loopformer.runs.checkpoint import CheckpointError
from loopformer.train.losses import accuracy, q_halt_loss, sequence_loss
from loopformer.train.optim import build_optimizer

FIXTURES = ("fprm_sudoku", "fprm_maze")
CASTED_LINEARS = ("lm_head", "q_head", "qkv_proj", "o_proj", "gate_up_proj", "down_proj")
PREFIX = "_orig_mod.model.inner."  # a compiled ACTLossHead's keys, as pretrain.py saves them


def reference_state(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """The fixture's weights as a checkpoint holds them: prefixed, with the all-ones weight-dropout masks
    (left out of the fixture files to keep them small)."""
    state = {PREFIX + k: v for k, v in weights.items()}
    for k, v in weights.items():
        if k.endswith(".weight") and k.split(".")[-2] in CASTED_LINEARS:
            state[PREFIX + k[: -len("weight")] + "mask"] = torch.ones_like(v)
    return state


def converted_weights(weights: dict[str, Tensor], meta: dict[str, Any]) -> dict[str, Tensor]:
    return converter("fprm")(reference_state(weights), meta["reference_config"]).weights


class Case:
    """One fixture: the converted loopformer model (float64) and the reference's tensors."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.t, self.meta = load_fixture(name)
        self.dtype = fixture_dtype(self.meta)
        self.weights = prefixed(self.t, "weights")
        converted = converter("fprm")(reference_state(self.weights), self.meta["reference_config"])
        self.run = build_config(converted.run)
        self.model = build_model(self.run.model.name, config=self.run.model_config()).to(self.dtype)
        self.model.load_state_dict(converted.weights, strict=True)
        b = prefixed(self.t, "batch")
        self.inputs, self.labels, self.ids = b["inputs"], b["labels"], b["puzzle_identifiers"]

    def loop(self, phase: str, **changes: Any):
        return dataclasses.replace(self.run.loop_config(self.model.config.loop, phase), **changes)

    def forward(self, phase: str, y0: Tensor, **changes: Any):
        iterates: list[Tensor] = []
        out = self.model(
            self.inputs,
            loop=self.loop(phase, **changes),
            state=y0,
            puzzle_ids=self.ids,
            callback=lambda t, z, idx: iterates.append(z.detach().clone()),
        )
        return out, iterates

    def loss(self, out) -> Tensor:
        """The trainer's deep-supervision loss: stablemax CE (per-sample mean) + 0.5 Q-halt BCE."""
        exact = accuracy(out.logits, self.labels).exact
        return sequence_loss(out.logits, self.labels, "stablemax") + 0.5 * q_halt_loss(out.q_logits, exact)


@pytest.fixture(scope="module", params=FIXTURES)
def case(request) -> Case:
    return Case(request.param)


def rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def test_parity_fprm_training_segment_iterates_logits_loss(case: Case) -> None:
    t = case.t
    out, iterates = case.forward("train", t["train.y0"])
    torch.testing.assert_close(torch.stack(iterates), t["train.y"], rtol=0, atol=1e-6)
    torch.testing.assert_close(out.loop.residuals, t["train.residues"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.logits, t["train.logits"], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.q_logits, t["train.q_logits"], rtol=0, atol=1e-5)
    loss = case.loss(out)
    assert abs(float(loss.detach()) - float(t["train.loss"])) <= 1e-6 * abs(float(t["train.loss"]))


def test_parity_fprm_gradients_and_one_adamw_step(case: Case) -> None:
    t, meta = case.t, case.meta
    model = case.model
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out, _ = case.forward("train", t["train.y0"])
    model.zero_grad(set_to_none=True)
    case.loss(out).backward()

    # the reference's puzzle gradient is per batch row; its rows are distinct puzzles: scatter into the table
    ref_grads = prefixed(t, "train.grad")
    table = torch.zeros_like(case.weights["puzzle_emb.weights"])
    table[case.ids] = ref_grads.pop("puzzle_emb.weights")
    expected = converted_weights({**ref_grads, "puzzle_emb.weights": table}, meta)
    norms = prefixed(t, "train.grad_norm")
    grads = dict(model.named_parameters())
    assert set(expected) == set(grads)
    for name, g_ref in expected.items():
        g = grads[name].grad
        assert g is not None, name
        assert rel(g, g_ref) <= 1e-5, (name, rel(g, g_ref))
    assert abs(
        float(grads["output.head.weight"].grad.norm()) - float(norms["lm_head.weight"])
    ) <= 1e-5 * float(norms["lm_head.weight"])

    opt = meta["optimizer"]
    optimizer = build_optimizer(
        model,
        lr=opt["lr"],
        weight_decay=opt["weight_decay"],
        betas=tuple(opt["betas"]),
        puzzle_emb=(opt["puzzle_emb_lr"], opt["puzzle_emb_weight_decay"]),  # the puzzle table: sign-SGD
    )
    optimizer.step()
    after = converted_weights(prefixed(t, "step"), meta)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), after[name], rtol=0, atol=1e-6, msg=name)
    table = model.embedding.puzzle_emb.weight.detach()
    assert not torch.allclose(table, converted_weights(case.weights, meta)["embedding.puzzle_emb.weight"])
    model.load_state_dict(start)  # the module-scoped case is shared by the other tests


def test_parity_fprm_full_inference_procedure(case: Case) -> None:
    """The authors halt the whole batch at the first step where its largest residual is below
    fp_thresh (``batch_residual`` halting, the converted ``loop_eval``); per-sample ``residual``
    halting would stop the early samples sooner and return other logits."""
    t = case.t
    n = int(t["eval.steps"])
    assert case.loop("eval").halting == "batch_residual" and case.loop("eval").max_steps > n
    out, iterates = case.forward("eval", t["eval.y0"])
    assert out.loop.steps.tolist() == [n] * len(case.inputs) and bool(out.loop.converged.all())
    torch.testing.assert_close(out.loop.residuals, t["eval.residues"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(iterates[-1], t["eval.y_final"], rtol=0, atol=1e-6)
    torch.testing.assert_close(out.logits, t["eval.logits"], rtol=0, atol=1e-5)
    per_sample, _ = case.forward("eval", t["eval.y0"], halting="residual")
    assert per_sample.loop.steps.min() < n  # the fixture really distinguishes the two rules


def test_parity_fprm_second_segment_resumes_the_solver_state(case: Case) -> None:
    """Segment 2 from the updated weights: the reference carries each running sample's iterate and
    its damped-solver state (step size, patience, best residual) from segment 1; halted samples
    (none after segment 1 in these fixtures) would restart."""
    t, meta = case.t, case.meta
    first, _ = case.forward("train", t["train.y0"])
    stats = first.loop.stats
    assert not bool(t["train.halted"].any())
    torch.testing.assert_close(stats["eta"], t["train.stepsize"][-1].reshape(-1), rtol=0, atol=1e-12)
    torch.testing.assert_close(stats["best"], t["train.best_residues"][-1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(stats["patience"].double(), t["train.patience"][-1], rtol=0, atol=0)
    start = {k: v.detach().clone() for k, v in case.model.state_dict().items()}
    case.model.load_state_dict(converted_weights(prefixed(t, "step"), meta))
    try:
        carried = {k: stats[k] for k in ("eta", "best", "patience")}
        iterates: list[Tensor] = []
        out = case.model(
            case.inputs,
            loop=case.loop("train"),
            state=t["seg2.y0"],
            puzzle_ids=case.ids,
            solver_state=carried,
            callback=lambda s, z, idx: iterates.append(z.detach().clone()),
        )
        torch.testing.assert_close(out.loop.residuals, t["seg2.residues"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(torch.stack(iterates), t["seg2.y"], rtol=0, atol=1e-6)
        torch.testing.assert_close(
            out.loop.stats["eta"], t["seg2.stepsize"][-1].reshape(-1), rtol=0, atol=1e-12
        )
        torch.testing.assert_close(out.logits, t["seg2.logits"], rtol=0, atol=1e-5)
        # segment 2 of 3: the reference halts a sample only on convergence (residual < fp_thresh);
        # what the trainer's halt_on_converged reads (fprm_maze: the third sample)
        assert out.loop.converged.tolist() == t["seg2.halted"].tolist()
        loss = float(case.loss(out).detach())
        assert abs(loss - float(t["seg2.loss"])) <= 1e-6 * abs(float(t["seg2.loss"]))
        fresh = case.model(case.inputs, loop=case.loop("train"), state=t["seg2.y0"], puzzle_ids=case.ids)
        if case.name == "fprm_sudoku":  # a sample's segment-2 residual exceeds its segment-1 best there:
            assert not torch.allclose(fresh.logits, t["seg2.logits"], atol=1e-5)  # a reset solver differs
    finally:
        case.model.load_state_dict(start)


def test_parity_fprm_converter_names_bad_checkpoints() -> None:
    t, meta = load_fixture("fprm_maze")
    state = reference_state(prefixed(t, "weights"))
    convert = converter("fprm")
    with pytest.raises(CheckpointError, match="unknown keys.*extra"):
        convert({**state, PREFIX + "extra.weight": torch.zeros(1)}, meta["reference_config"])
    missing = {k: v for k, v in state.items() if not k.endswith("lm_head.weight")}
    with pytest.raises(CheckpointError, match="missing key 'lm_head.weight'"):
        convert(missing, meta["reference_config"])
    masked = dict(state)
    masked[PREFIX + "lm_head.mask"] = torch.zeros_like(masked[PREFIX + "lm_head.mask"])
    with pytest.raises(CheckpointError, match="mask 'lm_head.mask'"):
        convert(masked, meta["reference_config"])
    with pytest.raises(CheckpointError, match="mlp_t"):
        convert(state, {**meta["reference_config"], "mlp_t": True})


def test_parity_fprm_convert_cli_writes_a_run_folder_eval_accepts(tmp_path) -> None:
    """``loopformer convert fprm`` on a checkpoint as ``pretrain.py`` saves it (+ its arch config), then
    ``loopformer eval`` on the run folder; the folder's weights are the converted fixture weights."""
    import yaml
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from loopformer.cli import cli

    t, meta = load_fixture("fprm_sudoku")  # 4x4 grid, vocab 6: the shape of a 4x4 Sudoku task
    weights = prefixed(t, "weights")
    torch.save(reference_state(weights), tmp_path / "step_1")
    (tmp_path / "all_config.yaml").write_text(yaml.safe_dump({"arch": meta["reference_config"]}))
    out = tmp_path / "run"
    args = [
        "convert",
        "fprm",
        str(tmp_path / "step_1"),
        "--config",
        str(tmp_path / "all_config.yaml"),
        "--out",
        str(out),
        "--set",
        "data.task=sudoku",
        "--set",
        "data.options={size: 4}",
        "--set",
        "data.eval_size=8",
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    saved = load_file(str(out / "checkpoints" / "step_00000000" / "model.safetensors"))
    expected = converted_weights(weights, meta)
    assert set(saved) == set(expected)
    for k, v in expected.items():
        torch.testing.assert_close(saved[k].double(), v.double(), rtol=1e-6, atol=1e-7, msg=k)
    result = CliRunner().invoke(cli, ["eval", str(out)])
    assert result.exit_code == 0, result.output
    assert "fprm" in result.output
