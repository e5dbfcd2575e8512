"""Stopping a training on SIGTERM / SIGINT: what cluster schedulers send before they preempt a job.

``StopSignals`` (a context manager around the training loop) turns the first SIGTERM or SIGINT
into a request: the loop finishes the step it is in, writes a checkpoint (or says why it could
not), releases the run folder's lock and raises ``TrainingInterrupted``, whose message the
``loopformer train`` command completes with the command that resumes the run; the exit status is
128 + the signal number, as for a process the signal killed. A second signal exits at once
(``KeyboardInterrupt`` for SIGINT, ``SystemExit(143)`` for SIGTERM; the lock is still released on
the way out, and every file is written atomically, so nothing half-written is left behind).

The final evaluation comes after the final checkpoint is written, so it is ``interruptible``: a signal during it
stops it at once (``TrainingInterrupted`` naming that checkpoint; a resume runs the evaluation again and
appends it to the last metrics record, as an uninterrupted run would have). Periodic evaluations and the
curriculum check are not interrupted: their step is not checkpointed yet, and the curriculum check changes
what the training does next.

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
from collections.abc import Iterator
from contextlib import contextmanager
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


class EvaluationInterrupted(BaseException):
    """A signal arrived inside ``StopSignals.interruptible`` (``signum``: which). A ``BaseException``, as
    ``KeyboardInterrupt`` is, so that no ``except Exception`` in the interrupted work takes it for an error."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


class StopSignals:
    """The first SIGTERM / SIGINT sets ``requested`` (the signal number); a second one exits at once."""

    def __init__(self, enabled: bool = True, distributed: bool = False) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.distributed = distributed
        self.requested: int | None = None
        self._previous: dict[int, Any] = {}
        self._votes: list[Any] = []  # the all-reduced flags of the last two steps (device tensors)
        self._interrupt = False  # inside ``interruptible``: the first signal raises EvaluationInterrupted

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

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """Work that a signal may stop at once (``EvaluationInterrupted``, also on entry when a signal came
        before): one process only, since under torchrun a rank leaving early would strand the others in
        their collectives (there the signal waits for the work to end, as elsewhere)."""
        if self.distributed or not self._previous:  # no handlers installed (disabled, or outside the context)
            yield
            return
        if self.requested is not None:
            raise EvaluationInterrupted(self.requested)
        self._interrupt = True
        try:
            yield
        finally:
            self._interrupt = False

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is None:
            self.requested = signum
            if self._interrupt:
                self._interrupt = False
                log.warning("%s: the final evaluation stops; the checkpoint is written", signal.Signals(signum).name)
                raise EvaluationInterrupted(signum)
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


__all__ = ["SIGNALS", "EvaluationInterrupted", "StopSignals", "TrainingInterrupted"]
