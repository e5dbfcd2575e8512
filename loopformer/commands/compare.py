"""``loopformer compare RUN_OR_REPORT... -o FOLDER``: one table and overlay plots across evaluations.

Each argument is a report folder (``loopformer eval`` / ``run`` output: it holds ``metrics.json``), a
run folder (its newest ``eval-*`` report), an ``eval --variant`` report (its variants) or a sweep
folder (its points); see ``loopformer.eval.compare``. The output folder follows the rules of
``loopformer.runs.folder.staged_output``: refused when it holds something unless ``--overwrite``,
built aside and swapped in whole. Reports are compared only when they were evaluated on the same task,
task options and held-out set (their ``heldout`` record; ``--allow-different-heldout`` lets them through
and the title says so); the title names the task, and sweep points without a report are named.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from loopformer.commands.common import PATH


def print_rows(rows: Sequence[dict[str, Any]], title: str) -> None:
    """The comparison as a rich table on the console (the markdown table's columns but exact accuracy and
    loss)."""
    from rich.console import Console
    from rich.table import Table

    from loopformer.eval.compare import columns_for, row_cells

    shown = [col for col in columns_for(rows) if col not in ("exact", "loss")]
    table = Table(title=title)
    for col in shown:
        table.add_column(col, justify="left" if col in ("run", "loop") else "right")
    for r in rows:
        table.add_row(*row_cells(r, shown))
    Console(highlight=False, width=160).print(table)


def compare_into(out: Path, folders: Sequence[Path], title: str, overwrite: bool,
                 names: Sequence[str] | None = None, root: Path | None = None, allow_heldout: bool = False,
                 missing: Sequence[str] = ()) -> dict[str, Path]:  # fmt: skip
    """Write the comparison of report ``folders`` into ``out`` (staged; see the module docstring). ``root``:
    the folder that owns ``out`` (a sweep's). The title (``title``, or by default ``comparison_title``: the
    table's rows and, when they differ, the reports) names what the reports were evaluated on; reports of
    other tasks or held-out sets are refused unless ``allow_heldout`` (``heldout_line``). ``missing``: the
    sweep points without a report, said on the console and below the table."""
    from loopformer.eval.compare import (
        check_kinds,
        comparison_title,
        heldout_line,
        load_entries,
        write_comparison,
    )
    from loopformer.runs.folder import staged_output

    entries = load_entries(folders, names)
    check_kinds(entries)  # bits per byte beside accuracy first: no held-out set makes those compare
    title = f"{title or comparison_title(entries, len(folders))} · {heldout_line(entries, allow_heldout)}"
    notes = [f"No report (not in the table): {', '.join(missing)}."] if missing else []
    with staged_output(out, "compare", overwrite, "--out", root=root) as staging:
        written = write_comparison(staging, entries, title, notes)
    print_rows([e.row() for e in entries], title)
    for note in notes:
        click.echo(note, err=True)
    return {k: out / Path(v).relative_to(staging) for k, v in written.items()}


def missing_points(sources: Sequence[str]) -> list[str]:
    """The points of the sweep folders among ``sources`` that have no report (``sweep_reports``)."""
    from loopformer.eval.compare import SWEEP_FILE, sweep_reports

    missing: list[str] = []
    for source in sources:
        folder = Path(source)
        if folder.is_dir() and (folder / SWEEP_FILE).is_file() and not (folder / "metrics.json").is_file():
            missing += [f"{source}: {m}" for m in sweep_reports(folder)[1]]
    return missing


@click.command("compare")
@click.argument("sources", nargs=-1, required=True, metavar="RUN_OR_REPORT...")
@click.option("--out", "-o", "out_dir", type=PATH, default=None, help="folder to write (default: a new compare-<time>)")
@click.option(
    "--overwrite", is_flag=True, help="replace what --out holds (moved aside once the new one is done)"
)
@click.option("--title", default=None, help="title of the table and plots")
@click.option(
    "--allow-different-heldout",
    is_flag=True,
    help="compare reports evaluated on different tasks, task options or held-out sets (the table says so)",
)
def compare(sources: tuple[str, ...], out_dir: Path | None, overwrite: bool, title: str | None,
            allow_different_heldout: bool = False) -> None:  # fmt: skip
    """Compare evaluations: accuracy, loops, converged, time, parameters; overlay plots.

    RUN_OR_REPORT: a report folder (loopformer eval / run), a run folder (its newest eval-* report), an
    eval --variant report or a sweep folder. Writes comparison.md, comparison.json and plots/ into --out.
    Reports evaluated on different tasks or held-out sets are refused unless --allow-different-heldout;
    sweep points without a report are named.
    """
    from loopformer.eval.compare import report_folders

    pairs = [(source, folder) for source in sources for folder in report_folders(source)]
    folders = [folder for _, folder in pairs]
    seen: dict[Path, str] = {}
    for source, folder in pairs:
        key = Path(folder).resolve()
        if key in seen:  # one evaluation twice would be a comparison with itself
            raise click.BadParameter(
                f"{source!r} names the report {folder} that {seen[key]!r} already gave",
                param_hint="RUN_OR_REPORT",
            )
        seen[key] = source
    out = Path(out_dir) if out_dir else Path(f"compare-{time.strftime('%Y%m%d-%H%M%S')}")
    written = compare_into(out, folders, title or "", overwrite, allow_heldout=allow_different_heldout,
                           missing=missing_points(sources))  # fmt: skip
    click.echo(f"table: {written['markdown']}  plots: {out / 'plots'}")
