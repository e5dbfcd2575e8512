"""The best checkpoint by an evaluation metric (``train.keep_best``).

The FPRM authors save the EMA weights at every evaluation (``checkpoint_every_eval: true`` in
nilskiKonjIzDunava/fprm ``config/cfg_pretrain_*.yaml``; ``pretrain.launch`` -> ``save_train_state``
writes ``step_<N>``) and publish the checkpoint with the best test metric (the model card of the
released checkpoints: "best test metric"); their code picks nothing itself. Here a run does it as it
trains: ``BestTracker.consider`` compares each evaluation the trainer runs (every ``eval_every``
steps and the final one, under ``loop_periodic``) with the best so far; a strictly better value
(NaN never is) makes the trainer checkpoint that step and point ``checkpoints/best`` at it
(``write_best``; ``save_checkpoint`` never prunes it). The record travels in every
checkpoint's training state, so a resumed run keeps comparing against the same best.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from loopformer.files import atomic_write_text, read_record
from loopformer.runs.layout import _STEP_DIR, BEST, CheckpointError, step_name

log = logging.getLogger("loopformer.train")


def best_label(record: dict[str, Any]) -> str:
    """'best (by eval_<metric>, step N)': how reports name the best checkpoint."""
    return f"best (by eval_{record['metric']}, step {record['step']})"


def write_best(
    root: str | Path, checkpoint: str | Path, metric: str, value: float, step: int, mode: str
) -> Path:
    """Point ``root/best`` at the step folder ``checkpoint`` (inside ``root``): a JSON record of the
    folder, the metric (a key of the evaluation summary), its value, the step and max / min, replaced
    atomically."""
    root = Path(root)
    name = Path(checkpoint).name
    if not _STEP_DIR.match(name) or not (root / name).is_dir():
        raise CheckpointError(f"best checkpoint {checkpoint} is not a step folder of {root}")
    record = {"checkpoint": name, "metric": metric, "value": float(value), "step": int(step), "mode": mode}
    atomic_write_text(root / BEST, json.dumps(record) + "\n", root=root)  # temp file, fsync, rename, fsync the folder
    return root / BEST


def read_best(root: str | Path) -> dict[str, Any] | None:
    """The record ``root/best`` holds (None when there is none); a malformed record, or one naming
    a folder that is gone (e.g. quarantined after a divergence), is ignored with a warning."""
    from loopformer.runs.records import BEST as SCHEMA

    pointer = Path(root) / BEST
    if not pointer.is_file():
        return None
    try:
        record = read_record(pointer, SCHEMA, CheckpointError)
    except CheckpointError as err:
        log.warning("%s (not a best-checkpoint record); ignoring it", err)
        return None
    if not (Path(root) / record["checkpoint"]).is_dir():
        log.warning("%s names %s, which is gone; ignoring it", pointer, record["checkpoint"])
        return None
    return record


def best_checkpoint(root: str | Path) -> Path | None:
    """The step folder ``root/best`` points to, None when there is none."""
    record = read_best(root)
    return Path(root) / record["checkpoint"] if record is not None else None


def find_best(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """(the best checkpoint folder, its record) of a run folder, a ``checkpoints/`` root or a
    ``loopformer run`` folder; CheckpointError when the run keeps none (train.keep_best unset)."""
    path = Path(path)
    if path.is_file() and path.name == BEST:
        path = path.parent
    for root in (path, path / "checkpoints", path / "model" / "checkpoints"):
        record = read_best(root)
        if record is not None:
            return root / record["checkpoint"], record
    raise CheckpointError(
        f"{path} keeps no best checkpoint (no checkpoints/best: the run was trained without train.keep_best)"
    )


def best_record_for(folder: str | Path) -> dict[str, Any] | None:
    """The best record of the run holding checkpoint ``folder`` when ``folder`` is that best one."""
    folder = Path(folder)
    record = read_best(folder.parent)
    return record if record is not None and record["checkpoint"] == folder.name else None


class BestTracker:
    """The best value of one evaluation metric so far, and the step and checkpoint it came from."""

    def __init__(self, metric: str, mode: str = "max") -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"train.keep_best_mode must be 'max' or 'min', got {mode!r}")
        self.metric, self.mode = metric, mode
        self.value: float | None = None
        self.step: int | None = None
        self.checkpoint: str | None = None  # the step folder's name

    @property
    def enabled(self) -> bool:
        return bool(self.metric)

    def better(self, value: float) -> bool:
        """Whether ``value`` strictly beats the best so far (the first finite value always does)."""
        if not math.isfinite(value):
            return False
        if self.value is None:
            return True
        return value > self.value if self.mode == "max" else value < self.value

    def consider(self, result: dict[str, Any], step: int) -> bool:
        """Take the evaluation ``result`` of ``step``; True when it is the new best (the caller then
        checkpoints the step and calls ``mark``)."""
        if not self.enabled or not result:
            return False
        if self.metric not in result:
            have = ", ".join(
                k for k, v in result.items() if isinstance(v, int | float) and not isinstance(v, bool)
            )
            raise ValueError(
                f"train.keep_best={self.metric!r} is not an evaluation metric of this run (it has {have})"
            )
        value = float(result[self.metric])
        if not self.better(value):
            return False
        self.value, self.step, self.checkpoint = value, step, step_name(step)
        return True

    def mark(self, checkpoint: Path) -> None:
        """The best step's checkpoint folder (as written)."""
        if checkpoint.name != self.checkpoint:
            raise ValueError(f"the best evaluation is step {self.step}, but {checkpoint} was written")

    # -- resume --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any] | None:
        if not self.enabled or self.value is None:
            return None
        return {"metric": self.metric, "mode": self.mode, "value": self.value, "step": self.step,
                "checkpoint": self.checkpoint}  # fmt: skip

    def restore(self, saved: dict[str, Any] | None, root: Path, resumed_step: int) -> None:
        """Continue from a checkpoint's record (``saved``) and the run's ``root/best`` pointer: the
        better of the two that name a folder still in ``root`` at or before ``resumed_step`` (the
        pointer can be newer than the state: the final evaluation runs after the final checkpoint)."""
        if not self.enabled:
            return
        candidates = []
        for record in (saved, read_best(root)):
            if not record or record.get("metric") != self.metric or record.get("mode", "max") != self.mode:
                continue
            if record.get("checkpoint") is None or record["step"] > resumed_step:
                continue
            if not (root / record["checkpoint"]).is_dir():
                log.warning(
                    "resume: the best checkpoint %s is not in %s; the best restarts",
                    record["checkpoint"],
                    root,
                )
                continue
            candidates.append(record)
        self.value = self.step = self.checkpoint = None
        for record in candidates:
            if self.better(float(record["value"])) or (
                self.value == record["value"] and record["step"] < self.step
            ):
                self.value, self.step, self.checkpoint = (
                    float(record["value"]),
                    int(record["step"]),
                    record["checkpoint"],
                )

    def fields(self) -> dict[str, Any]:
        """``best_step`` (the best evaluation's step so far) for an evaluation's metrics record."""
        return {"best_step": self.step} if self.enabled and self.step is not None else {}

    def write(self, root: Path) -> Path:
        """Point ``root/best`` at this best's checkpoint folder."""
        assert self.checkpoint is not None and self.value is not None and self.step is not None
        log.info("best checkpoint: %s (eval_%s = %s)", root / self.checkpoint, self.metric, self.value)
        return write_best(root, root / self.checkpoint, self.metric, self.value, self.step, self.mode)

    def summary(self, root: Path) -> dict[str, Any] | None:
        """``record()`` with the checkpoint's full path under ``root``."""
        record = self.record()
        return None if record is None else {**record, "checkpoint": str(root / record["checkpoint"])}

    def record(self) -> dict[str, Any] | None:
        """What ``summary.json`` reports: the folder, metric, value, step and label."""
        if self.value is None or self.checkpoint is None:
            return None
        out = {"metric": self.metric, "mode": self.mode, "value": self.value, "step": self.step,
               "checkpoint": self.checkpoint}  # fmt: skip
        return {**out, "label": best_label(out)}
