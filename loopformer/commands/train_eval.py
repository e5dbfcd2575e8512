"""``loopformer train RECIPE [key=value ...] [--resume]`` and ``loopformer eval CHECKPOINT``."""

from __future__ import annotations

import shlex
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from loopformer.commands.common import PATH, parse_int_list, parse_pairs, parse_variants, safe_name
from loopformer.commands.eval_extras import auto_note, auto_solver_search, segment_note
from loopformer.commands.suite import ModelUnderTest, SuiteOptions, accuracy_table, run_suite, spearman_text
from loopformer.devices import device_option, resolve_device
from loopformer.eval.auto_solver import DEFAULT_FRACTION
from loopformer.eval.predict import arc_pass_at_k
from loopformer.nn import autocast
from loopformer.runs import eval_dataset, load_run, training_depth


@click.command("train")
@click.argument("recipe")
@click.argument("overrides", nargs=-1)
@click.option("--resume", is_flag=True, help="continue from the run folder's latest checkpoint")
@click.option("--out", "-o", "out_dir", type=PATH, default=None, help="run folder (instead of the recipe's out_dir)")
@click.option(
    "--overwrite",
    is_flag=True,
    help="replace a previous run in the folder (swapped in whole once the new run's first checkpoint is written)",
)
@click.option(
    "--allow-config-change",
    is_flag=True,
    help="resume although the config changes the training stream (recorded in config_changes.jsonl)",
)
@click.option(
    "--print-config", is_flag=True, help="print the resolved configuration, every model and loop field (YAML), and exit"
)
@click.option("--plan", is_flag=True, help="print the memory plan per GPU and the micro-batch that fits, and exit")
@click.option("--gpu-memory", default="80GB", show_default=True, help="--plan: memory of one GPU (80GB, 141GB, 80GiB)")
@click.option("--gpus", default=1, show_default=True, type=int, help="--plan: number of GPUs the batch is split over")
def train(
    recipe: str,
    overrides: tuple[str, ...],
    resume: bool,
    out_dir: Path | None,
    overwrite: bool,
    allow_config_change: bool,
    print_config: bool,
    plan: bool,
    gpu_memory: str,
    gpus: int,
) -> None:
    """Train the model of RECIPE (a name in recipes/ or a path); OVERRIDES are key=value pairs."""
    from rich.console import Console

    from loopformer.commands.run import find_run_recipe
    from loopformer.config import build_config, read_recipe
    from loopformer.config.checks import check_unique
    from loopformer.train.trainer import Trainer

    check_unique(overrides)
    raw = read_recipe(find_run_recipe(recipe))
    raw.pop("run", None)  # the `loopformer run` table is not part of a training config
    extra = list(overrides)
    if resume:
        extra.append("train.resume=true")
    if overwrite:
        extra.append("train.overwrite=true")
    if allow_config_change:
        extra.append("train.allow_config_change=true")
    cfg = build_config(raw, extra, out_dir=out_dir)  # -o is a path, never an override
    if print_config:  # every model and loop field with its effective value (loopformer.config.recipes)
        from loopformer.config.recipes import print_config_yaml

        click.echo(print_config_yaml(cfg), nl=False)
        return
    if plan:
        from loopformer.config.memory import describe, parse_memory
        from loopformer.train.plan import make_plan

        the_plan, source = make_plan(cfg, gpus, parse_memory(gpu_memory))
        click.echo(f"plan for {recipe} ({cfg.model.name}, train.mode={cfg.train.mode}):")
        for line in describe(the_plan, cfg, source):
            click.echo(f"  {line}")
        return
    trainer = Trainer(cfg)
    console = Console(highlight=False, quiet=not trainer.strategy.is_main)  # rank 0 speaks under torchrun
    where = f" (resumed from {trainer.resumed_from}, step {trainer.step})" if trainer.resumed_from else ""
    console.print(f"training {cfg.model.name} ({trainer.model.num_parameters():,} parameters) on {cfg.data.task}"
                  f" for {cfg.train.steps} steps -> {cfg.out_dir}{where}")
    from loopformer.train.stop import TrainingInterrupted

    try:
        summary = trainer.fit()
    except TrainingInterrupted as err:  # SIGTERM / SIGINT: checkpointed and unlocked; say how to go on
        from loopformer.commands.common import resume_hint

        kept = [o for o in overrides if o.split("=", 1)[0] not in ("out_dir", "train.resume", "train.overwrite")]
        resume_hint(err, ["loopformer", "train", recipe, *kept, f"out_dir={cfg.out_dir}", "--resume"])
    except Exception as err:  # named by the run folder given, never the hidden --overwrite staging folder
        shown = trainer.folder.user_error(err)
        if shown is err:
            raise
        raise shown from None
    ev = summary.get("eval") or {}
    if "bits_per_byte" in ev:
        console.print(
            f"held-out: loss {ev['loss']:.4f} nats/token, {ev['bits_per_byte']:.4f} bits per byte, "
            f"token accuracy {100 * ev['token_acc']:.1f}%"
        )
    elif ev:
        acc = ev.get("valid_acc", ev.get("exact_acc"))
        console.print(
            f"held-out, {summary['eval_label']}: {'valid' if 'valid_acc' in ev else 'exact'} accuracy "
            f"{100 * acc:.1f}%, exact {100 * ev.get('exact_acc', float('nan')):.1f}%, "
            f"mean steps {ev.get('loop_steps', float('nan')):.2f}"
        )
    best = summary.get("best")
    if best:
        console.print(
            f"held-out, {best['label']}: eval_{best['metric']} {best['value']:.4g}  -> {best['checkpoint']}"
        )
    console.print(f"checkpoint: {summary['checkpoint']}  ({summary['wall_time']:.0f} s)")
    if best:
        console.print(
            f"the published protocol (loop_eval) on the best checkpoint: loopformer eval {shlex.quote(cfg.out_dir)} --best"
        )


@click.command("eval")
@click.argument("checkpoint")
@click.option(
    "--max-steps",
    "max_steps",
    default=None,
    metavar="B1,B2,...",
    help="inference step budgets for the accuracy-vs-compute curve (bits per byte for a text run), e.g. 1,2,4,8,16",
)
@click.option(
    "--budget-mode",
    type=click.Choice(["capped", "fixed"]),
    default="capped",
    show_default=True,
    help="capped: the halting rule with the cap; fixed: exactly that many loops",
)
@click.option(
    "--task-option",
    "--task-options",
    "-t",
    "task_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="held-out generation option (data.eval_generate), e.g. -t min_blanks=40",
)
@click.option(
    "--set",
    "-s",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    help="config override for evaluation: data.*, eval.*, loop_eval.* (e.g. loop_eval.max_steps=64)",
)
@click.option(
    "--examples", "-n", type=int, default=0, help="evaluate on the first N held-out examples (0 = all)"
)
@click.option(
    "--lens-loops",
    type=int,
    default=None,
    help="logit lens / overthinking loops (default: 2x the training depth; 0 = off)",
)
@click.option(
    "--analyses/--no-analyses",
    default=True,
    show_default=True,
    help="logit lens, overthinking, signal propagation, spectral radius",
)
@click.option("--ema/--no-ema", default=True, show_default=True, help="use the EMA weights when present")
@click.option(
    "--best",
    is_flag=True,
    help="the run's best checkpoint (checkpoints/best, kept by train.keep_best) instead of its latest",
)
@click.option("--out", "-o", "out_dir", type=PATH, default=None, help="report folder (default <run>/eval-step<N>-<time>)")
@click.option("--overwrite", is_flag=True, help="replace the report in --out (moved aside once the new one is done)")
@click.option(
    "--auto-solver",
    is_flag=True,
    help="search the registered solvers x tolerances on a held-out slice for the fewest map evaluations at "
    "the trained solver's accuracy, then evaluate the other rows with it (loopformer.eval.auto_solver)",
)
@click.option(
    "--auto-solver-slice",
    type=float,
    default=DEFAULT_FRACTION,
    show_default=True,
    help="share of the held-out set the search uses (seeded; the report covers the rest)",
)
@click.option(
    "--auto-solver-tolerance",
    type=float,
    default=0.0,
    show_default=True,
    help="accuracy points a candidate may lose against the trained solver on the slice",
)
@click.option(
    "--variant",
    "variants",
    multiple=True,
    metavar="'KEY=VALUE ...'",
    help="also evaluate with these loop_eval.* / eval.* overrides (space-separated), e.g. "
    "--variant loop_eval.solver=anderson; repeatable: one report compares the run's loop_eval and each variant",
)
@device_option()
def evaluate_cmd(checkpoint: str, max_steps: str | None, budget_mode: str, task_options: tuple[str, ...],
                 sets: tuple[str, ...], examples: int, lens_loops: int | None, analyses: bool, ema: bool,
                 best: bool, out_dir: Path | None, device: str, overwrite: bool = False, auto_solver: bool = False,
                 auto_solver_slice: float = DEFAULT_FRACTION, auto_solver_tolerance: float = 0.0,
                 variants: tuple[str, ...] = ()) -> None:  # fmt: skip
    """Evaluate CHECKPOINT (a run folder or checkpoint folder) on its held-out set; write a report.

    A text run (no validator) is scored by loss and bits per byte: --max-steps gives bits per byte at each
    loop budget, and the logit lens scores every loop's readout. ARC also gets pass@2, voting over
    augmentations. With --set eval.protocol=authors_trm_deq (or both) the Attractor puzzle authors'
    evaluation is added. With --auto-solver the report covers the held-out rows outside the search slice,
    with the chosen solver. With --variant the report holds one sub-report per loop (variants/NAME/) and
    their comparison table and overlay plots, as loopformer compare writes them.
    """
    from loopformer.config.checks import check_count, check_fraction

    overrides = list(sets) + [
        f"data.eval_generate.{k}={v}" for k, v in parse_pairs(task_options, "--task-option").items()
    ]
    budgets = parse_int_list(max_steps, "--max-steps")
    check_count("--examples", examples, 0)
    check_count("--lens-loops", lens_loops, 0)
    check_fraction("--auto-solver-slice", auto_solver_slice, 0.0, 1.0)
    check_fraction("--auto-solver-tolerance", auto_solver_tolerance, 0.0, 100.0, closed=True)
    if auto_solver and variants:
        raise click.UsageError("--auto-solver and --variant: choose one (the search picks one loop; --variant compares given ones)")
    auto = (auto_solver_slice, auto_solver_tolerance / 100) if auto_solver else None
    evaluate_checkpoint(checkpoint, overrides, budgets, budget_mode, examples, lens_loops, analyses, ema, best,
                        out_dir, device, overwrite, parse_variants(variants), auto)  # fmt: skip


def evaluate_checkpoint(checkpoint: str | Path, overrides: list[str], budgets: list[int], budget_mode: str = "capped",
                        examples: int = 0, lens_loops: int | None = None, analyses: bool = True, ema: bool = True,
                        best: bool = False, out_dir: str | Path | None = None, device: str = "auto",
                        overwrite: bool = False, variants: list[tuple[str, list[str]]] | None = None,
                        auto: tuple[float, float] | None = None) -> None:  # fmt: skip
    """What ``loopformer eval`` does (also ``loopformer sweep``): load, evaluate, write the report; the
    overrides, variants and loop counts are checked before the weights are read (``command_checks``)."""
    from loopformer.config.checks import check_loop_counts, check_variants

    dev = resolve_device(device)

    def checks(config: Any) -> None:
        check_loop_counts(config, {"--max-steps": budgets, "--lens-loops": lens_loops if analyses else None}, str(dev))
        check_variants(config, [o for _, o in variants or []], str(dev))

    run = load_run(checkpoint, use_ema=ema, config_overrides=tuple(overrides), device=str(dev), best=best,
                   check=checks)  # fmt: skip
    from loopformer.devices import set_cpu_threads

    set_cpu_threads(run.config.train.threads, dev, run.model)  # the run's train.threads rule, logged
    # how this report was made (metrics.json "evaluation"): a sweep re-evaluates a report made otherwise
    record = {"overrides": list(overrides), "budgets": list(budgets), "budget_mode": budget_mode,
              "examples": examples, "analyses": analyses, "lens_loops": lens_loops, "ema": ema, "best": best}  # fmt: skip
    from loopformer.commands.suite import run_job_references

    # the baseline of the `loopformer run` job this model belongs to, when evaluated on the same held-out set
    same = not examples and not any(o.lstrip("~+").startswith("data.") for o in overrides)
    references = run_job_references(run.path, same_heldout=same)
    with autocast(dev, run.config.bf16):  # evaluate in the precision the run trained in
        _evaluate(run, examples, None if out_dir is None else str(out_dir), budgets, budget_mode, lens_loops,
                  analyses, overwrite, variants or [], auto, record, references)  # fmt: skip


@contextmanager
def _report_folder(out: Path, run_dir: Path) -> Iterator[Path]:
    """The default report folder (a new name inside the run folder ``run_dir``, never through a link there),
    the run folder locked meanwhile."""
    from loopformer.files import check_inside
    from loopformer.runs.folder import RunLock

    check_inside(out, run_dir)
    with RunLock(out.parent, "eval"):
        yield out



def _evaluate(run: Any, examples: int, out_dir: str | None, budgets: list[int], budget_mode: str,
              lens_loops: int | None, analyses: bool, overwrite: bool = False,
              variants: list[tuple[str, list[str]]] | None = None, auto: tuple[float, float] | None = None,
              record: dict[str, Any] | None = None, references: dict[str, float] | None = None) -> None:  # fmt: skip
    from loopformer.runs.outputs import staged_output

    dataset = eval_dataset(run.task, run.config, examples)
    auto_record = None
    if auto is not None:  # search on a slice; the report covers the other rows with the chosen solver
        run, dataset, auto_record = auto_solver_search(run, dataset, auto)
    # no second process writes into a run folder in use (a training, another eval): lock what we write into
    if out_dir:  # -o: the run-folder rules (refused when it holds a report, built aside, swapped in whole)
        out = Path(out_dir)
        target = staged_output(out, "eval", overwrite, "--out")
    else:  # next to the checkpoints, not inside one (old checkpoints are rotated away)
        run_dir = run.path.parent.parent if run.path.parent.name == "checkpoints" else run.path
        out = run_dir / f"eval-step{run.step}-{time.strftime('%Y%m%d-%H%M%S')}"
        target = _report_folder(out, run_dir)
    with target as write_dir:
        if variants:
            _evaluate_variants(run, dataset, write_dir, out, budgets, budget_mode, lens_loops, analyses, variants,
                               record, references)  # fmt: skip
        else:
            _evaluate_into(run, dataset, write_dir, out, budgets, budget_mode, lens_loops, analyses, auto_record,
                           record, references)  # fmt: skip


def _evaluate_variants(run: Any, dataset: Any, out: Path, final: Path, budgets: list[int], budget_mode: str,
                       lens_loops: int | None, analyses: bool, variants: list[tuple[str, list[str]]],
                       record: dict[str, Any] | None = None, references: dict[str, float] | None = None) -> None:  # fmt: skip
    """The run's loop_eval and each variant into ``out/variants/<name>/``, then their comparison into ``out``.
    Every key a variant names is honoured: ``eval.max_examples`` evaluates that many held-out rows (the
    keys that cannot vary are refused before the weights are read: ``config.checks.VARIANT_FIXED``)."""
    import dataclasses

    from loopformer.commands.compare import print_rows
    from loopformer.config.checks import check_variants
    from loopformer.eval.compare import heldout_line, load_entries, write_comparison

    names, folders = [], []
    for i, (name, overrides) in enumerate([("loop_eval", []), *variants]):
        config = check_variants(run.config, [overrides])[0] if overrides else run.config
        variant = dataclasses.replace(run, config=config, loop_eval=config.loop_config(run.model.config.loop, "eval"))
        rows = dataset
        if any(o.lstrip("~").startswith("eval.max_examples") for o in overrides):  # the variant's own row count
            rows = eval_dataset(run.task, config, 0)
        folder = Path("variants") / f"{i:02d}-{safe_name(name)}"
        _evaluate_into(variant, rows, out / folder, final / folder, budgets, budget_mode, lens_loops, analyses,
                       record={**(record or {}), "variant": list(overrides)}, references=references)  # fmt: skip
        names.append(name)
        folders.append(out / folder)
    entries = load_entries(folders, names)
    title = (f"{run.family or run.config.model.name} ({run.path}): {len(entries)} evaluation loops compared · "
             f"{heldout_line(entries, allow=True)}")  # fmt: skip
    written = write_comparison(out, entries, title)
    print_rows([e.row() for e in entries], title)
    click.echo(f"comparison: {final / Path(written['markdown']).relative_to(out)}")


def _evaluate_into(run: Any, dataset: Any, out: Path, final: Path, budgets: list[int], budget_mode: str,
                   lens_loops: int | None, analyses: bool, auto_record: dict[str, Any] | None = None,
                   record: dict[str, Any] | None = None, references: dict[str, float] | None = None) -> None:  # fmt: skip
    """Evaluate and write the report into ``out``, naming the files by where they end up (``final``); the
    report records what it was evaluated on (``heldout``: task, options, the held-out set's fingerprint)
    and how (``evaluation``: ``record``)."""
    from rich.console import Console

    from loopformer.runs.fingerprint import heldout_record
    from loopformer.runs.provenance import collect, describe, record_for_step
    from loopformer.tasks.arc import ArcTask

    made = {"heldout": heldout_record(run.config, dataset), "evaluation": record}

    def shown(path: str | Path) -> Path:
        return final / Path(path).relative_to(out)
    console = Console(highlight=False)
    batch_size = run.config.eval.batch_size
    depth = training_depth(run)
    lens = (2 * depth if lens_loops is None else lens_loops) if analyses else 0
    options = SuiteOptions(budgets=budgets, budget_mode=budget_mode, lens_loops=lens, signal_loops=lens,
                           spectral=analyses, batch_size=batch_size, progress=True, references=dict(references or {}))  # fmt: skip
    run_dir = run.path.parent.parent if run.path.parent.name == "checkpoints" else run.path
    trained_by = record_for_step(run_dir, run.step)
    provenance = {"training": trained_by, "evaluation": collect(next(run.model.parameters()).device)}
    unit = "examples" if run.task.has_validator else "windows"
    unscored = made["heldout"].get("unscored_rows")
    notes = [f"Task: {run.config.data.task} {run.config.data.options}; {len(dataset)} held-out {unit}"
             + (f" ({unscored} rows without labels left out: they cannot be scored)." if unscored else "."),
             *segment_note(run.config.eval.segments), *auto_note(auto_record),
             *([f"Trained with {describe(trained_by)}."] if trained_by else [])]  # fmt: skip
    if not run.task.has_validator:  # language modelling: loss and bits per byte (loopformer.commands.lm_suite)
        from loopformer.commands.lm_suite import evaluate_text_run

        evaluate_text_run(run, dataset, out, final, options, depth, notes, {"provenance": provenance, **made})
        return
    extra: dict[str, Any] = {"checkpoint": {"path": str(run.path), "step": run.step, "label": run.label,
                                            "best": run.best}, **made}  # fmt: skip
    if auto_record is not None:
        extra["auto_solver"] = auto_record
    if isinstance(run.task, ArcTask):  # pass@2 over every test pair x augmentation version
        arc = arc_pass_at_k(
            run.model,
            run.task,
            loop=run.loop_eval,
            k=2,
            batch_size=batch_size,
            seed=run.config.data.eval_seed,
            segments=run.config.eval.segments,
        )
        extra["arc_pass_at_2"] = arc
    if run.config.eval.protocol != "clean":  # the Attractor puzzle authors' _eval, beside the clean metrics
        from loopformer.eval.authors import evaluate_authors_trm_deq

        ec = run.config.eval
        authors = evaluate_authors_trm_deq(run.model, run.task, dataset, loop=run.loop_eval, batch_size=batch_size,
                                           max_batches=ec.authors_max_batches, calls=ec.segments,
                                           exploration=run.config.train.halt_exploration, seed=run.config.seed,
                                           check=ec.check).summary()
        extra["authors_trm_deq"] = authors
    label = run.family or run.config.model.name
    console.print(f"{run.label}: {run.path} ({run.weights} weights)")
    from loopformer.eval.report import describe_loop

    extra["provenance"] = provenance
    suite = run_suite(
        out,
        f"{label} · {describe_loop(run.loop_eval)}: evaluation of {run.path} ({run.label}, {run.weights} weights)",
        run.task,
        dataset,
        ModelUnderTest(
            label, run.model, run.loop_eval, depth, segments=run.config.eval.segments, seed=run.config.seed
        ),
        (),
        options,
        notes=notes,
        log=lambda m: console.print(f"  {m}"),
        extra=extra,
    )
    console.print(accuracy_table(suite["results"]))
    if "arc_pass_at_2" in extra:
        arc = extra["arc_pass_at_2"]
        console.print(
            f"ARC pass@2 (voting over {run.task.versions} augmentation versions): {100 * arc['score']:.1f}% "
            f"of {int(arc['tasks'])} tasks ({int(arc['outputs_solved'])}/{int(arc['outputs'])} test outputs)"
            if arc["tasks"] else "ARC pass@2: not scored (no task has every test output known)"
        )
    if "authors_trm_deq" in extra:
        a = extra["authors_trm_deq"]
        console.print(
            f"authors' evaluation (eval.protocol, train_trm_deq.py _eval: training mode, Q halting with "
            f"exploration, {run.config.eval.segments} calls): exact {100 * a['exact_acc']:.1f}% of the "
            f"{a['n']} examples halted at the last call ({a['evaluated']} evaluated)"
        )
    console.print(f"steps vs difficulty: {spearman_text(suite['difficulty'][label])}")
    console.print(f"report: {shown(suite['report'])}  metrics: {shown(suite['metrics'])}")
