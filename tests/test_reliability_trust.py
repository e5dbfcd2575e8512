"""A run folder is data, never code (issue 35): nothing a checkpoint names is imported.

A trained tiny run's ``config.json`` is edited to name a plug-in module ``evil_mod`` (in its ``plugins`` list
and as its ``model.name``'s ``module:Class``) and ``evil_mod.py``, which creates a marker file when imported,
is put in the run folder and in the current folder. ``eval`` (run from inside the folder: ``cd RUN; loopformer
eval .``), ``solve`` and ``loopformer.load`` must refuse with one line naming the module and the option that
allows it, and the marker must not exist. A tampered ``config.json`` whose manifest no longer matches is
refused by the manifest check first. A plug-in that calls ``sys.exit(0)`` while importing is an error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from reliability_common import PUZZLE, newest_checkpoint, rewrite_manifest, tiny_recipe

from loopformer.config import build_config
from loopformer.train import Trainer

MARKER_CODE = "from pathlib import Path\nPath({marker!r}).write_text('imported')\n"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trust")
    Trainer(build_config({**tiny_recipe(), "out_dir": str(root / "run")})).fit()
    return root / "run"


def plant(run: Path, dest: Path, marker: Path, update_manifest: bool = True) -> Path:
    """A copy of ``run`` whose newest checkpoint names ``evil_mod`` (plugins list and model.name), with
    ``evil_mod.py`` in the run folder; the manifest rewritten to match unless ``update_manifest`` is False."""
    import shutil

    shutil.copytree(run, dest)
    folder = newest_checkpoint(dest)
    config = json.loads((folder / "config.json").read_text())
    config["plugins"] = ["evil_mod"]
    config["model"]["name"] = "evil_mod:Model"
    (folder / "config.json").write_text(json.dumps(config))
    if update_manifest:
        rewrite_manifest(folder)
    (dest / "evil_mod.py").write_text(MARKER_CODE.format(marker=str(marker)))
    return dest


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LOOPFORMER_IMPORT", "PYTHONPATH")}
    return subprocess.run(
        [sys.executable, "-m", "loopformer", *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


def test_eval_solve_and_load_never_import_a_module_the_run_names(trained: Path, tmp_path: Path) -> None:
    marker = tmp_path / "IMPORTED"
    run = plant(trained, tmp_path / "run", marker)
    (tmp_path / "evil_mod.py").write_text(MARKER_CODE.format(marker=str(marker)))  # and in the current folder
    load = f"import loopformer; loopformer.load({str(run)!r})"
    for args, cwd in (
        (["eval", ".", "--no-analyses", "-o", str(tmp_path / "report")], run),  # cd RUN; loopformer eval .
        (["eval", str(run), "--no-analyses", "-o", str(tmp_path / "report2")], tmp_path),
        (["solve", "sudoku", PUZZLE, "-c", str(run)], tmp_path),
    ):
        proc = run_cli(args, cwd)
        message = " ".join(proc.stderr.split())
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "names plug-in module 'evil_mod', which is not imported" in message, message
        assert "--import evil_mod" in message and "Traceback" not in proc.stderr
        assert not marker.exists(), args
    for cwd in (tmp_path, run):
        proc = subprocess.run([sys.executable, "-c", load], cwd=cwd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 1 and "PluginError" in proc.stderr and "evil_mod" in proc.stderr
        assert not marker.exists()


def test_a_tampered_config_is_refused_by_the_manifest_before_anything_is_read(
    trained: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "IMPORTED"
    run = plant(trained, tmp_path / "run", marker, update_manifest=False)
    proc = run_cli(["eval", ".", "--no-analyses", "-o", str(tmp_path / "report")], run)
    assert proc.returncode == 1 and "config.json is corrupt or truncated" in " ".join(proc.stderr.split())
    assert not marker.exists()


def test_the_user_may_import_the_module_the_run_names(trained: Path, tmp_path: Path) -> None:
    # the same refusal names the way out: with --import the recorded module is the user's choice
    marker = tmp_path / "IMPORTED"
    run = plant(trained, tmp_path / "run", marker)
    env = {k: v for k, v in os.environ.items() if k != "LOOPFORMER_IMPORT"}
    env["PYTHONPATH"] = str(run)
    proc = subprocess.run(
        [sys.executable, "-m", "loopformer", "--import", "evil_mod", "eval", str(run), "--no-analyses", "-o",
         str(tmp_path / "report")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert marker.exists()  # imported because the user asked; the run then fails on its fake model name
    assert proc.returncode == 1 and "evil_mod" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("body", ["import sys\nsys.exit(0)\n", "raise KeyError('boom')\n"])
def test_a_plugin_that_exits_or_raises_while_importing_is_an_error(tmp_path: Path, body: str) -> None:
    (tmp_path / "exiting_mod.py").write_text(body)
    env = {k: v for k, v in os.environ.items() if k != "LOOPFORMER_IMPORT"}
    env["PYTHONPATH"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "loopformer", "--import", "exiting_mod", "recipes"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "importing plug-in module 'exiting_mod'" in proc.stderr and "default" not in proc.stdout
