"""What the trainer builds before its first step: device, data splits, model and loop sampler.

- ``physical_cores`` / ``resolve_device``: CPU float32 runs one thread per physical core;
  ``device: auto`` picks CUDA when there is one.
- ``task_dataset``: a task's train / eval split (``loopformer.train.data.load_split``).
- ``task_model_defaults`` / ``build_run_model``: the model a recipe names, with the fields the
  task determines (vocabulary, sequence length, causality, puzzle ids, grid) filled in where the
  recipe leaves them unset; the fully resolved model config is written back into the run config.
- ``loop_sampler``: simple mode's loop-count sampler (Loop, Think & Generalize, arXiv
  2604.07822: fixed, Poisson, log-normal Poisson), or None for ``train.loop_sampler: none``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from loopformer.config import DataConfig, RunConfig, TrainConfig, to_dict
from loopformer.loop import LoopConfig, make_sampler
from loopformer.models.base import LoopedModel
from loopformer.tasks.base import Task, TokenDataset
from loopformer.train.data import load_split


def physical_cores() -> int:
    """Physical CPU cores available to this process (from /proc/cpuinfo; else os.cpu_count())."""
    try:
        pairs, phys = set(), None
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    pairs.add((phys, line.split(":")[1].strip()))
        if pairs:
            return max(1, min(len(pairs), len(os.sched_getaffinity(0))))
    except (OSError, AttributeError):
        pass
    return max(1, os.cpu_count() or 1)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cuda`` without CUDA raises."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was asked for but CUDA is not available")
    return torch.device(name)


def task_dataset(task: Task | None, data_config: DataConfig, split: str) -> TokenDataset | None:
    """The ``split`` ("train" / "eval") of ``task``; None for an eval split the task does not have."""
    if task is None:
        if split == "train":
            raise ValueError("no training data: pass train_data or a task")
        return None
    dataset = load_split(task, data_config, split)
    if dataset is None and split == "train":
        raise ValueError(f"the training set is empty: data.train_size=0 asks for all rows, but task "
                         f"{task.name!r} generates rows on demand; set data.train_size > 0")
    return dataset


def task_model_defaults(task: Task | None, train_data: TokenDataset) -> dict[str, Any]:
    """Model fields the task determines, used where the recipe leaves them unset."""
    out: dict[str, Any] = {}
    if task is not None:
        if task.vocab_size:
            out["vocab_size"] = int(task.vocab_size)
        out["causal"] = bool(task.causal)
        out["num_puzzle_ids"] = int(getattr(task, "num_puzzle_ids", 0) or 0)
        if out["num_puzzle_ids"]:
            out["puzzle_emb_len"] = 1  # one prepended puzzle token unless the recipe asks for more
        grid = getattr(task, "grid", None)
        size = getattr(task, "size", None)
        if grid is None and isinstance(size, int) and task.seq_len == size * size:
            grid = (size, size)
        if grid is not None:
            out["grid"] = tuple(grid)
    out["seq_len"] = int(train_data.inputs.shape[1])
    if "vocab_size" not in out:
        out["vocab_size"] = int(max(train_data.inputs.max(), train_data.labels.max()) + 1)
    return out


def build_run_model(config: RunConfig, task: Task | None, train_data: TokenDataset) -> LoopedModel:
    """The recipe's model with the task's defaults; records the resolved fields in ``config.model``."""
    from loopformer.models.registry import build_model, model_classes

    _, config_cls = model_classes(config.model.name)
    valid = {f.name for f in dataclasses.fields(config_cls)}
    defaults = {k: v for k, v in task_model_defaults(task, train_data).items() if k in valid}
    if "num_puzzle_ids" in config.model.fields:  # the recipe decides the puzzle embedding: no task default
        defaults.pop("puzzle_emb_len", None)
    model_config = config.model_config(**defaults)
    # the run folder records the fully resolved model config
    config.model.fields = {
        f.name: to_dict(getattr(model_config, f.name)) for f in dataclasses.fields(model_config)
    }
    return build_model(config.model.name, config=model_config)


def loop_sampler(tc: TrainConfig, loop_train: LoopConfig, seed: int) -> Any:
    """The simple-mode loop-count sampler; None for ``train.loop_sampler: none`` (loop_train as is)."""
    if tc.loop_sampler == "none":
        return None
    options = dict(tc.loop_sampler_options)
    if tc.loop_sampler == "fixed":
        options.setdefault("n", loop_train.max_steps)
    else:
        options.setdefault("seed", seed)
    return make_sampler(tc.loop_sampler, **options)
