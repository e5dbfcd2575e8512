"""``loopformer recipes``: the recipes shipped in the package, each with the first line of its comment.

A recipe is used by name from anywhere (a clone or a wheel install): ``loopformer train sudoku4_fprm``,
``loopformer run --recipe paper_sudoku_extreme_fprm``; ``--path`` prints where the files are, to copy one.
"""

from __future__ import annotations

from pathlib import Path

import click


def recipe_summary(path: Path) -> str:
    """The first comment line of a recipe (without '#'), or '' when it opens with none."""
    for line in path.read_text().splitlines():
        text = line.strip()
        if not text:
            continue
        return text.lstrip("#").strip() if text.startswith("#") else ""
    return ""


@click.command("recipes")
@click.option("--path", "show_path", is_flag=True, help="print the recipe folder's path and each file's")
def recipes(show_path: bool) -> None:
    """List the shipped recipes, each with what it reaches (use one by name: loopformer train NAME).

    Each line is the recipe's first comment line, whole: what it trains and what it reaches, measured or
    taken from docs/results.md.
    """
    from loopformer.config import RECIPE_DIR

    files = sorted(RECIPE_DIR.glob("*.yaml"))
    if show_path:
        click.echo(str(RECIPE_DIR))
    width = max((len(p.stem) for p in files), default=0)
    for path in files:
        where = f"  ({path})" if show_path else ""
        click.echo(f"{path.stem.ljust(width)}  {recipe_summary(path)}{where}")
