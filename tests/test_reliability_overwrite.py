"""Issue 24, ``train --overwrite``: the new run is built beside the old one and swapped in whole, so a
kill (SIGKILL, no clean-up) at any point leaves the folder holding the old run, byte for byte, or the
new one, whole; the next command clears what the killed one left beside the folder.

The kill is real: a forked child runs ``loopformer train --overwrite`` through the CLI and SIGKILLs
itself at the instant named (before the swap, right after it, while the old run is being removed)."""

from __future__ import annotations

import json
import os
import signal
import types
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from reliability_common import cli_text, tiny_recipe

from loopformer.cli import cli
from loopformer.runs import load_run
from loopformer.runs.folder import LOCK_NAME


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != LOCK_NAME}  # fmt: skip


def _train(recipe: Path, run: Path, *extra: str) -> str:
    result = CliRunner().invoke(cli, ["train", str(recipe), "-o", str(run), *extra])
    assert result.exit_code == 0, cli_text(result)
    return result.output


def _killed_child(monkeypatch_target: str, recipe: Path, run: Path) -> int:
    """Fork; the child SIGKILLs itself when ``monkeypatch_target`` is reached during the overwrite."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            import loopformer.runs.folder as of

            def die(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGKILL)

            if monkeypatch_target == "exchange":
                of.exchange_folders = die
            elif monkeypatch_target == "remove-old":
                real_swap = of.swap_in

                def swap_in(*args, **kwargs):
                    of.shutil = types.SimpleNamespace(rmtree=die)  # only swap_in's removal of the old run
                    return real_swap(*args, **kwargs)

                of.swap_in = swap_in
            elif monkeypatch_target == "after-remove":  # after the swap and the removal of the old run
                import loopformer.runs.folder as rf

                rf.RunLock.release = die
            CliRunner().invoke(cli, ["train", str(recipe), "-o", str(run), "--overwrite", "train.steps=3"])
        finally:
            os._exit(3)  # not reached when the kill came
    _, status = os.waitpid(pid, 0)
    return os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)


def _whole_new_run(run: Path) -> None:
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps and steps == sorted(steps), steps
    assert [p.name for p in (run / "checkpoints").glob("step_*")] == ["step_00000003"]
    yaml.safe_load((run / "config.yaml").read_text())
    load_run(run)  # the new checkpoint verifies and loads


@pytest.mark.parametrize("where", ["exchange", "after-remove", "remove-old"])
def test_a_kill_during_overwrite_leaves_the_old_run_or_the_new_one_whole(tmp_path, where) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(train={"steps": 2}), sort_keys=False))
    run = tmp_path / "run"
    _train(recipe, run)
    old = _snapshot(run)
    assert _killed_child(where, recipe, run) == signal.SIGKILL
    if where == "exchange":  # killed before the swap: the old run, byte for byte
        assert _snapshot(run) == old
    else:  # after it: the new run, whole (the old one may still lie beside it, hidden)
        _whole_new_run(run)
        assert not (run / "checkpoints" / "step_00000002").exists()
    # the next command clears what the killed one left beside the folder
    _train(recipe, run, "--overwrite", "train.steps=3")
    _whole_new_run(run)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]


def test_overwrite_replaces_the_whole_folder_in_one_exchange(tmp_path, monkeypatch) -> None:
    """One rename-exchange swaps the new run in: no entry-by-entry moves inside the run folder."""
    import loopformer.runs.folder as of

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(train={"steps": 2}), sort_keys=False))
    run = tmp_path / "run"
    _train(recipe, run)
    (run / "notes.txt").write_text("mine")  # an unrelated file of the old run goes with it
    calls: list[tuple[str, str]] = []
    exchange, replace = getattr(of, "exchange_folders", None), os.replace

    def spy_exchange(a, b):
        calls.append(("exchange", Path(b).name))
        return exchange(a, b) if exchange is not None else False

    def spy_replace(src, dst, *args, **kwargs):
        if Path(src).parent == run or Path(dst).parent == run:  # a move of one entry of the run folder
            calls.append(("replace", f"{src} -> {dst}"))
        return replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(of, "exchange_folders", spy_exchange, raising=False)
    monkeypatch.setattr(os, "replace", spy_replace)
    _train(recipe, run, "--overwrite", "train.steps=3")
    assert calls[:1] == [("exchange", "run")], calls
    assert not [c for c in calls if c[0] == "replace" and "checkpoints" not in c[1] and ".tmp" not in c[1]], calls
    assert not (run / "notes.txt").exists()
    _whole_new_run(run)


def test_overwrite_from_inside_the_run_folder(tmp_path, monkeypatch) -> None:
    """``-o .`` from the run folder itself: the new run replaces it and the process follows the name;
    from a folder below it the overwrite is refused (that folder would vanish)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(train={"steps": 2}), sort_keys=False))
    run = tmp_path / "run"
    _train(recipe, run)
    monkeypatch.chdir(run)
    _train(recipe, Path("."), "--overwrite", "train.steps=3")
    _whole_new_run(run)
    (run / "sub").mkdir()
    monkeypatch.chdir(run / "sub")
    result = CliRunner().invoke(cli, ["train", str(recipe), "-o", "..", "--overwrite", "train.steps=3"])
    assert result.exit_code == 1 and "holds the current folder" in result.output, cli_text(result)
    _whole_new_run(run)
