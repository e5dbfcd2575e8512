"""Stopping a training on SIGTERM / SIGINT: what cluster schedulers send before they preempt a job.

``StopSignals`` (a context manager around the training loop) turns the first SIGTERM or SIGINT
into a request: the loop finishes the step it is in, writes a checkpoint (or says why it could
not), releases the run folder's lock and raises ``TrainingInterrupted``, whose message the
``loopformer train`` command completes with the command that resumes the run; the exit status is
128 + the signal number, as for a process the signal killed. A second signal exits at once
(``KeyboardInterrupt`` for SIGINT, ``SystemExit(143)`` for SIGTERM; the lock is still released on
the way out, and every file is written atomically, so nothing half-written is left behind).

Handlers are installed from the main thread. Under ``torchrun`` the ranks may see a signal at different
steps while a checkpoint needs all of them: each step's all-reduce (the one that averages the loss for the
divergence check) carries every rank's flag (``flag``, ``vote``), and every rank reads the reduced flag of the
step before (``agreed``: one step late, while the current step's work is still queued, so the read does not
wait), so all ranks stop after the same step and write the checkpoint together.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

log = logging.getLogger("loopformer.train")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingInterrupted(RuntimeError):
    """The training stopped on a signal; ``checkpoint`` is what a resume continues from (None: ``why_not``)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None, why_not: str | None = None) -> None:
        self.signum, self.step, self.checkpoint, self.why_not = signum, step, checkpoint, why_not
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        if checkpoint is not None:
            what = f"checkpoint {checkpoint} written"
        else:
            what = f"no checkpoint written ({why_not})"
        super().__init__(f"training stopped by {name} after step {step}; {what}")


class StopSignals:
    """The first SIGTERM / SIGINT sets ``requested`` (the signal number); a second one exits at once."""

    def __init__(self, enabled: bool = True, distributed: bool = False) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.distributed = distributed
        self.requested: int | None = None
        self._previous: dict[int, Any] = {}
        self._votes: list[Any] = []  # the all-reduced flags of the last two steps (device tensors)

    def flag(self, device: Any) -> Any:
        """This process's request as a 0-dim float64 tensor on ``device`` (1: a signal arrived)."""
        import torch

        return torch.full((), float(self.requested is not None), dtype=torch.float64, device=device)

    def vote(self, reduced: Any) -> None:
        """Keep the step's all-reduced flag (read by ``agreed`` one step later)."""
        self._votes = [*self._votes[-1:], reduced]

    def agreed(self) -> int | None:
        """The signal to stop on after this step: this process's (one process), or under torchrun whether
        any rank had one at the step before (every rank reads the same all-reduced value; SIGTERM when this
        rank saw none itself)."""
        if not self.distributed:
            return self.requested
        if len(self._votes) < 2 or not self._votes[0].item() > 0:
            return None
        return self.requested if self.requested is not None else int(signal.SIGTERM)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is None:
            self.requested = signum
            log.warning(
                "%s: the training stops after this step and writes a checkpoint; send it again to stop at once",
                signal.Signals(signum).name,
            )
            return
        self._restore()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def __enter__(self) -> StopSignals:
        if self.enabled:
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __exit__(self, *exc: object) -> None:
        self._restore()


__all__ = ["SIGNALS", "StopSignals", "TrainingInterrupted"]
