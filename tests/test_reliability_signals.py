"""Issue 24, signals: SIGTERM / SIGINT during a training (what a scheduler sends before preemption)
finish the step, write a checkpoint, release the lock and print the command that resumes the run;
a second signal stops at once and still leaves every file whole and the folder unlocked. The
signals are real (``os.kill`` of this process from inside a training step, through the CLI)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from reliability_common import cli_text, tiny_recipe

from loopformer.cli import cli
from loopformer.runs import load_run
from loopformer.runs.checkpoint import verify_checkpoint
from loopformer.train.trainer import Trainer


@pytest.fixture
def recipe(tmp_path) -> Path:
    path = tmp_path / "recipe.yaml"
    # no periodic checkpoints: the one the signal writes is the only one
    path.write_text(yaml.safe_dump(tiny_recipe(train={"steps": 50}), sort_keys=False))
    return path


def _signal_at(monkeypatch, step: int, *signals: int) -> None:
    original = Trainer.train_step

    def train_step(self):
        if self.step == step:
            for sig in signals:
                os.kill(os.getpid(), sig)
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", train_step)


def _whole(run: Path) -> list[int]:
    yaml.safe_load((run / "config.yaml").read_text())
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert not (run / ".loopformer.lock").exists()
    assert not [p for p in run.rglob("*") if ".tmp" in p.name]
    return steps


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_checkpoints_unlocks_and_prints_the_resume_command(
    recipe, tmp_path, monkeypatch, sig
) -> None:
    run = tmp_path / "run"
    _signal_at(monkeypatch, 3, sig)
    result = CliRunner().invoke(cli, ["train", str(recipe), "-o", str(run), "seed=3"])
    text = cli_text(result)
    assert result.exit_code == 128 + sig, text[-800:]
    assert "internal error" not in text and "Traceback" not in text, text[-800:]
    assert f"training stopped by {signal.Signals(sig).name} after step 4" in text
    line = " ".join(text.split())
    assert f"resume with: loopformer train {recipe} seed=3 out_dir={run} --resume" in line, line[-400:]
    steps = sorted((run / "checkpoints").glob("step_*"))
    assert [p.name for p in steps] == ["step_00000004"] and verify_checkpoint(steps[0]) is None
    assert _whole(run) == [1, 2, 3, 4]
    assert load_run(run).step == 4
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are gone with the training
    monkeypatch.undo()
    again = CliRunner().invoke(
        cli, ["train", str(recipe), "-o", str(run), "seed=3", "train.steps=6", "--resume"]
    )
    assert again.exit_code == 0, cli_text(again)
    assert load_run(run).step == 6 and _whole(run) == [1, 2, 3, 4, 5, 6]  # continued, no step twice


def test_a_second_signal_stops_at_once_and_leaves_the_folder_whole(recipe, tmp_path, monkeypatch) -> None:
    run = tmp_path / "run"
    _signal_at(monkeypatch, 3, signal.SIGINT, signal.SIGINT)
    result = CliRunner().invoke(cli, ["train", str(recipe), "-o", str(run)])
    text = cli_text(result)
    # 128 + SIGINT, as for the first signal's TrainingInterrupted; a message instead of click's "Aborted!"
    assert result.exit_code == 130 and "Traceback" not in text and "internal error" not in text, text[-800:]
    assert "interrupted (Ctrl-C): loopformer train stopped" in text and "Aborted!" not in text
    assert "training stopped" not in text  # no checkpoint: it stopped in the step
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").glob("step_*"))
    assert _whole(run) == [1, 2, 3]


def _same_weights(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_run_stopped_by_a_signal_resumes_with_the_printed_command(recipe, tmp_path, monkeypatch) -> None:
    """``loopformer run``: SIGTERM in the looped model's training checkpoints it, exits 143 and prints
    ``loopformer run ... --resume``, which continues it bit for bit and then trains the baseline."""
    out = tmp_path / "out"
    args = ["run", "-r", str(recipe), "-o", str(out), "train.steps=6", "run.budgets=[1]", "run.lens_loops=0",
            "run.signal_loops=0", "run.spectral=false"]  # fmt: skip
    _signal_at(monkeypatch, 3, signal.SIGTERM)
    result = CliRunner().invoke(cli, args)
    text = " ".join(cli_text(result).split())
    assert result.exit_code == 143 and "Traceback" not in text and "internal error" not in text, text[-800:]
    assert "training stopped by SIGTERM after step 4" in text
    assert f"resume with: loopformer run -r {recipe} train.steps=6 'run.budgets=[1]'" in text, text[-600:]
    again = text.split("resume with: ", 1)[1].split()
    assert again[:2] == ["loopformer", "run"] and again[-1] == "--resume" and "-o" in again, again
    assert not (out / "model" / ".loopformer.lock").exists() and not (out / "baseline").exists()
    monkeypatch.undo()
    resumed = CliRunner().invoke(cli, [*args, "--resume"])
    assert resumed.exit_code == 0, cli_text(resumed)[-800:]
    assert load_run(out / "model").step == 6 and load_run(out / "baseline").step == 6
    ref = CliRunner().invoke(cli, ["train", str(recipe), "-o", str(tmp_path / "ref"), "train.steps=6"])
    assert ref.exit_code == 0, cli_text(ref)
    assert _same_weights(out / "model" / "checkpoints" / "step_00000006",
                         tmp_path / "ref" / "checkpoints" / "step_00000006")  # fmt: skip
    kept = CliRunner().invoke(cli, [*args, "--resume"])  # both finished: kept, only evaluated again
    assert kept.exit_code == 0 and "trained earlier" in kept.output, cli_text(kept)[-800:]


def test_sweep_stopped_by_a_signal_resumes_with_the_printed_command(recipe, tmp_path, monkeypatch) -> None:
    out = tmp_path / "sweep"
    args = ["sweep", str(recipe), "train.steps=6", "loop_eval.max_steps=2,3", "-o", str(out)]
    _signal_at(monkeypatch, 3, signal.SIGINT)
    result = CliRunner().invoke(cli, args)
    text = " ".join(cli_text(result).split())
    assert result.exit_code == 130 and "Traceback" not in text, text[-800:]
    assert f"resume with: loopformer sweep {recipe} train.steps=6 loop_eval.max_steps=2,3 -o {out}" in text, text[-600:]
    monkeypatch.undo()
    resumed = CliRunner().invoke(cli, args)
    assert resumed.exit_code == 0, cli_text(resumed)[-800:]
    (point,) = [p for p in out.iterdir() if (p / "checkpoints").is_dir()]
    ref = CliRunner().invoke(cli, ["train", str(recipe), "-o", str(tmp_path / "ref"), "train.steps=6"])
    assert ref.exit_code == 0, cli_text(ref)
    assert _same_weights(point / "checkpoints" / "step_00000006", tmp_path / "ref" / "checkpoints" / "step_00000006")
    assert (out / "compare" / "comparison.md").is_file()


def test_sigterm_outside_a_training_unwinds_and_unlocks(recipe, tmp_path, monkeypatch) -> None:
    """A SIGTERM during ``eval -o`` (no training loop to checkpoint) is one line and exit 143, not the
    default silent death: the lock is released and the half-built report folder removed."""
    run = tmp_path / "run"
    assert CliRunner().invoke(cli, ["train", str(recipe), "-o", str(run), "train.steps=2"]).exit_code == 0
    import loopformer.api as api

    real = api._report

    def killed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "_report", killed)
    report = tmp_path / "report"
    result = CliRunner().invoke(cli, ["eval", str(run), "-o", str(report), "--examples", "2"])
    text = cli_text(result)
    assert result.exit_code == 143 and "interrupted (SIGTERM): loopformer eval" in text, text[-600:]
    assert "Traceback" not in text and "internal error" not in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml", "run"] or not any(report.iterdir())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_signal_in_the_final_evaluation_stops_it_and_the_resume_evaluates_again(
    recipe, tmp_path, monkeypatch
) -> None:
    """The final checkpoint is written before the final evaluation: a SIGTERM during that evaluation (a
    scheduler's warning, which used to wait the whole evaluation out) stops the run at once with exit 143 and
    the resume command; the resume only evaluates, and its metrics equal an uninterrupted run's."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    args = ["train", str(recipe), "seed=5", "train.steps=6"]
    assert CliRunner().invoke(cli, [*args, "-o", str(ref)]).exit_code == 0
    original = Trainer.evaluate
    calls: list[int] = []

    def evaluate(self):
        calls.append(self.step)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, inside the evaluation
        return original(self)

    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    result = CliRunner().invoke(cli, [*args, "-o", str(run)])
    text = " ".join(cli_text(result).split())
    assert result.exit_code == 143 and "Traceback" not in text and "internal error" not in text, text[-800:]
    assert calls == [6] and "training stopped by SIGTERM after step 6" in text, text[-800:]
    assert f"checkpoint {run / 'checkpoints' / 'step_00000006'} written" in text, text[-800:]
    assert "--resume" in text.split("resume with: ", 1)[1]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert _whole(run) == [1, 2, 3, 4, 5, 6] and not any(k.startswith("eval_") for k in records[-1])
    assert verify_checkpoint(run / "checkpoints" / "step_00000006") is None
    monkeypatch.undo()
    again = CliRunner().invoke(cli, [*args, "-o", str(run), "--resume"])
    assert again.exit_code == 0, cli_text(again)[-800:]
    assert _whole(run) == [1, 2, 3, 4, 5, 6]
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    want = json.loads((ref / "metrics.jsonl").read_text().splitlines()[-1])
    evals = {k: v for k, v in want.items() if k.startswith("eval_")}
    assert evals and {k: last.get(k) for k in evals} == evals
    assert _same_weights(run / "checkpoints" / "step_00000006", ref / "checkpoints" / "step_00000006")
