"""Issue 24, one write path (``loopformer.files``): atomic replacement, appends that never rewrite
earlier lines or leave a torn one, and no write through a symbolic link inside a run folder."""

from __future__ import annotations

import errno
import json
import os

import pytest
from test_train_utils import TinyLooped, tiny_config, tiny_dataset

from loopformer.files import (
    UnsafePathError,
    WriteError,
    append_line,
    atomic_write_json,
    atomic_write_text,
    atomic_writer,
    check_inside,
)
from loopformer.train import Trainer


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path) -> None:
    path = tmp_path / "summary.json"
    atomic_write_json(path, {"a": 1})
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_writer(path, "w") as fh:
            fh.write('{"a": 2, "trunc')
            raise RuntimeError("boom")
    assert json.loads(path.read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    atomic_write_text(path, '{"a": 3}')
    assert json.loads(path.read_text()) == {"a": 3}


def test_a_write_into_a_missing_folder_is_a_write_error_naming_the_file(tmp_path) -> None:
    with pytest.raises(WriteError, match=r"could not write .*nowhere.*summary\.json: No such file") as info:
        atomic_write_text(tmp_path / "nowhere" / "summary.json", "{}")
    assert info.value.errno == errno.ENOENT


def test_append_line_cuts_a_failed_write_back_to_whole_lines(tmp_path, monkeypatch) -> None:
    path = tmp_path / "metrics.jsonl"
    append_line(path, json.dumps({"step": 1}))
    append_line(path, json.dumps({"step": 2}))
    real_write = os.write

    def half_then_full(fd: int, data) -> int:  # half the line lands, then the disk is full
        if len(data) > 4:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(WriteError, match="metrics.jsonl: No space left on device"):
        append_line(path, json.dumps({"step": 3, "loss": 0.5}))
    monkeypatch.undo()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_check_inside_refuses_links_and_paths_leaving_the_folder(tmp_path) -> None:
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    assert check_inside(run / "checkpoints" / "x", run) == run / "checkpoints" / "x"
    (run / "checkpoints").symlink_to(elsewhere)
    with pytest.raises(UnsafePathError, match=r"checkpoints is a symbolic link"):
        check_inside(run / "checkpoints" / "step_1" / "model.safetensors", run)
    with pytest.raises(UnsafePathError, match="outside the folder"):
        check_inside(run / ".." / "elsewhere" / "x", run)
    linked_run = tmp_path / "scratch-link"
    linked_run.symlink_to(run)  # the run folder itself may be a link
    assert check_inside(linked_run / "metrics.jsonl", linked_run) == linked_run / "metrics.jsonl"


@pytest.mark.parametrize("link", ["metrics.jsonl", "checkpoints", "config.yaml", "provenance.json", "origin.json",
                                  "config_changes.jsonl"])  # fmt: skip
def test_training_refuses_to_write_through_a_link_in_its_run_folder(tmp_path, link) -> None:
    run, victim = tmp_path / "run", tmp_path / "victim"
    run.mkdir()
    victim.mkdir() if link == "checkpoints" else victim.write_text("precious\n")
    (run / link).symlink_to(victim)
    cfg = tiny_config(run, "train.steps=2", "train.checkpoint_every=1")
    with pytest.raises(UnsafePathError, match=rf"{link} is a symbolic link"):
        Trainer(cfg, model=TinyLooped(), train_data=tiny_dataset(32), eval_data=tiny_dataset(8, seed=1)).fit()
    if link == "checkpoints":
        assert list(victim.iterdir()) == []
    else:
        assert victim.read_text() == "precious\n"


def test_a_report_into_a_link_inside_a_run_folder_is_refused(tmp_path) -> None:
    """``eval -o RUN/LINK`` (a link inside the run folder to a folder outside it) wrote the report
    through the link; now refused naming it. A report folder that is itself a link elsewhere is refused too
    (issue 35: an output replaced whole never goes through a link; its target stays as it was)."""
    from loopformer.runs.folder import staged_output

    run, outside = tmp_path / "run", tmp_path / "outside"
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    outside.mkdir()
    (run / "report-link").symlink_to(outside)
    for target in (run / "report-link", run / "report-link" / "sub"):
        with pytest.raises(UnsafePathError, match="report-link is a symbolic link"):
            with staged_output(target, "eval", overwrite=True):
                pass
    assert list(outside.iterdir()) == []
    (tmp_path / "scratch").symlink_to(outside)
    (outside / "notes.txt").write_text("precious")
    with pytest.raises(UnsafePathError, match="scratch is a symbolic link"):
        with staged_output(tmp_path / "scratch", "eval", overwrite=True):
            pass
    assert sorted(p.name for p in outside.iterdir()) == ["notes.txt"]
