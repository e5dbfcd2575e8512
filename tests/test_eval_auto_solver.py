"""``--auto-solver``: the search picks the fewest map evaluations among the settings that reach the
trained solver's accuracy, checked against an independent brute force over the same candidates on a
hand-built contractive model (float64) whose answer is right only once the loop has converged far
enough; and ``loopformer eval RUN --auto-solver`` on a tiny trained run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import Tensor, nn

from loopformer.eval.auto_solver import (
    TIME_TIE,
    candidate_configs,
    choose,
    count_map_rows,
    search,
    split_rows,
)
from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel, ModelConfig
from loopformer.tasks.base import Task, TokenDataset

V, T = 6, 4


class ShiftTask(Task):
    """Answer: every token + 1 (mod V); the validator recomputes it from the inputs."""

    name = "shift"
    vocab_size = V
    seq_len = T

    def generate(self, n: int, seed: int, **difficulty: object) -> TokenDataset:
        rng = np.random.default_rng(seed)
        x = rng.integers(0, V, size=(n, T))
        return TokenDataset(x, (x + 1) % V, rng.random(n))

    def check(self, inputs: np.ndarray, prediction: np.ndarray) -> bool:
        return bool(np.all(np.asarray(prediction) == (np.asarray(inputs) + 1) % V))


class Contractive(LoopedModel):
    """z <- (z - z*) A^T + z*, A with spectral radius 0.9: the fixed point z* is the one-hot answer, the
    start a scaled one-hot of the input (a wrong answer), so the prediction is right only after the
    iterate has moved most of the way."""

    def __init__(self, loop: LoopConfig) -> None:
        super().__init__(ModelConfig(vocab_size=V, d_model=V, loop=loop))
        g = torch.Generator().manual_seed(5)
        q, _ = torch.linalg.qr(torch.randn(V, V, generator=g, dtype=torch.float64))
        eigs = torch.linspace(-0.5, 0.9, V, dtype=torch.float64)
        self.register_buffer("a", q @ torch.diag(eigs) @ q.T)
        self.dummy = nn.Parameter(torch.zeros((), dtype=torch.float64))

    def embed(self, inputs: Tensor, puzzle_ids: Tensor | None = None) -> tuple[Tensor, ...]:
        answer = nn.functional.one_hot((inputs + 1) % V, V).double()
        scale = 1.0 + (inputs.sum(1, keepdim=True) % 5).double()[..., None]  # per-sample difficulty
        return answer, scale * nn.functional.one_hot(inputs, V).double()

    def init_state(self, ctx: tuple[Tensor, ...], generator: torch.Generator | None = None) -> Tensor:
        return ctx[1].clone()

    def step(self, z: Tensor, *ctx: Tensor) -> Tensor:
        return (z - ctx[0]) @ self.a.T + ctx[0]

    def readout(self, z: Tensor, *ctx: Tensor) -> Tensor:
        return z


def _brute_force(
    model: Contractive, task: ShiftTask, rows: TokenDataset, cfg: LoopConfig
) -> tuple[float, float]:
    """(valid accuracy, map evaluations per sample) of ``cfg`` on ``rows``, computed directly."""
    calls = [0]
    original = Contractive.step

    def counting(self: Contractive, z: Tensor, *ctx: Tensor) -> Tensor:
        calls[0] += z.shape[0]
        return original(self, z, *ctx)

    Contractive.step = counting  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            out = model(torch.as_tensor(rows.inputs), loop=cfg)
    finally:
        Contractive.step = original  # type: ignore[method-assign]
    pred = out.logits.argmax(-1).numpy()
    valid = np.mean([task.check(rows.inputs[i], pred[i]) for i in range(len(rows))])
    return float(valid), calls[0] / len(rows)


def test_search_matches_an_independent_brute_force() -> None:
    task = ShiftTask()
    data = task.generate(60, seed=1)
    base = LoopConfig(solver="picard", halting="residual", tol=0.02, max_steps=200)
    model = Contractive(base)
    # a looser tolerance (4x) among the candidates, so that some setting loses accuracy and the constraint binds
    # (at 1x and below every solver now reaches the reference here)
    factors = (4.0, 1.0, 0.5, 0.25)
    result, chosen_cfg, report = search(
        model, task, data, base, fraction=0.5, seed=3, tol_factors=factors, batch_size=16
    )
    search_rows, report_rows = split_rows(len(data), 0.5, 3)
    assert len(report) == len(report_rows) == result.report_rows and result.search_rows == len(search_rows)
    assert not set(search_rows) & set(report_rows)
    part = data.subset(search_rows)
    brute = {}
    for trial, cfg in candidate_configs(base, factors):
        assert cfg is not None, trial.error
        brute[(trial.solver, trial.tol)] = _brute_force(model, task, part, cfg)
    ref_acc = brute[("picard", 0.02)][0]
    assert result.reference.accuracy == pytest.approx(ref_acc)
    meeting = {k: ev for k, (acc, ev) in brute.items() if acc >= ref_acc}
    assert len(meeting) < len(brute)  # some loose tolerance loses accuracy: the constraint binds
    assert result.chosen.accuracy >= ref_acc
    assert (result.chosen.solver, result.chosen.tol) in meeting
    # chosen by measured time (each qualifying setting timed again); within 5% of the fastest, fewest map evals
    timed = [t for t in result.trials if t.qualifies]
    assert {(t.solver, t.tol) for t in timed} == set(meeting) and all(t.seconds > 0 for t in timed)
    fastest = min(t.seconds for t in timed)
    assert result.chosen.seconds <= fastest * (1 + TIME_TIE)
    tied = [t for t in timed if t.seconds <= fastest * (1 + TIME_TIE)]
    assert result.chosen.map_evals == min(t.map_evals for t in tied)
    for t in result.trials:  # the search's own figures agree with the brute force on every candidate
        acc, ev = brute[(t.solver, t.tol)]
        assert (t.accuracy, t.map_evals) == (pytest.approx(acc), pytest.approx(ev))
        assert t.map_evals == pytest.approx(t.mean_steps)  # compaction: one map row per step per sample
    assert (chosen_cfg.solver, chosen_cfg.tol) == (result.chosen.solver, result.chosen.tol)


def test_choose_honours_the_tolerance_and_ties() -> None:
    from loopformer.eval.auto_solver import Trial

    trials = [Trial("damped", 0.1, 0.9, 10.0), Trial("broyden", 0.1, 0.89, 6.0), Trial("anderson", 0.1, 0.95, 8.0),
              Trial("picard", 0.1, 0.95, 8.0), Trial("bad", 0.1, error="invalid")]  # fmt: skip
    assert choose(trials, 0.9).solver == "anderson"  # 8 evals, the earlier of two at equal accuracy
    assert choose(trials, 0.9, accuracy_tolerance=0.01).solver == "broyden"
    assert not trials[-1].qualifies
    with pytest.raises(RuntimeError, match="no candidate reached"):
        choose(trials[:1], 0.95)


def test_choose_takes_the_fastest_and_breaks_ties_by_map_evaluations() -> None:
    """Issue 33: fewer map evaluations are not always less time (Broyden 1.246 s vs damped 1.117 s)."""
    from loopformer.eval.auto_solver import Trial

    def trials(broyden_s: float) -> list:
        return [Trial("damped", 0.1, 0.9, 10.0, seconds=1.117), Trial("broyden", 0.1, 0.9, 6.0, seconds=broyden_s),
                Trial("anderson", 0.1, 0.8, 4.0, seconds=0.5)]  # fmt: skip

    assert choose(trials(1.246), 0.9).solver == "damped"  # the faster at equal accuracy
    assert choose(trials(1.15), 0.9).solver == "broyden"  # within 5%: a tie, the fewer map evaluations win
    assert choose(trials(1.246), 0.8).solver == "anderson"  # allowed by the accuracy, and fastest


def test_split_and_counting_errors() -> None:
    with pytest.raises(ValueError, match="auto-solver-slice"):
        split_rows(10, 1.5)
    with pytest.raises(ValueError, match="at least 2"):
        split_rows(1, 0.5)
    model = Contractive(LoopConfig())
    with count_map_rows(model) as rows:
        model(torch.zeros(3, T, dtype=torch.long), loop=LoopConfig(halting="fixed", max_steps=4))
    assert rows[0] == 12 and "step" not in vars(model)


def test_cli_auto_solver_on_a_tiny_run(tmp_path: Path) -> None:
    from loopformer.cli import cli
    from loopformer.config import build_config
    from loopformer.train.trainer import Trainer

    run_dir = tmp_path / "run"
    cfg = {
        "model": {"name": "fprm", "d_model": 16, "n_heads": 2, "n_layers": 1, "conv": "grid2d"},
        "data": {"task": "sudoku", "options": {"size": 4}, "train_generate": {"min_blanks": 2, "max_blanks": 4},
                 "eval_generate": {"min_blanks": 2, "max_blanks": 4}, "train_size": 24, "eval_size": 12},
        "train": {"mode": "deep_supervision", "steps": 3, "batch_size": 8, "max_segments": 2, "progress": False,
                  "log_every": 1},
        "loop_train": {"max_steps": 3, "grad": "truncated", "grad_steps": 2},
        "loop_eval": {"solver": "damped", "halting": "residual", "tol": 0.1, "max_steps": 6},
        "eval": {"batch_size": 16},
        "out_dir": str(run_dir),
    }  # fmt: skip
    Trainer(build_config(cfg)).fit()
    out = tmp_path / "ev"
    result = CliRunner().invoke(cli, ["eval", str(run_dir), "--auto-solver", "--auto-solver-slice", "0.5",
                                      "--no-analyses", "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "auto-solver" in result.output and "chosen" in result.output
    metrics = json.loads((out / "metrics.json").read_text())
    auto = metrics["auto_solver"]
    assert auto["search_rows"] == 6 and auto["report_rows"] == 6
    meeting = [t for t in auto["trials"] if t["accuracy"] >= auto["reference"]["accuracy"]]
    assert auto["chosen"]["accuracy"] >= auto["reference"]["accuracy"]
    assert auto["chosen"]["seconds"] <= min(t["seconds"] for t in meeting) * (1 + TIME_TIE)
    assert {"trained", "chosen"} <= set(auto["report"]) and auto["report"]["chosen"]["seconds"] > 0
    assert set(auto["report"]) == {"trained", "chosen"}
    (label,) = metrics["results"]
    assert metrics["results"][label]["n"] == 6  # the report covers the rows the search did not see
    assert metrics["results"][label]["loop"]["solver"] == auto["chosen"]["solver"]
