"""Tracking: the W&B run (offline mode, no network), the logging handler (quiet with -q) and the ETA
column of the training bar."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from click.testing import CliRunner

from loopformer.cli import cli
from loopformer.config import build_config

TINY = {
    "model": {"name": "fprm", "d_model": 16, "n_heads": 2, "n_layers": 1, "conv": "grid2d"},
    "data": {"task": "sudoku", "options": {"size": 4}, "train_size": 16, "eval_size": 4},
    "train": {"steps": 3, "batch_size": 4, "progress": False, "log_every": 1},
    "loop_train": {"max_steps": 2}, "loop_eval": {"max_steps": 2},
}  # fmt: skip


@pytest.mark.slow  # the real wandb: its service process takes tens of seconds to start on a busy machine
def test_wandb_offline_run(tmp_path: Path, monkeypatch) -> None:
    wandb = pytest.importorskip("wandb")
    from loopformer.train.trainer import Trainer

    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    cfg = build_config({**TINY, "out_dir": str(out),
                        "train": {**TINY["train"], "wandb": True, "wandb_mode": "offline"}})  # fmt: skip
    Trainer(cfg).fit()
    run_id = (out / "wandb_id").read_text().strip()
    offline = list((out / "wandb").glob(f"offline-run-*-{run_id}"))
    assert offline, list((out / "wandb").iterdir())
    assert list(offline[0].glob("*.wandb")), "the offline run wrote no history file"
    assert wandb.run is None  # finished


def test_wandb_patched_module(tmp_path: Path, monkeypatch) -> None:
    """The trainer's W&B calls, against a stand-in module: init arguments, logged steps, finish, resume id."""
    import sys
    import types

    from loopformer.train.trainer import Trainer

    events = []

    class Run:
        def log(self, numbers, step):
            events.append(("log", step, sorted(numbers)))

        def finish(self):
            events.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: events.append(("init", kw)) or Run()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "run"
    cfg = build_config({**TINY, "out_dir": str(out),
                        "train": {**TINY["train"], "wandb": True, "wandb_mode": "offline"}})  # fmt: skip
    Trainer(cfg).fit()
    init = events[0][1]
    assert init["mode"] == "offline" and init["project"] == "loopformer" and init["dir"] == str(out)
    assert init["config"]["train"]["wandb"] is True and init["id"] == (out / "wandb_id").read_text()
    steps = [e[1] for e in events if e[0] == "log"]
    assert steps[:3] == [1, 2, 3] and "loss" in events[1][2] and events[-1] == ("finish",)
    resumed = {
        **TINY,
        "out_dir": str(out),
        "train": {**TINY["train"], "wandb": True, "steps": 4, "resume": True},
    }
    Trainer(build_config(resumed)).fit()
    assert [e for e in events if e[0] == "init"][1][1]["id"] == init["id"]  # a resumed run continues it


def test_trackers_fan_out(tmp_path: Path) -> None:
    from loopformer.train.tracking import Trackers

    calls = []

    class Fake:
        def add_scalar(self, k, v, s):
            calls.append(("tb", k, v, s))

        def log(self, d, step):
            calls.append(("wandb", d, step))

        def close(self):
            calls.append("tb.close")

        def finish(self):
            calls.append("wandb.finish")

    t = Trackers(Fake(), Fake())
    t.log({"loss": 1.5}, 3)
    t.close()
    assert calls == [("tb", "loss", 1.5, 3), ("wandb", {"loss": 1.5}, 3), "tb.close", "wandb.finish"]


def test_info_messages_shown_unless_quiet(tmp_path: Path) -> None:
    import yaml

    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(TINY))
    args = ["train", str(recipe), f"out_dir={tmp_path / 'r'}", "train.resume=true"]
    loud = CliRunner().invoke(cli, args)
    assert loud.exit_code == 0, loud.output
    assert (
        "INFO" in loud.output and "resume: no usable checkpoint" in loud.output
    )  # a log.info of the trainer
    quiet = CliRunner().invoke(cli, ["-q", *args[:2], f"out_dir={tmp_path / 'q'}", "train.resume=true"])
    assert quiet.exit_code == 0 and "resume: no usable checkpoint" not in quiet.output
    assert logging.getLogger("loopformer").level == logging.WARNING
    CliRunner().invoke(cli, ["recipes"])
    assert logging.getLogger("loopformer").level == logging.INFO


def test_training_bar_has_an_eta() -> None:
    import io

    from rich.progress import TimeRemainingColumn

    from loopformer.train.metrics import TrainProgress

    with TrainProgress(True, 10, 0, log_every=1, stream=io.StringIO(), tty=True) as p:
        assert any(isinstance(c, TimeRemainingColumn) for c in p.bar.columns)
