"""One validation path for every command: what ``train`` checks, ``eval``, ``solve``, ``run`` and ``push`` check too.

``train`` and ``run`` build their configs with ``loopformer.config.build_config``, which validates every
value (``loopformer.config.schema.validate``: ranges with the dotted key, the task's options, sizes that
cannot fit in memory). ``eval``, ``solve`` and ``push`` start from a trained run's stored config instead;
``run_config_for`` applies their ``--set`` overrides to it and runs the *same* ``validate`` (for
evaluation: the training machine's ``device`` / ``train.threads`` are not held against this one, and
the memory bound is evaluation's), then what only a trained run can be checked against: the task its
model was trained on. ``check_count`` refuses a command's own numeric options (``--examples``,
``--max-steps``, ``run.budgets``...) by their names. All of it runs before any data is loaded or
model built; every refusal is a ``ConfigError`` (one line, exit status 1).

A command's own loop counts (``eval --max-steps`` / ``--lens-loops``, ``run.budgets`` /
``run.lens_loops`` / ``run.signal_loops``, ``sweep --max-steps``) go through ``check_loop_counts``: the
memory bound ``loop_eval.max_steps`` gets (``loopformer.config.memory.check_loops``), naming the option;
``eval --variant`` overrides through ``run_config_for`` like ``--set`` (``check_variants``). ``eval`` and
``sweep`` run them as ``load_run``'s ``check``, on the run's stored config, before the weights are read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loopformer.config.recipes import apply_overrides, build_config
from loopformer.config.schema import RunConfig, validate
from loopformer.config.strict import ConfigError, to_dict

EVAL_OVERRIDE_PREFIXES = ("data.", "eval.", "loop_eval.")


def check_unique(overrides: Sequence[str]) -> None:
    """ConfigError when a command line's overrides set (or delete, ``~key``) one key twice: which value
    was meant is a guess. Run by ``train``, ``run``, ``eval`` / ``solve`` / ``push``
    (``run_config_for``) on what the user typed."""
    seen: dict[str, str] = {}
    for text in overrides:
        key = str(text).split("=", 1)[0].strip().removeprefix("~").lstrip("+")  # Hydra's +key / ++key
        if key in seen:
            raise ConfigError(
                f"override {text!r}: {key} is already given ({seen[key]!r}); give each key once"
            )
        seen[key] = str(text)


def check_count(option: str, value: Any, low: int) -> None:
    """ConfigError unless ``value`` (a command option; None = not given) is an integer >= ``low``."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{option} must be an integer >= {low}, got {value!r}")


def check_fraction(option: str, value: Any, low: float, high: float, closed: bool = False) -> None:
    """ConfigError unless ``value`` is a finite number in ``(low, high)`` (``[low, high]`` when ``closed``)."""
    import math

    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (low <= value <= high if closed else low < value < high):
        bounds = f"[{low:g}, {high:g}]" if closed else f"({low:g}, {high:g})"
        raise ConfigError(f"{option} must be a finite number in {bounds}, got {value!r}")


def check_loop_counts(cfg: RunConfig, counts: dict[str, Any], device: str | None = None) -> None:
    """``check_loops`` for each ``{option: count}`` (a list item by item; None = not given): each count of
    loops ``cfg``'s evaluation would run must fit in memory, as ``loop_eval.max_steps`` must."""
    from loopformer.config.memory import check_loops

    for option, value in counts.items():
        for item in value if isinstance(value, list | tuple) else [value]:
            if item is not None:
                check_loops(cfg, option, int(item), device)


def check_variants(
    cfg: RunConfig, variants: Sequence[Sequence[str]], device: str | None = None
) -> list[RunConfig]:
    """Each variant's overrides applied to ``cfg`` (a validated run config) and validated as ``--set`` is
    (``run_config_for``); ConfigError naming the variant."""
    out = []
    for overrides in variants:
        fixed = [o for o in overrides if o.lstrip("~").partition("=")[0].strip() in VARIANT_FIXED]
        if fixed:  # the weights are loaded once, and every variant is scored the same way
            raise ConfigError(
                f"--variant {' '.join(overrides)!r}: {fixed[0].lstrip('~').partition('=')[0]} cannot vary between "
                f"variants (the weights are loaded once and every variant is scored alike); run eval once per value "
                f"with --set / --no-ema instead"
            )
        try:
            out.append(run_config_for(cfg, overrides, device=device))
        except ConfigError as err:
            raise ConfigError(f"--variant {' '.join(overrides)!r}: {err}") from None
    return out


# eval.* keys an ``eval --variant`` cannot change (every other loop_eval.* / eval.* key it names is honoured)
VARIANT_FIXED = ("eval.use_ema", "eval.check")


def check_counts(prefix: str, low: int, **values: Any) -> None:
    """``check_count`` for each ``name=value``, named ``<prefix><name>``; lists are checked item by item."""
    for name, value in values.items():
        items = value if isinstance(value, list | tuple) else [value]
        for i, item in enumerate(items):
            where = f"{prefix}{name}" + (f"[{i}]" if isinstance(value, list | tuple) else "")
            check_count(where, item, low)


def run_config_for(
    stored: RunConfig,
    overrides: Sequence[str] = (),
    device: str | None = None,
    task: str | None = None,
    prefixes: tuple[str, ...] = EVAL_OVERRIDE_PREFIXES,
) -> RunConfig:
    """A trained run's config (``stored``) with a command's ``overrides`` applied and validated as
    ``train`` validates (see the module docstring), for evaluating on ``device``.

    ``overrides`` may only touch keys under ``prefixes`` (evaluation changes how the model is run, never
    the model); ``data.task`` must stay the model's, and so must ``task`` when a command names one.
    """
    check_unique(overrides)
    for text in overrides:
        key = (
            str(text).split("=", 1)[0].strip().removeprefix("~").lstrip("+")
        )  # ~loop_eval.tol: the default; +key / ++key: Hydra
        if not key.startswith(prefixes):
            allowed = ", ".join(f"{p}*" for p in prefixes)
            raise ConfigError(f"override {text!r}: evaluation can only change {allowed} keys")
    trained_on = stored.data.task
    cfg = (
        build_config(apply_overrides(to_dict(stored), list(overrides)), check=False) if overrides else stored
    )
    if cfg.data.task != trained_on:
        raise ConfigError(
            f"data.task={cfg.data.task!r}: the model was trained on task {trained_on!r}; "
            "it can only be evaluated on that task"
        )
    if task is not None and task != trained_on:
        from loopformer.tasks.registry import TASKS

        known = "" if task in TASKS else f" (and {task!r} is no known task: {', '.join(sorted(TASKS))})"
        raise ConfigError(f"task {task!r}: the model was trained on task {trained_on!r}{known}")
    return validate(cfg, training=False, device=device)


def model_task_mismatch(
    fields: dict[str, Any], task: Any, width: int | None = None, ids: int | None = None
) -> str | None:
    """What the model ``fields`` (``model.*``: ``vocab_size``, ``seq_len``, ``grid``) cannot hold of
    ``task``, or None: fewer token ids than the task has (than ``ids``, the data's largest id + 1, when
    known), a grid other than the task's board, fewer positions than the board's cells or than ``width``
    (the data's sequence length, when known)."""
    vocab, seq, grid = fields.get("vocab_size"), fields.get("seq_len"), fields.get("grid")
    need = ids if ids is not None else int(getattr(task, "vocab_size", 0) or 0)
    if isinstance(vocab, int) and need > vocab:
        held = "its data has" if ids is not None else "has"
        return f"task {task.name!r} {held} {need} token ids, but model.vocab_size={vocab}"
    board = task.grid_shape() if hasattr(task, "grid_shape") else None
    if isinstance(grid, list | tuple) and board is not None and tuple(int(g) for g in grid) != tuple(board):
        return f"task {task.name!r} has a {board[0]}x{board[1]} grid, but model.grid={list(grid)}"
    on_board = board is not None and isinstance(grid, list | tuple)  # a model trained on a board
    cells = width if width is not None else (int(getattr(task, "seq_len", 0) or 0) if on_board else 0)
    if isinstance(seq, int) and cells and seq < cells:
        return f"task {task.name!r} has {cells} tokens per example, but model.seq_len={seq}"
    return None


def check_task_fits_model(task: Any, cfg: RunConfig) -> None:
    """ConfigError when the task ``cfg.data`` builds does not fit the trained model (``data.options``
    changed, e.g. a larger Sudoku or maze than the model was trained on): ``model_task_mismatch``."""
    problem = model_task_mismatch(cfg.model.fields, task)
    if problem is not None:
        raise ConfigError(
            f"data.options={cfg.data.options}: {problem}; the model can only be evaluated on data of its shape"
        )


def check_model_fields(given: dict[str, Any], task: Any, width: int, ids: int) -> None:
    """ConfigError when a recipe's own ``model.vocab_size`` / ``seq_len`` / ``grid`` (``given``; the
    trainer fills the unset ones from the task) cannot hold the task's data: ``width`` tokens an example,
    token ids up to ``ids`` - 1."""
    problem = model_task_mismatch(given, task, width, ids)
    if problem is not None:
        raise ConfigError(f"{problem}; leave it unset (the task sets it) or make it fit the data")


def check_trajectory(loops: int, tokens: int, what: str) -> None:
    """ConfigError when keeping ``tokens`` int64 answers for each of ``loops`` loops (``solve`` keeps every
    loop's answer) needs far more than this machine's RAM (``loopformer.config.memory.FAR_BEYOND``)."""
    from loopformer.config.memory import FAR_BEYOND, GIB, physical_memory

    ram, need = physical_memory(), 8.0 * max(int(loops), 1) * max(int(tokens), 1)
    if ram is not None and need > FAR_BEYOND * ram:
        raise ConfigError(
            f"{what}: keeping every loop's answer ({int(loops):,} loops x {tokens} tokens) needs at least "
            f"{need / GIB:,.1f} GiB, far more than the {ram / GIB:,.1f} GiB of RAM this machine has"
        )
