"""The extending guide's plug-in module, used from the ``loopformer`` command in subprocesses (issue 25).

docs/extending.md's ``my_plugins.py`` (a task and a model family) and ``successor.yaml`` are copied into a
temporary folder, which is put on ``PYTHONPATH``; nothing is registered in this process. The commands are
those of the guide: ``loopformer --import my_plugins train``, then ``eval`` and ``solve`` on the run without
``--import`` (the checkpoint records the module), ``LOOPFORMER_IMPORT``, ``module:Class`` names, and an
entry point in the ``loopformer.plugins`` group declared by a ``.dist-info`` folder on ``sys.path`` (what
``pip install`` of a plug-in package leaves behind).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def doc_file(name: str) -> str:
    """The code block that follows ``<!-- file: NAME -->`` in docs/extending.md."""
    found = re.search(rf"<!-- file: {re.escape(name)} -->\n```\w*\n(.*?)```", DOC.read_text(), re.S)
    assert found, f"docs/extending.md has no block for {name}"
    return found.group(1)


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("plugin")
    (folder / "my_plugins.py").write_text(doc_file("my_plugins.py"))
    (folder / "successor.yaml").write_text(doc_file("successor.yaml"))
    return folder


def loopformer(args: list[str], cwd: Path, path: list[Path], **env: str) -> subprocess.CompletedProcess:
    """``python -m loopformer ARGS`` in ``cwd`` with ``path`` in front of ``PYTHONPATH``."""
    environ = {k: v for k, v in os.environ.items() if k not in ("LOOPFORMER_IMPORT", "LOOPFORMER_DEBUG")}
    environ["PYTHONPATH"] = os.pathsep.join([*map(str, path), *filter(None, [os.environ.get("PYTHONPATH")])])
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-m", "loopformer", *args],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def checkpoint_config(run: Path) -> dict:
    folder = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    return json.loads((folder / "config.json").read_text())


@pytest.fixture(scope="module")
def trained(plugin_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The guide's first command: ``loopformer --import my_plugins train successor.yaml -o RUN``, run from
    another folder with the plug-in folder on PYTHONPATH."""
    work = tmp_path_factory.mktemp("work")
    ok(
        loopformer(
            ["--import", "my_plugins", "train", str(plugin_dir / "successor.yaml"), "-o", "run"],
            work,
            [plugin_dir],
        )
    )
    return work / "run"


def test_import_option_trains_and_the_checkpoint_records_the_module(trained: Path) -> None:
    saved = checkpoint_config(trained)
    assert saved["family"] == "gated_cell" and saved["plugins"] == ["my_plugins"]
    assert saved["model"]["name"] == "gated_cell" and saved["data"]["task"] == "successor"
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["steps"] == 60
    assert summary["eval"]["valid_acc"] > 0.9  # chance for a whole row is 6^-8


def test_eval_and_solve_run_the_recorded_module_only_when_imported(
    trained: Path, plugin_dir: Path, tmp_path: Path
) -> None:
    # on PYTHONPATH but not imported: the checkpoint's word is not enough (docs/extending.md)
    for args in (
        ["eval", str(trained), "--no-analyses", "-o", "report"],
        ["solve", "successor", "01234501", "-c", str(trained), "--json"],
    ):
        proc = loopformer(args, tmp_path, [plugin_dir])
        message = " ".join(proc.stderr.split())
        assert proc.returncode == 1 and "names plug-in module 'my_plugins', which is not imported" in message
        assert "--import my_plugins" in message and str(trained) in message and "Traceback" not in proc.stderr
    ok(loopformer(["--import", "my_plugins", "eval", str(trained), "--no-analyses", "-o", "report"], tmp_path,
                  [plugin_dir]))  # fmt: skip
    metrics = json.loads((tmp_path / "report" / "metrics.json").read_text())
    assert "gated_cell" in json.dumps(metrics)
    out = ok(
        loopformer(["solve", "successor", "01234501", "-c", str(trained), "--json"], tmp_path, [plugin_dir],
                   LOOPFORMER_IMPORT="my_plugins")  # fmt: skip
    )
    answer = json.loads(out)
    assert answer["solution"] == "12345012" and answer["valid"] is True


def test_an_import_that_cannot_be_found_is_a_clear_error(trained: Path, tmp_path: Path) -> None:
    proc = loopformer(["--import", "my_plugins", "eval", str(trained), "--no-analyses", "-o", "report"], tmp_path, [])
    assert proc.returncode == 1
    message = " ".join(proc.stderr.split())
    assert "cannot import plug-in module 'my_plugins'" in message and "PYTHONPATH" in message
    assert "Traceback" not in proc.stderr


def test_environment_variable_and_module_class_names(plugin_dir: Path, tmp_path: Path) -> None:
    ok(
        loopformer(
            ["data", "successor", "--count", "5", "--format", "hrm", "-o", "data"],
            tmp_path,
            [plugin_dir],
            LOOPFORMER_IMPORT="json, my_plugins",
        )
    )
    assert (tmp_path / "data" / "train" / "dataset.json").is_file()
    # without any import option, the config names the classes themselves
    ok(
        loopformer(
            [
                "train",
                str(plugin_dir / "successor.yaml"),
                "-o",
                "run",
                "train.steps=2",
                "model.name=my_plugins:GatedCell",
                "data.task=my_plugins:SuccessorTask",
            ],
            tmp_path,
            [plugin_dir],
        )
    )
    saved = checkpoint_config(tmp_path / "run")
    assert (
        saved["model"]["name"] == "my_plugins:GatedCell"
        and saved["data"]["task"] == "my_plugins:SuccessorTask"
    )
    assert saved["plugins"] == ["my_plugins"]
    # a name that is not registered without the module says so
    proc = loopformer(["train", str(plugin_dir / "successor.yaml"), "-o", "run2"], tmp_path, [plugin_dir])
    assert proc.returncode == 1 and "unknown model 'gated_cell'" in proc.stderr


def test_an_installed_entry_point_registers_the_plugins(plugin_dir: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    info = site / "my_plugins_dist-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-plugins-dist\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[loopformer.plugins]\nmy_plugins = my_plugins\n")
    ok(
        loopformer(
            ["train", str(plugin_dir / "successor.yaml"), "-o", "run", "train.steps=2"],
            tmp_path,
            [site, plugin_dir],
        )
    )
    assert checkpoint_config(tmp_path / "run")["plugins"] == ["my_plugins"]
    # a broken entry point is a warning naming it; the command still runs
    (info / "entry_points.txt").write_text("[loopformer.plugins]\nbroken = no_such_module_xyz\n")
    proc = loopformer(["recipes"], tmp_path, [site])
    assert proc.returncode == 0 and "sudoku4_fprm" in proc.stdout
    assert "broken" in proc.stderr and "no_such_module_xyz" in proc.stderr
