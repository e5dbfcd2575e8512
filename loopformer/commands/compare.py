"""``loopformer compare RUN_OR_REPORT... -o FOLDER``: one table and overlay plots across evaluations.

Each argument is a report folder (``loopformer eval`` / ``run`` output: it holds ``metrics.json``), a
run folder (its newest ``eval-*`` report, else the final evaluation ``train`` recorded in ``summary.json``), an ``eval --variant`` report (its variants) or a sweep
folder (its points); see ``loopformer.eval.compare``. The output folder (``loopformer.api.compare_reports``)
follows the rules of ``loopformer.runs.folder.staged_output``: refused when it holds something unless
``--overwrite``, built aside and swapped in whole. Reports are compared only when they were evaluated on the same task,
task options and held-out set (their ``heldout`` record; ``--allow-different-heldout`` lets them through
and the title says so); the title names the task, and sweep points without a report are named.
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from loopformer.commands.common import out_option, overwrite_option, print_comparison


@click.command("compare")
@click.argument("sources", nargs=-1, required=True, metavar="RUN_OR_REPORT...")
@out_option("folder to write (default: a new compare-<time>)")
@overwrite_option("replace what --out holds (moved aside once the new one is done)")
@click.option("--title", default=None, help="title of the table and plots")
@click.option("--allow-different-heldout", is_flag=True,
              help="compare reports evaluated on different tasks, task options or held-out sets (the table says so)")
def compare(sources: tuple[str, ...], out_dir: Path | None, overwrite: bool, title: str | None,
            allow_different_heldout: bool = False) -> None:  # fmt: skip
    """Compare evaluations: accuracy, loops, converged, time, parameters; overlay plots.

    RUN_OR_REPORT: a report folder (loopformer eval / run), a run folder (its newest eval-* report, else its
    final evaluation at the end of training), an
    eval --variant report or a sweep folder. Writes comparison.md, comparison.json and plots/ into --out.
    Reports evaluated on different tasks or held-out sets are refused unless --allow-different-heldout;
    sweep points without a report are named.
    """
    from loopformer.api import compare_reports
    from loopformer.eval.compare import missing_points, report_folders

    folders: list[Path] = []
    seen: dict[Path, str] = {}
    for source in sources:
        for folder in report_folders(source):
            key = Path(folder).resolve()
            if key in seen:  # one evaluation twice would be a comparison with itself
                raise click.BadParameter(f"{source!r} names the report {folder} that {seen[key]!r} already gave",
                                         param_hint="RUN_OR_REPORT")  # fmt: skip
            seen[key] = source
            folders.append(folder)
    out = Path(out_dir) if out_dir else Path(f"compare-{time.strftime('%Y%m%d-%H%M%S')}")
    compare_reports(out, folders, title or "", overwrite, allow_heldout=allow_different_heldout,
                    missing=missing_points(sources))  # fmt: skip
    print_comparison(out)
    click.echo(f"table: {out / 'comparison.md'}  plots: {out / 'plots'}")
