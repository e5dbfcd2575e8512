"""The run folder's logs and the progress bar (evaluation itself is ``loopformer.eval.evaluate``).

- ``RunLog``: rank 0's writer for the run folder: ``open`` (``prepare_run_dir``: the config, the
  provenance record (``loopformer.runs.provenance``), a
  resumed run's stale metrics, the trackers: TensorBoard / W&B), ``write`` (``write_metrics``: one
  JSONL line, mirrored to the trackers), ``write_summary`` and ``close``; on other ranks every call
  does nothing.
- ``last_finite`` for the loop's residual traces (the console output: loopformer.train.progress).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from loopformer.config import RunConfig, save_config
from loopformer.files import append_line, atomic_write_json, atomic_write_text

log = logging.getLogger("loopformer.train")


def last_finite(rows: Tensor) -> Tensor:
    """Per column, the last non-NaN value of a [steps, B] trace (NaN when none)."""
    finite = ~torch.isnan(rows)
    if rows.numel() == 0:
        return rows.new_full(rows.shape[1:], float("nan"))
    last = (finite.cumsum(0) == finite.sum(0, keepdim=True)) & finite
    vals = torch.where(last, rows, torch.zeros_like(rows)).sum(0)
    return torch.where(finite.any(0), vals, torch.full_like(vals, float("nan")))


# ----------------------------------------------------------------------------------------------
# the run folder's logs
# ----------------------------------------------------------------------------------------------
def prepare_run_dir(
    config: RunConfig, run_dir: Path, ckpt_dir: Path, resumed: bool, step: int, device: Any = None
) -> Any:
    """Write the config and a provenance record (``loopformer.runs.provenance``: appended on a resume); a
    resumed run drops the metrics its killed predecessor wrote past ``step``.

    Returns the run's ``loopformer.train.tracking.Trackers`` (TensorBoard, W&B) when any is on, else None.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, run_dir)
    from loopformer.runs.provenance import append_record, collect

    append_record(run_dir, collect(device if device is not None else config.device, step, resumed))
    metrics = run_dir / "metrics.jsonl"
    if resumed and metrics.is_file():  # drop lines the killed run wrote after it
        kept = [line for line in metrics.read_text(errors="replace").splitlines() if _step_of(line) <= step]
        # a new file renamed over the old one: a failed write (disk full) leaves the old log whole
        atomic_write_text(metrics, "".join(line + "\n" for line in kept), root=run_dir)
    # a fresh run never deletes anything: loopformer.runs.folder refused a folder holding a run
    # (or, with --overwrite, made this a staging folder that replaces the old run at the first checkpoint)
    from loopformer.train.tracking import open_trackers

    return open_trackers(config, run_dir)  # TensorBoard / W&B when asked


def _step_of(line: str) -> float:
    """A metrics line's step; infinity for a line a killed run left torn (dropped on resume)."""
    try:
        record = json.loads(line)
        return float(record.get("step", 0))
    except (ValueError, AttributeError, TypeError):
        return math.inf


def write_metrics(run_dir: Path, record: dict[str, Any], tb: Any, step: int) -> None:
    """Append ``record`` to ``metrics.jsonl`` (and its numbers to TensorBoard ``tb`` when given)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    append_line(run_dir / "metrics.jsonl", json.dumps(record), root=run_dir)  # never rewrites earlier lines
    if tb is not None:
        numbers = {k: v for k, v in record.items()
                   if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)}  # fmt: skip
        tb.log(numbers, record.get("step", step))


class RunLog:
    """The run folder's metrics and summary, written by rank 0 only (``enabled``)."""

    def __init__(self, run_dir: Path, enabled: bool = True) -> None:
        self.run_dir = run_dir
        self.enabled = enabled
        self.trackers: Any = None  # loopformer.train.tracking.Trackers after open() when any tracker is on

    def open(self, config: RunConfig, ckpt_dir: Path, resumed: bool, step: int, device: Any = None) -> None:
        if self.enabled:
            self.trackers = prepare_run_dir(config, self.run_dir, ckpt_dir, resumed, step, device)

    def write(self, record: dict[str, Any], step: int) -> None:
        if self.enabled:
            write_metrics(self.run_dir, record, self.trackers, step)

    def join_last(self, record: dict[str, Any], step: int) -> None:
        """Add ``record`` to the log's last record when that is ``step``'s (a resume at the final step
        evaluates again: still one record per step; the file is rewritten whole, atomically), else append."""
        if not self.enabled:
            return
        path = self.run_dir / "metrics.jsonl"
        lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
        if not lines or _step_of(lines[-1]) != step:
            self.write(record, step)
            return
        lines[-1] = json.dumps({**json.loads(lines[-1]), **record})
        atomic_write_text(path, "".join(line + "\n" for line in lines), root=self.run_dir)

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.enabled:
            atomic_write_json(self.run_dir / "summary.json", summary, root=self.run_dir, indent=2)

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None
