"""Evaluation of a looped model on a task: accuracies, loop steps, test-time compute, adaptivity.

- ``evaluate``: one pass over a dataset. Three accuracies, from the weakest to the strictest claim:
  token accuracy (labelled positions predicted right, pooled over the dataset), exact accuracy
  (every labelled position right), and the headline *valid accuracy*: the task's independent
  validator ``task.check(inputs_row, prediction_row)`` judges the whole predicted answer without
  looking at the label (HRM's dataset builders, arXiv 2506.21734: "a prediction counts only if it is a valid shortest path").
  Per example it records difficulty, loop steps taken, convergence, exact and valid.
- ``accuracy_vs_budget``: the test-time compute curve. The loop is run with ``max_steps`` set to
  each budget, either with the halting rule forced to ``fixed`` (exactly ``b`` loops) or with the
  model's own halting rule capped at ``b`` (arXiv 2606.18206: FPRM halts at a fixed point or at the cap).
- ``steps_vs_difficulty``: mean steps per difficulty bucket and the Spearman rank correlation
  between difficulty and steps (arXiv 2606.18206: "more iterations for puzzles with more blanks").
- ``load_for_eval``: a trained model and its task from a checkpoint, with the EMA weights when the
  checkpoint has them (the papers evaluate the EMA, arXiv 2606.18206; TRM arXiv 2510.04871, HRM arXiv 2506.21734).
- ``evaluate_lm``: tasks without a validator (``Task.has_validator`` False: language modelling)
  are scored by the held-out cross-entropy (nats per token) and bits per byte instead.
- ``arc_pass_at_k``: ARC's pass@2 (HRM / TRM's ARC protocol, arXiv 2506.21734): predictions for every test pair under every
  augmentation, de-augmented and voted by ``ArcTask.evaluate``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from scipy import stats
from torch import Tensor

from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel, ModelOutput
from loopformer.numerics import check_output
from loopformer.tasks.base import IGNORE_INDEX, Task, TokenDataset

BUDGET_MODES = ("fixed", "capped")


@dataclass
class ExampleRecord:
    """One evaluated example."""

    index: int
    difficulty: float
    steps: int
    converged: bool
    exact: bool  # every labelled position equals the label
    valid: bool  # the task's independent validator accepts the prediction
    token_accuracy: float  # labelled positions right / labelled positions (nan when none)


@dataclass
class EvalResult:
    """Metrics of one evaluation pass; ``records`` keeps one entry per example."""

    task: str
    n: int
    exact_accuracy: float
    token_accuracy: float
    valid_accuracy: float
    mean_steps: float
    steps_histogram: dict[int, int]
    converged_fraction: float
    loop: dict[str, Any]
    records: list[ExampleRecord] = field(default_factory=list)

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
            "converged_fraction": self.converged_fraction,
            "steps_histogram": {str(k): v for k, v in sorted(self.steps_histogram.items())},
            "loop": self.loop,
        }
        if records:
            out["records"] = [dataclasses.asdict(r) for r in self.records]
        return out


def loop_summary(cfg: LoopConfig | None) -> dict[str, Any]:
    """A JSON-friendly view of a loop configuration."""
    if cfg is None:
        return {}
    if dataclasses.is_dataclass(cfg):
        out = {k: v for k, v in dataclasses.asdict(cfg).items() if isinstance(v, str | int | float | bool)}
        for name in dict.fromkeys(str(getattr(cfg, axis, "")) for axis in ("solver", "halting", "grad")):
            group = getattr(cfg, name, None) if name else None  # the chosen plug-ins' option groups (LoopConfig.damped, ...)
            if dataclasses.is_dataclass(group):
                out[name] = dataclasses.asdict(group)
        return out
    return {"repr": repr(cfg)}


def with_budget(cfg: LoopConfig, budget: int, mode: str = "fixed") -> LoopConfig:
    """``cfg`` with the step cap set to ``budget``; ``fixed`` also forces exactly ``budget`` loops."""
    if budget < 1:
        raise ValueError(f"a step budget must be >= 1, got {budget}")
    if mode not in BUDGET_MODES:
        raise ValueError(f"unknown budget mode {mode!r} (known: {', '.join(BUDGET_MODES)})")
    changes: dict[str, Any] = {"max_steps": int(budget)}
    if mode == "fixed":
        changes["halting"] = "fixed"
    if hasattr(cfg, "min_steps") and getattr(cfg, "min_steps", 0) and cfg.min_steps > budget:  # type: ignore[attr-defined]
        changes["min_steps"] = int(budget)
    return dataclasses.replace(cfg, **changes)


def iter_batches(dataset: TokenDataset, batch_size: int, max_batches: int | None = None) -> Iterator[slice]:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n_batches = math.ceil(len(dataset) / batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for b in range(n_batches):
        yield slice(b * batch_size, min(len(dataset), (b + 1) * batch_size))


def batch_tensors(
    dataset: TokenDataset, index: slice, device: torch.device | str
) -> tuple[Tensor, Tensor, Tensor | None]:
    inputs = torch.as_tensor(dataset.inputs[index], device=device)
    labels = torch.as_tensor(dataset.labels[index], device=device)
    puzzle_ids = None if dataset.puzzle_ids is None else torch.as_tensor(dataset.puzzle_ids[index], device=device)
    return inputs, labels, puzzle_ids


def model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


class _Progress:
    """A rich progress bar when asked for and there is more than one batch; otherwise nothing."""

    def __init__(self, enabled: bool, total: int, description: str) -> None:
        self.bar = None
        if enabled and total > 1:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                transient=True,
            )
            self.task = self.bar.add_task(description, total=total)

    def __enter__(self) -> _Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.advance(self.task)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


class _EvalPass:
    """``model`` in eval mode on ``device`` running ``loop`` (default: its own) over ``dataset``, the
    initial iterates drawn from one generator seeded with ``seed``; the training mode is restored on exit."""

    def __init__(
        self,
        model: LoopedModel,
        dataset: TokenDataset,
        loop: LoopConfig | None,
        device: torch.device | str | None,
        seed: int,
    ) -> None:
        self.model = model
        self.dataset = dataset
        self.device = torch.device(device) if device is not None else model_device(model)
        self.cfg = loop if loop is not None else model.config.loop
        self.seed = seed

    def __enter__(self) -> _EvalPass:
        self.model.to(self.device)
        self.was_training = self.model.training
        self.model.eval()
        self.generator = torch.Generator(device=self.device).manual_seed(self.seed)
        return self

    def __exit__(self, *exc: object) -> None:
        self.model.train(self.was_training)

    def forward(self, index: slice) -> tuple[Tensor, Tensor, ModelOutput]:
        """(inputs, labels, model output) of the rows ``index``."""
        inputs, labels, puzzle_ids = batch_tensors(self.dataset, index, self.device)
        out = self.model(inputs, loop=self.cfg, puzzle_ids=puzzle_ids, generator=self.generator)
        check_output(out, f"evaluation rows {index.start}..{index.stop}")  # a NaN model is never scored
        return inputs, labels, out


def score_predictions(
    task: Task, inputs: np.ndarray, labels: np.ndarray, predictions: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per row: (exact [N] bool, valid [N] bool, right labelled tokens [N], labelled tokens [N])."""
    mask = labels != IGNORE_INDEX
    right = ((predictions == labels) & mask).sum(axis=1)
    count = mask.sum(axis=1)
    exact = right == count
    valid = np.asarray([bool(task.check(inputs[i], predictions[i])) for i in range(len(inputs))], dtype=bool)
    return exact, valid, right, count


@torch.no_grad()
def evaluate(
    model: LoopedModel,
    task: Task,
    dataset: TokenDataset,
    loop: LoopConfig | None = None,
    batch_size: int = 64,
    max_batches: int | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
    seed: int = 0,
) -> EvalResult:
    """Run ``model`` (with ``loop`` or its default loop) over ``dataset`` and score every prediction.

    The initial iterate is drawn from a generator seeded with ``seed``, so an evaluation is repeatable.
    """
    if len(dataset) == 0:
        raise ValueError("cannot evaluate on an empty dataset")
    batches = list(iter_batches(dataset, batch_size, max_batches))
    records: list[ExampleRecord] = []
    right_total = count_total = 0
    with _EvalPass(model, dataset, loop, device, seed) as run:
        cfg = run.cfg
        with _Progress(progress, len(batches), f"eval {task.name}") as bar:
            for index in batches:
                _, _, out = run.forward(index)
                pred = out.logits.argmax(dim=-1).cpu().numpy()
                steps, converged = _loop_stats(out, len(pred), cfg)
                x_np, y_np = dataset.inputs[index], dataset.labels[index]
                exact, valid, right, count = score_predictions(task, x_np, y_np, pred)
                right_total += int(right.sum())
                count_total += int(count.sum())
                for j, i in enumerate(range(index.start, index.stop)):
                    records.append(
                        ExampleRecord(
                            index=i,
                            difficulty=float(dataset.difficulty[i]),
                            steps=int(steps[j]),
                            converged=bool(converged[j]),
                            exact=bool(exact[j]),
                            valid=bool(valid[j]),
                            token_accuracy=float(right[j] / count[j]) if count[j] else float("nan"),
                        )
                    )
                bar.advance()
    n = len(records)
    steps_arr = np.asarray([r.steps for r in records])
    return EvalResult(
        task=task.name,
        n=n,
        exact_accuracy=float(np.mean([r.exact for r in records])),
        token_accuracy=float(right_total / count_total) if count_total else float("nan"),
        valid_accuracy=float(np.mean([r.valid for r in records])),
        mean_steps=float(steps_arr.mean()),
        steps_histogram=dict(sorted(Counter(int(s) for s in steps_arr).items())),
        converged_fraction=float(np.mean([r.converged for r in records])),
        loop=loop_summary(cfg),
        records=records,
    )


def _loop_stats(out: ModelOutput, batch: int, cfg: LoopConfig) -> tuple[np.ndarray, np.ndarray]:
    if out.loop is None:  # a model that bypasses the engine: one pass
        return np.ones(batch, dtype=np.int64), np.zeros(batch, dtype=bool)
    steps = out.loop.steps.detach().cpu().numpy().reshape(-1)
    converged = out.loop.converged.detach().cpu().numpy().reshape(-1).astype(bool)
    return steps, converged


# ------------------------------------------------------------------------------------------------
# test-time compute
# ------------------------------------------------------------------------------------------------


@dataclass
class BudgetPoint:
    budget: int
    valid_accuracy: float
    exact_accuracy: float
    token_accuracy: float
    mean_steps: float
    converged_fraction: float


@dataclass
class BudgetCurve:
    mode: str
    points: list[BudgetPoint]

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "points": [dataclasses.asdict(p) for p in self.points]}


def accuracy_vs_budget(
    model: LoopedModel,
    task: Task,
    dataset: TokenDataset,
    budgets: Sequence[int],
    mode: str = "fixed",
    loop: LoopConfig | None = None,
    batch_size: int = 64,
    max_batches: int | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
    seed: int = 0,
) -> BudgetCurve:
    """Accuracy at each inference step budget (``fixed``: exactly b loops; ``capped``: halting rule, cap b)."""
    if not budgets:
        raise ValueError("give at least one step budget")
    base = loop if loop is not None else model.config.loop
    points = []
    for b in sorted({int(b) for b in budgets}):
        res = evaluate(
            model, task, dataset, loop=with_budget(base, b, mode), batch_size=batch_size,
            max_batches=max_batches, device=device, progress=progress, seed=seed,
        )
        points.append(
            BudgetPoint(b, res.valid_accuracy, res.exact_accuracy, res.token_accuracy, res.mean_steps,
                        res.converged_fraction)
        )
    return BudgetCurve(mode, points)


# ------------------------------------------------------------------------------------------------
# adaptivity: steps vs difficulty
# ------------------------------------------------------------------------------------------------


@dataclass
class DifficultyBucket:
    low: float
    high: float
    count: int
    mean_steps: float
    valid_accuracy: float


@dataclass
class DifficultyStats:
    buckets: list[DifficultyBucket]
    spearman_rho: float
    spearman_p: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "spearman_rho": self.spearman_rho,
            "spearman_p": self.spearman_p,
            "buckets": [dataclasses.asdict(b) for b in self.buckets],
        }

    def mean_steps_by_difficulty(self) -> dict[str, float]:
        """``{"low-high": mean steps}`` (``"d"`` when a bucket holds one difficulty value)."""
        out = {}
        for b in self.buckets:
            key = _fmt(b.low) if b.low == b.high else f"{_fmt(b.low)}-{_fmt(b.high)}"
            out[key] = b.mean_steps
        return out


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.3g}"


def steps_vs_difficulty(
    difficulty: Sequence[float] | np.ndarray,
    steps: Sequence[float] | np.ndarray,
    valid: Sequence[bool] | np.ndarray | None = None,
    max_buckets: int = 8,
) -> DifficultyStats:
    """Mean steps per difficulty bucket (one per distinct value, or quantile buckets beyond
    ``max_buckets`` values) and Spearman's rho between difficulty and steps (nan when either is constant)."""
    d = np.asarray(difficulty, dtype=np.float64)
    s = np.asarray(steps, dtype=np.float64)
    v = np.zeros(len(d), dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
    if d.shape != s.shape or d.ndim != 1 or len(d) == 0:
        raise ValueError(f"difficulty {d.shape} and steps {s.shape} must be equal non-empty 1-D arrays")
    values = np.unique(d)
    if len(values) <= max_buckets:
        edges = [(x, x) for x in values]
        members = [d == x for x in values]
    else:
        qs = np.unique(np.quantile(d, np.linspace(0, 1, max_buckets + 1)))
        edges, members = [], []
        for k in range(len(qs) - 1):
            lo, hi = qs[k], qs[k + 1]
            m = (d >= lo) & ((d < hi) if k < len(qs) - 2 else (d <= hi))
            if m.any():
                edges.append((float(d[m].min()), float(d[m].max())))
                members.append(m)
    buckets = [
        DifficultyBucket(float(lo), float(hi), int(m.sum()), float(s[m].mean()), float(v[m].mean()))
        for (lo, hi), m in zip(edges, members)
    ]
    if len(d) < 3 or np.all(d == d[0]) or np.all(s == s[0]):
        rho, p = float("nan"), float("nan")
    else:
        r = stats.spearmanr(d, s)
        rho, p = float(r.statistic), float(r.pvalue)
    return DifficultyStats(buckets, rho, p)


def easy_hard_steps(difficulty: np.ndarray, steps: np.ndarray) -> dict[str, float]:
    """Mean steps on the easier and the harder half (split at the median difficulty)."""
    d = np.asarray(difficulty, dtype=np.float64)
    s = np.asarray(steps, dtype=np.float64)
    med = float(np.median(d))
    easy, hard = d <= med, d > med
    if not hard.any():  # all at or below the median: split strictly below instead
        easy, hard = d < med, d >= med
    return {
        "easy_mean_steps": float(s[easy].mean()) if easy.any() else float("nan"),
        "hard_mean_steps": float(s[hard].mean()) if hard.any() else float("nan"),
        "split_difficulty": med,
    }


# ------------------------------------------------------------------------------------------------
# loading a trained run
# ------------------------------------------------------------------------------------------------


@dataclass
class LoadedRun:
    """A trained model ready to evaluate: the model (EMA weights when asked and present), its task,
    run configuration and evaluation loop."""

    path: Path
    step: int
    family: str
    model: LoopedModel
    task: Task
    config: Any  # RunConfig
    loop_eval: LoopConfig
    loop_train: LoopConfig
    weights: str  # "model" | "ema"


def load_for_eval(path: str | Path, use_ema: bool = True, config_overrides: tuple[str, ...] = (),
             device: str = "cpu") -> LoadedRun:
    """Load a checkpoint (a checkpoint folder, a ``checkpoints/`` root, a run folder or a hub id) and its task,
    with the EMA weights when ``use_ema`` and the checkpoint keeps an EMA.

    ``config_overrides`` (``data.*``, ``eval.*``, ``loop_eval.*`` keys only) change how the run is
    evaluated, never the model.
    """
    from loopformer.config import ConfigError, apply_overrides, build_config, to_dict
    from loopformer.hub import resolve_source
    from loopformer.tasks.registry import get_task
    from loopformer.train.checkpoint import CheckpointError, load_checkpoint

    path = resolve_source(path)  # a hub id (owner/name) is downloaded, a local path kept
    for text in config_overrides:
        key = text.split("=", 1)[0]
        if not key.startswith(("data.", "eval.", "loop_eval.")):
            raise ConfigError(
                f"override {text!r}: evaluation can only change data.*, eval.* and loop_eval.* keys"
            )
    ckpt = load_checkpoint(path, use_ema=use_ema, device=device)
    config = ckpt.config
    if config_overrides:
        config = build_config(apply_overrides(to_dict(config), list(config_overrides)), check=False)
    task = get_task(config.data.task, **config.data.options)
    model = ckpt.model
    if not isinstance(model, LoopedModel):
        raise CheckpointError(f"checkpoint {ckpt.path} holds a {type(model).__name__}, not a loopformer model")
    model.eval()
    return LoadedRun(
        path=ckpt.path,
        step=ckpt.step,
        family=ckpt.family,
        model=model,
        task=task,
        config=config,
        loop_eval=config.loop_config(model.config.loop, "eval"),
        loop_train=config.loop_config(model.config.loop, "train"),
        weights=ckpt.weights,
    )


def eval_dataset(task: Task, config: Any, max_examples: int = 0) -> TokenDataset:
    """The run's held-out set: ``data.eval_path`` or ``task.generate(eval_size, eval_seed, **eval_generate)``
    (``loopformer.train.data.load_split``: a folder is HRM's format, ``eval_size`` 0 = all rows)."""
    from loopformer.train.data import load_split

    data = load_split(task, config.data, "eval")
    if data is None or len(data) == 0:
        raise ValueError(
            f"the run has no held-out set (data.eval_size = {config.data.eval_size} gave no rows of task "
            f"{task.name!r} and there is no data.eval_path)"
        )
    limit = max_examples or config.eval.max_examples
    if limit and limit < len(data):
        data = data.subset(slice(0, limit))
    return data


def training_depth(run: LoadedRun) -> int:
    """Loops per forward call in training (the training depth an overthinking plot marks)."""
    cfg = run.config
    options = cfg.train.loop_sampler_options
    if cfg.train.loop_sampler == "fixed" and "n" in options:
        return int(options["n"])
    return int(run.loop_train.max_steps)


# ------------------------------------------------------------------------------------------------
# tasks without a validator (language modelling) and ARC pass@k
# ------------------------------------------------------------------------------------------------


@dataclass
class LMEvalResult:
    """Held-out language-modelling metrics: mean cross-entropy per labelled token and bits per byte."""

    task: str
    n: int  # examples (windows)
    tokens: int  # labelled tokens scored
    loss: float  # nats per token
    bits_per_byte: float
    token_accuracy: float
    exact_accuracy: float
    mean_steps: float
    loop: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
) -> LMEvalResult:
    """Mean cross-entropy (nats per labelled token, summed in float64) and bits per byte of ``model`` on
    ``dataset`` (``loopformer.tasks.text.bits_per_byte`` with the task's ``tokens_per_byte``, 1 for bytes)."""
    from loopformer.tasks.text import bits_per_byte

    if len(dataset) == 0:
        raise ValueError("cannot evaluate on an empty dataset")
    batches = list(iter_batches(dataset, batch_size, max_batches))
    nll = right = count = exact = steps = 0.0
    n = 0
    with _EvalPass(model, dataset, loop, device, seed) as run:
        cfg = run.cfg
        with _Progress(progress, len(batches), f"eval {task.name}") as bar:
            for index in batches:
                inputs, labels, out = run.forward(index)
                logits = out.logits.float()
                mask = labels != IGNORE_INDEX
                token_nll = F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
                )
                nll += float(token_nll.double().sum())
                hit = (logits.argmax(-1) == labels) & mask
                right += float(hit.sum())
                count += float(mask.sum())
                exact += float((hit.sum(1) == mask.sum(1)).sum())
                steps += float(_loop_stats(out, len(inputs), cfg)[0].sum())
                n += len(inputs)
                bar.advance()
    loss = nll / count if count else float("nan")
    return LMEvalResult(
        task=task.name, n=n, tokens=int(count), loss=loss,
        bits_per_byte=bits_per_byte(loss, float(getattr(task, "tokens_per_byte", 1.0))),
        token_accuracy=right / count if count else float("nan"), exact_accuracy=exact / max(n, 1),
        mean_steps=steps / max(n, 1), loop=loop_summary(cfg),
    )


@torch.no_grad()
def predict(
    model: LoopedModel,
    dataset: TokenDataset,
    loop: LoopConfig | None = None,
    batch_size: int = 64,
    device: torch.device | str | None = None,
    seed: int = 0,
) -> np.ndarray:
    """Arg-max predictions [N, T] of ``model`` on every row of ``dataset``."""
    rows = []
    with _EvalPass(model, dataset, loop, device, seed) as run:
        for index in iter_batches(dataset, batch_size):
            rows.append(run.forward(index)[2].logits.argmax(-1).cpu().numpy())
    return np.concatenate(rows) if rows else np.zeros((0, dataset.inputs.shape[1]), dtype=np.int64)


def arc_pass_at_k(
    model: LoopedModel,
    task: Task,
    dataset: TokenDataset | None = None,
    loop: LoopConfig | None = None,
    k: int = 2,
    batch_size: int = 64,
    device: torch.device | str | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """ARC pass@k (HRM / TRM's ARC protocol, arXiv 2506.21734) with voting over augmentations: ``task.evaluate`` of the model's
    predictions on ``dataset`` (default: every test pair under every augmentation version,
    ``task.generate(0, seed, part="test")``). Returns ``ArcTask.evaluate``'s dictionary
    (``score``, ``all_solved``, ``outputs_solved``, ``outputs``, ``tasks``) plus ``k`` and ``rows``.
    """
    from loopformer.tasks.arc import ArcTask

    if not isinstance(task, ArcTask):
        raise TypeError(f"arc_pass_at_k needs an ARC task, got {task.name!r}")
    if dataset is None:
        dataset = task.generate(0, seed, part="test")
    if dataset.puzzle_ids is None:
        raise ValueError("ARC pass@k needs puzzle ids on the dataset (task, augmentation version of every row)")
    predictions, q_logits = [], []  # the halting head's logits break vote ties (TRM evaluators/arc.py)
    with torch.no_grad(), _EvalPass(model, dataset, loop, device, seed) as run:
        for index in iter_batches(dataset, batch_size):
            out = run.forward(index)[2]
            predictions.append(out.logits.argmax(-1).cpu().numpy())
            q_logits.append(None if out.q_logits is None else out.q_logits.float().cpu().numpy())
    preds = np.concatenate(predictions) if predictions else np.zeros((0, dataset.inputs.shape[1]), dtype=np.int64)
    q = None if not q_logits or any(x is None for x in q_logits) else np.concatenate(q_logits)
    result = task.evaluate(dataset.inputs, dataset.puzzle_ids, preds, k, q_logits=q)
    return {**result, "k": float(k), "rows": float(len(dataset))}
