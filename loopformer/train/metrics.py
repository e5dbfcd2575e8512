"""What a training run reports: the step's metrics on the device, the run folder's logs, the console.

The step's metrics and its divergence check, kept on the device between two host reads. A step yields its metrics as device tensors (loss and its parts, accuracies, norms, the loop's statistics,
the training mode's) and host values (step, learning rate, loop count, curriculum level). Reading a device
value makes the host wait for the device (a sync per value, ~10-15 per step before; issue 33), so:

- ``StepMeter`` sums the device metrics over the steps between two reads and brings them back in ONE
  transfer when the trainer logs (every ``train.log_every`` steps and at the last step), evaluates,
  checkpoints, checks the curriculum or stops. A logged device metric is the mean over the steps since the
  previous logged record ("halted": slots halted per step; under torchrun summed over ranks); a host value
  is the last step's. With ``train.log_every: 1`` every record is its own step's, as before.
- ``DivergenceCheck`` decides on the device whether a step's loss, state norm and gradient norm are finite
  and within ``train.max_loss`` / ``train.max_state_norm``. A failed step is not applied: the optimiser and
  the EMA are told to skip it (``optim.skip_step``, as mixed-precision loss scalers skip a step with
  non-finite gradients) and so is every later step, and the first failure (step, quantity, value) is kept
  on the device; the next read brings it back and the trainer raises ``TrainingDivergedError`` naming it,
  before any checkpoint or evaluation of the steps after it.

The run folder's logs: ``RunLog`` is rank 0's writer for the run folder: ``open`` (the config, the provenance
record (``loopformer.runs.folder.collect``), a resumed run's stale metrics dropped, the trackers: TensorBoard /
W&B, ``loopformer.train.tracking``), ``write`` (one JSONL line of ``metrics.jsonl``, mirrored to the trackers),
``join_last``, ``write_summary`` and ``close``; on other ranks every call does nothing.

The console: ``TrainProgress``, for a terminal and for a log file.

- On a terminal (stdout is a TTY): a rich progress bar whose text is the last step's metrics; rich
  fits it to the terminal's width.
- Anywhere else (``nohup``, SLURM / torchrun log files, a pipe): one plain line every
  ``train.log_every`` steps and at the last step, never cut to a width: step, loss, token / exact
  accuracy, loop steps, learning rate, throughput and the time left (ETA), flushed at once so a
  log file shows the run as it goes.
- Periodic and final evaluation results are printed in both modes (``eval step N: ...``).

``train.progress: false`` silences all of it (the metrics file is written either way).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor

from loopformer.config import RunConfig, save_config
from loopformer.files import append_line, atomic_write_json, atomic_write_text, read_bytes
from loopformer.models.base import ModelOutput


def last_finite(rows: Tensor) -> Tensor:
    """Per column, the last non-NaN value of a [steps, B] trace (NaN when none)."""
    finite = ~torch.isnan(rows)
    if rows.numel() == 0:
        return rows.new_full(rows.shape[1:], float("nan"))
    last = (finite.cumsum(0) == finite.sum(0, keepdim=True)) & finite
    vals = torch.where(last, rows, torch.zeros_like(rows)).sum(0)
    return torch.where(finite.any(0), vals, torch.full_like(vals, float("nan")))


QUANTITIES = ("loss", "state norm", "gradient norm")


def host_value(value: Any) -> Any:
    """A 0-dim tensor as a Python number (a host read); anything else as it is."""
    if isinstance(value, Tensor) and value.dim() == 0:
        return value.item()
    return value


class StepMetrics(Mapping):
    """What ``Trainer.train_step`` returns: the step's metrics by name. ``raw`` holds them as produced (device
    tensors and host values; what the trainer's ``StepMeter`` sums without reading); looking one up by name
    reads it (``host_value``), for callers that drive ``train_step`` themselves."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self.raw = raw

    def __getitem__(self, key: str) -> Any:
        return host_value(self.raw[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)


class DivergenceCheck:
    """The step-level divergence test, on the device; ``first``: [step, quantity index, value] of the first
    failed step (step -1: none yet)."""

    def __init__(self, device: torch.device, max_loss: float | None, max_state_norm: float | None) -> None:
        limits = [math.inf if x is None else float(x) for x in (max_loss, max_state_norm, None)]
        self.limits = torch.tensor(limits, dtype=torch.float64, device=device)
        self.first = torch.tensor([-1.0, 0.0, math.nan], dtype=torch.float64, device=device)

    def check(self, step: int, loss: Tensor, state_norm: Tensor, grad_norm: Tensor) -> Tensor:
        """Whether step ``step`` (0-based) may update (a 0-dim bool tensor): no step so far has failed."""
        return self.check_tensor(torch.full_like(self.first[0], step), loss, state_norm, grad_norm)

    def check_tensor(self, step: Tensor, loss: Tensor, state_norm: Tensor, grad_norm: Tensor) -> Tensor:
        """``check`` with the step as a 0-dim tensor (a compiled step: a new step does not recompile)."""
        values = torch.stack([loss.double(), state_norm.double(), grad_norm.double().to(loss.device)])
        bad = ~torch.isfinite(values) | (values > self.limits)
        which = torch.argmax(bad.to(torch.int32))  # the first failed quantity, in QUANTITIES' order
        worst = values.gather(0, which.reshape(1)).reshape(())  # a tensor index: no host read
        record = torch.stack([step.double().to(values.device), which.double(), worst])
        self.first = torch.where(bad.any() & (self.first[0] < 0), record, self.first)
        return self.first[0] < 0

    @staticmethod
    def failure(first: list[float]) -> tuple[int, str, float] | None:
        """(step, quantity, value) of a read ``first``; None when no step failed."""
        if first[0] < 0:
            return None
        return int(first[0]), QUANTITIES[int(first[1])], first[2]


class StepMeter:
    """Sums of the steps' device metrics since the last logged record (see the module docstring)."""

    def __init__(self) -> None:
        self.sums: dict[str, Tensor] = {}
        self.counts: dict[str, int] = {}
        self.host: dict[str, Any] = {}
        self.carried: dict[str, float] = {}  # sums restored from a checkpoint (added at the next read)

    def add(self, metrics: Mapping[str, Any]) -> None:
        """Add one step's metrics (device tensors summed in float64; other values kept as the last)."""
        raw = metrics.raw if isinstance(metrics, StepMetrics) else metrics
        for key, value in raw.items():
            if isinstance(value, Tensor):
                value = value.detach().to(torch.float64)
                total = self.sums.get(key)
                self.sums[key] = value if total is None else total + value
                self.counts[key] = self.counts.get(key, 0) + 1
            else:
                self.host[key] = value

    def read(self, extra: Tensor | None = None, reset: bool = True) -> tuple[dict[str, Any], list[float]]:
        """(the record: means of the device metrics and the last host values, ``extra`` read alongside) in one
        transfer; ``reset`` starts the next interval."""
        keys = list(self.sums)
        parts = [self.sums[k].reshape(1) for k in keys] + ([extra.reshape(-1)] if extra is not None else [])
        values = torch.cat([p.to(parts[0].device) for p in parts]).tolist() if parts else []
        record = dict(self.host)
        for key, total in zip(keys, values):
            record[key] = (total + self.carried.get(key, 0.0)) / self.counts[key]
        tail = values[len(keys) :]
        if reset:
            self.sums, self.counts, self.host, self.carried = {}, {}, {}, {}
        return record, tail

    def state_dict(self) -> dict[str, Any]:
        """The interval so far, for a checkpoint (a read: checkpoints are written at read points anyway)."""
        keys = list(self.sums)
        values = torch.cat([self.sums[k].reshape(1) for k in keys]).tolist() if keys else []
        sums = {k: v + self.carried.get(k, 0.0) for k, v in zip(keys, values)}
        return {"sums": {**self.carried, **sums}, "counts": dict(self.counts), "host": dict(self.host)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Continue the interval a checkpoint was written in (its sums are added at the next read)."""
        self.sums, self.counts, self.host, self.carried = {}, {}, {}, {}
        if state:
            self.carried = {k: float(v) for k, v in state["sums"].items()}
            self.counts = {k: int(v) for k, v in state["counts"].items()}
            self.host = dict(state["host"])


def loop_metrics(out: ModelOutput) -> dict[str, Tensor]:
    """Mean loop steps, last finite residual and converged fraction of a forward's loop, and with the
    implicit gradient (``ift``) the backward solve's mean iterations and largest final residual (device
    tensors; the backward ran inside this step)."""
    if out.loop is None:
        return {}
    metrics = {"loop_steps": out.loop.steps.float().mean()}
    if out.loop.residuals is not None and out.loop.residuals.numel():
        metrics["residual"] = torch.nanmean(last_finite(out.loop.residuals.detach().float()))
    metrics["converged"] = out.loop.converged.float().mean()
    if "ift_steps" in out.loop.stats:
        metrics["ift_steps"] = out.loop.stats["ift_steps"].float().mean()
        metrics["ift_residual"] = out.loop.stats["ift_residual"].float().nan_to_num(nan=0.0).amax()
        if "ift_capped" in out.loop.stats:
            metrics["ift_capped"] = out.loop.stats["ift_capped"].float().mean()
    return metrics


# --------------------------------------------------------------------------------------------
# The run folder's logs
# --------------------------------------------------------------------------------------------
def _step_of(line: str) -> float:
    """A metrics line's step; infinity for a line a killed run left torn (dropped on resume)."""
    try:
        record = json.loads(line)
        return float(record.get("step", 0))
    except (ValueError, AttributeError, TypeError):
        return math.inf


class RunLog:
    """The run folder's metrics and summary, written by rank 0 only (``enabled``)."""

    def __init__(self, run_dir: Path, enabled: bool = True) -> None:
        self.run_dir = run_dir
        self.enabled = enabled
        self.trackers: Any = None  # loopformer.train.tracking.Trackers after open() when any tracker is on

    def open(self, config: RunConfig, resumed: bool, step: int, device: Any = None) -> None:
        """Write the config and a provenance record (appended on a resume); a resumed run drops the metrics
        its killed predecessor wrote past ``step``; open the trackers (TensorBoard, W&B) ``config`` asks for."""
        if not self.enabled:
            return
        from loopformer.runs.folder import RunFolderError, append_record, collect
        from loopformer.train.tracking import open_trackers

        run_dir = self.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, run_dir)
        append_record(run_dir, collect(device if device is not None else config.device, step, resumed))
        metrics = run_dir / "metrics.jsonl"
        if resumed and (metrics.exists() or metrics.is_symlink()):  # drop lines the killed run wrote after it
            text = read_bytes(metrics, RunFolderError).decode("utf-8", errors="replace")  # a FIFO is named, never read
            kept = [line for line in text.splitlines() if _step_of(line) <= step]
            # a new file renamed over the old one: a failed write (disk full) leaves the old log whole
            atomic_write_text(metrics, "".join(line + "\n" for line in kept), root=run_dir)
        # a fresh run never deletes anything: loopformer.runs.folder refused a folder holding a run
        # (or, with --overwrite, made this a staging folder that replaces the old run at the first checkpoint)
        self.trackers = open_trackers(config, run_dir)  # None unless TensorBoard / W&B is asked for

    def write(self, record: dict[str, Any], step: int) -> None:
        """Append ``record`` to ``metrics.jsonl`` (never rewriting earlier lines) and its numbers to the trackers."""
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        append_line(self.run_dir / "metrics.jsonl", json.dumps(record), root=self.run_dir)
        if self.trackers is not None:
            numbers = {k: v for k, v in record.items()
                       if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)}  # fmt: skip
            self.trackers.log(numbers, record.get("step", step))

    def join_last(self, record: dict[str, Any], step: int) -> None:
        """Add ``record`` to the log's last record when that is ``step``'s (a resume at the final step
        evaluates again: still one record per step; the file is rewritten whole, atomically), else append."""
        if not self.enabled:
            return
        from loopformer.runs.folder import RunFolderError

        path = self.run_dir / "metrics.jsonl"
        lines = read_bytes(path, RunFolderError).decode("utf-8", errors="replace").splitlines() if path.exists() else []
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


# --------------------------------------------------------------------------------------------
# The console
# --------------------------------------------------------------------------------------------
EVAL_KEYS = ("valid_acc", "exact_acc", "token_acc", "loop_steps", "converged", "loss", "bits_per_byte")


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def step_text(m: dict[str, Any]) -> str:
    """The metrics of one training step as ``key value`` pairs (loss, accuracies, loops, level)."""
    parts = []
    if "loss" in m:
        parts.append(f"loss {m['loss']:.4f}")
    if "token_acc" in m:  # token / exact; a language model has no exact accuracy
        parts.append(f"acc {m['token_acc']:.3f}" + (f"/{m['exact_acc']:.3f}" if "exact_acc" in m else ""))
    if "loop_steps" in m:
        parts.append(f"loops {m['loop_steps']:.1f}")
    if "level" in m:
        parts.append(f"level {m['level']:g}")
    return "  ".join(parts)


def eval_text(step: int, result: dict[str, Any], final: bool = False) -> str:
    """One line for an evaluation's results (the keys of :data:`EVAL_KEYS` it holds)."""
    parts = []
    for key in EVAL_KEYS:
        value = result.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parts.append(f"{key} {value:.4f}" if key != "loop_steps" else f"{key} {value:.2f}")
    weights = f" ({result['weights']} weights)" if result.get("weights") else ""
    return f"{'final eval' if final else 'eval'} step {step}{weights}: " + (
        "  ".join(parts) or "(no metrics)"
    )


class TrainProgress:
    """Progress of ``total`` steps from ``start``: a bar on a terminal, plain lines elsewhere.

    ``enabled`` False prints nothing; ``tty`` (default: ``stream.isatty()``) picks the mode.
    """

    def __init__(
        self,
        enabled: bool,
        total: int,
        start: int,
        log_every: int,
        stream: IO[str] | None = None,
        tty: bool | None = None,
    ) -> None:
        self.enabled = enabled
        self.total = total
        self.start = start
        self.log_every = max(1, int(log_every))
        self.stream = stream if stream is not None else sys.stdout
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty()) if tty is None else tty
        self.bar: Any = None
        self.task_id: Any = None
        self.t0 = time.perf_counter()

    def __enter__(self) -> TrainProgress:
        self.t0 = time.perf_counter()
        if self.enabled and self.tty:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                console=Console(file=self.stream),
            )
            self.bar.__enter__()
            self.task_id = self.bar.add_task("train", total=self.total, completed=self.start, info="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)
            self.bar = None

    def line(self, step: int, metrics: dict[str, Any]) -> str:
        """The plain log line of ``step``: metrics, learning rate, steps/s since the start, ETA."""
        elapsed = time.perf_counter() - self.t0
        done = step - self.start
        rate = done / elapsed if elapsed > 0 and done > 0 else 0.0
        parts = [f"step {step}/{self.total}", step_text(metrics)]
        if "lr" in metrics:
            parts.append(f"lr {metrics['lr']:.2e}")
        if rate > 0:
            parts.append(f"{rate:.2f} steps/s" if rate >= 0.1 else f"{1 / rate:.1f} s/step")
            parts.append(f"eta {_duration((self.total - step) / rate)}")
        return "  ".join(p for p in parts if p)

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        """After optimiser step ``step``: move the bar, or print a line every ``log_every`` steps."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(self.task_id, completed=step, info=step_text(metrics))
        elif step % self.log_every == 0 or step == self.total:
            print(self.line(step, metrics), file=self.stream, flush=True)

    def message(self, text: str) -> None:
        """A line above the bar (terminal) or in the log (elsewhere)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, file=self.stream, flush=True)

    def evaluation(self, step: int, result: dict[str, Any], final: bool = False) -> None:
        """Print an evaluation's results in either mode."""
        if result:
            self.message(eval_text(step, result, final))
