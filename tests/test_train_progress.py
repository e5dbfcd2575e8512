"""Training output in a log file: plain lines every ``train.log_every`` steps, evaluation results in
both modes, nothing cut to 80 columns (loopformer/train/progress.py)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from loopformer.train.metrics import TrainProgress, eval_text
from tests.reliability_common import tiny_recipe


def test_plain_lines_every_log_every_steps_with_lr_throughput_and_eta() -> None:
    out = io.StringIO()
    metrics = {"loss": 1.5, "token_acc": 0.5, "exact_acc": 0.25, "loop_steps": 6.0, "lr": 1e-3}
    with TrainProgress(True, 30, 0, log_every=10, stream=out, tty=False) as p:
        for step in range(1, 31):
            p.update(step, metrics)
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["10/30", "20/30", "30/30"]
    for line in lines:
        assert "loss 1.5000" in line and "acc 0.500/0.250" in line and "loops 6.0" in line
        assert "lr 1.00e-03" in line and re.search(r"(steps/s|s/step)", line) and "eta " in line


def test_resumed_run_counts_from_its_start_and_prints_the_last_step() -> None:
    out = io.StringIO()
    with TrainProgress(True, 25, 20, log_every=10, stream=out, tty=False) as p:
        for step in range(21, 26):
            p.update(step, {"loss": 1.0})
    assert [line.split()[1] for line in out.getvalue().splitlines()] == ["25/25"]


def test_evaluation_lines_are_never_cut() -> None:
    out = io.StringIO()
    result = {k: 0.123456 for k in ("valid_acc", "exact_acc", "token_acc", "loop_steps", "converged", "loss")}
    with TrainProgress(True, 10, 0, log_every=5, stream=out, tty=False) as p:
        p.evaluation(5, {**result, "weights": "ema"})
    (line,) = out.getvalue().splitlines()
    assert line == eval_text(5, {**result, "weights": "ema"}) and len(line) > 80
    assert line.startswith("eval step 5 (ema weights): valid_acc 0.1235") and line.endswith("loss 0.1235")


def test_disabled_prints_nothing() -> None:
    out = io.StringIO()
    with TrainProgress(False, 10, 0, log_every=1, stream=out, tty=False) as p:
        p.update(1, {"loss": 1.0})
        p.evaluation(1, {"valid_acc": 1.0})
    assert out.getvalue() == ""


def test_train_into_a_log_file_shows_progress_and_evaluations(tmp_path: Path) -> None:
    """``loopformer train RECIPE ... > log.txt``: the log holds step lines and the evaluations."""
    recipe = tiny_recipe(train={"steps": 6, "log_every": 2, "eval_every": 3, "progress": True})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(recipe))
    log = tmp_path / "log.txt"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    with log.open("w") as fh:
        proc = subprocess.run(
            [sys.executable, "-m", "loopformer", "train", str(path), f"out_dir={tmp_path / 'run'}"],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=300,
        )
    text = log.read_text()
    assert proc.returncode == 0, text
    steps = [line.split()[1] for line in text.splitlines() if line.startswith("step ")]
    assert steps == ["2/6", "4/6", "6/6"], text
    assert re.search(r"^eval step 3 \(ema weights\): valid_acc ", text, re.M), text
    assert re.search(r"^final eval step 6 \(ema weights\): valid_acc ", text, re.M), text
    # log messages are plain lines too: the thread-count line is whole, not wrapped at 80 columns
    threads = [line for line in text.splitlines() if "CPU threads:" in line]
    assert len(threads) == 1 and threads[0].startswith("INFO ") and threads[0].endswith("train.threads=N)"), text
