"""Run loading: a run's data splits, and a trained run ready to evaluate.

The trainer builds its train / eval sets with ``task_dataset``; ``loopformer eval`` / ``run`` / ``solve``,
``loopformer.load`` and the experiments load a trained model with ``load_run`` and its held-out set with
``eval_dataset``.

- ``load_split``: a run's train / eval set from ``DataConfig``: a file (``task.load``), an HRM / TRM
  folder (``loopformer.tasks.formats.load_hrm_folder``) or ``task.generate``.
- ``task_dataset``: ``load_split`` with the errors a training run needs (an empty training set).
- ``eval_dataset``: the held-out set of a run (``eval.max_examples`` applied).
- ``load_run``: a checkpoint's model (EMA weights when asked and present), its task, run configuration and
  train / eval loops as a ``LoadedRun``.
- ``training_depth``: loops per forward call in training (the depth an overthinking plot marks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loopformer.config import DataConfig, RunConfig
from loopformer.config.checks import check_task_fits_model, run_config_for
from loopformer.loop import LoopConfig
from loopformer.loop.samplers import training_sampler
from loopformer.models.base import LoopedModel
from loopformer.runs.checkpoint import (
    CheckpointError,
    best_label,
    build_stored_model,
    find_best,
    latest_checkpoint,
    load_stored_weights,
    read_best,
    read_checkpoint_config,
    resolve_checkpoint,
    verified,
)
from loopformer.tasks.base import IGNORE_INDEX, Task, TokenDataset
from loopformer.tasks.registry import get_task

log = logging.getLogger("loopformer")

HRM_SPLITS = {"train": "train", "eval": "test"}  # our split name -> HRM's folder name


def load_split(task: Task, data: DataConfig, split: str) -> TokenDataset | None:
    """The ``split`` ("train" | "eval") set of ``data``.

    A path that is a folder is read with ``load_hrm_folder`` (``<path>/train`` or ``<path>/test``, or
    the folder itself when it holds a ``dataset.json``); a file with ``task.load``. Without a path,
    ``task.generate(size, seed, **options)``: size 0 asks for all rows (tasks with a finite pool, e.g.
    ARC or KG, return them all; generators return none). None when that gives no rows. The training set
    of a task that ``streams`` (text) is ``task.stream(size, seed, **options)`` instead: rows read when a
    batch indexes them (size 0: one pass over the split).
    """
    if split not in HRM_SPLITS:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    path = data.train_path if split == "train" else data.eval_path
    size = data.train_size if split == "train" else data.eval_size
    if size < 0:
        raise ValueError(f"data.{split}_size must be >= 0 (0 = all rows), got {size}")
    if path:
        folder = Path(path)
        if folder.is_dir():
            from loopformer.tasks.formats import load_hrm_folder

            if (folder / "dataset.json").is_file():  # the split folder itself
                return load_hrm_folder(folder.parent, folder.name, task=task)
            return load_hrm_folder(folder, HRM_SPLITS[split], task=task)
        return task.load(path)
    seed = data.train_seed if split == "train" else data.eval_seed
    options = data.train_generate if split == "train" else data.eval_generate
    if split == "train" and task.streams:  # read a batch at a time, never held whole (the text task)
        return task.stream(size, seed, **options)
    dataset = task.generate(size, seed, **options)
    return dataset if len(dataset) else None


def run_task(data: DataConfig) -> Task:
    """The task a run's ``data`` section names, built with its options."""
    return get_task(data.task, **data.options)


def task_dataset(task: Task | None, data: DataConfig, split: str) -> TokenDataset | None:
    """The ``split`` ("train" / "eval") of ``task``; None for an eval split the task does not have. An eval
    split keeps only the rows it can score (``scorable``)."""
    if task is None:
        if split == "train":
            raise ValueError("no training data: pass train_data or a task")
        return None
    dataset = load_split(task, data, split)
    if dataset is None and split == "train":
        raise ValueError(
            f"the training set is empty: data.train_size=0 asks for all rows, but task "
            f"{task.name!r} generates rows on demand; set data.train_size > 0"
        )
    return dataset if dataset is None or split == "train" else scorable(dataset, task, data)


def scorable(dataset: TokenDataset, task: Task, data: DataConfig) -> TokenDataset:
    """``dataset`` without the rows that cannot be scored: rows whose labels are all ``IGNORE_INDEX`` (ARC
    test pairs whose output is unknown) would count as solved (nothing to get wrong). The rows left out are
    counted in ``meta["unscored_rows"]`` (reports state it); ValueError when no row is left."""
    if not task.has_validator or len(dataset) == 0:
        return dataset
    labelled = (np.asarray(dataset.labels) != IGNORE_INDEX).any(axis=1)
    dropped = int(len(dataset) - labelled.sum())
    if dropped == 0:
        return dataset
    where = data.eval_path or f"task {task.name!r} generated with data.eval_generate={data.eval_generate}"
    if dropped == len(dataset):
        raise ValueError(
            f"none of the {dropped} held-out rows of {where} has labels (e.g. ARC test pairs whose output is "
            f"not known: give the solutions file), so nothing can be scored"
        )
    log.warning("%d of the %d held-out rows of %s have no labels (unknown outputs): left out of the score",
                dropped, len(dataset), where)  # fmt: skip
    kept = dataset.subset(np.flatnonzero(labelled))
    kept.meta["unscored_rows"] = dropped
    return kept


def eval_dataset(task: Task, config: RunConfig, max_examples: int = 0) -> TokenDataset:
    """The run's held-out set: ``data.eval_path`` or ``task.generate(eval_size, eval_seed, **eval_generate)``
    (``load_split``: a folder is HRM's format, ``eval_size`` 0 = all rows), without the rows that cannot be
    scored (``scorable``), cut to ``max_examples`` (default ``eval.max_examples``; 0 = all)."""
    data = task_dataset(task, config.data, "eval")
    if data is None or len(data) == 0:
        raise ValueError(
            f"the run has no held-out set (data.eval_size = {config.data.eval_size} gave no rows of task "
            f"{task.name!r} and there is no data.eval_path)"
        )
    limit = max_examples or config.eval.max_examples
    if limit and limit < len(data):
        data = data.subset(slice(0, limit))
    return data


@dataclass
class LoadedRun:
    """A trained model ready to evaluate: the model (EMA weights when asked and present), its task,
    run configuration and train / eval loops."""

    path: Path
    step: int
    family: str
    model: LoopedModel
    task: Task
    config: RunConfig
    loop_eval: LoopConfig
    loop_train: LoopConfig
    weights: str  # "model" | "ema"
    # "best (by eval_<metric>, step N)" for the run's best checkpoint (train.keep_best), "latest (step N)"
    # for its newest one, else "step N"
    label: str = ""
    best: dict[str, Any] | None = None  # the checkpoints/best record when this is the best checkpoint


def checkpoint_label(folder: Path, step: int) -> tuple[str, dict[str, Any] | None]:
    """(the label reports give checkpoint ``folder``, its best record when it is the run's best)."""
    record = read_best(folder.parent)
    if record is not None and record["checkpoint"] == folder.name:
        return best_label(record), record
    latest = latest_checkpoint(folder.parent)
    return (f"latest (step {step})" if latest == folder else f"step {step}"), None


def load_run(
    path: str | Path,
    use_ema: bool = True,
    config_overrides: tuple[str, ...] = (),
    device: str = "cpu",
    best: bool = False,
    task: str | None = None,
    check: Callable[[RunConfig], None] | None = None,
    verify: bool = False,
) -> LoadedRun:
    """Load a checkpoint (a checkpoint folder, a ``checkpoints/`` root, a run folder or a hub id) and its task,
    with the EMA weights when ``use_ema`` and the checkpoint keeps an EMA. ``best``: the run's best
    checkpoint (``checkpoints/best``, ``train.keep_best``) instead of its latest. ``verify``: refuse a
    checkpoint without its manifest (``verified``; loaded with a warning that it is unverified otherwise).

    One straight path: read the folder (resolve it, verify its manifest before anything in it is used, read
    ``config.json``: the plug-in modules it names must already be imported by the user) -> read and validate
    its config with ``config_overrides`` (``data.*``, ``eval.*``, ``loop_eval.*`` keys only: they change how
    the run is evaluated, never the model) as ``train`` validates it (``loopformer.config.checks.run_config_for``;
    ``task``: the task the caller expects; ``check``: the caller's own checks of that config) -> build the
    model -> load the weights.
    """
    from loopformer.runs.hub import resolve_source  # huggingface_hub only where a hub id is read

    folder = resolve_source(path)  # a hub id (owner/name) is downloaded, a local path kept
    folder = verified(find_best(folder)[0] if best else resolve_checkpoint(folder), require_manifest=verify)
    stored, family, step = read_checkpoint_config(folder)
    config = run_config_for(stored, config_overrides, device=device, task=task)
    if check is not None:
        check(config)
    built_task = run_task(config.data)
    check_task_fits_model(built_task, config)
    model = build_stored_model(folder, family, config)
    if not isinstance(model, LoopedModel):
        raise CheckpointError(f"checkpoint {folder} holds a {type(model).__name__}, not a loopformer model")
    _, weights = load_stored_weights(folder, model, use_ema, device)
    model.eval()
    label, record = checkpoint_label(folder, step)
    return LoadedRun(
        path=folder,
        step=step,
        family=family,
        model=model,
        task=built_task,
        config=config,
        loop_eval=config.loop_config(model.config.loop, "eval"),
        loop_train=config.loop_config(model.config.loop, "train"),
        weights=weights,
        label=label,
        best=record,
    )


def training_depth(run: LoadedRun) -> int:
    """Loops per forward call in training (the training depth an overthinking plot marks)."""
    cfg = run.config
    max_steps = int(run.loop_train.max_steps)
    sampler = training_sampler(cfg.train.loop_sampler, cfg.train.loop_sampler_options, max_steps, cfg.seed)
    depth = None if sampler is None else sampler.constant_depth
    return max_steps if depth is None else int(depth)
