"""Issue 24, one lock built on the OS (``fcntl.flock``): two processes that try to lock a run folder at
the same instant never both hold it, a lock whose holder has not written its details yet is not
"unreadable" (it is held), and a holder that dies frees the folder at once."""

from __future__ import annotations

import fcntl
import json
import multiprocessing as mp
import os
import signal
import socket
import time

import pytest
from reliability_common import hold_lock

from loopformer.runs.folder import LOCK_NAME, RunFolderError, RunLock

ROUNDS = 200
DEAD_PID = 999_999_999  # above any pid_max: no such process


def _contender(folder: str, idx: int, start: str, barrier, inside, overlaps, wins, refusals) -> None:
    for _ in range(ROUNDS):
        if start == "stale" and idx == 0:  # a lock file left by a holder that is gone
            with open(os.path.join(folder, LOCK_NAME), "w") as fh:
                fh.write(json.dumps({"pid": DEAD_PID, "host": socket.gethostname(), "purpose": "train"}))
        barrier.wait()  # both processes leave the barrier together and lock at once
        try:
            lock = RunLock(folder, f"race-{idx}").acquire()
        except RunFolderError:
            with refusals.get_lock():
                refusals.value += 1
            barrier.wait()
            continue
        with inside.get_lock():
            inside.value += 1
            if inside.value > 1:
                overlaps.value += 1
        time.sleep(0.003)  # hold it long enough that a second holder would overlap
        with inside.get_lock():
            inside.value -= 1
        with wins.get_lock():
            wins.value += 1
        lock.release()
        barrier.wait()  # nobody starts the next round before both finished this one


@pytest.mark.timeout(180)
@pytest.mark.parametrize("start", ["free", "stale"])
def test_two_processes_locking_at_the_same_instant_never_both_hold_the_lock(tmp_path, start) -> None:
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(2, timeout=60)
    inside, overlaps, wins, refusals = (ctx.Value("i", 0) for _ in range(4))
    procs = [
        ctx.Process(
            target=_contender, args=(str(tmp_path), i, start, barrier, inside, overlaps, wins, refusals)
        )
        for i in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(150)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert overlaps.value == 0, f"both processes held the lock at once in {overlaps.value} rounds"
    assert wins.value + refusals.value == 2 * ROUNDS
    assert wins.value >= ROUNDS  # every round someone got it ...
    assert refusals.value >= ROUNDS // 4, refusals.value  # ... and the two really raced for it
    assert not (tmp_path / LOCK_NAME).exists()  # the last holder removed it


def test_a_lock_held_before_its_holder_wrote_its_details_is_held(tmp_path) -> None:
    # the old lock took an empty lock file over as "unreadable"; a flock held on it is a held lock
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(RunFolderError, match="in use by another process"):
            RunLock(tmp_path, "train").acquire()
    finally:
        os.close(fd)
    with RunLock(tmp_path, "train") as lock:
        assert lock.held


def test_a_killed_holder_frees_the_folder_and_a_second_lock_names_the_holder(tmp_path) -> None:
    proc = hold_lock(tmp_path, "convert")
    try:
        with pytest.raises(RunFolderError, match=rf"in use by process {proc.pid} on .*\(convert since"):
            RunLock(tmp_path, "eval").acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with RunLock(tmp_path, "eval") as lock:  # the OS dropped the dead holder's lock
        assert lock.held and (tmp_path / LOCK_NAME).is_file()
    assert not (tmp_path / LOCK_NAME).exists()


def test_the_same_process_locking_again_takes_over_its_own_lock(tmp_path) -> None:
    first = RunLock(tmp_path, "train").acquire()
    second = RunLock(tmp_path, "resume").acquire()  # an abandoned Trainer in this interpreter
    assert second.held and not first.held
    second.release()
    first.release()  # a no-op: it gave the lock up
    assert not (tmp_path / LOCK_NAME).exists()


def test_every_command_that_writes_a_folder_waits_for_its_lock(tmp_path) -> None:
    """While another process holds a folder's lock, every command that would write into it is refused
    naming the holder, and writes nothing: train, resume, eval (into the run, or -o), compare -o,
    data generate (a file in it, or an HRM folder), data prepare -o, sweep -o, consolidate --out."""
    import yaml
    from click.testing import CliRunner
    from reliability_common import fails_cleanly, tiny_recipe

    from loopformer.cli import cli

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(), sort_keys=False))
    run, busy = tmp_path / "run", tmp_path / "busy"
    assert CliRunner().invoke(cli, ["train", str(recipe), "-o", str(run)]).exit_code == 0
    step = sorted((run / "checkpoints").glob("step_*"))[-1]
    report = tmp_path / "report"
    assert CliRunner().invoke(cli, ["eval", str(run), "-o", str(report), "--examples", "2"]).exit_code == 0
    gen = ["data", "generate", "sudoku", "--size", "4", "--count", "3"]
    commands = {
        busy: [["train", str(recipe), "-o", str(busy)], ["eval", str(run), "-o", str(busy), "--examples", "2"],
               ["compare", str(report), "-o", str(busy)], [*gen, "-o", str(busy / "d.csv")],
               [*gen, "--format", "hrm", "-o", str(busy)], ["sweep", str(recipe), "loop_eval.max_steps=2,3", "-o", str(busy)],
               ["data", "prepare", "sudoku-extreme", "-o", str(busy), "--from", str(tmp_path)],
               ["push", str(run), "me/x", "--to-folder", str(busy)]],
        run: [["train", str(recipe), "-o", str(run), "--resume"], ["eval", str(run), "--examples", "2"],
              ["consolidate", str(step), "--out", str(run / "checkpoints")]],
    }  # fmt: skip
    for folder, invocations in commands.items():
        folder.mkdir(exist_ok=True)
        proc = hold_lock(folder, seconds=120)
        try:
            before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
            for args in invocations:
                fails_cleanly(CliRunner().invoke(cli, args), f"in use by process {proc.pid}")
                assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before, args
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
