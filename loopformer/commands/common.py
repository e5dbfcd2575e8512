"""Shared pieces of the ``loopformer`` commands: one-line errors, checkpoint + task loading.

Every command raises ordinary exceptions (``ConfigError``, ``CheckpointError``, ``TaskDataError``,
``KeyError`` from the registries, ``FileNotFoundError``...); ``CleanErrorGroup`` turns any of them
into one line on stderr and exit status 1, unless ``--debug`` (or ``LOOPFORMER_DEBUG=1``) asks for
the traceback.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel
from loopformer.tasks.base import Task, TokenDataset

# exceptions whose message is already meant for the user
_USER_ERRORS = ("ConfigError", "CheckpointError", "TaskDataError", "FileNotFoundError", "KeyError",
                "ValueError", "TrainingDivergedError", "PermissionError", "NotADirectoryError",
                "IsADirectoryError", "NotImplementedError")


def one_line(err: BaseException) -> str:
    """The exception as one line: ``KeyError('x')`` -> ``x``; multi-line messages joined."""
    if isinstance(err, KeyError) and err.args:
        text = str(err.args[0])
    else:
        text = str(err) or type(err).__name__
    text = " ".join(part.strip() for part in text.splitlines() if part.strip())
    if type(err).__name__ not in _USER_ERRORS:
        text = f"{type(err).__name__}: {text} (internal error; run with --debug for the traceback)"
    return text


def debug_enabled(ctx: click.Context | None) -> bool:
    if os.environ.get("LOOPFORMER_DEBUG", "") not in ("", "0"):
        return True
    while ctx is not None:
        if ctx.params.get("debug"):
            return True
        ctx = ctx.parent
    return False


class CleanErrorGroup(click.Group):
    """A click group that reports errors in one line (no traceback unless --debug)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort, KeyboardInterrupt):
            raise
        except Exception as err:
            if debug_enabled(ctx):
                raise
            raise click.ClickException(one_line(err)) from None


def parse_pairs(pairs: tuple[str, ...] | list[str], what: str) -> dict[str, Any]:
    """``("a=1", "b=[2,3]")`` -> ``{"a": 1, "b": [2, 3]}`` (values parsed as YAML)."""
    import yaml

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise click.BadParameter(f"expected key=value, got {pair!r}", param_hint=what)
        try:
            out[key] = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            out[key] = value
    return out


def parse_int_list(text: str | None, what: str) -> list[int]:
    if not text:
        return []
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=what) from None
    if any(v < 1 for v in values):
        raise click.BadParameter(f"step counts must be >= 1, got {text!r}", param_hint=what)
    return values


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


def load_run(path: str | Path, use_ema: bool = True, config_overrides: tuple[str, ...] = (),
             device: str = "cpu") -> LoadedRun:
    """Load a checkpoint (a checkpoint folder, a ``checkpoints/`` root or a run folder) and its task.

    ``config_overrides`` (``data.*``, ``eval.*``, ``loop_eval.*`` keys only) change how the run is
    evaluated, never the model.
    """
    from loopformer.config import ConfigError, apply_overrides, build_config, to_dict
    from loopformer.tasks.registry import get_task
    from loopformer.train.checkpoint import load_checkpoint

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
    assert isinstance(model, LoopedModel)
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
    """The run's held-out set: ``data.eval_path`` or ``task.generate(eval_size, eval_seed, **eval_generate)``."""
    dc = config.data
    if dc.eval_path:
        data = task.load(dc.eval_path)
    else:
        if dc.eval_size <= 0:
            raise ValueError("the run has no held-out set (data.eval_size = 0 and no data.eval_path)")
        data = task.generate(dc.eval_size, dc.eval_seed, **dc.eval_generate)
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
