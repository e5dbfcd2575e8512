"""``loopformer eval`` honours ``eval.segments``: TRM / HRM evaluate ``halt_max_steps`` = 16 chained
segments carrying the state (TinyRecursiveModels ``pretrain.py`` ``evaluate``). The CLI's metrics
must equal calling the model segment by segment by hand."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from test_tasks_arc import write_tasks

from loopformer.cli import cli
from loopformer.config import build_config
from loopformer.eval.evaluate import arc_pass_at_k, predict
from loopformer.loop import LoopConfig
from loopformer.models.base import ModelOutput
from loopformer.runs import eval_dataset, load_run
from loopformer.tasks.arc import ArcTask

TINY_TRM = {
    "model": {"name": "trm", "d_model": 16, "n_heads": 2, "n_layers": 1, "n_inner": 2, "mlp_multiple": 8},
    "data": {"task": "sudoku", "options": {"size": 4}, "train_generate": {"min_blanks": 4, "max_blanks": 8},
             "eval_generate": {"min_blanks": 6, "max_blanks": 10}, "train_size": 32, "eval_size": 12},
    "train": {"mode": "deep_supervision", "steps": 6, "batch_size": 8, "max_segments": 3, "progress": False,
              "lr": 3.0e-3, "warmup_steps": 1, "log_every": 1},
    "loop_train": {"halting": "fixed", "max_steps": 2, "grad": "truncated", "grad_steps": 1},
    "loop_eval": {"halting": "fixed", "max_steps": 2},
    "eval": {"batch_size": 5, "segments": 3},  # 3 batches (5, 5, 2 rows), 3 segments each
    "seed": 3,
}  # fmt: skip


@pytest.fixture(scope="module")
def trm_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loopformer.train.trainer import Trainer

    out = tmp_path_factory.mktemp("trm_segments")
    Trainer(build_config({**TINY_TRM, "out_dir": str(out)})).fit()
    return out


def _by_hand(run, segments: int) -> dict[str, float]:
    """Each batch of ``eval.batch_size`` rows through ``segments`` model calls, the state carried; the
    initial iterates from one generator seeded with the run's seed (drawn by the first call only)."""
    data = eval_dataset(run.task, run.config)
    model, g = run.model.eval(), torch.Generator().manual_seed(run.config.seed)
    right = count = exact = valid = steps = 0
    bs = run.config.eval.batch_size
    with torch.no_grad():
        for start in range(0, len(data), bs):
            inputs = torch.as_tensor(data.inputs[start : start + bs])
            labels = data.labels[start : start + bs]
            state = None
            for _ in range(segments):
                kw = {} if state is None else {"state": state}
                out = model(inputs, loop=run.loop_eval, generator=g, **kw)
                state = out.state
                steps += int(out.loop.steps.sum())
            pred = out.logits.argmax(-1).numpy()
            mask = labels >= 0
            right += int((pred == labels)[mask].sum())
            count += int(mask.sum())
            exact += int(((pred == labels) | ~mask).all(1).sum())
            valid += sum(bool(run.task.check(x, p)) for x, p in zip(data.inputs[start : start + bs], pred))
    n = len(data)
    return {"token_accuracy": right / count, "exact_accuracy": exact / n, "valid_accuracy": valid / n,
            "mean_steps": steps / n}  # fmt: skip


def _cli_results(run_dir: Path, out: Path, *sets: str) -> dict:
    args = ["eval", str(run_dir), "--no-analyses", "--out", str(out)]
    for s in sets:
        args += ["--set", s]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    (res,) = json.loads((out / "metrics.json").read_text())["results"].values()
    return res


def test_eval_chains_the_configured_segments_like_calls_by_hand(trm_run: Path, tmp_path: Path) -> None:
    run = load_run(trm_run)
    assert run.config.eval.segments == 3
    three = _cli_results(trm_run, tmp_path / "three")
    one = _cli_results(trm_run, tmp_path / "one", "eval.segments=1")
    hand3, hand1 = _by_hand(run, 3), _by_hand(run, 1)
    for res, hand in ((three, hand3), (one, hand1)):
        for key in ("token_accuracy", "exact_accuracy", "valid_accuracy", "mean_steps"):
            assert res[key] == pytest.approx(hand[key], abs=1e-12), key
    assert three["mean_steps"] == 3 * one["mean_steps"] == 3 * 2  # 3 segments of 2 steps
    # the chained segments give another model output than one segment: the prediction changed
    assert not np.isclose(hand3["token_accuracy"], hand1["token_accuracy"])


def test_the_trainer_final_evaluation_agrees_with_loopformer_eval(trm_run: Path, tmp_path: Path) -> None:
    summary = json.loads((trm_run / "summary.json").read_text())
    res = _cli_results(trm_run, tmp_path / "ev", "eval.batch_size=5")
    assert summary["eval"]["token_acc"] == pytest.approx(res["token_accuracy"], abs=1e-12)
    assert summary["eval"]["loop_steps"] == pytest.approx(res["mean_steps"], abs=1e-12)


def test_predict_chains_segments(trm_run: Path) -> None:
    run = load_run(trm_run)
    data = eval_dataset(run.task, run.config)
    chained = predict(run.model, data, loop=run.loop_eval, batch_size=5, seed=run.config.seed, segments=3)
    g, state, model = torch.Generator().manual_seed(run.config.seed), None, run.model.eval()
    hand = []
    with torch.no_grad():
        for start in range(0, len(data), 5):
            inputs, state = torch.as_tensor(data.inputs[start : start + 5]), None
            for _ in range(3):
                out = model(
                    inputs, loop=run.loop_eval, generator=g, **({} if state is None else {"state": state})
                )
                state = out.state
            hand.append(out.logits.argmax(-1).numpy())
    assert np.array_equal(chained, np.concatenate(hand))
    one = predict(run.model, data, loop=run.loop_eval, batch_size=5, seed=run.config.seed)
    assert not np.array_equal(chained, one)


class _AnswersOnItsSecondSegment(torch.nn.Module):
    """An ARC "model" that emits an all-PAD canvas on a fresh start and the right answer once it is
    given a carried state (a second chained segment)."""

    def __init__(self, answers: dict[bytes, np.ndarray]) -> None:
        super().__init__()
        self.answers = answers
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(loop=LoopConfig(max_steps=1))

    def forward(self, inputs, loop=None, puzzle_ids=None, generator=None, state=None, **_):
        if state is None:
            target = torch.zeros_like(inputs)
        else:
            target = torch.as_tensor(np.stack([self.answers[x.numpy().tobytes()] for x in inputs]))
        return ModelOutput(logits=F.one_hot(target, 12).float(), state=torch.ones(len(inputs), 1), loop=None)

    def blocks_per_step(self) -> int:
        return 1


def test_arc_pass_at_k_chains_segments(tmp_path: Path) -> None:
    write_tasks(tmp_path / "tasks")
    task = ArcTask(tmp_path / "tasks", augmentations=2)
    test = task.generate(0, 0, part="test")
    model = _AnswersOnItsSecondSegment({x.tobytes(): y for x, y in zip(test.inputs, test.labels)})
    assert arc_pass_at_k(model, task, batch_size=3)["score"] == 0.0
    assert arc_pass_at_k(model, task, batch_size=3, segments=2)["score"] == 1.0


def test_solve_chains_eval_segments_as_loopformer_eval(trm_run: Path) -> None:
    """``loopformer.solve`` runs the run's ``eval.segments`` (3) chained segments carrying the state: its
    answer is ``predict``'s / ``evaluate``'s for the same puzzle, its steps the summed loop steps, and its
    trajectory covers every loop of every segment (one segment reads a different answer on some row)."""
    import loopformer
    from loopformer.eval.evaluate import evaluate

    run = load_run(trm_run)
    data = eval_dataset(run.task, run.config)
    segments, seed = run.config.eval.segments, run.config.seed
    preds = predict(run.model, data, loop=run.loop_eval, seed=seed, segments=segments)
    one = predict(run.model, data, loop=run.loop_eval, seed=seed, segments=1)
    result = evaluate(run.model, run.task, data, loop=run.loop_eval, seed=seed, segments=segments)
    differs = [i for i in range(len(data)) if not np.array_equal(preds[i], one[i])]
    assert differs, "every row reads the same answer after 1 and 3 segments: the test would not bite"
    for i in {0, differs[0]}:
        sol = loopformer.solve(run, data.inputs[i])
        assert np.array_equal(sol.tokens, preds[i])
        assert sol.steps == result.records[i].steps == segments * run.loop_eval.max_steps
        assert len(sol.trajectory) == sol.steps and np.array_equal(sol.trajectory[-1], sol.tokens)
        assert sol.valid == bool(run.task.check(data.inputs[i], preds[i])) == result.records[i].valid
    single = loopformer.solve(run, data.inputs[differs[0]], segments=1)  # one segment: today's old answer
    assert np.array_equal(single.tokens, one[differs[0]]) and single.steps == run.loop_eval.max_steps


def test_logit_lens_and_signal_propagation_chain_segments(trm_run: Path) -> None:
    """With ``segments`` the per-loop analyses carry the state across segments as ``evaluate`` does: the lens
    reads ``evaluate``'s accuracies after each segment's last loop, and the curves cover every loop."""
    from loopformer.eval.analysis import logit_lens, signal_propagation
    from loopformer.eval.evaluate import evaluate

    run = load_run(trm_run)
    data = eval_dataset(run.task, run.config)
    per, segments, seed = run.loop_eval.max_steps, run.config.eval.segments, run.config.seed
    lens = logit_lens(run.model, run.task, data, per, loop=run.loop_eval, seed=seed, segments=segments)
    assert lens.loops == list(range(1, per * segments + 1))
    for k in range(1, segments + 1):
        ev = evaluate(run.model, run.task, data, loop=run.loop_eval, seed=seed, segments=k)
        assert lens.exact_accuracy[k * per - 1] == pytest.approx(ev.exact_accuracy)
        assert lens.token_accuracy[k * per - 1] == pytest.approx(ev.token_accuracy)
    sig = signal_propagation(run.model, data, per, loop=run.loop_eval, seed=seed, segments=segments)
    assert len(sig.update_norm) == per * segments and all(u > 0 for u in sig.update_norm)
