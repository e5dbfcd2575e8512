"""``loopformer data``: generate, show and summarise task datasets, for every task in the registry.

    loopformer data TASK [--size N] [--count N] [--seed S] [--out/-o FILE] [--option/-t key=value ...]
    loopformer data generate TASK ...          (the same; TASK as a first word is shorthand for this)
    loopformer data show TASK FILE [--index i]
    loopformer data stats TASK FILE
    loopformer data prepare NAME --out FOLDER  the standard datasets (``loopformer.tasks.prepare``)

``--size`` and ``--option key=value`` go to the task's constructor when it takes that keyword, else to
``task.generate`` (values parsed as YAML scalars / lists: ``--option box=[2,3]``, ``--option loops=0.1``);
unknown keys are errors.  The file is written with ``task.save`` (Sudoku / maze: the Sudoku-Extreme /
Maze-Hard CSV), as an HRM folder with ``--format hrm``, or as Parquet with ``--format parquet`` (the
``datasets`` library reads it; needs pyarrow).  ``show`` / ``stats`` infer constructor options
such as the grid size from the file (``Task.infer_options(path)``; none for most tasks).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np

from loopformer.commands.common import (
    WholeHelpGroup,
    out_option,
    overwrite_option,
    parse_pairs,
    plain_console,
    task_option,
)
from loopformer.config.strict import excerpt
from loopformer.tasks.base import Task, TaskDataError, TokenDataset
from loopformer.tasks.prepare import DATASETS, done_message, prepare


class _DataGroup(WholeHelpGroup):
    """A group whose unknown first word is a task name: ``data sudoku ...`` == ``data generate sudoku ...``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and not args[0].startswith("-") and args[0] not in self.commands:
            args = ["generate", *args]
        return super().parse_args(ctx, args)


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
        raise click.UsageError(f"unknown option(s) {excerpt(unknown)} for task {task_cls.name!r} (known: {known})")
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
    from loopformer.config.schema import check_option_types

    check_option_types(cls.__init__, init_kw, "--option")  # as train checks data.options, by annotation
    check_option_types(cls.generate, gen_kw, "--option")
    try:
        return cls(**init_kw), gen_kw
    except (TypeError, ValueError) as exc:
        raise click.UsageError(f"cannot build task {name!r} with {excerpt(init_kw)}: {exc}") from None


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
@out_option("Output file (or folder).", required=True)
@task_option("Extra task keyword; repeatable.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["native", "hrm", "parquet"]),
    default="native",
    show_default=True,
    help="native: the task's own file format (task.save); hrm: an HRM/TRM folder; parquet: one row per example "
    "(inputs, labels, difficulty), read by datasets.load_dataset('parquet', data_files=OUT); needs pyarrow.",
)
@click.option("--split", default="train", show_default=True, help="Split folder for --format hrm.")
@overwrite_option("replace an existing OUT file (--format hrm: the split folder)")
def generate_cmd(task_name: str, size: int | None, count: int, seed: int, out_dir: Path, task_options: tuple[str, ...],
                 fmt: str, split: str, overwrite: bool) -> None:  # fmt: skip
    """Generate COUNT examples of TASK with SEED and write them to OUT."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    out = out_dir
    options = parse_pairs(task_options, "--option")
    if size is not None:
        if "size" in options:
            raise click.UsageError("--size given twice (also as --option size=...)")
        options["size"] = size
    task, gen_kw = _make_task(task_name, options)
    if count < 0:
        raise click.BadParameter("must be >= 0", param_hint="--count")
    from loopformer.config.memory import check_rows

    check_rows("--count", count, getattr(task, "seq_len", 1))  # before any row is generated
    check_generate_target(out, fmt, split, overwrite)
    console = plain_console(stderr=True)
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
    from loopformer.files import missing_parts, remove_empty
    from loopformer.runs.folder import RunLock, staged_output

    folder = out if fmt == "hrm" else (out.parent if str(out.parent) else Path("."))
    created = missing_parts(folder)
    try:
        with RunLock(folder, "generate"):  # data prepare -o and other generates into this folder wait
            if fmt == "parquet":
                from loopformer.tasks.formats import save_parquet

                save_parquet(ds, out)
                return
            if fmt != "hrm":
                task.save(ds, out)
                return
            from loopformer.tasks.formats import save_hrm_folder

            with staged_output(out / split, "generate", overwrite, "--out") as tmp:
                save_hrm_folder(ds, out, split, vocab_size=task.vocab_size or None, split_folder=tmp)
    except BaseException:
        remove_empty(created)  # the folders this command made, left empty by the failure
        raise


@data.command("show")
@click.argument("task_name", metavar="TASK")
@click.argument("file", type=click.Path(exists=True, path_type=Path))
@click.option("--index", "-i", type=int, default=0, show_default=True, help="Example to show.")
@task_option("Task constructor keyword.")
@click.option("--plain", is_flag=True, help="No colour markup.")
def show_cmd(task_name: str, file: Path, index: int, task_options: tuple[str, ...], plain: bool) -> None:
    """Render example INDEX of FILE: the input, then the label."""

    task, _ = _make_task(task_name, parse_pairs(task_options, "--option"), file)
    ds = _load(task, file)
    if not -len(ds) <= index < len(ds):
        raise click.BadParameter(f"{index} is out of range for {len(ds)} examples", param_hint="--index")
    console = plain_console()  # long paths must not break lines
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
@task_option("Task constructor keyword.")
@click.option("--bins", type=int, default=10, show_default=True, help="Histogram bins (fewer if few values).")
def stats_cmd(task_name: str, file: Path, task_options: tuple[str, ...], bins: int) -> None:
    """Print the example count and a difficulty histogram of FILE."""
    from rich.table import Table

    task, _ = _make_task(task_name, parse_pairs(task_options, "--option"), file)
    ds = _load(task, file)
    console = plain_console()  # long paths must not break lines
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


@data.command("prepare")
@click.argument("name", type=click.Choice(list(DATASETS)))
@out_option("Output folder.", required=True)
@click.option("--from", "from_dir", type=click.Path(exists=True, path_type=Path), default=None,
              help="Folder with the files already on disk (no download); text: the corpus, a file or a folder.")  # fmt: skip
@click.option("--subset", type=int, default=None, help="Training rows to keep, seeded (0 = all; default: the papers').")
@click.option("--augment", type=int, default=None, help="Augmented copies per training puzzle (default: the papers').")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the subset and augmentations.")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None, help="huggingface_hub cache folder.")
@overwrite_option("replace the dataset in OUT (moved aside once the new one is complete)")
@click.option("--shuffle", is_flag=True, help="text: documents in an order seeded by --seed.")
@click.option("--vocab-size", type=int, default=None, help="text from a .npy of token ids: its vocabulary.")
@click.option("--tokens-per-byte", type=float, default=None,
              help="text from a .npy of token ids: tokens per UTF-8 byte of the text it encodes.")  # fmt: skip
@click.option("--text-column", default="text", show_default=True, help="text from a .parquet: the column.")
def prepare_cmd(name: str, out_dir: Path, from_dir: Path | None, subset: int | None, augment: int | None, seed: int,
                cache_dir: Path | None, overwrite: bool = False, shuffle: bool = False, vocab_size: int | None = None,
                tokens_per_byte: float | None = None, text_column: str = "text") -> None:  # fmt: skip
    """Download (or read --from DIR), subsample, augment and validate dataset NAME into OUT.

    Examples: loopformer data prepare sudoku-extreme --out data/sudoku-extreme-1k-aug-1000;
    loopformer data prepare text --from /data/fineweb-edu --shuffle --out data/fineweb-bytes
    (a memory-mapped token file the text task streams: data.options.path=data/fineweb-bytes)
    """
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    from loopformer.config.checks import check_count
    from loopformer.runs.folder import staged_output

    out = out_dir
    for option, value in (("--subset", subset), ("--augment", augment), ("--seed", seed)):
        check_count(option, value, 0)  # before the output folder is claimed
    console = plain_console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeRemainingColumn(),
                  console=console, transient=True) as bar:  # fmt: skip
        bars: dict[str, Any] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in bars:
                bars[stage] = bar.add_task(stage, total=total or None)
            bar.update(bars[stage], completed=done)

        # built in a hidden folder and swapped in whole: a killed prepare leaves the old dataset
        text = {"shuffle": shuffle, "vocab_size": vocab_size, "tokens_per_byte": tokens_per_byte,
                "text_column": text_column} if name == "text" else None  # fmt: skip
        if text is None and (shuffle or vocab_size is not None or tokens_per_byte is not None):
            raise click.UsageError(f"--shuffle, --vocab-size and --tokens-per-byte apply to text, not {name}")
        with staged_output(out, "prepare", overwrite, "--out") as tmp:
            record = prepare(name, tmp, from_dir, subset, augment, seed, progress, cache_dir, text)
    console = plain_console(stderr=True)
    if name == "text":
        console.print(f"wrote {record['rows']['tokens']:,} tokens ({record['dtype']}, vocabulary {record['vocab_size']}, "
                      f"{record['bytes']:,} bytes, sha256 {record['sha256'][:12]}...) to {out}; train with "
                      f"data.task=text data.options.path={out}")  # fmt: skip
        return
    console.print(done_message(name, out, record, seed))
