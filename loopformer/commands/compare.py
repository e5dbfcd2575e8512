"""``loopformer compare RUN_OR_REPORT... -o FOLDER``: one table and overlay plots across evaluations.

Each argument is a report folder (``loopformer eval`` / ``run`` output: it holds ``metrics.json``), a
run folder (its newest ``eval-*`` report), an ``eval --variant`` report (its variants) or a sweep
folder (its points); see ``loopformer.eval.compare``. The output folder follows the rules of
``loopformer.runs.outputs.staged_output``: refused when it holds something unless ``--overwrite``,
built aside and swapped in whole.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click


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
                 names: Sequence[str] | None = None) -> dict[str, Path]:  # fmt: skip
    """Write the comparison of report ``folders`` into ``out`` (staged; see the module docstring)."""
    from loopformer.eval.compare import comparison_title, load_entries, write_comparison
    from loopformer.runs.outputs import staged_output

    entries = load_entries(folders, names)
    title = title or comparison_title(entries, len(folders))  # counts the table's rows
    with staged_output(out, "compare", overwrite, "--out") as staging:
        written = write_comparison(staging, entries, title)
    print_rows([e.row() for e in entries], title)
    return {k: out / Path(v).relative_to(staging) for k, v in written.items()}


@click.command("compare")
@click.argument("sources", nargs=-1, required=True, metavar="RUN_OR_REPORT...")
@click.option("--out", "-o", "out_dir", default=None, help="folder to write (default: a new compare-<time>)")
@click.option(
    "--overwrite", is_flag=True, help="replace what --out holds (moved aside once the new one is done)"
)
@click.option("--title", default=None, help="title of the table and plots")
def compare(sources: tuple[str, ...], out_dir: str | None, overwrite: bool, title: str | None) -> None:
    """Compare evaluations: accuracy, loops, converged, time, parameters; overlay plots.

    RUN_OR_REPORT: a report folder (loopformer eval / run), a run folder (its newest eval-* report), an
    eval --variant report or a sweep folder. Writes comparison.md, comparison.json and plots/ into --out.
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
    written = compare_into(out, folders, title or "", overwrite)
    click.echo(f"table: {written['markdown']}  plots: {out / 'plots'}")
