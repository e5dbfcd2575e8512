"""Evaluation of a looped model on a dataset: the one evaluation path of the library.

``loopformer eval``, ``loopformer run``, the experiments and the trainer's periodic and final
evaluation all call ``evaluate`` (or ``evaluate_lm`` for a task without a validator) and nothing
else; they share one batch loop (``_EvalPass.batches``).

- ``evaluate``: three accuracies, from the weakest to the strictest claim: token accuracy
  (labelled positions predicted right, pooled over the dataset), exact accuracy (every labelled
  position right), and the headline *valid accuracy*: the task's independent validator
  ``task.check(inputs_row, prediction_row)`` judges the whole predicted answer without looking at
  the label (a prediction counts only if, e.g., it is a valid shortest path). Per example it
  records difficulty, loop steps, convergence, exact and valid. ``segments > 1`` chains that many
  forward calls carrying the state, as TRM / HRM evaluate; ``check=False`` (or no task) skips the
  validator (``valid_accuracy`` is then NaN).
- ``evaluate_lm``: tasks without a validator (``Task.has_validator`` False: language modelling) are
  scored by the held-out cross-entropy (nats per token, summed in float64) and bits per byte, over
  the same batch loop.
- ``predict`` and ``arc_pass_at_k``: arg-max predictions, and ARC's pass@k voted over augmentations.
- ``EvalComm``: how a multi-process job shares an evaluation (rows per rank, sums over ranks,
  lock-step halting). The default is one process; the trainer passes its distributed strategy's
  (``loopformer.train.strategy``), so this module never imports the trainer.

Test-time compute curves and steps-vs-difficulty statistics are in ``loopformer.eval.budget``;
loading a trained run for evaluation is ``loopformer.runs.load_run``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from loopformer.loop import HALTINGS, LoopConfig
from loopformer.models.base import LoopedModel, ModelOutput
from loopformer.nn import autocast
from loopformer.numerics import check_output
from loopformer.tasks.base import IGNORE_INDEX, Task, TokenDataset


@dataclass
class ExampleRecord:
    """One evaluated example."""

    index: int
    difficulty: float
    steps: int
    converged: bool
    exact: bool  # every labelled position equals the label
    valid: bool  # the task's independent validator accepts the prediction (False when not checked)
    token_accuracy: float  # labelled positions right / labelled positions (nan when none)
    blocks: float = math.nan  # transformer blocks applied: each forward call's steps x the model's blocks_per_step()


@dataclass
class EvalResult:
    """Metrics of one evaluation pass; ``records`` keeps one entry per example (this rank's)."""

    task: str
    n: int
    exact_accuracy: float
    token_accuracy: float
    valid_accuracy: float  # NaN when the validator was not run
    mean_steps: float
    steps_histogram: dict[int, int]
    converged_fraction: float  # NaN under a halting rule that never stops early (fixed): nothing converges
    loop: dict[str, Any]
    records: list[ExampleRecord] = field(default_factory=list)
    mean_blocks: float = math.nan  # test-time compute: transformer blocks per example (ExampleRecord.blocks)

    @property
    def steps(self) -> np.ndarray:
        return np.asarray([r.steps for r in self.records], dtype=np.int64)

    @property
    def difficulty(self) -> np.ndarray:
        return np.asarray([r.difficulty for r in self.records], dtype=np.float64)

    @property
    def valid(self) -> np.ndarray:
        return np.asarray([r.valid for r in self.records], dtype=bool)

    @property
    def exact(self) -> np.ndarray:
        return np.asarray([r.exact for r in self.records], dtype=bool)

    def to_dict(self, records: bool = False) -> dict[str, Any]:
        out = {
            "task": self.task,
            "n": self.n,
            "valid_accuracy": self.valid_accuracy,
            "exact_accuracy": self.exact_accuracy,
            "token_accuracy": self.token_accuracy,
            "mean_steps": self.mean_steps,
            "mean_blocks": self.mean_blocks,
            "converged_fraction": self.converged_fraction,
            "steps_histogram": {str(k): v for k, v in sorted(self.steps_histogram.items())},
            "loop": self.loop,
        }
        if records:
            out["records"] = [dataclasses.asdict(r) for r in self.records]
        return out

    def summary(self) -> dict[str, Any]:
        """The short metric names the trainer logs (``eval_<key>`` in ``metrics.jsonl``)."""
        out: dict[str, Any] = {
            "n": self.n,
            "token_acc": self.token_accuracy,
            "exact_acc": self.exact_accuracy,
        }
        if not math.isnan(self.valid_accuracy):
            out["valid_acc"] = self.valid_accuracy
        out["loop_steps"] = self.mean_steps
        out["blocks"] = self.mean_blocks
        if not math.isnan(self.converged_fraction):
            out["converged"] = self.converged_fraction
        return out


class EvalComm:
    """One process: every row is local, sums are the values, no lock-step.

    A distributed strategy subclasses it: ``local_rows`` picks this rank's rows, ``local_batches`` its
    round-robin share of a run of batches, ``sum`` adds a
    list of floats over ranks, ``max`` takes the maximum, and ``lockstep`` returns an object with
    ``callback(t, z, active)`` / ``drain()`` (``loopformer.train.dist.LockstepHalting``) or None.
    """

    def local_rows(self, rows: np.ndarray) -> np.ndarray:
        return rows

    def local_batches(self, n: int) -> np.ndarray:
        """Which of ``n`` consecutive batches this process runs when batches are dealt round-robin (the
        authors' protocol, ``loopformer.eval.authors``): all of them here."""
        return np.arange(n, dtype=np.int64)

    def sum(self, values: list[float]) -> list[float]:
        return list(values)

    def max(self, value: float) -> float:
        return float(value)

    def lockstep(self) -> Any:
        return None


def loop_summary(cfg: LoopConfig | None) -> dict[str, Any]:
    """A JSON-friendly view of a loop configuration."""
    if cfg is None:
        return {}
    if dataclasses.is_dataclass(cfg):
        out = {k: v for k, v in dataclasses.asdict(cfg).items() if isinstance(v, str | int | float | bool)}
        for name in dict.fromkeys(str(getattr(cfg, axis, "")) for axis in ("solver", "halting", "grad")):
            group = getattr(cfg, "plugins", {}).get(name) if name else None  # the chosen plug-ins' options
            if dataclasses.is_dataclass(group):
                out[name] = dataclasses.asdict(group)
        return out
    return {"repr": repr(cfg)}


def iter_batches(dataset: TokenDataset, batch_size: int, max_batches: int | None = None) -> Iterator[slice]:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n_batches = math.ceil(len(dataset) / batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for b in range(n_batches):
        yield slice(b * batch_size, min(len(dataset), (b + 1) * batch_size))


def batch_tensors(
    dataset: TokenDataset, index: slice | np.ndarray, device: torch.device | str
) -> tuple[Tensor, Tensor, Tensor | None]:
    inputs = torch.as_tensor(dataset.inputs[index], device=device)
    labels = torch.as_tensor(dataset.labels[index], device=device)
    puzzle_ids = (
        None if dataset.puzzle_ids is None else torch.as_tensor(dataset.puzzle_ids[index], device=device)
    )
    return inputs, labels, puzzle_ids


def model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module, device: torch.device | str | None = None) -> Iterator[torch.device]:
    """``model`` on ``device`` (default: where it is) in eval mode; its training mode restored on exit."""
    device = torch.device(device) if device is not None else model_device(model)
    model.to(device)
    was_training = model.training
    model.eval()
    try:
        yield device
    finally:
        model.train(was_training)


def score_predictions(
    task: Task | None, inputs: np.ndarray, labels: np.ndarray, predictions: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per row: (exact [N] bool, valid [N] bool, right labelled tokens [N], labelled tokens [N]).

    ``task`` None: no validator is run and ``valid`` is all False."""
    mask = labels != IGNORE_INDEX
    right = ((predictions == labels) & mask).sum(axis=1)
    count = mask.sum(axis=1)
    exact = right == count
    if task is None:
        return exact, np.zeros(len(inputs), dtype=bool), right, count
    valid = np.asarray([bool(task.check(inputs[i], predictions[i])) for i in range(len(inputs))], dtype=bool)
    return exact, valid, right, count


def _progress(batches: Iterator[EvalBatch], enabled: bool, total: int, description: str) -> Iterator[EvalBatch]:
    """``batches`` under a rich progress bar when asked for and there is more than one batch."""
    if not enabled or total <= 1:
        yield from batches
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  transient=True) as bar:  # fmt: skip
        yield from bar.track(batches, total=total, description=description)


@dataclass
class EvalBatch:
    """One evaluated batch: dataset rows, tensors, the last segment's output and loop steps summed over segments."""

    rows: np.ndarray
    inputs: Tensor
    labels: Tensor
    out: ModelOutput
    steps: np.ndarray  # [B] int64
    converged: np.ndarray  # [B] bool
    blocks: np.ndarray  # [B] float64: transformer blocks applied (steps x blocks_per_step, summed over segments)


class _EvalPass:
    """``model`` in eval mode on ``device`` running ``loop`` (default: its own) over ``dataset``.

    The initial iterates are drawn from one generator seeded with ``seed``; the training mode is
    restored on exit. ``batches()`` yields this rank's batches (``comm.local_rows``); a rank with
    fewer batches keeps answering the lock-step all-reduces of the others.
    """

    def __init__(
        self,
        model: LoopedModel,
        dataset: TokenDataset,
        loop: LoopConfig | None,
        device: torch.device | str | None,
        seed: int,
        comm: EvalComm | None = None,
    ) -> None:
        self.model = model
        self.dataset = dataset
        self.cfg = loop if loop is not None else model.config.loop
        self.seed = seed
        self.comm = comm if comm is not None else EvalComm()
        self._mode = eval_mode(model, device)

    def __enter__(self) -> _EvalPass:
        self.device = self._mode.__enter__()
        self.generator = torch.Generator(device=self.device).manual_seed(self.seed)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)

    def forward(
        self,
        index: slice | np.ndarray,
        state: Tensor | None = None,
        callback: Callable | None = None,
        bf16: bool = False,
    ) -> tuple[Tensor, Tensor, ModelOutput]:
        """(inputs, labels, model output) of the rows ``index``."""
        inputs, labels, puzzle_ids = batch_tensors(self.dataset, index, self.device)
        ctx = autocast(self.device, bf16) if bf16 else contextlib.nullcontext()
        extra: dict[str, Any] = {}  # only what is set: a model may override forward without them
        if state is not None:
            extra["state"] = state
        if callback is not None:
            extra["callback"] = callback
        with ctx:
            out = self.model(inputs, loop=self.cfg, puzzle_ids=puzzle_ids, generator=self.generator, **extra)
        where = (
            f"rows {index.start}..{index.stop}"
            if isinstance(index, slice)
            else f"rows {index[0]}..{index[-1] + 1}"
        )
        check_output(out, f"evaluation {where}")  # a NaN model is never scored
        return inputs, labels, out

    def batches(
        self, batch_size: int, max_batches: int | None = None, segments: int = 1, bf16: bool = False
    ) -> Iterator[EvalBatch]:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        rows = self.comm.local_rows(np.arange(len(self.dataset), dtype=np.int64))
        n_batches = math.ceil(len(rows) / batch_size)
        if max_batches is not None:
            n_batches = min(n_batches, max_batches)
        lockstep = self.comm.lockstep()
        if lockstep is not None:  # every rank runs the same number of batches' lock-step rounds
            n_batches = int(self.comm.max(n_batches))
        for b in range(n_batches):
            index = rows[b * batch_size : (b + 1) * batch_size]
            if len(index) == 0:
                for _ in range(segments):
                    lockstep.drain()
                continue
            yield self._segments(index, segments, lockstep, bf16)

    def _segments(self, index: np.ndarray, segments: int, lockstep: Any, bf16: bool) -> EvalBatch:
        state = None
        steps = np.zeros(len(index), dtype=np.int64)
        converged = np.zeros(len(index), dtype=bool)
        blocks = np.zeros(len(index), dtype=np.float64)
        for _ in range(max(1, segments)):
            inputs, labels, out = self.forward(index, state, lockstep.callback if lockstep else None, bf16)
            if lockstep is not None:
                lockstep.drain()
            state = out.state
            if out.loop is None:  # a model that bypasses the engine: one pass
                these = np.ones(len(index), dtype=np.int64)
            else:
                these = out.loop.steps.detach().cpu().numpy().reshape(-1)
                converged = out.loop.converged.detach().cpu().numpy().reshape(-1).astype(bool)
            steps += these
            blocks += these * float(self.model.blocks_per_step())  # the model counts its own (this call's) blocks
        return EvalBatch(index, inputs, labels, out, steps, converged, blocks)


@torch.no_grad()
def evaluate(
    model: LoopedModel,
    task: Task | None,
    dataset: TokenDataset,
    loop: LoopConfig | None = None,
    batch_size: int = 64,
    max_batches: int | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
    seed: int = 0,
    *,
    segments: int = 1,
    check: bool = True,
    bf16: bool = False,
    comm: EvalComm | None = None,
) -> EvalResult:
    """Run ``model`` (with ``loop`` or its default loop) over ``dataset`` and score every prediction.

    The initial iterate is drawn from a generator seeded with ``seed``, so an evaluation is
    repeatable. ``segments`` chained forward calls carry the state; ``check`` runs the task's
    validator (never without a task); ``comm`` shares the rows and the counts between ranks.
    """
    if len(dataset) == 0:
        raise ValueError("cannot evaluate on an empty dataset")
    validator = task if check and task is not None and task.has_validator else None
    records: list[ExampleRecord] = []
    right_total = count_total = 0
    name = task.name if task is not None else str(dataset.meta.get("task", ""))
    with _EvalPass(model, dataset, loop, device, seed, comm) as run:
        total = math.ceil(len(dataset) / max(batch_size, 1))
        total = total if max_batches is None else min(total, max_batches)
        for b in _progress(run.batches(batch_size, max_batches, segments, bf16), progress, total, f"eval {name}"):
            pred = b.out.logits.argmax(dim=-1).cpu().numpy()
            exact, valid, right, count = score_predictions(
                validator, dataset.inputs[b.rows], dataset.labels[b.rows], pred
            )
            right_total += int(right.sum())
            count_total += int(count.sum())
            records.extend(_records(dataset, b, exact, valid, right, count))
    return _result(name, records, right_total, count_total, validator is not None, run, loop_summary(run.cfg))


def _records(
    dataset: TokenDataset,
    b: EvalBatch,
    exact: np.ndarray,
    valid: np.ndarray,
    right: np.ndarray,
    count: np.ndarray,
) -> Iterator[ExampleRecord]:
    for j, i in enumerate(b.rows):
        yield ExampleRecord(
            index=int(i),
            difficulty=float(dataset.difficulty[i]),
            steps=int(b.steps[j]),
            converged=bool(b.converged[j]),
            blocks=float(b.blocks[j]),
            exact=bool(exact[j]),
            valid=bool(valid[j]),
            token_accuracy=float(right[j] / count[j]) if count[j] else float("nan"),
        )


def _result(
    name: str,
    records: list[ExampleRecord],
    right: int,
    count: int,
    checked: bool,
    run: _EvalPass,
    loop: dict[str, Any],
) -> EvalResult:
    """The pass's metrics, summed over ranks (``records`` and the histogram stay this rank's)."""
    local = [
        len(records),
        sum(r.exact for r in records),
        sum(r.valid for r in records),
        right,
        count,
        sum(r.steps for r in records),
        sum(r.converged for r in records),
        sum(r.blocks for r in records),
    ]
    n, exact, valid, right_all, count_all, steps, converged, blocks = run.comm.sum([float(x) for x in local])
    n_ = max(n, 1.0)
    stops = HALTINGS.get(str(run.cfg.halting)).stops_early  # a fixed count of loops converges nowhere
    return EvalResult(
        task=name,
        n=int(n),
        exact_accuracy=exact / n_,
        token_accuracy=right_all / count_all if count_all else float("nan"),
        valid_accuracy=valid / n_ if checked else float("nan"),
        mean_steps=steps / n_,
        steps_histogram=dict(sorted(Counter(r.steps for r in records).items())),
        converged_fraction=converged / n_ if stops else math.nan,
        loop=loop,
        records=records,
        mean_blocks=blocks / n_,
    )


@dataclass
class LMEvalResult:
    """Held-out language-modelling metrics: mean cross-entropy per labelled token and bits per byte."""

    task: str
    n: int  # examples (windows)
    tokens: int  # labelled tokens scored
    loss: float  # nats per token
    bits_per_byte: float
    token_accuracy: float  # no exact accuracy: a whole window predicted right is no measure of a language model
    mean_steps: float
    loop: dict[str, Any]
    mean_blocks: float = math.nan  # test-time compute: transformer blocks per window

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> dict[str, Any]:
        """The short metric names the trainer logs."""
        return {
            "n": self.n,
            "loss": self.loss,
            "bits_per_byte": self.bits_per_byte,
            "token_acc": self.token_accuracy,
            "loop_steps": self.mean_steps,
            "blocks": self.mean_blocks,
        }


@torch.no_grad()
def evaluate_lm(
    model: LoopedModel,
    task: Task,
    dataset: TokenDataset,
    loop: LoopConfig | None = None,
    batch_size: int = 64,
    max_batches: int | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
    seed: int = 0,
    *,
    segments: int = 1,
    bf16: bool = False,
    comm: EvalComm | None = None,
) -> LMEvalResult:
    """Mean cross-entropy (nats per labelled token, summed in float64) and bits per byte of ``model`` on
    ``dataset`` (``loopformer.tasks.text.bits_per_byte`` with the task's ``tokens_per_byte``, 1 for bytes)."""
    from loopformer.tasks.text import bits_per_byte

    if len(dataset) == 0:
        raise ValueError("cannot evaluate on an empty dataset")
    nll = right = count = steps = blocks = n = 0.0
    with _EvalPass(model, dataset, loop, device, seed, comm) as run:
        total = math.ceil(len(dataset) / max(batch_size, 1))
        for b in _progress(run.batches(batch_size, max_batches, segments, bf16), progress, total, f"eval {task.name}"):
            logits, labels = b.out.logits.float(), b.labels
            mask = labels != IGNORE_INDEX
            token_nll = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                labels.reshape(-1),
                ignore_index=IGNORE_INDEX,
                reduction="none",
            )
            nll += float(token_nll.double().sum())
            hit = (logits.argmax(-1) == labels) & mask
            right += float(hit.sum())
            count += float(mask.sum())
            steps += float(b.steps.sum())
            blocks += float(b.blocks.sum())
            n += len(b.rows)
    nll, right, count, steps, blocks, n = run.comm.sum([nll, right, count, steps, blocks, n])
    loss = nll / count if count else float("nan")
    return LMEvalResult(
        task=task.name,
        n=int(n),
        tokens=int(count),
        loss=loss,
        bits_per_byte=bits_per_byte(loss, float(task.tokens_per_byte)),
        token_accuracy=right / count if count else float("nan"),
        mean_steps=steps / max(n, 1),
        loop=loop_summary(run.cfg),
        mean_blocks=blocks / max(n, 1),
    )


@torch.no_grad()
def predict(
    model: LoopedModel,
    dataset: TokenDataset,
    loop: LoopConfig | None = None,
    batch_size: int = 64,
    device: torch.device | str | None = None,
    seed: int = 0,
    *,
    segments: int = 1,
) -> np.ndarray:
    """Arg-max predictions [N, T] of ``model`` on every row of ``dataset`` (after ``segments`` chained
    calls carrying the state, as ``evaluate``)."""
    return _predictions(model, dataset, loop, batch_size, device, seed, segments)[0]


def _predictions(model: LoopedModel, dataset: TokenDataset, loop: LoopConfig | None, batch_size: int,
                 device: torch.device | str | None, seed: int, segments: int) -> tuple[np.ndarray, np.ndarray | None]:  # fmt: skip
    """(arg-max predictions [N, T], the halting head's logits [N] or None when the model has no such head)."""
    rows, q = [], []
    with _EvalPass(model, dataset, loop, device, seed) as run:
        for b in run.batches(batch_size, segments=segments):
            rows.append(b.out.logits.argmax(-1).cpu().numpy())
            q.append(None if b.out.q_logits is None else b.out.q_logits.float().cpu().numpy())
    preds = np.concatenate(rows) if rows else np.zeros((0, dataset.inputs.shape[1]), dtype=np.int64)
    return preds, None if not q or any(x is None for x in q) else np.concatenate(q)


@torch.no_grad()
def arc_pass_at_k(
    model: LoopedModel,
    task: Task,
    dataset: TokenDataset | None = None,
    loop: LoopConfig | None = None,
    k: int = 2,
    batch_size: int = 64,
    device: torch.device | str | None = None,
    seed: int = 0,
    *,
    segments: int = 1,
) -> dict[str, float]:
    """ARC pass@k with voting over augmentations: ``task.evaluate`` of the model's predictions on
    ``dataset`` (default: every test pair under every augmentation version,
    ``task.generate(0, seed, part="test")``). Returns ``ArcTask.evaluate``'s dictionary
    (``score``, ``all_solved``, ``outputs_solved``, ``outputs``, ``tasks``) plus ``k`` and ``rows``.
    ``segments``: chained calls carrying the state per batch (TRM / HRM: 16), as ``evaluate``.
    """
    from loopformer.tasks.arc import ArcTask

    if not isinstance(task, ArcTask):
        raise TypeError(f"arc_pass_at_k needs an ARC task, got {task.name!r}")
    if dataset is None:
        dataset = task.generate(0, seed, part="test")
    if dataset.puzzle_ids is None:
        raise ValueError(
            "ARC pass@k needs puzzle ids on the dataset (task, augmentation version of every row)"
        )
    # the halting head's logits break vote ties (TRM evaluators/arc.py)
    preds, q = _predictions(model, dataset, loop, batch_size, device, seed, segments)
    result = task.evaluate(dataset.inputs, dataset.puzzle_ids, preds, k, q_logits=q)
    return {**result, "k": float(k), "rows": float(len(dataset))}
