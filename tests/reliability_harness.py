"""Fuzz and kill-resume harness for issue 16 (used by tests/test_reliability_fuzz.py and
tests/test_reliability_kill.py), and the command that writes the crash-report table:

    python tests/reliability_harness.py --write docs/reliability.md

Fuzzing (hypothesis, derandomised so every run tries the same cases): random byte strings,
truncations and byte-level mutations of valid inputs of each kind go through the project's
loaders and, for some kinds, the ``loopformer`` command line (click's CliRunner). An outcome is
``success``, ``clear error`` (one of the project's own error types with a message; for the CLI:
exit status 1 or 2, one message, no traceback) or ``crash`` (anything else), and a crash fails
the test. The kill-resume rounds SIGKILL one tiny training run at random moments and inside
checkpoint writes, resume it each time, and compare the final weights with an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_common import TINY_RECIPE

from loopformer.config import ConfigError
from loopformer.numerics import NumericalFaultError
from loopformer.runs.checkpoint import CheckpointError
from loopformer.runs.folder import RunFolderError
from loopformer.tasks.base import TaskDataError

PROJECT_ERRORS = (ConfigError, TaskDataError, CheckpointError, NumericalFaultError, RunFolderError)
REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------------
# mutations
# ----------------------------------------------------------------------------------------------
def mutations(base: bytes) -> st.SearchStrategy[bytes]:
    """Random bytes, truncations of ``base``, and ``base`` with bytes flipped / inserted / deleted."""
    n = len(base)
    flips = st.lists(st.tuples(st.integers(0, max(n - 1, 0)), st.integers(0, 255)), min_size=1, max_size=6)

    def flip(edits: list[tuple[int, int]]) -> bytes:
        data = bytearray(base)
        for pos, value in edits:
            if data:
                data[pos % len(data)] = value
        return bytes(data)

    def splice(args: tuple[int, int, bytes]) -> bytes:
        start, length, insert = args
        return base[:start] + insert + base[start + length :]

    return st.one_of(
        st.binary(max_size=300),
        st.integers(0, n).map(lambda k: base[:k]),
        flips.map(flip),
        st.tuples(st.integers(0, n), st.integers(0, 40), st.binary(max_size=40)).map(splice),
    )


def text_mutations(base: str) -> st.SearchStrategy[bytes]:
    """``mutations`` plus line-level edits (a line dropped, duplicated or replaced by random text)."""
    lines = base.splitlines(keepends=True)

    def edit(args: tuple[int, int, str]) -> bytes:
        i, kind, text = args
        out = list(lines)
        i %= max(len(out), 1)
        if kind == 0 and out:
            del out[i]
        elif kind == 1 and out:
            out.insert(i, out[i])
        else:
            out.insert(i, text + "\n")
        return "".join(out).encode("utf-8", "surrogatepass")

    line_edits = st.tuples(st.integers(0, 1000), st.integers(0, 2), st.text(max_size=40)).map(edit)
    return st.one_of(mutations(base.encode()), line_edits)


# ----------------------------------------------------------------------------------------------
# outcomes
# ----------------------------------------------------------------------------------------------
class Tally:
    """Outcomes per input kind; ``crashes`` keeps the first few unexpected exceptions."""

    def __init__(self) -> None:
        self.counts: dict[str, Counter] = {}
        self.crashes: list[str] = []
        self.crash_types: Counter = Counter()  # "kind: ExceptionType" -> cases

    def call(self, kind: str, fn: Callable[[], Any]) -> None:
        counter = self.counts.setdefault(kind, Counter())
        try:
            fn()
        except PROJECT_ERRORS as err:
            if not str(err).strip():
                counter["crash"] += 1
                self.crashes.append(f"{kind}: {type(err).__name__} without a message")
                self.crash_types[f"{kind}: {type(err).__name__} without a message"] += 1
            else:
                counter["clear error"] += 1
        except Exception as err:
            counter["crash"] += 1
            if len(self.crashes) < 20:
                self.crashes.append(f"{kind}: {type(err).__name__}: {str(err)[:200]}")
            self.crash_types[f"{kind}: {type(err).__name__}"] += 1
        else:
            counter["success"] += 1

    def cli(self, kind: str, args: list[str]) -> None:
        from click.testing import CliRunner

        from loopformer.cli import cli

        counter = self.counts.setdefault(kind, Counter())
        result = CliRunner().invoke(cli, args, catch_exceptions=True)
        output = result.output
        if result.exit_code == 0:
            counter["success"] += 1
        elif (
            result.exit_code in (1, 2)
            and output.strip()
            and "Traceback" not in output
            and "internal error" not in output
            and (result.exception is None or isinstance(result.exception, SystemExit))
        ):
            counter["clear error"] += 1
        else:
            counter["crash"] += 1
            self.crash_types[f"{kind}: {type(result.exception).__name__}"] += 1
            if len(self.crashes) < 20:
                self.crashes.append(
                    f"{kind}: exit {result.exit_code}: {output.strip()[-300:]!r} "
                    f"({type(result.exception).__name__})"
                )


def _fuzz(strategy: st.SearchStrategy, n: int, body: Callable[[Any], None]) -> None:
    @settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def run(value: Any) -> None:
        body(value)

    run()


# ----------------------------------------------------------------------------------------------
# valid inputs
# ----------------------------------------------------------------------------------------------
def _sudoku_csv(folder: Path) -> Path:
    from loopformer.tasks.sudoku import SudokuTask

    task = SudokuTask(4)
    path = folder / "sudoku.csv"
    task.save(task.generate(4, 0, min_blanks=4, max_blanks=8), path)
    return path


ARC_TASK = {
    "train": [{"input": [[1, 2], [3, 4]], "output": [[4, 3], [2, 1]]}],
    "test": [{"input": [[0, 1], [1, 0]], "output": [[1, 0], [0, 1]]}],
}


def _checkpoint(folder: Path) -> Path:
    from loopformer.config import build_config
    from loopformer.models.registry import build_model
    from loopformer.runs.checkpoint import save_checkpoint

    cfg = build_config({**TINY_RECIPE, "out_dir": str(folder)})
    filled = {"vocab_size": 6, "seq_len": 16, "grid": [4, 4]}  # what the trainer fills in from the task
    cfg.model.fields.update(filled)
    model = build_model(cfg.model.name, config=cfg.model_config())
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    save_checkpoint(folder / "checkpoints", 1, model, cfg, ema_state=ema, training_state={"x": 1})
    return folder


OVERRIDE_KEYS = [
    "train.lr",
    "train.steps",
    "train.batch_size",
    "train.threads",
    "train.weight_decay",
    "train.grad_clip",
    "train.betas",
    "train.loop_sampler",
    "train.loop_sampler_options",
    "train.ema",
    "eval.batch_size",
    "eval.max_examples",
    "model.d_model",
    "model.n_heads",
    "model.name",
    "model.loop.max_steps",
    "loop_train.max_steps",
    "loop_eval.tol",
    "data.task",
    "data.options",
    "data.options.size",
    "data.train_size",
    "data.curriculum.threshold",
    "seed",
    "device",
    "out_dir",
    "train.mode",
    "train.nope",
    "nope",
    "model.nope",
    "loop_train.nope",
]
OVERRIDE_VALUES = st.one_of(
    st.sampled_from(
        [
            "0",
            "-1",
            "1",
            "3",
            "1e39",
            "-0.5",
            ".nan",
            ".inf",
            "true",
            "null",
            "[]",
            "[1, 2]",
            "{a: 1}",
            "{mean: 4}",
            "fprm",
            "cuda",
            "cpu",
            "poisson",
            "''",
            "{",
            "&a [*a]",
            "{a: 1, a: 2}",
            "100000",
            "2.5",
            "sudoku",
            "deep_supervision",
        ]
    ),
    st.text(max_size=12),
    st.integers(-(10**6), 10**6).map(str),
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False).map(repr),
)


# ----------------------------------------------------------------------------------------------
# the fuzz kinds
# ----------------------------------------------------------------------------------------------
def fuzz_kinds(work: Path, scale: float = 1.0) -> dict[str, Callable[[Tally], None]]:
    """``{kind: run(tally)}``; each runs its share of the cases (``scale`` x the default counts)."""
    from loopformer.config import build_config, load_config, load_config_file
    from loopformer.runs.checkpoint import load_checkpoint, load_training_state
    from loopformer.tasks.arc import load_folder, load_kaggle
    from loopformer.tasks.formats import load_hrm_folder, save_hrm_folder
    from loopformer.tasks.sudoku import SudokuTask

    work.mkdir(parents=True, exist_ok=True)
    count = lambda n: max(1, int(n * scale))  # noqa: E731
    recipe_text = yaml.safe_dump(TINY_RECIPE, sort_keys=False)
    csv_path = _sudoku_csv(work)
    csv_text = csv_path.read_text()
    task4 = SudokuTask(4)
    hrm = work / "hrm"
    save_hrm_folder(task4.load(csv_path), hrm, "train", vocab_size=task4.vocab_size)
    hrm_files = {p.name: p.read_bytes() for p in sorted((hrm / "train").iterdir())}
    ckpt = _checkpoint(work / "run")
    step = ckpt / "checkpoints" / "step_00000001"
    ckpt_files = {p.name: p.read_bytes() for p in sorted(step.iterdir())}
    cfg_json = (step / "config.json").read_text()
    arc_text = json.dumps(ARC_TASK, indent=1)
    kaggle_text = json.dumps(
        {"t1": {"train": ARC_TASK["train"], "test": [{"input": [[0, 1], [1, 0]]}]}}, indent=1
    )
    solutions_text = json.dumps({"t1": [[[1, 0], [0, 1]]]})

    def write(path: Path, data: bytes) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path

    def recipe(t: Tally) -> None:
        _fuzz(
            text_mutations(recipe_text),
            count(300),
            lambda b: t.call("recipe (YAML)", lambda: load_config(write(work / "r" / "recipe.yaml", b))),
        )

    def overrides(t: Tally) -> None:
        pair = st.tuples(st.sampled_from(OVERRIDE_KEYS), OVERRIDE_VALUES).map(lambda kv: f"{kv[0]}={kv[1]}")
        anything = st.text(max_size=30)
        _fuzz(
            st.lists(st.one_of(pair, anything), min_size=1, max_size=3),
            count(400),
            lambda o: t.call("key=value overrides", lambda: build_config({}, o)),
        )

    def config_json(t: Tally) -> None:
        _fuzz(
            text_mutations(cfg_json),
            count(250),
            lambda b: t.call("config.json", lambda: load_config_file(write(work / "c" / "config.json", b))),
        )

    def csv(t: Tally) -> None:
        _fuzz(
            text_mutations(csv_text),
            count(300),
            lambda b: t.call("Sudoku CSV", lambda: task4.load(write(work / "csv" / "s.csv", b))),
        )

    def arc(t: Tally) -> None:
        _fuzz(
            text_mutations(arc_text),
            count(300),
            lambda b: t.call("ARC task JSON", lambda: load_folder(write(work / "arc" / "t.json", b).parent)),
        )

    def kaggle(t: Tally) -> None:
        def body(args: tuple[bytes, bool]) -> None:
            data, mutate_solutions = args
            c = write(work / "kg" / "c.json", kaggle_text.encode() if mutate_solutions else data)
            s = write(work / "kg" / "s.json", data if mutate_solutions else solutions_text.encode())
            t.call("Kaggle JSON", lambda: load_kaggle(c, s))

        _fuzz(st.tuples(text_mutations(kaggle_text), st.booleans()), count(250), body)

    def numpy_folder(t: Tally) -> None:
        names = sorted(hrm_files)

        folder = work / "hrm_fuzz"
        for name, content in hrm_files.items():
            write(folder / "train" / name, content)

        def body(args: tuple[int, bytes]) -> None:
            i, data = args
            name = names[i % len(names)]
            write(folder / "train" / name, data)
            try:
                t.call("numpy folder (HRM)", lambda: load_hrm_folder(folder, "train", task=task4))
            finally:
                write(folder / "train" / name, hrm_files[name])

        base = st.integers(0, len(names) - 1).flatmap(
            lambda i: st.tuples(st.just(i), mutations(hrm_files[names[i]]))
        )
        _fuzz(base, count(120), body)

    def checkpoint(t: Tally) -> None:
        names = sorted(ckpt_files) + ["latest"]

        run = work / "ck_fuzz"
        shutil.copytree(ckpt, run)

        def body(args: tuple[int, bytes]) -> None:
            i, data = args
            name = names[i % len(names)]
            target = (
                run / "checkpoints" / name if name == "latest" else run / "checkpoints" / step.name / name
            )
            write(target, data)

            def load() -> None:
                loaded = load_checkpoint(run, use_ema=True)
                load_training_state(loaded.path)

            try:
                t.call("checkpoint folder", load)
            finally:
                write(target, ckpt_files.get(name, b"step_00000001\n"))

        base = st.integers(0, len(names) - 1).flatmap(
            lambda i: st.tuples(st.just(i), mutations(ckpt_files.get(names[i], b"step_00000001\n")))
        )
        _fuzz(base, count(200), body)

    def cli(t: Tally) -> None:
        good = write(work / "r" / "good.yaml", recipe_text.encode())
        puzzles = st.one_of(st.text(max_size=20), st.text(alphabet="1234.0 x", min_size=14, max_size=18))
        _fuzz(puzzles, count(30), lambda p: t.cli("CLI: solve", ["solve", "sudoku", p, "-c", str(ckpt)]))
        pair = st.tuples(st.sampled_from(OVERRIDE_KEYS), OVERRIDE_VALUES).map(lambda kv: f"{kv[0]}={kv[1]}")
        # train.steps=0 last: a config that would build is still refused, so nothing trains
        _fuzz(
            st.lists(pair, min_size=1, max_size=3),
            count(60),
            lambda o: t.cli("CLI: train overrides", ["train", str(good), *o, "train.steps=0"]),
        )
        _fuzz(
            text_mutations(recipe_text),
            count(60),
            lambda b: t.cli(
                "CLI: train recipe", ["train", str(write(work / "r" / "cli.yaml", b)), "train.steps=0"]
            ),
        )
        _fuzz(
            st.integers(0, len(ckpt_files) - 1).flatmap(
                lambda i: st.tuples(st.just(i), st.binary(max_size=64))
            ),
            count(30),
            lambda a: _cli_eval(t, ckpt, work, sorted(ckpt_files), a),
        )

    return {
        "recipe": recipe,
        "overrides": overrides,
        "config_json": config_json,
        "csv": csv,
        "arc": arc,
        "kaggle": kaggle,
        "numpy_folder": numpy_folder,
        "checkpoint": checkpoint,
        "cli": cli,
    }


def _cli_eval(t: Tally, ckpt: Path, work: Path, names: list[str], args: tuple[int, bytes]) -> None:
    i, data = args
    run = work / "ck_cli"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(ckpt, run)
    (run / "checkpoints" / "step_00000001" / names[i]).write_bytes(data)
    t.cli("CLI: eval", ["eval", str(run), "-n", "2", "--no-analyses", "-o", str(work / "eval_out")])


# ----------------------------------------------------------------------------------------------
# kill and resume
# ----------------------------------------------------------------------------------------------
def _worker(cfg: dict[str, Any], pause: str, conn: Any) -> None:
    """The training process (forked): reports "started N", "saved N" and "mid-checkpoint" through
    ``conn``; ``pause`` = "manifest:N" / "weights:N" waits for the SIGKILL inside step N's checkpoint
    write (before the manifest, i.e. files written but the folder not renamed; or after model.safetensors)."""
    import re

    from test_train_utils import TinyLooped, tiny_dataset

    import loopformer.runs.checkpoint as ck
    import loopformer.train.trainer as tr
    from loopformer.config import build_config

    where, at = pause.split(":")

    def step_of(path: Any) -> int:
        m = re.search(r"step_(\d+)", str(path))
        return int(m.group(1)) if m else -1

    original_manifest, original_weights, original_save = ck.write_manifest, ck.save_weights, tr.Trainer.save

    def slow_manifest(folder: Path) -> None:
        if where == "manifest" and step_of(folder) == int(at):
            conn.send("mid-checkpoint")
            time.sleep(60)
        original_manifest(folder)

    def slow_weights(tensors: Any, path: Path, metadata: Any = None, root: Any = None) -> None:
        original_weights(tensors, path, metadata, root)
        if where == "weights" and path.name == "model.safetensors" and step_of(path) == int(at):
            conn.send("mid-checkpoint")
            time.sleep(60)

    def save(self: Any) -> Path:
        out = original_save(self)
        conn.send(f"saved {self.step}")
        return out

    ck.write_manifest, ck.save_weights, tr.Trainer.save = slow_manifest, slow_weights, save
    trainer = tr.Trainer(build_config(cfg), model=TinyLooped(), train_data=tiny_dataset(64), eval_data=None)
    conn.send(f"started {trainer.step}")
    trainer.fit()
    conn.send("done")


class _Run:
    """A forked training process (no interpreter start-up: the parent has torch imported already)."""

    def __init__(self, cfg: dict[str, Any], pause: str) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        self._recv, send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_worker, args=(cfg, pause, send), daemon=True)
        self.proc.start()
        send.close()

    def readline(self) -> str:
        try:
            return self._recv.recv()
        except EOFError:
            return ""

    def running(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join()

    def finish(self, timeout: float) -> int | None:
        self.proc.join(timeout)
        return self.proc.exitcode


def _kill_config(out: Path, steps: int) -> dict[str, Any]:
    """A tiny deep-supervision run (tests/test_train_utils.TinyLooped) with an EMA, a checkpoint every step."""
    return {
        "out_dir": str(out),
        "device": "cpu",
        "model": {"name": "transformer"},
        "train": {
            "mode": "deep_supervision",
            "steps": steps,
            "batch_size": 8,
            "max_segments": 3,
            "lr": 0.01,
            "ema": 0.9,
            "progress": False,
            "log_every": 1,
            "threads": 1,
            "checkpoint_every": 1,
            "keep_checkpoints": 2,
            "resume": True,
        },
    }


def _launch(cfg: dict[str, Any], pause: str) -> _Run:
    return _Run(cfg, pause)


def _import_before_forking() -> None:
    """What every training process imports, once in the parent: each forked child then starts in
    milliseconds instead of importing the trainer and torch._dynamo (which AdamW's constructor pulls
    in lazily, about a second) itself."""
    import test_train_utils  # noqa: F401
    import torch

    import loopformer.train.trainer  # noqa: F401

    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])


def kill_resume_rounds(work: Path, kills: int = 4, steps: int = 30, seed: int = 0) -> dict[str, Any]:
    """One run SIGKILLed ``kills`` times (alternately inside a checkpoint write and at a random moment),
    resumed after each kill, then to the end; and an uninterrupted run. Returns the record."""
    from loopformer.runs.checkpoint import latest_checkpoint, load_weights

    _import_before_forking()
    rng = random.Random(seed)
    killed, plain = work / "killed", work / "plain"
    for folder in (killed, plain):
        shutil.rmtree(folder, ignore_errors=True)
    reference = _launch(_kill_config(plain, steps), "none:0")  # runs beside the killed one
    events = []
    for k in range(kills):
        pause = ("manifest", "none", "weights", "none")[k % 4]
        target = (k + 1) * steps // (kills + 1)  # spread the kills over the run
        proc = _launch(_kill_config(killed, steps), f"{pause}:{target}")
        started = proc.readline().split()
        wanted = "mid-checkpoint" if pause != "none" else f"saved {target}"
        while (line := proc.readline()) and line.strip() != wanted:
            pass
        if pause == "none":  # a random moment after the target step's checkpoint
            time.sleep(rng.uniform(0.0, 0.05))
        running = proc.running()
        proc.kill()
        at = latest_checkpoint(killed / "checkpoints")
        events.append(
            {
                "kill": k + 1,
                "moment": {
                    "none": "random",
                    "manifest": "before the manifest (files written, folder not renamed)",
                    "weights": "after model.safetensors",
                }[pause],
                "resumed_at_step": int(started[1]) if len(started) > 1 else None,
                "latest_after_kill": at.name if at else None,
                "killed_while_running": running,
            }
        )
    final = _launch(_kill_config(killed, steps), "none:0")
    if final.finish(300) != 0 or reference.finish(300) != 0:
        raise RuntimeError(
            f"a training run failed (exit codes {final.proc.exitcode}, {reference.proc.exitcode})"
        )
    a = load_weights(latest_checkpoint(killed / "checkpoints") / "model.safetensors")
    b = load_weights(latest_checkpoint(plain / "checkpoints") / "model.safetensors")
    ea = load_weights(latest_checkpoint(killed / "checkpoints") / "ema.safetensors")
    eb = load_weights(latest_checkpoint(plain / "checkpoints") / "ema.safetensors")
    identical = (
        set(a) == set(b)
        and all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)
        and all(np.array_equal(ea[k].numpy(), eb[k].numpy()) for k in ea)
    )
    metrics = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    return {
        "kills": kills,
        "steps": steps,
        "events": events,
        "identical_weights": identical,
        "metric_steps": [m["step"] for m in metrics],
    }


# ----------------------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------------------
def crash_report(scale: float = 1.0, kills: int = 4) -> tuple[Tally, dict[str, Any], float]:
    tally = Tally()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for run in fuzz_kinds(Path(tmp) / "fuzz", scale).values():
            run(tally)
        fuzz_time = time.perf_counter() - t0
        kill = kill_resume_rounds(Path(tmp) / "kill", kills=kills)
        kill["seconds"] = time.perf_counter() - t0 - fuzz_time
    return tally, kill, fuzz_time


def markdown(tally: Tally, kill: dict[str, Any], fuzz_time: float) -> str:
    rows = ["| input kind | cases tried | clear error | success | crash |", "|---|---:|---:|---:|---:|"]
    total = Counter()
    for kind, c in tally.counts.items():
        n = sum(c.values())
        total.update(c)
        rows.append(f"| {kind} | {n} | {c['clear error']} | {c['success']} | {c['crash']} |")
    rows.append(
        f"| **all** | **{sum(total.values())}** | {total['clear error']} | {total['success']} | "
        f"{total['crash']} |"
    )
    kills = ["| kill | moment | latest checkpoint after the kill |", "|---:|---|---|"]
    for e in kill["events"]:
        kills.append(f"| {e['kill']} | {e['moment']} | {e['latest_after_kill'] or '(none yet)'} |")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return "\n".join(
        [
            f"Fuzz cases: {sum(total.values())} in {fuzz_time:.1f} s (load average {load}).",
            "",
            *rows,
            "",
            f"Kill-resume: one {kill['steps']}-step run SIGKILLed {kill['kills']} times, resumed after each; "
            f"final weights (and EMA) identical to an uninterrupted run: **{kill['identical_weights']}**; "
            f"metrics.jsonl steps {kill['metric_steps']} ({kill['seconds']:.1f} s for both runs).",
            "",
            *kills,
            *(
                [
                    "",
                    "Crashes (input kind: exception type, cases):",
                    *[f"- {c}: {n}" for c, n in sorted(tally.crash_types.items())],
                ]
                if tally.crash_types
                else []
            ),
        ]
    )


BEGIN, END = "<!-- crash-report:begin -->", "<!-- crash-report:end -->"


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", type=Path, help="replace the table between the markers in this file")
    parser.add_argument("--scale", type=float, default=1.0)
    args = parser.parse_args()
    table = markdown(*crash_report(args.scale))
    if args.write:
        text = args.write.read_text()
        start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
        args.write.write_text(text[:start] + "\n" + table + "\n" + text[end:])
    print(table)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
