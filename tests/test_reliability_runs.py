"""Issue 16, run folders and checkpoints: a fresh run never destroys a previous one, a lock keeps a
second process out, resume falls back past corrupt checkpoints, divergence never names a bad
checkpoint "good", one metrics record per step, and the ``latest`` pointer stays inside its folder."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from reliability_common import hold_lock
from test_train_utils import TinyLooped, tiny_config, tiny_dataset

from loopformer.runs.checkpoint import (
    latest_checkpoint,
    latest_good_checkpoint,
    resolve_checkpoint,
    step_dirs,
)
from loopformer.runs.folder import LOCK_NAME, RunFolderError, RunLock
from loopformer.train import Trainer, TrainingDivergedError


def _trainer(cfg) -> Trainer:
    return Trainer(cfg, model=TinyLooped(), train_data=tiny_dataset(64), eval_data=tiny_dataset(16, seed=1))


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _snapshot(folder) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != LOCK_NAME
    }


def test_fresh_run_into_a_run_folder_refuses_and_deletes_nothing(tmp_path) -> None:
    _trainer(tiny_config(tmp_path, "train.steps=4", "train.checkpoint_every=2")).fit()
    before = _snapshot(tmp_path)
    with pytest.raises(RunFolderError, match=r"train\.resume=true.*--overwrite"):
        _trainer(tiny_config(tmp_path, "train.steps=2"))
    assert _snapshot(tmp_path) == before  # checkpoints and metrics untouched
    assert not (tmp_path / LOCK_NAME).exists()  # the refused process left no lock behind


def test_overwrite_keeps_the_old_run_until_the_first_new_checkpoint(tmp_path) -> None:
    _trainer(tiny_config(tmp_path, "train.steps=4", "train.checkpoint_every=2")).fit()
    before = _snapshot(tmp_path)
    tr = _trainer(tiny_config(tmp_path, "train.steps=4", "train.checkpoint_every=2", "train.overwrite=true"))
    original = tr.train_step

    def killed_before_first_save() -> dict:
        if tr.step == 1:
            raise KeyboardInterrupt("killed")
        return original()

    tr.train_step = killed_before_first_save
    with pytest.raises(KeyboardInterrupt):
        tr.fit()
    assert _snapshot(tmp_path) == before  # killed before its first checkpoint: the old run is intact
    summary = _trainer(tiny_config(tmp_path, "train.steps=3", "train.overwrite=true")).fit()
    assert [p.name for p in step_dirs(tmp_path / "checkpoints")] == ["step_00000003"]
    assert summary["checkpoint"] == str(tmp_path / "checkpoints" / "step_00000003")
    # replaced whole (one exchange with the folder it was built in beside): nothing of the old run is left
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert not [p for p in tmp_path.parent.iterdir() if p.name.startswith(f".{tmp_path.name}.")]
    assert [m["step"] for m in _metrics(tmp_path)] == [1, 2, 3]


def test_a_second_process_is_kept_out_and_a_stale_lock_is_taken_over(tmp_path) -> None:
    proc = hold_lock(tmp_path, seconds=30)
    try:
        with pytest.raises(RunFolderError, match=rf"in use by process {proc.pid} on {socket.gethostname()}"):
            _trainer(tiny_config(tmp_path, "train.steps=2"))
        with pytest.raises(RunFolderError, match="in use"):
            _trainer(tiny_config(tmp_path, "train.steps=2", "train.resume=true"))
    finally:
        proc.kill()
        proc.wait()
    info = json.loads((tmp_path / LOCK_NAME).read_text())
    assert info["pid"] == proc.pid and info["host"] == socket.gethostname()
    _trainer(tiny_config(tmp_path, "train.steps=2")).fit()  # the holder died: its lock is stale
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_lock_from_another_host_is_never_taken_over(tmp_path) -> None:
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "elsewhere", "purpose": "train"}))
    with pytest.raises(RunFolderError, match="host 'elsewhere'.*delete"):
        RunLock(tmp_path, "eval").acquire()


def test_a_recycled_pid_does_not_hold_the_lock(tmp_path) -> None:
    # pid 1 exists but started at another time than the lock records: the holder is gone
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": socket.gethostname(), "started": "-1"}))
    with RunLock(tmp_path, "train") as lock:
        assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == lock.token


def test_resume_falls_back_past_a_corrupt_latest_checkpoint(tmp_path, caplog) -> None:
    _trainer(tiny_config(tmp_path, "train.steps=4", "train.checkpoint_every=2")).fit()
    bad = tmp_path / "checkpoints" / "step_00000004" / "model.safetensors"
    data = bytearray(bad.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte: same size, different hash
    bad.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="loopformer.train"):
        tr = _trainer(tiny_config(tmp_path, "train.steps=6", "train.resume=true"))
    assert tr.step == 2 and tr.resumed_from.name == "step_00000002"
    assert "step_00000004" in caplog.text and "SHA-256" in caplog.text
    (tmp_path / "checkpoints" / "step_00000002" / "state.json").write_text("{")  # truncated
    folder, skipped = latest_good_checkpoint(tmp_path / "checkpoints")
    assert folder is None and len(skipped) == 2 and "state.json" in skipped[1]


def test_divergence_never_names_a_non_finite_checkpoint_and_keeps_one_record_per_step(tmp_path) -> None:
    cfg = tiny_config(tmp_path, "train.steps=8", "train.checkpoint_every=2", "train.log_every=1")
    tr = _trainer(cfg)
    original = tr.train_step

    def blow_up() -> dict:
        out = original()
        if tr.step == 3:  # the update of step 4 leaves NaN weights behind (its own loss was finite)
            with torch.no_grad():
                tr.model.w.weight.fill_(float("nan"))
        return out

    tr.train_step = blow_up
    with pytest.raises(TrainingDivergedError) as info:
        tr.fit()
    assert "step_00000002" in str(info.value) and "step_00000004" not in str(info.value)
    assert [p.name for p in step_dirs(tmp_path / "checkpoints")] == ["step_00000002"]
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_00000002"
    steps = [m["step"] for m in _metrics(tmp_path)]
    assert len(steps) == len(set(steps)) and steps == [1, 2, 3, 4, 5]
    assert _metrics(tmp_path)[-1]["diverged"] == "weights"


def test_a_checkpoint_whose_forward_diverged_is_quarantined(tmp_path) -> None:
    cfg = tiny_config(tmp_path, "train.steps=8", "train.checkpoint_every=2", "train.log_every=1")
    tr = _trainer(cfg)
    original = tr.train_step

    def explode() -> dict:
        if tr.step == 4:  # the weights of checkpoint 4 give an infinite loss
            with torch.no_grad():
                tr.model.out.weight.mul_(1e30)
        return original()

    tr.train_step = explode
    with pytest.raises(TrainingDivergedError, match=r"at step 4.*last good checkpoint is .*step_00000002"):
        tr.fit()
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert "diverged_step_00000004" in names and "step_00000004" not in names
    steps = [m["step"] for m in _metrics(tmp_path)]
    assert len(steps) == len(set(steps))


def test_eval_records_join_the_step_record(tmp_path) -> None:
    _trainer(tiny_config(tmp_path, "train.steps=4", "train.eval_every=2", "train.log_every=1")).fit()
    records = _metrics(tmp_path)
    assert [m["step"] for m in records] == [1, 2, 3, 4]
    assert "eval_exact_acc" in records[1] and "loss" in records[1] and "eval_exact_acc" in records[3]


def test_latest_pointer_never_leaves_its_folder(tmp_path) -> None:
    _trainer(tiny_config(tmp_path / "a", "train.steps=2")).fit()
    _trainer(tiny_config(tmp_path / "b", "train.steps=4")).fit()
    other = tmp_path / "b" / "checkpoints" / "step_00000004"
    for pointer in (str(other), "../../b/checkpoints/step_00000004", "\xff\xfe"):
        (tmp_path / "a" / "checkpoints" / "latest").write_text(pointer)
        assert resolve_checkpoint(tmp_path / "a") == tmp_path / "a" / "checkpoints" / "step_00000002"


def test_stale_lock_of_a_killed_process_and_staging_leftovers(tmp_path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": proc.pid, "host": socket.gethostname()}))
        with pytest.raises(RunFolderError, match="in use"):
            RunLock(tmp_path, "train").acquire()
    finally:
        proc.kill()
        proc.wait()
    (tmp_path / ".overwrite-staging").mkdir()
    time.sleep(0.01)
    _trainer(tiny_config(tmp_path, "train.steps=1")).fit()
    assert not (tmp_path / ".overwrite-staging").exists()
    assert os.listdir(tmp_path / "checkpoints")


def test_loopformer_run_never_reuses_a_previous_run_folder(tmp_path, monkeypatch) -> None:
    from loopformer.commands.run import run_folder_for

    monkeypatch.chdir(tmp_path)
    first = run_folder_for(None, False)
    (first / "summary.json").write_text("{}")
    second = run_folder_for(None, False)  # same second: a new name, the first run untouched
    assert second != first and second.parent == first.parent and (first / "summary.json").is_file()
    with pytest.raises(RunFolderError, match="--overwrite"):
        run_folder_for(str(first), False)
    assert run_folder_for(str(first), True) == first
    assert run_folder_for(str(tmp_path / "new"), False) == tmp_path / "new"


def test_saving_a_step_again_swaps_the_folder_in_one_exchange(tmp_path, monkeypatch) -> None:
    """Re-saving a step (a resume that stops at once) replaced ``step_N`` by two renames, with a moment
    when the folder was missing (a kill there lost the only checkpoint); now one exchange."""
    tr = _trainer(tiny_config(tmp_path, "train.steps=2"))
    tr.fit()
    final = tmp_path / "checkpoints" / "step_00000002"
    real = os.replace

    def watched(src, dst, *args, **kwargs):
        assert os.fspath(src) != os.fspath(final), "the step folder was renamed away"
        return real(src, dst, *args, **kwargs)

    import loopformer.runs.checkpoint as of

    exchanged = []
    real_exchange = of.exchange_folders
    monkeypatch.setattr(of, "exchange_folders", lambda a, b: exchanged.append(b) or real_exchange(a, b))
    monkeypatch.setattr(os, "replace", watched)
    tr.save()
    assert exchanged == [final]
    assert latest_checkpoint(tmp_path / "checkpoints") == final
    assert not [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


def test_a_resume_of_a_finished_run_keeps_one_record_per_step(tmp_path) -> None:
    """``train --resume`` of a run that had finished evaluated again and appended a second record for
    its last step; the evaluation now joins that step's record."""
    _trainer(tiny_config(tmp_path, "train.steps=2")).fit()
    first = _metrics(tmp_path)
    _trainer(tiny_config(tmp_path, "train.steps=2", "train.resume=true")).fit()
    again = _metrics(tmp_path)
    assert [m["step"] for m in again] == [1, 2] and again[0] == first[0]
    assert {k for k in again[1] if k.startswith("eval_")} == {k for k in first[1] if k.startswith("eval_")}
