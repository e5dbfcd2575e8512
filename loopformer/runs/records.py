"""The schemas of the JSON files run storage writes, and their one reader.

Every JSON file loopformer writes into a run folder and reads back (``summary.json``, ``provenance.json``,
``origin.json``, a checkpoint's ``state.json``, the ``checkpoints/best`` pointer, the lock file's record)
is read through ``loopformer.files.read_record`` with its schema here, so a malformed or crafted file is
one line naming the file and the field (``run/summary.json: 'steps' must be an integer >= 0, got str``),
never a bare key name, an internal error, or a value silently taken for another. The report's
``metrics.json`` and a sweep's ``sweep.json`` have their schemas beside their reader
(``loopformer.eval.compare``), which sits on this floor too.

- ``read_summary(run)``: a training run's (or a ``loopformer run`` folder's) ``summary.json``, or None.
- ``finished_summary(run, steps)``: the summary of a run whose training reached ``steps``, its
  ``checkpoint`` confined to the run's own ``checkpoints/`` (a path read from a file is never followed
  out of the folder that holds the file).
- ``inside(folder, relative, where)``: a path read from a file in ``folder`` that must stay inside it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from loopformer.files import Each, Rule, UnsafePathError, check_record, read_record
from loopformer.runs.layout import _STEP_DIR, CheckpointError

SUMMARY_FILE = "summary.json"
NONNEG = Rule(int, lambda v: v >= 0, "an integer >= 0")
NUMBER = (float, None)
PID = Rule(int, lambda v: 0 < v < 1 << 22, "a process id (1 .. 4194303)")

# what the trainer writes (loopformer.train.trainer.Trainer.summary) and `loopformer run` writes
# (loopformer.commands.run): every field optional, each of its type when present
SUMMARY: dict[str, Any] = {
    "steps?": NONNEG,
    "checkpoint?": (str, None),
    "run_dir?": (str, None),
    "resumed_from?": (str, None),
    "train?": (dict, None),
    "eval?": (Each((float, str, bool, None, dict, list)), None),
    "eval_label?": (str, None),
    "best?": ({"label": str, "metric": str, "value": float, "step?": NONNEG, "checkpoint?": str}, None),
    "wall_time?": NUMBER,
    "parameters?": (int, Each((int, None)), None),
    "mean_steps_by_difficulty?": (Each(NUMBER), None),
    "recipe?": (str, None),
    "overrides?": ([str], None),
}
PROVENANCE: dict[str, Any] = {
    "records": [{"step?": NONNEG, "started?": (str, None), "resumed?": bool, "command?": (str, None)}],
}
ORIGIN: dict[str, Any] = {"checkpoint": str, "run": str, "step": NONNEG, "time?": str}
BEST: dict[str, Any] = {
    "checkpoint": Rule(str, lambda v: _STEP_DIR.match(v) is not None, "a step_N folder name"),
    "metric": str,
    "value": float,
    "step": NONNEG,
    "mode?": Rule(str, lambda v: v in ("max", "min"), "'max' or 'min'"),
}
LOCK: dict[str, Any] = {"pid": PID, "host?": (str, None), "purpose?": str, "token?": str,
                        "started?": (str, None), "time?": str}  # fmt: skip
# a checkpoint's state.json (loopformer.train.resume.training_state): tensors are {"__tensor__": key}
STATE: dict[str, Any] = {
    "step": NONNEG,
    "stream?": dict,
    "rng?": dict,
    "optimizer?": dict,
    "optimizer_layout?": str,
    "curriculum?": (dict, None),
    "carry?": (dict, list, None),
    "elapsed?": NUMBER,
    "best?": (dict, None),
    "data?": (dict, None),
    # the metrics summed since the last logged record (loopformer.train.step_metrics.StepMeter.state_dict)
    "meter?": ({"sums": Each(float), "counts": Each(NONNEG), "host": dict}, None),
    "sharded?": {"world_size?": NONNEG, "aliases?": Each(str), "ema?": bool},
}


def read_summary(run: str | Path) -> dict[str, Any] | None:
    """``run/summary.json`` checked against ``SUMMARY`` (ValueError naming the file and field); None when
    there is none."""
    path = Path(run) / SUMMARY_FILE
    if not path.is_file():
        return None
    return read_record(path, SUMMARY)


def inside(folder: str | Path, relative: str, where: str) -> Path:
    """``folder / relative`` for a path read from a file in ``folder`` (``where`` names the file and field):
    a relative path without ``..`` that resolves inside ``folder``; UnsafePathError otherwise."""
    folder = Path(folder)
    rel = Path(relative)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise UnsafePathError(f"{where} names {relative!r}, which is not a path inside {folder}")
    path = folder / rel
    real_folder, real = os.path.realpath(folder), os.path.realpath(path)
    if os.path.commonpath([real_folder, real]) != real_folder:
        raise UnsafePathError(f"{where} names {relative!r}, which leads out of {folder} (a symbolic link)")
    return path


def finished_summary(run: str | Path, steps: int) -> dict[str, Any] | None:
    """``run``'s summary when its training reached ``steps`` and wrote a checkpoint, else None; its
    ``checkpoint`` is this run's own ``checkpoints/<step folder>`` (the recorded path is read as a name,
    never followed out of the run folder)."""
    run = Path(run)
    summary = read_summary(run)
    if summary is None or int(summary.get("steps") or 0) < steps or not summary.get("checkpoint"):
        return None
    name = Path(str(summary["checkpoint"])).name
    where = f"{run / SUMMARY_FILE}: 'checkpoint'"
    if _STEP_DIR.match(name) is None:
        raise CheckpointError(
            f"{where} names {summary['checkpoint']!r}, which is not a step_N checkpoint folder"
        )
    folder = inside(run, f"checkpoints/{name}", where)
    if not folder.is_dir():
        return None  # pruned or removed: the run is not finished as far as this command can see
    return {**summary, "checkpoint": str(folder)}


def check_state(skeleton: Any, path: Path) -> dict[str, Any]:
    """A checkpoint's ``state.json`` skeleton checked against ``STATE`` (CheckpointError naming the field)."""
    return check_record(skeleton, STATE, str(path), CheckpointError)


__all__ = [
    "BEST",
    "LOCK",
    "ORIGIN",
    "PROVENANCE",
    "STATE",
    "SUMMARY",
    "check_state",
    "finished_summary",
    "inside",
    "read_summary",
]
