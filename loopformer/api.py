"""The Python API: load a trained model, solve a puzzle with it, watch the loop think; evaluate a run
into a report and compare reports, as ``loopformer eval`` / ``compare`` do.

    import loopformer
    run = loopformer.load("runs/sudoku")            # a run folder, checkpoint folder or hub id (owner/name)
    sol = loopformer.solve(run, "5...27..9..41......1..5.3...")
    sol.answer, sol.valid, sol.steps, sol.trajectory
    sol.to_dict()                                   # exactly the fields of `loopformer solve --json`
    parse_puzzle(run.task, "2..3......3..42.")      # a puzzle's input tokens [T] (the task's notation, checked)
    from loopformer.api import evaluate_checkpoint, ReportOptions
    evaluate_checkpoint("runs/sudoku", ReportOptions(budgets=[1, 2, 4, 8]))   # the report folder

``load`` returns a ``LoadedRun``: ``.model`` (EMA weights when the run keeps them), ``.task``, ``.config``
(the resolved run configuration) and ``.loop_eval`` (the evaluation loop: solver, halting, cap).
``solve`` runs the run's evaluation on one puzzle (``eval.segments`` chained loops carrying the state, as
``loopformer eval``; TRM / HRM / Attractor-puzzle runs evaluate 16) and records the answer read out after
every loop of every segment (the logit lens of ``loopformer.eval.analysis.trace_loops``); ``valid`` is the
task's independent validator's verdict, never a comparison with a stored label.  ``loopformer solve``
prints exactly this.

Types, the same in Python and in ``solve --json`` (``Solution.to_dict()`` is the JSON record's source): an
answer's *text* is the task's notation (``Task.format_grid``) or None when the prediction is no well-formed
grid, its *tokens* are token ids. ``answer`` (JSON ``solution``) and ``trajectory_text`` (JSON
``trajectory``) are text; ``tokens`` (JSON ``solution_tokens``) and ``trajectory`` (JSON
``trajectory_tokens``) are tokens: numpy arrays in Python, lists of ints in JSON.

``evaluate_checkpoint`` and ``compare_reports`` join run storage (loading a run, the report folder's one
write path, provenance, the held-out set's fingerprint) and evaluation (``loopformer.eval.suite``: what a
report computes and writes), which sit on one floor and never import each other. They return the folder
they wrote; what a command prints of it comes through ``log`` or from the files.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from loopformer.devices import resolve_device
from loopformer.eval.budget import with_budget
from loopformer.runs import LoadedRun, load_run
from loopformer.tasks.base import Task, TaskDataError

if TYPE_CHECKING:
    from loopformer.eval.suite import Log, ReportOptions


def load(run_or_hub_id: str | Path, device: str | torch.device = "auto", use_ema: bool = True,
         verify: bool = False) -> LoadedRun:  # fmt: skip
    """A trained model from a run folder, checkpoint folder or hub id (``owner/name[@revision]``).

    ``device``: ``auto`` (CUDA when present), ``cpu``, ``cuda`` or ``cuda:N``. ``use_ema``: True or False
    (anything else, such as the string "no", is a ValueError: it would read as true). ``verify``: refuse a
    checkpoint without its manifest (loaded with a warning that it is unverified otherwise).
    """
    for name, flag in (("use_ema", use_ema), ("verify", verify)):
        if not isinstance(flag, bool):
            raise ValueError(f"loopformer.load: {name} must be True or False, got {flag!r}")
    return load_run(run_or_hub_id, use_ema=use_ema, device=str(resolve_device(device)), verify=verify)


@dataclass
class Solution:
    """What ``solve`` returns: token arrays [T], their text form, the validator's verdict, the trajectory."""

    task: str
    puzzle: np.ndarray
    tokens: np.ndarray  # the answer's tokens after the last loop
    answer: str | None  # the answer's text (task.format_grid); None when it is no well-formed grid
    valid: bool  # the task's independent validator (task.check)
    steps: int  # loops run, summed over the segments
    trajectory: list[np.ndarray] = field(repr=False)  # the answer's tokens read out after loop 1, 2, ..., steps
    checkpoint: str = ""
    weights: str = ""
    trajectory_text: list[str | None] = field(default_factory=list, repr=False)  # the text of each of them
    puzzle_text: str | None = None  # the puzzle's text

    def changes(self) -> list[int]:
        """Tokens changed at each loop (the first loop counts every token)."""
        prev, out = None, []
        for frame in self.trajectory:
            out.append(int(frame.size if prev is None else (frame != prev).sum()))
            prev = frame
        return out

    def to_dict(self, task: Task | None = None) -> dict[str, Any]:
        """The ``solve --json`` fields (text as text, tokens as lists of ints); ``task`` recomputes the texts."""
        puzzle, text = self.puzzle_text, self.trajectory_text
        if task is not None or len(text) != len(self.trajectory):
            if task is None:
                raise ValueError("Solution.to_dict: the texts were not recorded; pass the task")
            puzzle, text = format_answer(task, self.puzzle), [format_answer(task, f) for f in self.trajectory]
        return {"task": self.task, "puzzle": puzzle, "solution": self.answer,
                "solution_tokens": [int(t) for t in self.tokens], "valid": self.valid, "steps": self.steps,
                "trajectory": text, "trajectory_tokens": [[int(x) for x in f] for f in self.trajectory],
                "checkpoint": self.checkpoint, "weights": self.weights}  # fmt: skip


def parse_puzzle(task: Task, puzzle: str | np.ndarray | list[int]) -> np.ndarray:
    """Input tokens [T] for one puzzle: text through the task's parser, or integer token ids (a list or
    an integer array; floats, booleans, bytes and other objects are a ``TaskDataError``)."""
    if isinstance(puzzle, bytes | bytearray):
        raise TaskDataError("the puzzle is bytes; pass text (decode it) or a list / array of token ids")
    if not isinstance(puzzle, str):
        tokens = _token_ids(puzzle)
    else:  # the task's notation (Task.parse_grid; by default whitespace- or comma-separated token ids)
        tokens = np.asarray(task.parse_grid(puzzle, "puzzle"), dtype=np.int64).reshape(-1)
    if tokens.size == 0:
        raise TaskDataError("the puzzle is empty")
    if task.vocab_size and (tokens.min() < 0 or tokens.max() >= task.vocab_size):
        raise TaskDataError(f"puzzle tokens must lie in [0, {task.vocab_size - 1}] for task {task.name!r}")
    if task.seq_len and tokens.size != task.seq_len:
        raise TaskDataError(f"the puzzle has {tokens.size} tokens, task {task.name!r} expects {task.seq_len}")
    return tokens


def _token_ids(puzzle: Any) -> np.ndarray:
    """``puzzle`` (a list or array of token ids) as int64 [T]; TaskDataError unless every id is an integer
    (floats holding whole numbers are taken)."""
    try:
        raw = np.asarray(puzzle)
    except (ValueError, TypeError):  # ragged nesting
        raise TaskDataError("the puzzle's token ids do not form an array (ragged lists?)") from None
    flat = raw.reshape(-1)
    if flat.size == 0:
        return flat.astype(np.int64)
    whole = raw.dtype.kind == "f" and bool(np.isfinite(flat).all() and (flat == np.round(flat)).all())
    if whole and float(np.abs(flat).max()) >= 2.0**63:  # no int64 holds it: the cast would wrap silently
        raise TaskDataError("the puzzle's token ids are far beyond any vocabulary")
    if raw.dtype == object and all(isinstance(x, int) and not isinstance(x, bool) for x in flat):
        raise TaskDataError("the puzzle's token ids are far beyond any vocabulary")
    if raw.dtype.kind not in "iu" and not whole:
        raise TaskDataError(f"the puzzle's token ids must be integers, got {flat[0]!r} ({raw.dtype})")
    if raw.dtype.kind == "u" and flat.max() > np.iinfo(np.int64).max:
        raise TaskDataError("the puzzle's token ids are far beyond any vocabulary")
    return flat.astype(np.int64)


def format_answer(task: Task, tokens: np.ndarray) -> str | None:
    """The task's text form of a token array (``Task.format_grid``: a grid string, by default the token
    ids joined by spaces); None when the prediction is no well-formed grid (its tokens say what it is)."""
    try:
        return task.format_grid(tokens)
    except (TaskDataError, ValueError, IndexError):
        return None


def check_givens(task: Task, tokens: np.ndarray) -> dict[str, Any]:
    """What the task's exact solver says about the puzzle itself, before any model runs:
    ``{"status": "solvable" | "contradictory" | "unsolvable" | "not unique" | "unchecked", "detail": str | None}``
    (Sudoku: duplicated givens, then a solution count up to 2; maze: a unique start / goal joined by a path)."""
    conflict = task.find_conflict(tokens)
    if conflict:
        return {"status": "contradictory", "detail": f"the givens contradict each other: {conflict}"}
    n = task.count_solutions(tokens, limit=2)
    if n is not None:
        if n == 0:
            return {
                "status": "unsolvable",
                "detail": "the givens admit no solution (the exact solver found none)",
            }
        if n > 1:
            return {"status": "not unique", "detail": "the givens admit more than one solution"}
        return {"status": "solvable", "detail": None}
    length = task.shortest_path_length(tokens)
    if length is not None:
        if length < 0:
            return {"status": "unsolvable", "detail": "no path joins a unique start S to a unique goal G"}
        return {"status": "solvable", "detail": None}
    return {"status": "unchecked", "detail": None}


@torch.no_grad()
def solve(model: LoadedRun | str | Path, puzzle: str | np.ndarray | list[int], max_steps: int | None = None,
          seed: int | None = None, segments: int | None = None, puzzle_id: int | None = None) -> Solution:  # fmt: skip
    """Solve one puzzle with a trained model (a ``LoadedRun``, or anything ``load`` accepts).

    ``segments`` chained loops carry the state (default: the run's ``eval.segments``, so the answer is
    ``loopformer eval``'s prediction for this puzzle); ``max_steps`` caps each segment's loops (default: the
    run's evaluation loop); ``seed`` seeds the initial iterate (default: the run's seed).  Runs on the
    model's device, under bf16 autocast when the run trained in bf16. ``puzzle_id``: the row of the model's
    per-puzzle embedding table (TRM / HRM on ARC: the puzzle's task id, as in the run's dataset); required
    when the table has more than one row, 0 for a one-row table.
    """
    from loopformer.config.checks import check_count, check_trajectory
    from loopformer.eval.analysis import trace_loops
    from loopformer.eval.evaluate import model_device
    from loopformer.nn import autocast
    from loopformer.numerics import NumericalFaultError

    check_count("max_steps", max_steps, 1)
    check_count("segments", segments, 1)
    check_count("puzzle_id", puzzle_id, 0)
    run = model if isinstance(model, LoadedRun) else load(model)
    task = run.task
    tokens = parse_puzzle(task, puzzle)
    loops = (max_steps or int(run.loop_eval.max_steps)) * (segments or max(int(run.config.eval.segments), 1))
    check_trajectory(loops, tokens.size, f"max_steps={max_steps}" if max_steps else "loop_eval.max_steps")
    loop = run.loop_eval if max_steps is None else with_budget(run.loop_eval, max_steps, "capped")
    segments = run.config.eval.segments if segments is None else segments
    device = model_device(run.model)
    frames: list[np.ndarray] = []

    def observe(t: int, z: torch.Tensor, logits: torch.Tensor) -> None:
        if not bool(torch.isfinite(logits).all()) or not bool(torch.isfinite(z).all()):
            raise NumericalFaultError(f"solve: loop {t}: the model's logits or loop state hold NaN or infinite "
                                      "values (diverged weights or an unstable loop); no answer is reported")  # fmt: skip
        frames.append(logits[0].argmax(-1).cpu().numpy())

    generator = torch.Generator(device=device).manual_seed(run.config.seed if seed is None else seed)
    run.model.eval()
    with autocast(device, run.config.bf16):
        ids = _puzzle_ids(run, puzzle_id, device)
        _, final_logits = trace_loops(run.model, torch.as_tensor(tokens[None], device=device), loop, observe,
                                      puzzle_ids=ids, generator=generator, segments=segments)  # fmt: skip
    if not bool(torch.isfinite(final_logits).all()):
        raise NumericalFaultError(
            "solve: the model's final logits hold NaN or infinite values; no answer is reported"
        )
    final = final_logits[0].argmax(-1).cpu().numpy()
    return Solution(task.name, tokens, final, format_answer(task, final), bool(task.check(tokens, final)),
                    len(frames), frames, str(run.path), run.weights, [format_answer(task, f) for f in frames],
                    format_answer(task, tokens))  # fmt: skip


def _puzzle_ids(run: LoadedRun, puzzle_id: int | None, device: torch.device) -> torch.Tensor | None:
    """[1] puzzle id for models with a per-puzzle embedding table; ValueError naming the problem."""
    n = int(getattr(run.model.config, "num_puzzle_ids", 0) or 0)
    if n == 0:
        if puzzle_id is not None:
            raise ValueError(f"puzzle id {puzzle_id} given, but the model in {run.path} has no per-puzzle embedding")
        return None
    if puzzle_id is None:
        if n > 1:
            raise ValueError(f"the model in {run.path} has a per-puzzle embedding of {n} rows (one per task): give "
                             "the puzzle's id (--puzzle-id / puzzle_id=), as its dataset numbers it")  # fmt: skip
        puzzle_id = 0
    if not 0 <= puzzle_id < n:
        raise ValueError(f"puzzle id {puzzle_id} is out of range: the model's table has ids 0..{n - 1}")
    return torch.tensor([puzzle_id], dtype=torch.long, device=device)


def _quiet(_message: Any) -> None:
    return None


def evaluate_checkpoint(checkpoint: str | Path, options: ReportOptions | None = None, log: Log = _quiet) -> Path:
    """What ``loopformer eval`` (and each point of ``loopformer sweep``) does: load ``checkpoint`` (a run
    folder, checkpoint folder or hub id), evaluate it as ``options`` say and write the report; returns the
    report folder. The overrides, variants and loop counts are checked before the weights are read. With
    ``options.variants`` the report holds one sub-report per loop (``variants/NN-name/``) and their
    comparison (``comparison.md`` / ``.json``, overlay plots); with ``options.auto_solver`` the search runs
    on a slice of the held-out set and the report covers the other rows, with the chosen solver."""
    from loopformer.config.checks import check_loop_counts, check_variants
    from loopformer.devices import set_cpu_threads
    from loopformer.eval.auto_solver import search_run
    from loopformer.eval.suite import ReportOptions, run_job_references
    from loopformer.nn import autocast
    from loopformer.runs import eval_dataset
    from loopformer.runs.folder import staged_output

    opts = options or ReportOptions()
    dev = resolve_device(opts.device)

    def checks(config: Any) -> None:
        lens = opts.lens_loops if opts.analyses else None
        check_loop_counts(config, {"--max-steps": opts.budgets, "--lens-loops": lens}, str(dev))
        check_variants(config, [o for _, o in opts.variants], str(dev))

    run = load_run(checkpoint, use_ema=opts.ema, config_overrides=tuple(opts.overrides), device=str(dev),
                   best=opts.best, check=checks, verify=opts.verify)  # fmt: skip
    set_cpu_threads(run.config.train.threads, dev, run.model)  # the run's train.threads rule, logged
    # the baseline of the `loopformer run` job this model belongs to, when evaluated on the same held-out set
    same = not opts.examples and not any(o.lstrip("~+").startswith("data.") for o in opts.overrides)
    references = {**opts.references, **run_job_references(run.path, same_heldout=same)}
    opts = dataclasses.replace(opts, batch_size=run.config.eval.batch_size, references=references)
    with autocast(dev, run.config.bf16):  # evaluate in the precision the run trained in
        dataset = eval_dataset(run.task, run.config, opts.examples)
        auto = None
        if opts.auto_solver is not None:  # search on a slice; the report covers the other rows
            run, dataset, auto = search_run(run, dataset, *opts.auto_solver, log=log)
        # no second process writes into a run folder in use (a training, another eval): lock what we write into
        if opts.out_dir:  # the run-folder rules (refused when it holds a report, built aside, swapped in whole)
            out = Path(opts.out_dir)
            target = staged_output(out, "eval", opts.overwrite, "--out")
        else:  # next to the checkpoints, not inside one (old checkpoints are rotated away)
            out = _run_dir(run) / f"eval-step{run.step}-{time.strftime('%Y%m%d-%H%M%S')}"
            target = _report_folder(out, _run_dir(run))
        with target as write_dir:
            if opts.variants:
                _evaluate_variants(run, dataset, write_dir, out, opts, log)
            else:
                _report(run, dataset, write_dir, out, opts, log, auto=auto)
    return out


def _run_dir(run: LoadedRun) -> Path:
    return run.path.parent.parent if run.path.parent.name == "checkpoints" else run.path


@contextmanager
def _report_folder(out: Path, run_dir: Path) -> Iterator[Path]:
    """The default report folder (a new name inside the run folder ``run_dir``, never through a link there),
    the run folder locked meanwhile."""
    from loopformer.files import check_inside
    from loopformer.runs.folder import RunLock

    check_inside(out, run_dir)
    with RunLock(out.parent, "eval"):
        yield out


def _report(run: LoadedRun, dataset: Any, out: Path, final: Path, opts: ReportOptions, log: Log,
            auto: dict[str, Any] | None = None, variant: list[str] | None = None) -> None:  # fmt: skip
    """One report of ``run`` into ``out`` (files named by where they end up, ``final``), recording what it was
    evaluated on (``heldout``: task, options, the held-out set's fingerprint), how (``evaluation``) and the
    provenance of the training and of this evaluation."""
    from loopformer.eval.auto_solver import auto_note
    from loopformer.eval.evaluate import model_device
    from loopformer.eval.suite import evaluate_run, segment_note
    from loopformer.runs import training_depth
    from loopformer.runs.folder import collect, describe, heldout_record, record_for_step

    made: dict[str, Any] = {"heldout": heldout_record(run.config, dataset),
                            "evaluation": {**opts.record(), **({"variant": variant} if variant is not None else {})}}  # fmt: skip
    if auto is not None:
        made["auto_solver"] = auto
    trained_by = record_for_step(_run_dir(run), run.step)
    made["provenance"] = {"training": trained_by, "evaluation": collect(model_device(run.model))}
    unit = "examples" if run.task.has_validator else "windows"
    unscored = made["heldout"].get("unscored_rows")
    notes = [f"Task: {run.config.data.task} {run.config.data.options}; {len(dataset)} held-out {unit}"
             + (f" ({unscored} rows without labels left out: they cannot be scored)." if unscored else "."),
             *segment_note(run.config.eval.segments), *auto_note(auto),
             *([f"Trained with {describe(trained_by)}."] if trained_by else [])]  # fmt: skip
    evaluate_run(run, dataset, out, final, opts, training_depth(run), notes, made, log)


def _evaluate_variants(run: LoadedRun, dataset: Any, out: Path, final: Path, opts: ReportOptions, log: Log) -> None:
    """The run's loop_eval and each variant into ``out/variants/<name>/``, then their comparison into ``out``.
    Every key a variant names is honoured: ``eval.max_examples`` evaluates that many held-out rows (the
    keys that cannot vary are refused before the weights are read: ``config.checks.VARIANT_FIXED``)."""
    from loopformer.config.checks import check_variants
    from loopformer.eval.compare import heldout_line, load_entries, write_comparison
    from loopformer.runs import eval_dataset

    names, folders = [], []
    for i, (name, overrides) in enumerate([("loop_eval", []), *opts.variants]):
        config = check_variants(run.config, [overrides])[0] if overrides else run.config
        variant = dataclasses.replace(run, config=config, loop_eval=config.loop_config(run.model.config.loop, "eval"))
        rows = dataset
        if any(o.lstrip("~").startswith("eval.max_examples") for o in overrides):  # the variant's own row count
            rows = eval_dataset(run.task, config, 0)
        folder = Path("variants") / f"{i:02d}-{safe_name(name)}"
        _report(variant, rows, out / folder, final / folder, opts, log, variant=list(overrides))
        names.append(name)
        folders.append(out / folder)
    entries = load_entries(folders, names)
    title = (f"{run.family or run.config.model.name} ({run.path}): {len(entries)} evaluation loops compared · "
             f"{heldout_line(entries, allow=True)}")  # fmt: skip
    write_comparison(out, entries, title)


def compare_reports(out: str | Path, folders: Sequence[Path], title: str = "", overwrite: bool = False,
                    names: Sequence[str] | None = None, root: Path | None = None, allow_heldout: bool = False,
                    missing: Sequence[str] = ()) -> Path:  # fmt: skip
    """What ``loopformer compare`` (and a sweep's ``compare/``) writes: the comparison of report ``folders``
    (``comparison.md``, ``comparison.json``, overlay plots) into ``out``, built aside and swapped in whole
    (refused when ``out`` holds something, unless ``overwrite``); returns ``out``. ``root``: the folder that
    owns ``out`` (a sweep's). The title (``title``, or by default the table's rows counted) names what the
    reports were evaluated on; reports of other tasks or held-out sets are refused unless ``allow_heldout``.
    ``missing``: the sweep points without a report, said below the table."""
    from loopformer.eval.compare import (
        check_kinds,
        comparison_title,
        heldout_line,
        load_entries,
        write_comparison,
    )
    from loopformer.runs.folder import staged_output

    entries = load_entries(folders, names, read=read_evaluation)
    check_kinds(entries)  # bits per byte beside accuracy first: no held-out set makes those compare
    title = f"{title or comparison_title(entries, len(folders))} · {heldout_line(entries, allow_heldout)}"
    notes = [f"No report (not in the table): {', '.join(missing)}."] if missing else []
    with staged_output(out, "compare", overwrite, "--out", root=root) as staging:
        write_comparison(staging, entries, title, notes)
    return Path(out)


# a trained run's final evaluation (summary.json ``eval``) -> the names a report's metrics.json gives its results
_SUMMARY_RESULT = {"n": "n", "valid_acc": "valid_accuracy", "exact_acc": "exact_accuracy", "token_acc": "token_accuracy",
                   "loop_steps": "mean_steps", "blocks": "mean_blocks", "converged": "converged_fraction",
                   "bits_per_byte": "bits_per_byte", "loss": "loss"}  # fmt: skip


def read_evaluation(folder: Path) -> dict[str, Any]:
    """What ``compare`` reads of a folder: a report's ``metrics.json``, or for a run folder without a report its
    final evaluation at the end of training (``summary.json``) in that shape: its results, the trainer's
    evaluation loop (loop_periodic over loop_eval), parameters, blocks per loop step, the held-out set the
    final checkpoint recorded, and ``evaluation_label`` naming it. ValueError when the run recorded none."""
    from loopformer.config import load_config_file
    from loopformer.eval.compare import METRICS, read_metrics
    from loopformer.runs.checkpoint import StateRecord, read_record, step_name
    from loopformer.runs.folder import read_summary

    if (folder / METRICS).is_file():
        return read_metrics(folder)
    summary = read_summary(folder) or {}
    ev = summary.get("eval") or {}
    if "n" not in ev:
        raise ValueError(f"{folder} holds no evaluation report and its training recorded no final evaluation "
                         f"(data.eval_size 0?): run `loopformer eval {folder}` first")  # fmt: skip
    config = load_config_file(folder)
    loop = config.loop_config(config.model_config().loop, "periodic")
    result = {long: ev[short] for short, long in _SUMMARY_RESULT.items() if short in ev}
    steps, blocks = result.get("mean_steps"), result.get("mean_blocks")
    state = folder / "checkpoints" / step_name(int(summary.get("steps") or 0)) / "state.json"
    held = (read_record(state, StateRecord).get("data") or {}).get("eval") if state.is_file() else None
    parameters = summary.get("parameters")
    return {"results": {config.model.name: result},
            "models": {config.model.name: {"loop": dataclasses.asdict(loop), "baseline": loop.max_steps <= 1,
                                           "parameters": parameters if isinstance(parameters, int) else None,
                                           "blocks": blocks / steps if blocks is not None and steps else None}},
            "heldout": None if not held else {"task": config.data.task, "options": dict(config.data.options),
                                              "rows": held.get("rows"), "sha256": held.get("sha256")},
            "evaluation_label": f"end of training, step {summary.get('steps')} ({ev.get('weights', '?')} weights)"}  # fmt: skip


def safe_name(text: str) -> str:
    """``text`` as a folder name: letters, digits and ``._=,+-`` kept, anything else ``-``."""
    kept = "".join(c if c.isalnum() or c in "._=,+-" else "-" for c in text).strip("-.")
    return kept[:120] or "point"
