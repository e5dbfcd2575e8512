"""``loopformer train RECIPE [key=value ...] [--resume]`` and ``loopformer eval CHECKPOINT``: their
arguments and what they print; the training is ``loopformer.train.Trainer``'s, the evaluation
``loopformer.api.evaluate_checkpoint``'s (options: ``loopformer.eval.suite.ReportOptions``)."""

from __future__ import annotations

import shlex
from pathlib import Path

import click

from loopformer.commands.common import (
    best_option,
    budgets_option,
    device_option,
    ema_option,
    out_option,
    overwrite_option,
    parse_pairs,
    parse_variants,
    plain_console,
    print_comparison,
    print_config_option,
    task_option,
    verify_option,
)


@click.command("train")
@click.argument("recipe")
@click.argument("overrides", nargs=-1)
@click.option("--resume", is_flag=True, help="continue from the run folder's latest checkpoint")
@out_option("run folder (instead of the recipe's out_dir)")
@overwrite_option("replace a previous run in the folder (swapped in whole once the new run's first checkpoint is "
                  "written)")
@click.option("--allow-config-change", is_flag=True,
              help="resume although the config changes the training stream (recorded in config_changes.jsonl)")
@print_config_option()
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

    from loopformer.commands.run import training_config
    from loopformer.config.checks import check_unique

    check_unique(overrides)
    extra = list(overrides)
    if resume:
        extra.append("train.resume=true")
    if overwrite:
        extra.append("train.overwrite=true")
    if allow_config_change:
        extra.append("train.allow_config_change=true")
    cfg = training_config(recipe, extra, out_dir)  # -o is a path, never an override
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
    from loopformer.train.trainer import Trainer  # after the configuration is read and checked

    trainer = Trainer(cfg)
    # rank 0 speaks; soft_wrap: whole lines in a log file, never wrapped at 80 columns
    console = plain_console(quiet=not trainer.strategy.is_main)
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
@budgets_option("inference step budgets for the accuracy-vs-compute curve (bits per byte for a text run), "
                "e.g. 1,2,4,8,16")
@click.option("--budget-mode", type=click.Choice(["capped", "fixed"]), default="capped", show_default=True,
              help="capped: the halting rule with the cap; fixed: exactly that many loops")
@task_option("held-out generation option (data.eval_generate), e.g. -t min_blanks=40")
@click.option("--set", "-s", "sets", multiple=True, metavar="KEY=VALUE",
              help="config override for evaluation: data.*, eval.*, loop_eval.* (e.g. loop_eval.max_steps=64)")
@click.option("--examples", "-n", type=int, default=0, help="evaluate on the first N held-out examples (0 = all)")
@click.option("--lens-loops", type=int, default=None,
              help="logit lens / overthinking loops (default: 2x the training depth; 0 = off)")
@click.option("--analyses/--no-analyses", default=True, show_default=True,
              help="logit lens, overthinking, signal propagation, spectral radius")
@ema_option()
@best_option()
@verify_option()
@out_option("report folder (default <run>/eval-step<N>-<time>)")
@overwrite_option("replace the report in --out (moved aside once the new one is done)")
@click.option("--auto-solver", is_flag=True,
              help="search the registered solvers x tolerances on a held-out slice for the fewest map evaluations "
              "at the trained solver's accuracy, then evaluate the other rows with it (loopformer.eval.auto_solver)")
@click.option("--auto-solver-slice", type=float, default=None,
              help="share of the held-out set the search uses (seeded; the report covers the rest; default "
              "loopformer.eval.auto_solver.DEFAULT_FRACTION, 0.25)")
@click.option("--auto-solver-tolerance", type=float, default=0.0, show_default=True,
              help="accuracy points a candidate may lose against the trained solver on the slice")
@click.option("--variant", "variants", multiple=True, metavar="'KEY=VALUE ...'",
              help="also evaluate with these loop_eval.* / eval.* overrides (space-separated), e.g. --variant "
              "loop_eval.solver=anderson; repeatable: one report compares the run's loop_eval and each variant")
@device_option()
def evaluate_cmd(checkpoint: str, budgets: list[int], budget_mode: str, task_options: tuple[str, ...],
                 sets: tuple[str, ...], examples: int, lens_loops: int | None, analyses: bool, ema: bool, best: bool,
                 verify: bool, out_dir: Path | None, overwrite: bool, auto_solver: bool, auto_solver_slice: float | None,
                 auto_solver_tolerance: float, variants: tuple[str, ...], device: str) -> None:  # fmt: skip
    """Evaluate CHECKPOINT (a run folder or checkpoint folder) on its held-out set; write a report.

    A text run (no validator) is scored by loss and bits per byte: --max-steps gives bits per byte at each
    loop budget, and the logit lens scores every loop's readout. ARC also gets pass@2, voting over
    augmentations. With --set eval.protocol=authors_trm_deq (or both) the Attractor puzzle authors'
    evaluation is added. With --auto-solver the report covers the held-out rows outside the search slice,
    with the chosen solver. With --variant the report holds one sub-report per loop (variants/NAME/) and
    their comparison table and overlay plots, as loopformer compare writes them.
    """

    from loopformer.api import evaluate_checkpoint
    from loopformer.config.checks import check_count, check_fraction
    from loopformer.eval.suite import ReportOptions

    check_count("--examples", examples, 0)
    check_count("--lens-loops", lens_loops, 0)
    if auto_solver_slice is None:
        from loopformer.eval.auto_solver import DEFAULT_FRACTION

        auto_solver_slice = DEFAULT_FRACTION
    check_fraction("--auto-solver-slice", auto_solver_slice, 0.0, 1.0)
    check_fraction("--auto-solver-tolerance", auto_solver_tolerance, 0.0, 100.0, closed=True)
    if auto_solver and variants:
        raise click.UsageError("--auto-solver and --variant: choose one (the search picks one loop; --variant compares given ones)")
    overrides = list(sets) + [
        f"data.eval_generate.{k}={v}" for k, v in parse_pairs(task_options, "--task-option").items()
    ]
    options = ReportOptions(
        budgets=budgets, budget_mode=budget_mode, analyses=analyses, lens_loops=lens_loops, overrides=overrides,
        examples=examples, ema=ema, best=best, verify=verify, device=device, out_dir=out_dir, overwrite=overwrite,
        variants=parse_variants(variants),
        auto_solver=(auto_solver_slice, auto_solver_tolerance / 100) if auto_solver else None,
    )  # fmt: skip
    folder = evaluate_checkpoint(checkpoint, options, log=plain_console().print)
    if variants:
        print_comparison(folder)
        click.echo(f"comparison: {folder / 'comparison.md'}")
