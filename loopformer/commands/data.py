"""``loopformer data``: generate, show and summarise task datasets, for every task in the registry.

    loopformer data TASK [--size N] [--count N] [--seed S] [--out/-o FILE] [--option/-t key=value ...]
    loopformer data generate TASK ...          (the same; TASK as a first word is shorthand for this)
    loopformer data show TASK FILE [--index i]
    loopformer data stats TASK FILE

``--size`` and ``--option key=value`` go to the task's constructor when it takes that keyword, else to
``task.generate`` (values parsed as YAML scalars / lists: ``--option box=[2,3]``, ``--option loops=0.1``);
unknown keys are errors.  The file is written with ``task.save`` (Sudoku / maze: the Sudoku-Extreme /
Maze-Hard CSV), or as an HRM folder with ``--format hrm``.  ``show`` / ``stats`` infer constructor options
such as the grid size from the file (``Task.infer_options(path)``; none for most tasks).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np
import yaml

from loopformer.commands.common import PATH, WholeHelpGroup
from loopformer.tasks.base import Task, TaskDataError, TokenDataset


class _DataGroup(WholeHelpGroup):
    """A group whose unknown first word is a task name: ``data sudoku ...`` == ``data generate sudoku ...``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and not args[0].startswith("-") and args[0] not in self.commands:
            args = ["generate", *args]
        return super().parse_args(ctx, args)


# the task's constructor keywords (``data show`` / ``data stats``): ``-t size=9``, repeatable
TASK_OPTION = click.option(
    "--option", "--task-option", "-t", "extra", multiple=True, metavar="KEY=VALUE", help="Task constructor keyword."
)

def _parse_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key.isidentifier():
            raise click.BadParameter(f"expected key=value, got {pair!r}", param_hint="--option")
        try:
            out[key] = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError as exc:
            raise click.BadParameter(f"cannot parse value of {key!r}: {exc}", param_hint="--option") from None
    return out


def _keywords(fn: Callable[..., Any], skip: tuple[str, ...]) -> tuple[set[str], bool]:
    params = inspect.signature(fn).parameters
    names = {
        name
        for name, p in params.items()
        if name not in skip and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    return names, any(p.kind == p.VAR_KEYWORD for p in params.values())


def split_options(task_cls: type[Task], options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Route options to (constructor kwargs, generate kwargs) by the two signatures; unknown keys raise."""
    init_names, _ = _keywords(task_cls.__init__, ("self",))
    gen_names, gen_var = _keywords(task_cls.generate, ("self", "n", "seed", "progress"))
    init_kw, gen_kw, unknown = {}, {}, []
    for key, value in options.items():
        if key in init_names:
            init_kw[key] = value
        elif key in gen_names or gen_var:
            gen_kw[key] = value
        else:
            unknown.append(key)
    if unknown:
        known = ", ".join(sorted(init_names | gen_names)) or "none"
        raise click.UsageError(f"unknown option(s) {unknown} for task {task_cls.name!r} (known: {known})")
    return init_kw, gen_kw


def _make_task(name: str, options: dict[str, Any], path: Path | None = None) -> tuple[Task, dict[str, Any]]:
    from loopformer.tasks.registry import task_class

    try:
        cls = task_class(name)
    except KeyError as exc:
        raise click.UsageError(str(exc.args[0])) from None
    if path is not None:
        try:
            inferred = cls.infer_options(path)
        except (OSError, ValueError, UnicodeDecodeError):
            inferred = {}
        options = {**inferred, **options}
    init_kw, gen_kw = split_options(cls, options)
    try:
        return cls(**init_kw), gen_kw
    except (TypeError, ValueError) as exc:
        raise click.UsageError(f"cannot build task {name!r} with {init_kw}: {exc}") from None


def _load(task: Task, file: Path) -> TokenDataset:
    from loopformer.tasks.formats import load_hrm_folder

    try:
        if file.is_dir():
            split = "train" if (file / "train").is_dir() else "test"
            return load_hrm_folder(file, split, task=task)
        return task.load(file)
    except TaskDataError as exc:
        raise click.ClickException(str(exc)) from None
    except NotImplementedError as exc:
        raise click.ClickException(str(exc)) from None


@click.group("data", cls=_DataGroup, context_settings={"help_option_names": ["-h", "--help"]})
def data() -> None:
    """Generate, show and summarise task datasets; loopformer data TASK ... generates examples of TASK."""


@data.command("generate")
@click.argument("task_name", metavar="TASK")
@click.option(
    "--size", type=int, default=None, help="Grid size / task size (constructor or generate keyword)."
)
@click.option("--count", type=int, default=1000, show_default=True, help="Number of examples.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", "-o", "out", type=PATH, required=True, help="Output file (or folder).")
@click.option(
    "--option",
    "--task-option",
    "-t",
    "extra",
    multiple=True,
    metavar="KEY=VALUE",
    help="Extra task keyword; repeatable.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["native", "hrm"]),
    default="native",
    show_default=True,
    help="native: the task's own file format (task.save); hrm: an HRM/TRM folder.",
)
@click.option("--split", default="train", show_default=True, help="Split folder for --format hrm.")
@click.option(
    "--overwrite", is_flag=True, help="replace an existing OUT file (--format hrm: the split folder)"
)
def generate_cmd(
    task_name: str,
    size: int | None,
    count: int,
    seed: int,
    out: Path,
    extra: tuple[str, ...],
    fmt: str,
    split: str,
    overwrite: bool,
) -> None:
    """Generate COUNT examples of TASK with SEED and write them to OUT."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    options = _parse_options(extra)
    if size is not None:
        if "size" in options:
            raise click.UsageError("--size given twice (also as --option size=...)")
        options["size"] = size
    task, gen_kw = _make_task(task_name, options)
    if count < 0:
        raise click.BadParameter("must be >= 0", param_hint="--count")
    check_generate_target(out, fmt, split, overwrite)
    console = Console(stderr=True)
    takes_progress = "progress" in inspect.signature(task.generate).parameters
    with Progress(
        TextColumn(f"[bold]{task_name}[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        bar_id = bar.add_task("generate", total=count)
        kwargs = dict(gen_kw)
        if takes_progress:
            kwargs["progress"] = lambda k: bar.advance(bar_id, k)
        try:
            ds = task.generate(count, seed, **kwargs)
        except (TypeError, ValueError) as exc:
            raise click.ClickException(f"generation failed: {exc}") from None
        bar.update(bar_id, completed=count)
    try:
        write_generated(task, ds, out, fmt, split, overwrite)
    except NotImplementedError as exc:
        raise click.ClickException(f"{exc}; use --format hrm") from None
    console.print(f"wrote {len(ds)} {task_name} examples to {out}")


def check_generate_target(out: Path, fmt: str, split: str, overwrite: bool) -> None:
    """Refuse, before anything is generated, an OUT that lies in a training run's folder, or that
    already holds a dataset (the file; ``--format hrm``: the split folder) unless ``overwrite``."""
    from loopformer.runs.folder import RunFolderError, run_at_or_above

    target = out / split if fmt == "hrm" else out
    for folder in (out, target):
        found = run_at_or_above(folder)
        if found is not None:
            raise RunFolderError(f"--out {out} is inside the training run {found}; `data generate` "
                                 f"never writes into a run's folder: choose another path")  # fmt: skip
    if fmt != "hrm" and out.is_dir():
        raise RunFolderError(f"--out {out} is a folder; name the file to write (or use --format hrm)")
    if fmt == "hrm" and out.exists() and not out.is_dir():
        raise RunFolderError(f"--out {out} is a file, not a folder: --format hrm writes a folder")
    if target.exists() and not overwrite and (target.is_file() or any(target.iterdir())):
        raise RunFolderError(f"--out {target} already exists; pass --overwrite to replace it, "
                             f"or choose another path")  # fmt: skip


def write_generated(task: Task, ds: TokenDataset, out: Path, fmt: str, split: str, overwrite: bool) -> None:
    """Write ``ds`` to ``out`` under the folder's lock: a file atomically, an HRM split folder built
    aside and swapped in whole (``loopformer.runs.folder.staged_output``)."""
    from loopformer.runs.folder import RunLock, staged_output

    folder = out if fmt == "hrm" else (out.parent if str(out.parent) else Path("."))
    created = not folder.exists()
    try:
        with RunLock(folder, "generate"):  # data prepare -o and other generates into this folder wait
            if fmt != "hrm":
                task.save(ds, out)
                return
            from loopformer.tasks.formats import save_hrm_folder

            with staged_output(out / split, "generate", overwrite, "--out") as tmp:
                save_hrm_folder(ds, out, split, vocab_size=task.vocab_size or None, split_folder=tmp)
    except BaseException:
        if created and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()  # the folder this command made, left empty by the failure
        raise


@data.command("show")
@click.argument("task_name", metavar="TASK")
@click.argument("file", type=click.Path(exists=True, path_type=Path))
@click.option("--index", "-i", type=int, default=0, show_default=True, help="Example to show.")
@TASK_OPTION
@click.option("--plain", is_flag=True, help="No colour markup.")
def show_cmd(task_name: str, file: Path, index: int, extra: tuple[str, ...], plain: bool) -> None:
    """Render example INDEX of FILE: the input, then the label."""
    from rich.console import Console

    task, _ = _make_task(task_name, _parse_options(extra), file)
    ds = _load(task, file)
    if not -len(ds) <= index < len(ds):
        raise click.BadParameter(f"{index} is out of range for {len(ds)} examples", param_hint="--index")
    console = Console(highlight=False, soft_wrap=True)  # long paths must not break lines
    x, y = ds.inputs[index], ds.labels[index]
    label = np.where(y == -100, x, y)

    def render(pred: np.ndarray | None) -> str:
        if not plain and "markup" in inspect.signature(task.render).parameters:
            return task.render(x, pred, markup=True)  # type: ignore[call-arg]
        return task.render(x, pred)

    console.print(f"[bold]{task_name}[/bold] {file} example {index}: difficulty {ds.difficulty[index]:g}")
    console.print("input:")
    console.print(render(None), markup=not plain)
    console.print(f"label (valid by task.check: {task.check(x, label)}):")
    console.print(render(label), markup=not plain)


@data.command("stats")
@click.argument("task_name", metavar="TASK")
@click.argument("file", type=click.Path(exists=True, path_type=Path))
@TASK_OPTION
@click.option("--bins", type=int, default=10, show_default=True, help="Histogram bins (fewer if few values).")
def stats_cmd(task_name: str, file: Path, extra: tuple[str, ...], bins: int) -> None:
    """Print the example count and a difficulty histogram of FILE."""
    from rich.console import Console
    from rich.table import Table

    task, _ = _make_task(task_name, _parse_options(extra), file)
    ds = _load(task, file)
    console = Console(highlight=False, soft_wrap=True)  # long paths must not break lines
    d = ds.difficulty
    console.print(f"{task_name} {file}: {len(ds)} examples, seq_len {ds.inputs.shape[1]}")
    if len(ds) == 0:
        return
    console.print(f"difficulty: min {d.min():g}  mean {d.mean():.2f}  max {d.max():g}")
    distinct = np.unique(d)
    if len(distinct) <= bins:
        edges = None
        counts = [int((d == v).sum()) for v in distinct]
        names = [f"{v:g}" for v in distinct]
    else:
        counts_arr, edges = np.histogram(d, bins=bins)
        counts = counts_arr.tolist()
        names = [
            f"[{edges[i]:g}, {edges[i + 1]:g}{']' if i == len(counts) - 1 else ')'}"
            for i in range(len(counts))
        ]
    table = Table(title="difficulty histogram")
    table.add_column("difficulty")
    table.add_column("count", justify="right")
    table.add_column("", justify="left")
    peak = max(counts) or 1
    for name, c in zip(names, counts):
        table.add_row(name, str(c), "#" * max(0, round(40 * c / peak)))
    console.print(table)
