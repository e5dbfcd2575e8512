"""Issue 24, a full disk during a training: a resumed run under a file-size limit (``RLIMIT_FSIZE``,
what ``ulimit -f`` sets; ``SIGXFSZ`` ignored so that a write past it fails with ``EFBIG`` like a full
disk) fails while it writes a checkpoint, appends to ``metrics.jsonl`` or rewrites it on resume.
Afterwards every file of the run still parses, the previous checkpoint still loads, no temporary
file is left behind, and the user sees one line naming the file and the problem."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from reliability_common import cli_text, tiny_recipe

from loopformer.cli import cli
from loopformer.runs import load_run
from loopformer.runs.checkpoint import latest_good_checkpoint

REPO = Path(__file__).resolve().parents[1]
STEPS = 12
LONG_STEPS = 30

# the resume runs in a child process whose writes past `limit` bytes fail with EFBIG
CHILD = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
from loopformer.cli import cli
cli(sys.argv[2:], prog_name="loopformer")
"""


def _train(folder: Path, steps: int) -> tuple[Path, Path]:
    recipe = folder / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(train={"checkpoint_every": 2}), sort_keys=False))
    run = folder / "run"
    result = CliRunner().invoke(cli, ["train", str(recipe), f"out_dir={run}", f"train.steps={steps}"])
    assert result.exit_code == 0, cli_text(result)
    return recipe, run


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _train(tmp_path_factory.mktemp("limit"), STEPS)


@pytest.fixture(scope="module")
def long_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A run whose log outgrows its config files (about 350 bytes a record)."""
    return _train(tmp_path_factory.mktemp("limit-long"), LONG_STEPS)


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _resume_under_limit(recipe: Path, run: Path, limit: int, steps: int) -> subprocess.CompletedProcess:
    args = ["train", str(recipe), f"out_dir={run}", f"train.steps={steps}", "--resume"]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONDONTWRITEBYTECODE": "1", "LOOPFORMER_DEBUG": ""}  # fmt: skip
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(limit), *args], capture_output=True, text=True, env=env, timeout=300
    )


def _assert_run_intact(run: Path, result: subprocess.CompletedProcess, expected_step: int) -> str:
    text = result.stdout + result.stderr
    assert result.returncode == 1, f"exit {result.returncode}: {text[-600:]}"
    errors = [line for line in text.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and "Traceback" not in text and "internal error" not in text, text[-600:]
    assert "File too large" in errors[0] and "could not write" in errors[0], errors[0]
    yaml.safe_load((run / "config.yaml").read_text())
    json.loads((run / "config.json").read_text())
    for i, line in enumerate(_lines(run / "metrics.jsonl")):
        assert isinstance(json.loads(line), dict), f"metrics.jsonl line {i + 1}: {line!r}"
    if (run / "summary.json").exists():
        json.loads((run / "summary.json").read_text())
    folder, skipped = latest_good_checkpoint(run / "checkpoints")
    assert folder is not None and not skipped, skipped
    loaded = load_run(run)
    assert loaded.step == expected_step
    leftovers = [str(p) for p in run.rglob("*") if ".tmp" in p.name or p.name == ".loopformer.lock"]
    assert leftovers == [], leftovers
    return errors[0]


def _cut_back_to(run: Path, step: int) -> None:
    """The run as a killed process leaves it: its newest checkpoint is ``step``, metrics run further."""
    for folder in (run / "checkpoints").glob("step_*"):
        if int(folder.name.split("_")[1]) > step:
            shutil.rmtree(folder)
    (run / "checkpoints" / "latest").write_text(f"step_{step:08d}\n")
    (run / "summary.json").unlink()


def test_a_checkpoint_write_past_the_limit_keeps_the_previous_checkpoint(base_run, tmp_path) -> None:
    recipe, base = base_run
    run = shutil.copytree(base, tmp_path / "run")
    weights = (run / "checkpoints" / f"step_{STEPS:08d}" / "model.safetensors").stat().st_size
    config = max((run / name).stat().st_size for name in ("config.yaml", "config.json"))
    limit = weights - 1
    assert limit > config + 4096  # config and metrics fit: the checkpoint is what fails
    before = (run / "metrics.jsonl").read_bytes()
    error = _assert_run_intact(run, _resume_under_limit(recipe, run, limit, STEPS + 2), STEPS)
    assert "safetensors" in error
    assert (run / "metrics.jsonl").read_bytes().startswith(before)  # earlier lines never rewritten
    assert sorted(p.name for p in (run / "checkpoints").iterdir())[-1] == f"step_{STEPS:08d}"


def test_a_metrics_append_past_the_limit_leaves_whole_lines(long_run, tmp_path) -> None:
    recipe, base = long_run
    run = shutil.copytree(base, tmp_path / "run")
    metrics = run / "metrics.jsonl"
    size, line = metrics.stat().st_size, max(len(x) for x in _lines(metrics))
    limit = size + line // 2  # the next record is cut half-way by the limit
    config = max((run / name).stat().st_size for name in ("config.yaml", "config.json"))
    assert limit > config
    before = metrics.read_bytes()
    error = _assert_run_intact(run, _resume_under_limit(recipe, run, limit, LONG_STEPS + 2), LONG_STEPS)
    assert "metrics.jsonl" in error
    assert metrics.read_bytes() == before  # the torn record was cut back off


def test_a_resume_that_drops_records_past_the_limit_keeps_the_old_log(long_run, tmp_path) -> None:
    recipe, base = long_run
    run = shutil.copytree(base, tmp_path / "run")
    metrics = run / "metrics.jsonl"
    lines = _lines(metrics)
    config = max((run / name).stat().st_size for name in ("config.yaml", "config.json"))
    # back to the oldest checkpoint kept: the records it keeps still outgrow the config files
    step = min(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*"))
    _cut_back_to(run, step)
    kept = sum(len(x) + 1 for x in lines[:step])
    assert step < LONG_STEPS and kept > config + 64
    before = metrics.read_bytes()
    error = _assert_run_intact(run, _resume_under_limit(recipe, run, kept - 1, LONG_STEPS), step)
    assert "metrics.jsonl" in error
    assert metrics.read_bytes() == before  # the new, shorter log was never renamed over the old one


def _under_limit(limit: int, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONDONTWRITEBYTECODE": "1", "LOOPFORMER_DEBUG": ""}  # fmt: skip
    return subprocess.run([sys.executable, "-c", CHILD, str(limit), *args], capture_output=True, text=True,
                          env=env, timeout=300, cwd=cwd)  # fmt: skip


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_eval_compare_and_data_generate_past_the_limit_leave_the_old_output(base_run, tmp_path) -> None:
    """``eval -o``, ``compare -o`` and ``data generate`` (a file, an HRM folder) that fail past the limit:
    one line naming the file the user asked for (not the hidden staging folder), the previous output
    byte for byte, no staging folder, temporary file or lock left, and no new, empty folder."""
    _, run = base_run
    report, table = tmp_path / "report", tmp_path / "table"
    for args in (["eval", str(run), "-o", str(report), "--examples", "2"], ["compare", str(report), "-o", str(table)]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, cli_text(result)
    gen = ["data", "generate", "sudoku", "--size", "4", "--count", "3000"]
    assert CliRunner().invoke(cli, [*gen, "-o", str(tmp_path / "d.csv")]).exit_code == 0
    before = _tree(tmp_path)
    cases = [
        (["eval", str(run), "-o", "report", "--examples", "2", "--overwrite"], "report/"),
        (["eval", str(run), "-o", "fresh", "--examples", "2"], "fresh/"),
        (["compare", "report", "-o", "table", "--overwrite"], "table/"),
        ([*gen, "--seed", "1", "-o", "d.csv", "--overwrite"], "d.csv"),
        ([*gen, "--format", "hrm", "-o", "hrm"], "hrm/train/"),
    ]
    for args, named in cases:
        result = _under_limit(4096, *args, cwd=tmp_path)
        text = result.stdout + result.stderr
        errors = [line for line in text.splitlines() if line.startswith("Error")]
        assert result.returncode == 1 and len(errors) == 1, f"{args}: {text[-600:]}"
        assert "Traceback" not in text and "internal error" not in text, text[-600:]
        assert f"could not write {named}" in errors[0] and "File too large" in errors[0], errors[0]
        assert _tree(tmp_path) == before, args
        assert sorted(p.name for p in tmp_path.iterdir()) == ["d.csv", "report", "table"], args
