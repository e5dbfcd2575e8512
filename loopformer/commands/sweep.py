"""``loopformer sweep RECIPE key=a,b,c other=x,y [key=value ...] -o FOLDER``: a grid of runs, then
their comparison.

Arguments whose value holds top-level commas are the grid's axes (``loop_eval.solver=damped,anderson``;
a list stays one value when bracketed: ``train.betas=[0.9,0.95]``); the others are overrides of every
point. The cartesian product runs sequentially into one folder:

- axes that change training (anything but ``loop_eval.*`` / ``eval.*``) give one run folder per
  combination, ``FOLDER/<key=value,...>/`` (``FOLDER/run/`` when no axis changes training), each key
  by its last part (``lr=0.001``) unless two axes share it;
- axes that only change evaluation (``loop_eval.*``, ``eval.*``) share their training run: each of
  their combinations is one report, ``<run>/eval-<key=value,...>/`` (``eval-default`` without any);
- ``FOLDER/sweep.json`` lists the grid and the reports; ``FOLDER/compare/`` holds the comparison
  (``loopformer compare``: table and overlay plots), replaced at every sweep.

Resumable: a point whose run finished (``summary.json`` at ``train.steps``) is not trained again, one
killed part-way resumes from its checkpoint, and a report already written with the same evaluation
settings is kept; one written with others (another ``--max-steps`` or ``--analyses``) is evaluated again.
A finished point whose recorded configuration differs from the new one is refused (use another folder).
Nothing is written through a symbolic link inside the sweep folder (a linked ``compare/``, point or
report folder is refused), and the paths ``sweep.json`` lists are read only inside the folder.

Several GPUs: the points are independent, so one process per GPU is natural; ``point_command``
gives the ``loopformer train`` / ``loopformer eval`` command lines of a point, for a launcher that
places one per device (``CUDA_VISIBLE_DEVICES``); this command itself runs them in turn.
"""

from __future__ import annotations

import itertools
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from loopformer.commands.common import budgets_option, device_option, out_option, plain_console

EVAL_PREFIXES = ("loop_eval.", "eval.")


@dataclass
class Point:
    """One grid point: the training run folder it uses and its report folder inside that run."""

    train: list[str]  # the overrides that change training (axes and fixed ones)
    evaluate: list[str]  # loop_eval.* / eval.* overrides
    run: str  # the run folder's name inside the sweep folder
    report: str  # the report folder's name inside the run folder
    name: str  # the comparison's row name


def split_values(text: str) -> list[str]:
    """``"a,[1,2],b"`` -> ``["a", "[1,2]", "b"]``: commas inside brackets or quotes do not split."""
    out, depth, quote, current = [], 0, "", ""
    for c in text:
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        elif c == "," and depth == 0:
            out.append(current)
            current = ""
            continue
        current += c
    return [*out, current]


def parse_grid(arguments: tuple[str, ...] | list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """(axes {key: [values]}, fixed overrides) of the command line's ``key=value`` arguments."""
    axes: dict[str, list[str]] = {}
    fixed: list[str] = []
    for text in arguments:
        key, sep, raw = text.partition("=")
        if not sep or not key.strip():
            if text.startswith("~"):
                fixed.append(text)
                continue
            raise click.BadParameter(f"expected key=value or key=a,b,c, got {text!r}", param_hint="GRID")
        values = split_values(raw)
        if key in axes or any(f.partition("=")[0] == key for f in fixed):
            raise click.BadParameter(f"{key} is given twice", param_hint="GRID")
        if len(values) == 1:
            fixed.append(text)
            continue
        if any(not v.strip() for v in values):
            raise click.BadParameter(f"{text!r} has an empty value", param_hint="GRID")
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise click.BadParameter(f"{text!r} lists {', '.join(repeated)} more than once", param_hint="GRID")
        axes[key] = values
    return axes, fixed


def short_keys(keys: list[str]) -> dict[str, str]:
    """Each key by its last part (``loop_eval.solver`` -> ``solver``) unless two keys share it."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: s if last.count(s) == 1 else k for k, s in zip(keys, last)}


def _label(pairs: list[tuple[str, str]], short: dict[str, str]) -> str:
    from loopformer.api import safe_name

    return safe_name(",".join(f"{short[k]}={v}" for k, v in pairs))


def grid_points(axes: dict[str, list[str]], fixed: list[str]) -> list[Point]:
    """Every combination of ``axes`` (first axis slowest), with ``fixed`` applied to each."""
    train_fixed = [f for f in fixed if not f.lstrip("~").startswith(EVAL_PREFIXES)]
    eval_fixed = [f for f in fixed if f.lstrip("~").startswith(EVAL_PREFIXES)]
    keys = list(axes)
    short = short_keys(keys)
    points = []
    for values in itertools.product(*(axes[k] for k in keys)):
        pairs = list(zip(keys, values))
        train = [(k, v) for k, v in pairs if not k.startswith(EVAL_PREFIXES)]
        evaluate = [(k, v) for k, v in pairs if k.startswith(EVAL_PREFIXES)]
        run = _label(train, short) if train else "run"
        report = f"eval-{_label(evaluate, short)}" if evaluate else "eval-default"
        points.append(Point(
            train=train_fixed + [f"{k}={v}" for k, v in train],
            evaluate=eval_fixed + [f"{k}={v}" for k, v in evaluate],
            run=run, report=report, name=_label(pairs, short) or "default",
        ))  # fmt: skip
    return points


def point_command(recipe: str, folder: Path, point: Point, budgets: str | None = None) -> list[list[str]]:
    """The ``loopformer train`` and ``loopformer eval`` command lines of ``point`` (one process per GPU)."""
    run = folder / point.run
    train = ["loopformer", "train", recipe, *point.train, "-o", str(run), "--resume"]
    evaluate = ["loopformer", "eval", str(run), *[a for o in point.evaluate for a in ("-s", o)],
                "-o", str(run / point.report), "--no-analyses"]  # fmt: skip
    return [train, evaluate + (["--max-steps", budgets] if budgets else [])]


def _same_config(run: Path, cfg: Any) -> str | None:
    """None when ``run``'s recorded config matches ``cfg`` (before the trainer resolves the model's fields from
    the task, so only the keys ``cfg`` sets are compared); else the first differing key."""
    from loopformer.config import load_config_file, to_dict
    from loopformer.plugins import reading_data

    with reading_data(f"{run / 'config.json'}"):  # a run folder is data: nothing it names is imported
        old = to_dict(load_config_file(run, check=False))
    new = to_dict(cfg)
    for section in ("data", "eval", "loop_train", "loop_eval", "loop_periodic", "seed"):
        if old.get(section) != new.get(section):
            return section
    ignore = {"resume", "overwrite", "progress"}
    for key, value in new["train"].items():
        if key not in ignore and old["train"].get(key) != value:
            return f"train.{key}"
    for key, value in new["model"].items():
        if old["model"].get(key) != value:
            return f"model.{key}"
    return None


def check_points(recipe: str, folder: Path, points: list[Point], budgets: list[int], device: str) -> None:
    """Every point's training config (``train``'s checks) and its evaluation overrides and loop budgets
    (``eval``'s, ``loopformer.config.checks``), before the sweep folder is created or a point trained."""
    from loopformer.commands.run import training_config
    from loopformer.config.checks import check_loop_counts, run_config_for
    from loopformer.devices import resolve_device

    dev = str(resolve_device(device))
    for point in points:
        evaluated = run_config_for(training_config(recipe, point.train, folder / point.run), point.evaluate, device=dev)
        check_loop_counts(evaluated, {"--max-steps": budgets}, dev)


def _train_point(recipe: str, run: Path, point: Point, echo: Any) -> None:
    from loopformer.commands.run import training_config
    from loopformer.runs.folder import finished_summary
    from loopformer.train.trainer import Trainer

    cfg = training_config(recipe, point.train, run)
    if (run / "config.json").is_file():
        differs = _same_config(run, cfg)
        if differs is not None:
            raise click.UsageError(
                f"{run} was trained with another {differs} than this sweep asks for; "
                "sweep into another folder (or remove that point)"
            )
        if finished_summary(run, cfg.train.steps) is not None:  # read through its schema
            echo(f"{point.run}: finished earlier, not trained again")
            return
        cfg = training_config(recipe, [*point.train, "train.resume=true"], run)
    echo(f"{point.run}: training {cfg.model.name} for {cfg.train.steps} steps -> {run}")
    Trainer(cfg).fit()


def _check_compare_folder(compare: Path) -> None:
    """The sweep replaces its own ``compare/`` on every run, never through a link, and only when it holds
    its earlier comparison (or nothing): anything else there is refused, not replaced."""
    from loopformer.files import check_inside
    from loopformer.runs.folder import RunFolderError

    check_inside(compare, compare.parent)
    if compare.is_dir() and not (compare / "comparison.json").is_file():
        others = sorted(p.name for p in compare.iterdir() if not p.name.startswith("."))
        if others:
            raise RunFolderError(f"{compare} holds {', '.join(others[:3])}, not this sweep's comparison; the sweep "
                                 f"replaces only its own: move it away")  # fmt: skip


def _report_differs(report: Path, point: Point, budgets: list[int], analyses: bool) -> str | None:
    """None when ``report`` holds a report made as this sweep makes it now (its ``metrics.json``
    ``evaluation`` record: the point's overrides, ``--max-steps``, ``--analyses``); "" when there is none;
    else how it was made otherwise (it is evaluated again: a rerun never keeps a report made under other
    settings while ``sweep.json`` claims the new ones)."""
    from loopformer.eval.compare import read_metrics

    if not (report / "metrics.json").is_file():
        return ""
    made = read_metrics(report).get("evaluation")
    if not isinstance(made, dict):
        return "without a record of its evaluation settings"
    now = {"overrides": list(point.evaluate), "budgets": list(budgets), "analyses": analyses}
    differ = [f"{k} {made.get(k)!r} (now {v!r})" for k, v in now.items() if made.get(k) != v]
    return f"with other evaluation settings: {'; '.join(differ)}" if differ else None


def check_sweep_folder(folder: Path, recipe: str, axes: dict[str, Any], fixed: dict[str, Any]) -> None:
    """Refuse a sweep folder that is a file, lies in a training run's folder, is one, or holds
    something other than this sweep (another sweep's ``sweep.json``, a dataset, a report)."""
    from loopformer.commands.common import check_job_folder
    from loopformer.eval.compare import read_sweep
    from loopformer.runs.folder import RunFolderError

    record = folder / "sweep.json"
    check_job_folder(folder, "sweep", record.is_file())
    if not record.is_file():
        return
    old = read_sweep(folder)  # through its schema: a malformed file is one line naming the field
    if (old.get("recipe"), old.get("axes"), old.get("fixed")) != (recipe, axes, fixed):
        raise RunFolderError(
            f"--out {folder} holds another sweep ({record}: recipe {old.get('recipe', '?')}, "
            f"axes {', '.join(old.get('axes') or [])}); a sweep is resumed with the same recipe and grid: "
            f"choose another --out"
        )


@click.command("sweep")
@click.argument("recipe")
@click.argument("grid", nargs=-1, required=True)
@out_option("the sweep folder (one run folder per point)", required=True)
@budgets_option("loop budgets of each point's accuracy-vs-budget curve, e.g. 1,2,4,8")
@click.option("--analyses/--no-analyses", default=False, show_default=True,
              help="logit lens, signal propagation and spectral radius in every report")  # fmt: skip
@device_option("where each point is evaluated (training: the recipe's device key)")
def sweep(recipe: str, grid: tuple[str, ...], out_dir: Path, budgets: list[int], analyses: bool, device: str) -> None:
    """Run RECIPE over a grid, e.g. loop_eval.solver=damped,anderson train.lr=1e-3,3e-4; compare the points.

    GRID: key=a,b,c arguments are axes (their cartesian product is run in turn); key=value ones apply to
    every point. Points that differ only in loop_eval.* / eval.* share one training run. Resumable:
    finished points are skipped. The comparison (table + plots) goes to OUT/compare/.
    """
    from loopformer.files import missing_parts, remove_empty

    axes, fixed = parse_grid(grid)
    if not axes:
        raise click.BadParameter("no axis: give at least one key=a,b,... argument", param_hint="GRID")
    max_steps = ",".join(map(str, budgets)) or None  # as given, for the points' commands and the resume hint
    points = grid_points(axes, fixed)
    folder = Path(out_dir)
    check_sweep_folder(folder, recipe, axes, fixed)  # before anything is written
    check_points(recipe, folder, points, budgets, device)
    created = missing_parts(folder)  # removed again (while empty) when the sweep fails before writing
    try:
        _sweep(recipe, grid, folder, axes, fixed, points, budgets, max_steps, analyses, device)
    except BaseException:
        remove_empty(created)
        raise


def _sweep(recipe: str, grid: tuple[str, ...], folder: Path, axes: dict[str, Any], fixed: list[str],
           points: list[Point], budgets: list[int], max_steps: str | None, analyses: bool, device: str) -> None:  # fmt: skip
    """The sweep itself, in its locked folder (see the module docstring)."""

    from loopformer.api import compare_reports, evaluate_checkpoint
    from loopformer.commands.common import print_comparison, resume_hint
    from loopformer.eval.suite import ReportOptions
    from loopformer.files import atomic_write_json, check_inside
    from loopformer.runs.folder import RunLock
    from loopformer.train.stop import TrainingInterrupted

    with RunLock(folder, "sweep"):  # one sweep at a time in a folder; each run folder is locked by its run
        check_sweep_folder(folder, recipe, axes, fixed)  # again, now that no other sweep can write it
        for point in points:  # the sweep's own folders: never through a link out of it
            check_inside(folder / point.run / point.report, folder)
        _check_compare_folder(folder / "compare")
        atomic_write_json(folder / "sweep.json", {
            "recipe": recipe, "axes": axes, "fixed": fixed, "max_steps": budgets,
            "evaluation": {"max_steps": budgets, "analyses": analyses},
            "points": [{"name": p.name, "run": p.run, "report": f"{p.run}/{p.report}",
                        "commands": [shlex.join(c) for c in point_command(recipe, folder, p, max_steps)]}
                       for p in points],
            "reports": [f"{p.run}/{p.report}" for p in points],
        }, root=folder, indent=2, newline=True)  # fmt: skip
        for i, point in enumerate(points, 1):
            click.echo(f"[{i}/{len(points)}] {point.name}")
            run = folder / point.run
            try:
                _train_point(recipe, run, point, click.echo)
            except TrainingInterrupted as err:  # SIGTERM / SIGINT: the point is checkpointed; rerun resumes
                again = ["loopformer", "sweep", recipe, *grid, "-o", str(folder),
                         *(["--max-steps", max_steps] if max_steps else []),
                         *(["--analyses"] if analyses else []), *(["--device", device] if device != "auto" else [])]  # fmt: skip
                resume_hint(err, again)
            report = run / point.report
            why = _report_differs(report, point, budgets, analyses)
            if why is None:
                click.echo(f"{point.name}: report {report} written earlier, kept")
                continue
            if why:
                click.echo(f"{point.name}: report {report} was written {why}; evaluating again")
            options = ReportOptions(budgets=budgets, analyses=analyses, overrides=point.evaluate, device=device,
                                    out_dir=report, overwrite=True)  # fmt: skip
            evaluate_checkpoint(run, options, log=plain_console().print)
        reports = [folder / p.run / p.report for p in points]
        compare_reports(folder / "compare", reports, f"sweep of {recipe}: {', '.join(axes)}", True,
                        [p.name for p in points], root=folder)  # fmt: skip
    print_comparison(folder / "compare")
    click.echo(f"comparison: {folder / 'compare' / 'comparison.md'}  plots: {folder / 'compare' / 'plots'}")
