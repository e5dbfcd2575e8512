"""``loopformer solve TASK PUZZLE --checkpoint RUN``: watch a trained model think on one puzzle.

The puzzle is read through the task's own parser (``parse_grid`` for Sudoku / maze: the CSV text,
'.' for blanks) or, for other tasks, as whitespace / comma separated token ids. Every loop state
is read out through the model's head (the engine callback, as in the logit lens) and printed
when the predicted answer changes, over the run's ``eval.segments`` chained segments (the state carried,
as ``loopformer eval``: the answer is eval's prediction); the final answer is judged by the task's
independent validator.
``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import json
from typing import Any

import click
import numpy as np

from loopformer.api import check_givens, format_answer, parse_puzzle
from loopformer.api import solve as solve_puzzle
from loopformer.commands.common import device_option, ema_option, json_option, plain_console, verify_option
from loopformer.devices import resolve_device
from loopformer.numerics import NumericalFaultError
from loopformer.runs import load_run
from loopformer.tasks.base import Task

# solve --json: schema (str), task, puzzle, solution (str | null: not a well-formed grid), solution_tokens (list[int] | null), valid (bool),
# steps (int | null), trajectory (list[str | null] | null), trajectory_tokens (list[list[int]] | null), checkpoint,
# weights (str), givens ({status, detail}), error (str | null): loopformer.Solution.to_dict() plus givens / error
SOLVE_JSON_KEYS = (
    "schema",
    "task",
    "puzzle",
    "givens",
    "solution",
    "solution_tokens",
    "valid",
    "steps",
    "trajectory",
    "trajectory_tokens",
    "checkpoint",
    "weights",
    "error",
)


def solve_record(**values: Any) -> dict[str, Any]:
    """The one ``solve --json`` schema: every key of SOLVE_JSON_KEYS, always (None when not known)."""
    record = {key: values.get(key) for key in SOLVE_JSON_KEYS}
    record["schema"] = "loopformer.solve/1"
    return record


@click.command("solve")
@click.argument("task_name", metavar="TASK")
@click.argument("puzzle")
@click.option(
    "--checkpoint", "-c", required=True, help="run folder, checkpoints/ folder or checkpoint folder"
)
@json_option("print one JSON object (solution, valid, steps, ...)")
@click.option("--max-steps", type=int, default=None, help="cap on loops (default: the run's evaluation loop)")
@ema_option()
@verify_option()
@click.option("--all-loops", is_flag=True, help="print every loop, not only those where the answer changed")
@click.option(
    "--puzzle-id",
    type=int,
    default=None,
    help="row of the model's per-puzzle embedding (TRM / HRM on ARC: the task's id in the run's data)",
)
@device_option()
def solve(
    task_name: str,
    puzzle: str,
    checkpoint: str,
    as_json: bool,
    max_steps: int | None,
    ema: bool,
    verify: bool,
    all_loops: bool,
    puzzle_id: int | None,
    device: str,
) -> None:
    """Solve PUZZLE with a trained model, printing the answer as the loop refines it.

    PUZZLE is one input in TASK's notation, quoted for the shell:

    \b
    sudoku  The grid row by row, size x size characters: digits 1-9 (then A-G
            beyond 9), '.' or '0' for a blank; spaces and newlines are ignored.
            A 4x4 puzzle the default job's model solves: "2..3......3..42."
    maze    The grid row by row, size x size characters: '#' wall, ' ' open,
            'S' start, 'G' goal; newlines are dropped, spaces are cells.
    arc     The test input grid as the ARC task files write it, JSON rows of
            colours 0-9 (at most 30x30): "[[0,7,7],[7,7,7],[0,7,7]]". It is
            placed at the top left of the 30x30 canvas; the answer is printed
            the same way. The 900 canvas token ids are read too. A TRM / HRM
            run also needs --puzzle-id (the task's id in the run's data).
    other   The token ids of one input row, separated by spaces or commas
            (groups, kg_depth, kg_systematic, text, plug-in tasks).

    \b
    Example, on the model loopformer run trained (its run folder):
    loopformer solve sudoku "2..3......3..42." -c runs/<timestamp>
    """
    from loopformer.config.checks import check_count

    check_count("--max-steps", max_steps, 1)
    check_count("--puzzle-id", puzzle_id, 0)
    try:  # the run's config is checked (and its task against TASK) before the weights are read
        run = load_run(checkpoint, use_ema=ema, device=str(resolve_device(device)), task=task_name, verify=verify)
    except NumericalFaultError as err:  # NaN / inf weights: refused at loading, still one JSON schema
        if as_json:
            click.echo(json.dumps(solve_record(task=task_name, puzzle=puzzle, valid=False, error=str(err))))
        raise
    task = run.task
    tokens = parse_puzzle(task, puzzle)  # the task's notation, its vocabulary and length checked
    from loopformer.config.checks import check_trajectory

    loops = (max_steps or int(run.loop_eval.max_steps)) * max(int(run.config.eval.segments), 1)
    check_trajectory(loops, tokens.size, f"--max-steps {max_steps}" if max_steps else "loop_eval.max_steps")
    givens = check_givens(task, tokens)
    common = {
        "task": task.name,
        "puzzle": format_answer(task, tokens),
        "givens": givens,
        "checkpoint": str(run.path),
        "weights": run.weights,
    }
    try:
        solution = solve_puzzle(run, tokens, max_steps=max_steps, puzzle_id=puzzle_id)
    except NumericalFaultError as err:
        if as_json:
            click.echo(json.dumps(solve_record(**common, valid=False, error=str(err))))
        raise
    frames, valid, steps = solution.trajectory, solution.valid, solution.steps
    if as_json:
        click.echo(json.dumps(solve_record(**{**solution.to_dict(), **common, "valid": valid})))
        return

    console = plain_console()
    render = _renderer(task, console.is_terminal)
    console.print(f"[bold]{task.name}[/bold] puzzle, checkpoint {run.path} ({run.weights} weights)")
    console.print(render(tokens, None))
    if givens["detail"]:
        from rich.markup import escape

        console.print(
            f"[bold red]{escape(givens['status'])}[/bold red]: {escape(givens['detail'])} "
            "(the task's exact solver); the model's answer follows"
        )
    previous: np.ndarray | None = None
    for t, pred in enumerate(frames, start=1):
        changed = int((pred != previous).sum()) if previous is not None else int(pred.size)
        if previous is None or changed or all_loops or t == steps:
            ok = task.check(tokens, pred)
            console.print(
                f"\n[bold]loop {t}[/bold]: {changed} token(s) changed, {'valid' if ok else 'not yet valid'}"
            )
            console.print(render(tokens, pred))
        previous = pred
    legend = marks_legend(task, console.is_terminal)
    if legend:
        console.print(legend)
    verdict = "[bold green]VALID[/bold green]" if valid else "[bold red]INVALID[/bold red]"
    console.print(f"\nanswer after {steps} loop(s): {verdict} (judged by the task's independent validator)")
    if givens["status"] in ("contradictory", "unsolvable"):
        console.print(f"the puzzle itself is {givens['status']}: no valid answer exists")


def marks_legend(task: Task, colour: bool) -> str:
    """What the board's marks mean, for tasks whose ``render`` marks cells (Sudoku): '' for others."""
    if getattr(task, "name", "") != "sudoku":
        return ""
    if colour:
        return ("\nbold: a given; [cyan]cyan[/cyan]: filled in by the model; [bold red]!x![/bold red]: breaks a "
                "rule (changes a given, or repeats in a row, column or box)")  # fmt: skip
    return ("\nx: a given; (x): filled in by the model; !x!: breaks a rule (changes a given, or repeats in a "
            "row, column or box)")  # fmt: skip


def _renderer(task: Task, colour: bool) -> Any:
    """Colour (rich markup) on a terminal when the task offers it; plain text with markers otherwise."""
    import inspect

    try:
        takes_markup = colour and "markup" in inspect.signature(task.render).parameters
    except (TypeError, ValueError):
        takes_markup = False

    def render(inputs: np.ndarray, prediction: np.ndarray | None) -> str:
        if takes_markup:
            return task.render(inputs, prediction, markup=True)  # type: ignore[call-arg]
        from rich.markup import escape

        return escape(task.render(inputs, prediction))

    return render
