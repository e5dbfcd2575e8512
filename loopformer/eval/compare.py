"""Comparing evaluations: one table and overlay plots across runs, eval variants or sweep points.

Reads only what evaluation reports already hold (``metrics.json`` written by
``loopformer.eval.suite.run_suite``: ``results``, ``models``, ``budget``, ``difficulty``), so it
works on reports from ``loopformer eval``, ``loopformer run`` and ``loopformer sweep`` alike.

- ``report_folders(path)``: the report folders a command-line argument names: a report folder
  itself (it holds ``metrics.json``), an ``eval --variant`` report (its ``variants/*``), a sweep folder
  (its points' reports, ``sweep_reports``: each path ``sweep.json`` lists must lie inside the sweep
  folder, and the points without a report are named) or a run folder (its newest ``eval-*`` report, else
  the run folder itself: its final evaluation at the end of training, which ``load_entries``' reader reads).
- ``load_entries(folders)``: one ``Entry`` per model of each report (a ``loopformer run`` report
  holds the looped model and its baseline); each ``metrics.json`` (and ``sweep.json``) is read through
  its record (``MetricsRecord``, ``SweepRecord``: dataclasses read by ``loopformer.config.strict.read_record``), so a malformed one is one line
  naming the file and the field.
- ``heldout_line(entries, allow)``: what the reports were evaluated on (their ``heldout`` record: task,
  task options, the held-out set's fingerprint); reports that differ there are refused unless
  ``allow``, and the comparison's title says what they were evaluated on, or that it differs.
- ``write_comparison(out, entries, title)``: ``comparison.md`` and ``comparison.json`` (accuracy,
  mean loops, converged fraction, time per example, parameters, test-time compute = transformer blocks
  per example as the model counts them, which evaluation each row is) and ``plots/accuracy_vs_budget.png`` (log2 x-axis with a tick at every power
  of two; a run without a budget curve is one point at its mean loops; a baseline, a model without a
  loop ("one pass"), is a horizontal line) and ``plots/loops_vs_difficulty.png`` (when some model has
  more than one difficulty value); every file through ``loopformer.files``. Language-model reports
  (``loopformer eval`` on a text run) are compared by bits per byte (``LM_COLUMNS``,
  ``plots/bpb_vs_budget.png``); mixing them with validator reports is an error (``check_kinds``).
- ``comparison_title(entries, reports)``: the default title, counting the table's rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loopformer.config.strict import Record, read_record
from loopformer.eval import plots
from loopformer.eval.report import console_table, describe_loop, md_table, num, write_json
from loopformer.files import JSONInt, JSONNumber, JSONStr, atomic_write_text, check_inside

METRICS = "metrics.json"
SWEEP_FILE = "sweep.json"
RUN_SUMMARY = "summary.json"  # a trained run's record, its final held-out evaluation included


@dataclass
class _Result(Record):
    n: JSONInt | None = None
    valid_accuracy: JSONNumber | None = None
    exact_accuracy: JSONNumber | None = None
    mean_steps: JSONNumber | None = None
    mean_blocks: JSONNumber | None = None  # test-time compute: transformer blocks per example
    converged_fraction: JSONNumber | None = None
    loop: dict | None = None
    bits_per_byte: JSONNumber | None = None  # this and the next two: language-model reports
    loss: JSONNumber | None = None
    token_accuracy: JSONNumber | None = None


@dataclass
class _Model(Record):
    loop: dict | None = None
    parameters: JSONInt | None = None
    blocks: JSONNumber | None = None  # transformer blocks per loop step, as the evaluation counted them
    seconds_per_example: JSONNumber | None = None
    baseline: bool = False


@dataclass
class _BudgetPoint(Record):
    budget: JSONNumber
    valid_accuracy: JSONNumber | None = None


@dataclass
class _Budget(Record):
    mode: JSONStr = ""
    points: list[_BudgetPoint] = field(default_factory=list)


@dataclass
class _Bucket(Record):
    low: JSONNumber
    high: JSONNumber
    mean_steps: JSONNumber | None = None


@dataclass
class _Difficulty(Record):
    buckets: list[_Bucket] = field(default_factory=list)


@dataclass
class _Heldout(Record):
    task: JSONStr
    options: dict = field(default_factory=dict)
    rows: JSONInt = 0
    sha256: JSONStr = ""


@dataclass
class MetricsRecord(Record):
    """What a report's metrics.json holds that compare reads (``loopformer.eval.suite.run_suite`` writes it)."""

    results: dict[str, _Result] = field(default_factory=dict)
    models: dict[str, _Model] = field(default_factory=dict)
    budget: dict[str, _Budget | None] = field(default_factory=dict)
    difficulty: dict[str, _Difficulty | None] = field(default_factory=dict)
    heldout: _Heldout | None = None
    evaluation_label: JSONStr | None = None  # which evaluation this is (a run's final one: "end of training ...")
    checkpoint: dict | JSONStr | None = None  # what `loopformer eval` evaluated (its label: "latest (step 3)")


@dataclass
class _SweepPoint(Record):
    name: JSONStr
    report: JSONStr
    run: JSONStr = ""


@dataclass
class SweepRecord(Record):
    """What ``loopformer sweep`` writes (``loopformer.commands.sweep``) as sweep.json."""

    recipe: JSONStr | None = None
    axes: dict | None = None  # compared whole with a rerun's grid: any value that differs is another sweep
    fixed: list | dict | None = None
    max_steps: list[JSONInt] = field(default_factory=list)
    points: list[_SweepPoint] = field(default_factory=list)
    reports: list[JSONStr] = field(default_factory=list)
    evaluation: dict | None = None


@dataclass
class Entry:
    """One model of one evaluation report, as a row of the comparison."""

    name: str
    source: Path
    result: dict[str, Any]
    model: dict[str, Any] = field(default_factory=dict)
    budget: dict[str, Any] | None = None
    difficulty: dict[str, Any] | None = None
    heldout: dict[str, Any] | None = None  # what the report was evaluated on (task, options, fingerprint)
    evaluation: str = ""  # which evaluation the row comes from (an eval report, a training's final evaluation)

    @property
    def loop(self) -> dict[str, Any]:
        return self.model.get("loop") or self.result.get("loop") or {}

    @property
    def baseline(self) -> bool:
        if "baseline" in self.model:
            return bool(self.model["baseline"])
        return int(self.loop.get("max_steps", 2)) <= 1

    @property
    def is_lm(self) -> bool:
        """A language model's report (scored by bits per byte, no validator)."""
        return "bits_per_byte" in self.result

    @property
    def accuracy(self) -> float:
        valid = self.result.get("valid_accuracy")
        return float(valid if valid is not None else self.result.get("exact_accuracy") or math.nan)

    def row(self) -> dict[str, Any]:
        mean_steps, blocks = self.result.get("mean_steps"), self.model.get("blocks")
        compute = self.result.get("mean_blocks")  # counted by the model; reports before it: loops x blocks
        if compute is None and blocks is not None and mean_steps is not None:
            compute = mean_steps * blocks
        seconds = self.model.get("seconds_per_example")
        return {
            "name": self.name,
            "loop": describe_loop(self.loop) if self.loop else "",
            "baseline": self.baseline,
            "examples": self.result.get("n"),
            "valid_accuracy": self.result.get("valid_accuracy"),
            "exact_accuracy": self.result.get("exact_accuracy"),
            "bits_per_byte": self.result.get("bits_per_byte"),  # language models (no validator)
            "loss": self.result.get("loss"),
            "token_accuracy": self.result.get("token_accuracy"),
            "mean_loops": mean_steps,
            "converged_fraction": self.result.get("converged_fraction"),
            "ms_per_example": None if seconds is None else 1000 * seconds,
            "parameters": self.model.get("parameters"),
            "blocks": blocks,
            "test_time_compute": compute,  # transformer blocks per example (loops x blocks per loop step)
            "evaluation": self.evaluation,
            "source": str(self.source),
        }


def _is_report(folder: Path) -> bool:
    return (folder / METRICS).is_file()


def report_folders(path: str | Path) -> list[Path]:
    """The report folders ``path`` names (see the module docstring); FileNotFoundError when none."""
    path = Path(path)
    if path.is_file() and path.name == METRICS:
        return [path.parent]
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such run, report or sweep folder")
    if _is_report(path):
        return [path]
    variants = sorted(p for p in (path / "variants").glob("*") if _is_report(p))
    if variants:
        return variants
    if (path / SWEEP_FILE).is_file():
        found, _ = sweep_reports(path)
        if found:
            return found
    evals = sorted((p for p in path.glob("eval-*") if _is_report(p)), key=lambda p: p.stat().st_mtime)
    if evals:
        return [evals[-1]]
    if (path / RUN_SUMMARY).is_file():  # a run straight out of training: its final evaluation (read_entries' reader)
        return [path]
    raise FileNotFoundError(
        f"{path} holds no evaluation report (metrics.json) and no training summary: run `loopformer eval {path}` first"
    )


def read_sweep(folder: Path) -> dict[str, Any]:
    """``folder/sweep.json`` checked against ``SweepRecord`` (ValueError naming the file and the field)."""
    return read_record(Path(folder) / SWEEP_FILE, SweepRecord)


def sweep_reports(folder: Path) -> tuple[list[Path], list[str]]:
    """(the report folders of a sweep's points that hold a report, "name (report)" of those that do not);
    every path ``sweep.json`` lists must lie inside ``folder`` (``UnsafePathError`` otherwise: a path read
    from a file is never followed out of the folder that holds it)."""
    record = read_sweep(folder)
    points = record.get("points") or [{"name": r, "report": r} for r in record.get("reports") or []]
    found, missing = [], []
    for point in points:
        report = check_inside(Path(folder) / point["report"], folder)
        if _is_report(report):
            found.append(report)
        else:
            missing.append(f"{point['name']} ({point['report']})")
    return found, missing


def read_metrics(folder: Path) -> dict[str, Any]:
    """A report's ``metrics.json`` checked against ``MetricsRecord`` (ValueError naming the file and field)."""
    return read_record(Path(folder) / METRICS, MetricsRecord)


def _source_name(folder: Path) -> str:
    """A report's row name: its sweep point's name, else its run's name, else the folder's."""
    if folder.name.startswith("eval-") and (folder.parent / "config.json").is_file():
        if (folder.parent.parent / SWEEP_FILE).is_file():
            for point in read_sweep(folder.parent.parent).get("points") or []:
                if point["report"] == f"{folder.parent.name}/{folder.name}":
                    return point["name"]
        return folder.parent.name  # a run's own report: name it by the run
    return folder.name


def _evaluation_label(folder: Path, metrics: dict[str, Any]) -> str:
    """Which evaluation a report is: the label it was given, else ``eval report NAME of CHECKPOINT``."""
    if metrics.get("evaluation_label"):
        return str(metrics["evaluation_label"])
    checkpoint = metrics.get("checkpoint")
    label = checkpoint.get("label") if isinstance(checkpoint, dict) else metrics.get("label")
    return f"eval report {folder.name}" + (f" of {label}" if label else "")


def load_entries(folders: Sequence[Path], names: Sequence[str] | None = None,
                 read: Callable[[Path], dict[str, Any]] = read_metrics) -> list[Entry]:  # fmt: skip
    """One ``Entry`` per model in each report folder; ``names`` (one per folder) replaces the folder names.
    ``read``: a folder -> what its ``metrics.json`` holds (``loopformer.api.compare_reports`` also reads a
    trained run's final evaluation into that shape, ``evaluation_label`` naming it)."""
    entries: list[Entry] = []
    for i, folder in enumerate(folders):
        metrics = read(folder)
        results = metrics.get("results") or {}
        if not results:
            raise ValueError(f"the report {folder} holds no held-out results (a language-model report?)")
        base = names[i] if names else _source_name(folder)
        for label, result in results.items():
            entries.append(
                Entry(
                    name=base if len(results) == 1 else f"{base}: {label}",
                    source=folder,
                    result=result,
                    model=(metrics.get("models") or {}).get(label, {}),
                    budget=(metrics.get("budget") or {}).get(label),
                    difficulty=(metrics.get("difficulty") or {}).get(label),
                    heldout=metrics.get("heldout"),
                    evaluation=_evaluation_label(folder, metrics),
                )
            )
    seen: dict[str, int] = {}
    for e in entries:  # unique row names
        seen[e.name] = seen.get(e.name, 0) + 1
        if seen[e.name] > 1:
            e.name = f"{e.name} #{seen[e.name]}"
    return entries


def _heldout_text(h: dict[str, Any] | None) -> str:
    """``sudoku (size=4), 6 held-out rows sha256 1a2b3c4d5e6f``, or what is unknown."""
    if not h:
        return "an unrecorded held-out set (a report written before loopformer recorded it)"
    options = ", ".join(f"{k}={v}" for k, v in (h.get("options") or {}).items())
    task = h["task"] + (f" ({options})" if options else "")
    digest = str(h.get("sha256") or "?")[:12]
    return f"{task}, {h.get('rows', '?')} held-out rows sha256 {digest}"


def _heldout_key(h: dict[str, Any] | None) -> tuple:
    if not h:
        return ("?",)
    return (h["task"], repr(sorted((h.get("options") or {}).items())), h.get("rows"), h.get("sha256"))


def heldout_line(entries: Sequence[Entry], allow: bool = False, option: str = "--allow-different-heldout") -> str:
    """What every entry was evaluated on, for the comparison's title: ``task sudoku (size=4), 6 held-out rows
    sha256 ...``. Reports evaluated on another task, other task options or another held-out set are refused
    (ValueError naming the difference) unless ``allow``; then the line says that they differ, report by report."""
    seen: dict[tuple, list[Entry]] = {}
    for e in entries:
        seen.setdefault(_heldout_key(e.heldout), []).append(e)
    if len(seen) <= 1:
        return f"evaluated on {_heldout_text(entries[0].heldout if entries else None)}"
    groups = [f"{_heldout_text(group[0].heldout)}: {', '.join(e.name for e in group)}" for group in seen.values()]
    if not allow:
        raise ValueError(
            f"these reports were evaluated on different tasks or held-out sets, so their numbers do not compare: "
            f"{'; '.join(groups)}. Compare reports of one held-out set, or pass {option} (the table then says so)"
        )
    return "NOT ONE HELD-OUT SET (" + "; ".join(groups) + ")"


def _legend_name(e: Entry, suffix: str = "") -> str:
    """The entry's name and its loop (solver, halting rule, tolerance, cap) for a legend."""
    if e.baseline:
        return f"{e.name} (baseline, one pass)"
    loop = f": {describe_loop(e.loop)}" if e.loop else ""
    return f"{e.name}{suffix}{loop}"


def plot_budget(entries: Sequence[Entry], title: str = "") -> Any:
    """Accuracy vs loop budget (log2 x-axis), or for language models held-out bits per byte (lower is
    better); a run without a budget curve is one point at its mean loops; a baseline (one pass) is a
    horizontal line."""
    lm = bool(entries) and all(e.is_lm for e in entries)

    def headline(e: Entry) -> float | None:
        bpb = e.result.get("bits_per_byte")
        return (None if bpb is None else float(bpb)) if lm else 100 * e.accuracy

    fig, ax = plots.figure((7, 4.5))
    for e in entries:
        y = headline(e)
        if e.baseline and y is not None:
            ax.axhline(y, ls="--", color="gray", lw=1.2, label=_legend_name(e))
        elif e.budget and e.budget.get("points"):
            pts = e.budget["points"]
            ys = [p["bits_per_byte"] if lm else 100 * (p["valid_accuracy"] or 0) for p in pts]
            ax.plot([p["budget"] for p in pts], ys, marker="o", label=_legend_name(e, f" ({e.budget.get('mode', '')})"))
        elif e.result.get("mean_steps") and y is not None:
            ax.plot([e.result["mean_steps"]], [y], marker="s", ls="", label=_legend_name(e, " (at its mean loops)"))
    plots.log2_axis(ax, _budget_xs(entries), "loops: the budget (max loops), or a run's mean loops (log2)")
    if lm:
        ax.set_ylabel("held-out bits per byte (lower is better)")
        ax.set_title("bits per byte vs loop budget")
    else:
        ax.set_ylabel("valid accuracy (%)")
        ax.set_ylim(-2, 102)
        ax.set_title("accuracy vs loop budget")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=7)
    return plots.finish(fig, None, title)


def _budget_xs(entries: Sequence[Entry]) -> list[float]:
    """Every x value a budget plot draws (budgets, or a run's mean loops), for its log2 ticks."""
    xs: list[float] = []
    for e in entries:
        if e.budget and e.budget.get("points"):
            xs += [float(p["budget"]) for p in e.budget["points"]]
        elif e.result.get("mean_steps") and not e.baseline:
            xs.append(float(e.result["mean_steps"]))
    return xs


def comparison_title(entries: Sequence[Entry], reports: int) -> str:
    """The default title: how many rows the table has and, when it differs, from how many reports
    (a `loopformer run` report holds the looped model and its baseline: two rows)."""
    rows = len(entries)
    what = "language models" if entries and all(e.is_lm for e in entries) else "evaluations"
    if rows == reports:
        return f"comparison of {rows} {what}"
    return f"comparison of {rows} {what} from {reports} reports"


def check_kinds(entries: Sequence[Entry]) -> None:
    """ValueError when language-model reports (bits per byte) and validator reports (accuracy) are mixed:
    their numbers share no scale."""
    lm = sorted({str(e.source) for e in entries if e.is_lm})
    other = sorted({str(e.source) for e in entries if not e.is_lm})
    if lm and other:
        raise ValueError(f"cannot compare language-model reports (bits per byte: {lm[0]}) with validator reports "
                         f"(accuracy: {other[0]}); compare each kind on its own")  # fmt: skip


def plot_loops_vs_difficulty(entries: Sequence[Entry], title: str = "") -> Any:
    """Mean loops per difficulty bucket, one line per looped model."""
    fig, ax = plots.figure((7, 4.5))
    for e in entries:
        buckets = (e.difficulty or {}).get("buckets") or []
        if e.baseline or not buckets:
            continue
        ax.plot([(b["low"] + b["high"]) / 2 for b in buckets], [b["mean_steps"] for b in buckets], marker="o",
                label=_legend_name(e))  # fmt: skip
    ax.set_xlabel("difficulty")
    ax.set_ylabel("mean loops")
    ax.set_title("loops vs difficulty")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=7)
    return plots.finish(fig, None, title)


COLUMNS = ("run", "loop", "valid", "exact", "mean loops", "converged", "ms / example", "parameters",
           "test-time compute", "evaluation")  # fmt: skip


# the columns of a comparison of language models (bits per byte instead of validator accuracy)
LM_COLUMNS = ("run", "loop", "bits per byte", "loss", "token", "mean loops", "ms / example", "parameters",
              "test-time compute", "evaluation")  # fmt: skip


def columns_for(rows: Sequence[dict[str, Any]]) -> tuple[str, ...]:
    """``LM_COLUMNS`` when every row is a language model's, else ``COLUMNS``."""
    return LM_COLUMNS if rows and all(r.get("bits_per_byte") is not None for r in rows) else COLUMNS


def row_cells(r: dict[str, Any], columns: Sequence[str] = COLUMNS) -> list[str]:
    """One comparison row as text, in ``columns`` order (the markdown table and the console table)."""
    cells = {
        "run": r["name"] + (" (baseline)" if r["baseline"] else ""),
        "loop": r["loop"],
        "valid": num(r["valid_accuracy"], True),
        "exact": num(r["exact_accuracy"], True),
        "bits per byte": num(r.get("bits_per_byte"), digits=4),
        "loss": num(r.get("loss"), digits=4),
        "token": num(r.get("token_accuracy"), True),
        "mean loops": num(r["mean_loops"]),
        "converged": num(r["converged_fraction"], True),
        "ms / example": num(r["ms_per_example"], digits=3),
        "parameters": "-" if r["parameters"] is None else f"{r['parameters']:,}",
        "test-time compute": num(r["test_time_compute"], digits=1),
        "evaluation": r.get("evaluation") or "-",
    }
    return [cells[c] for c in columns]


def comparison_markdown(title: str, rows: list[dict[str, Any]], plot_paths: dict[str, str],
                        notes: Sequence[str] = ()) -> str:  # fmt: skip
    header = list(columns_for(rows))
    table = [row_cells(r, header) for r in rows]
    lines = [f"# {title}", "", *md_table(header, table)]
    scored = ("`bits per byte`: held-out cross-entropy in bits per byte (lower is better)."
              if header == list(LM_COLUMNS) else "`valid`: the task's independent validator.")  # fmt: skip
    lines += [
        f"{scored} `ms / example`: wall time of the evaluation pass per held-out example. `test-time compute`: "
        "transformer blocks applied per example, each loop step counted by its model (a TRM cycle (n_inner + 1) "
        "x n_layers, an HRM cycle l_cycles x l_layers + n_layers, an inner solve as many evaluations as it "
        "made). `evaluation`: the report a row comes from, or a run's final evaluation at the end of training.",
        "",
    ]
    for note in notes:  # e.g. the sweep points without a report
        lines += [note, ""]
    for caption, rel in plot_paths.items():
        lines += [f"![{caption}]({rel})", ""]
    return "\n".join(lines)


def write_comparison(out: str | Path, entries: Sequence[Entry], title: str = "comparison",
                     notes: Sequence[str] = ()) -> dict[str, Path]:  # fmt: skip
    """Write the comparison table (markdown + JSON) and overlay plots into ``out``; returns the paths.
    ``notes``: lines written below the table (and into comparison.json)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    check_kinds(entries)
    rows = [e.row() for e in entries]
    figures = comparison_figures(entries, title)
    rel = {}
    for caption, (name, fig) in figures.items():
        plots.save_figure(fig, out / "plots" / name)
        rel[caption] = f"plots/{name}"
    markdown = atomic_write_text(out / "comparison.md", comparison_markdown(title, rows, rel, notes), root=out)
    data = write_json(out / "comparison.json", {"title": title, "rows": rows, "plots": rel, "notes": list(notes)})
    return {"markdown": markdown, "json": data, **{k: out / v for k, v in rel.items()}}


def comparison_figures(entries: Sequence[Entry], title: str) -> dict[str, tuple[str, Any]]:
    """{caption: (file name, figure)}: bits per byte vs budget for language models; accuracy vs budget
    and, when some looped model has more than one difficulty value, loops vs difficulty otherwise."""
    if entries and all(e.is_lm for e in entries):
        return {"bits per byte vs loop budget": ("bpb_vs_budget.png", plot_budget(entries, title))}
    figures = {"accuracy vs loop budget": ("accuracy_vs_budget.png", plot_budget(entries, title))}
    if any(len((e.difficulty or {}).get("buckets") or []) > 1 for e in entries if not e.baseline):
        figures["loops vs difficulty"] = ("loops_vs_difficulty.png", plot_loops_vs_difficulty(entries, title))
    return figures


def comparison_table(rows: Sequence[dict[str, Any]], title: str) -> Any:
    """The comparison as a rich table for the console (the markdown table's columns but exact accuracy and
    loss)."""
    shown = [col for col in columns_for(rows) if col not in ("exact", "loss")]
    return console_table(title, shown, [row_cells(r, shown) for r in rows], left=("run", "loop", "evaluation"))


def missing_points(sources: Sequence[str | Path]) -> list[str]:
    """The points of the sweep folders among ``sources`` that have no report (``sweep_reports``)."""
    missing: list[str] = []
    for source in sources:
        folder = Path(source)
        if folder.is_dir() and (folder / SWEEP_FILE).is_file() and not _is_report(folder):
            missing += [f"{source}: {m}" for m in sweep_reports(folder)[1]]
    return missing


__all__ = [
    "Entry",
    "MetricsRecord",
    "SweepRecord",
    "check_kinds",
    "columns_for",
    "comparison_figures",
    "comparison_table",
    "comparison_title",
    "comparison_markdown",
    "heldout_line",
    "load_entries",
    "missing_points",
    "plot_budget",
    "plot_loops_vs_difficulty",
    "read_metrics",
    "read_sweep",
    "report_folders",
    "sweep_reports",
    "write_comparison",
]
