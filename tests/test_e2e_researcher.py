"""The researcher's path end to end (issue 13): ``data prepare`` on real-format Sudoku-Extreme files, train
a paper recipe by name at tiny size, ``eval --device cpu``, ``push`` to a local test repository, and load
the pushed model back.  Fast variant: in-process, the package as checked out.  Slow variant: the same
commands from a wheel installed in a fresh virtual environment (not editable), as subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_data_prepare import sudoku_extreme_dir

from loopformer.cli import cli

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.d_model=16", "model.n_heads=2", "model.n_layers=1", "model.puzzle_emb_dim=16", "train.steps=2", "train.batch_size=8",
        "train.max_segments=1", "train.warmup_steps=0", "train.progress=false", "train.log_every=1",
        "train.eval_every=0", "train.checkpoint_every=0", "loop_train.max_steps=2", "loop_train.grad_steps=1",
        "loop_eval.max_steps=3", "loop_periodic.max_steps=3", "eval.batch_size=8"]  # fmt: skip


def _steps(data: Path, run: Path, repo: Path) -> list[list[str]]:
    return [
        ["data", "prepare", "sudoku-extreme", "--from", str(data / "raw"), "--subset", "20", "--augment", "3",
         "--out", str(data / "D")],
        ["train", "paper_sudoku_extreme_fprm", f"data.train_path={data / 'D'}", f"data.eval_path={data / 'D'}",
         f"out_dir={run}", *TINY],
        ["eval", str(run), "--device", "cpu", "--no-analyses", "--out", str(run / "eval")],
        ["push", str(run), "me/tiny-sudoku-extreme", "--to-folder", str(repo)],
        ["solve", "sudoku", "5...27..9..41......1..5.3...92.6.8...5......66..7..29.8...7...2.......8...9..36..",
         "-c", str(repo), "--json", "--device", "cpu"],
    ]  # fmt: skip


def _check(run: Path, repo: Path, solve_output: str) -> None:
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and (run / "eval" / "metrics.json").is_file()
    assert {p.name for p in repo.iterdir()} >= {
        "model.safetensors",
        "config.json",
        "README.md",
        "summary.json",
    }
    assert "arXiv:2606.18206" in (repo / "README.md").read_text()
    record = json.loads(solve_output.strip().splitlines()[-1])
    assert record["steps"] >= 1 and isinstance(record["valid"], bool) and len(record["solution_tokens"]) == 81


def test_researcher_path_in_process(tmp_path: Path) -> None:
    sudoku_extreme_dir(tmp_path / "raw")
    run, repo = tmp_path / "run", tmp_path / "repo"
    runner = CliRunner()
    outputs = []
    for args in _steps(tmp_path, run, repo):
        result = runner.invoke(cli, args)
        assert result.exit_code == 0, f"{args[0]}: {result.output}"
        outputs.append(result.output)
    assert "train 80" in outputs[0]
    _check(run, repo, outputs[-1])


@pytest.mark.slow
def test_researcher_path_from_a_wheel(tmp_path: Path) -> None:
    """Build the wheel, install it (no deps) into a fresh venv that borrows this one's third-party packages."""
    import site
    import sysconfig

    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(ROOT)], check=True, cwd=tmp_path)  # fmt: skip
    wheel = next(wheels.glob("loopformer-*.whl"))
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    purelib = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip())  # fmt: skip
    borrowed = [p for p in {*site.getsitepackages(), sysconfig.get_paths()["purelib"]} if Path(p).is_dir()]
    (purelib / "borrowed_dependencies.pth").write_text("\n".join(borrowed) + "\n")  # torch, numpy, ... only
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True)  # fmt: skip
    where = subprocess.run([str(py), "-c", "import loopformer; print(loopformer.__file__)"], check=True,
                           capture_output=True, text=True, cwd=tmp_path).stdout.strip()  # fmt: skip
    assert where.startswith(str(purelib)), f"loopformer imported from {where}, not the wheel"
    exe = env_dir / "bin" / "loopformer"
    assert exe.is_file()
    sudoku_extreme_dir(tmp_path / "raw")
    run, repo = tmp_path / "run", tmp_path / "repo"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    output = ""
    for args in _steps(tmp_path, run, repo):
        done = subprocess.run([str(exe), *args], capture_output=True, text=True, cwd=tmp_path, env=env)
        assert done.returncode == 0, f"{args[0]}: {done.stdout}\n{done.stderr}"
        output = done.stdout
    _check(run, repo, output)
