"""Issue 24, the output-folder swap (``loopformer.runs.folder.staged_output``): the new content replaces
the old in one atomic step where the OS allows (``renameat2(RENAME_EXCHANGE)``), the old content is
removed only after the new one is in place (nothing accumulates), and a crash at any step of the swap
(simulated by making that step fail) leaves the folder holding the old content or the new, whole."""

from __future__ import annotations

import os
import sys

import pytest

import loopformer.runs.folder as of
from loopformer.runs.folder import staged_output


def _files(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _old(tmp_path):
    out = tmp_path / "out"
    with staged_output(out, "prepare", overwrite=False) as tmp:
        (tmp / "train").mkdir()
        (tmp / "train" / "dataset.json").write_text('{"old": 1}')
    return out, _files(out)


def _new(tmp):
    (tmp / "train").mkdir()
    (tmp / "train" / "dataset.json").write_text('{"new": 1}')
    (tmp / "extra.txt").write_text("new")


NEW = {"train/dataset.json": b'{"new": 1}', "extra.txt": b"new"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux's")
def test_the_swap_is_one_exchange_and_the_old_content_is_removed_after_it(tmp_path, monkeypatch) -> None:
    out, _ = _old(tmp_path)
    calls = []
    real_exchange, real_rmtree = getattr(of, "exchange_folders", lambda a, b: False), of.shutil.rmtree

    def exchange(a, b):
        ok = real_exchange(a, b)
        calls.append(("exchange", ok, _files(out)))  # the new content is in place at the exchange itself
        return ok

    def rmtree(path, *args, **kwargs):
        calls.append(("rmtree", path.name, _files(out)))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(of, "exchange_folders", exchange, raising=False)
    monkeypatch.setattr(of.shutil, "rmtree", rmtree)
    renames = []
    real_replace = os.replace
    monkeypatch.setattr(of.os, "replace", lambda a, b: renames.append((a, b)) or real_replace(a, b))
    with staged_output(out, "prepare", overwrite=True) as tmp:
        _new(tmp)
    assert calls[-2][:2] == ("exchange", True) and calls[-2][2] == NEW
    assert calls[-1][0] == "rmtree" and calls[-1][2] == NEW  # removed only once the new content was in place
    assert renames == []  # no entry-by-entry moves: one exchange
    assert _files(out) == NEW and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_without_an_exchange_two_renames_and_nothing_left_behind(tmp_path, monkeypatch) -> None:
    out, _ = _old(tmp_path)
    monkeypatch.setattr(
        of, "exchange_folders", lambda a, b: False, raising=False
    )  # not Linux, or a file system without it
    with staged_output(out, "prepare", overwrite=True) as tmp:
        _new(tmp)
    assert _files(out) == NEW and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("step", ["exchange", "first-rename", "second-rename", "remove-old"])
def test_a_crash_at_any_step_of_the_swap_leaves_old_or_new_content_whole(tmp_path, monkeypatch, step) -> None:
    out, before = _old(tmp_path)
    real_replace = os.replace
    count = {"n": 0}

    def crash(*args, **kwargs):
        raise OSError(5, "simulated crash")

    if step == "exchange":
        monkeypatch.setattr(of, "exchange_folders", crash)
    elif step in ("first-rename", "second-rename"):
        monkeypatch.setattr(of, "exchange_folders", lambda a, b: False)
        nth = 1 if step == "first-rename" else 2

        def replace(a, b):
            count["n"] += 1
            if count["n"] == nth:
                raise OSError(5, "simulated crash")
            return real_replace(a, b)

        monkeypatch.setattr(of.os, "replace", replace)
    else:
        real_rmtree = of.shutil.rmtree

        def rmtree(path, *args, **kwargs):
            if ".staging-" in path.name and (path / "train").exists():  # the old content, after the swap
                raise KeyboardInterrupt("killed while removing the old content")
            return real_rmtree(path, *args, **kwargs)

        monkeypatch.setattr(of.shutil, "rmtree", rmtree)
    with pytest.raises((OSError, KeyboardInterrupt)):
        with staged_output(out, "prepare", overwrite=True) as tmp:
            _new(tmp)
    assert _files(out) in (before, NEW), _files(out)
    if step != "remove-old":
        assert _files(out) == before  # the swap never happened: the old content, untouched
    else:
        assert _files(out) == NEW
    monkeypatch.undo()
    with staged_output(out, "prepare", overwrite=True) as tmp:  # the next command clears the leftovers
        _new(tmp)
    assert _files(out) == NEW and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
