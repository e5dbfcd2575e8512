"""Console progress of a training run, for a terminal and for a log file.

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

import sys
import time
from typing import IO, Any

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
    if "token_acc" in m and "exact_acc" in m:
        parts.append(f"acc {m['token_acc']:.3f}/{m['exact_acc']:.3f}")
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
