"""``loopformer run``: the main job. Train the recipe's looped model and a plain-transformer baseline of
equal parameters on the same budget, evaluate both on held-out examples with the task's independent
validator, run the loop analyses, and write ``summary.json``, ``report.md`` and plots.

A run recipe is an ordinary ``RunConfig`` recipe (``loopformer.config``) plus one extra table,
``run:``, read here (strictly, unknown keys are errors):

```yaml
run:
  baseline:                    # the comparison model, trained with the same data, steps and batch
    enabled: true
    label: plain transformer (equal parameters)
    model: {name: transformer} # merged over the main model's shared fields (d_model, n_heads, n_layers...)
    train: {mode: simple}      # merged over the main train table
    loop_train: {}             # replaces the main model's loop overrides (the baseline has its own loop)
    loop_eval: {}
  budgets: [1, 2, 4, 8, 16]    # inference step budgets for the test-time compute curve
  budget_mode: capped          # capped (halting rule, cap b) | fixed (exactly b loops)
  lens_loops: 32               # logit lens / overthinking loops (0 = off)
  signal_loops: 32
  spectral: true
  analysis_examples: 128
```

Overrides on the command line: ``key=value`` for the main config (also inherited by the baseline),
``run.key=value`` for this table, ``baseline.key=value`` for the baseline's config only.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from loopformer.commands.common import (
    device_option,
    out_option,
    overwrite_option,
    plain_console,
    print_config_option,
)
from loopformer.devices import resolve_device

DEFAULT_RECIPE = "default"
# fields a plain transformer shares with the looped families (copied unless the baseline sets them)
SHARED_MODEL_FIELDS = ("d_model", "n_heads", "n_layers", "expansion", "rope", "causal", "tie_embeddings",
                       "vocab_size", "seq_len", "num_puzzle_ids", "puzzle_emb_len")


@dataclass
class BaselineSpec:
    enabled: bool = True
    label: str = "plain transformer (equal parameters)"
    model: dict[str, Any] = field(default_factory=lambda: {"name": "transformer"})
    train: dict[str, Any] = field(default_factory=lambda: {"mode": "simple"})
    loop_train: dict[str, Any] = field(default_factory=dict)
    loop_eval: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunSection:
    baseline: BaselineSpec = field(default_factory=BaselineSpec)
    budgets: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    budget_mode: str = "capped"
    lens_loops: int = 32
    signal_loops: int = 32
    spectral: bool = True
    analysis_examples: int = 128
    title: str = ""


def training_config(recipe: str | Path, overrides: list[str] | tuple[str, ...], out_dir: str | Path | None = None) -> Any:
    """The ``RunConfig`` a recipe (a name in recipes/ or a path) trains with ``overrides``: its ``run:`` table,
    ``loopformer run``'s, is no part of it (``loopformer train`` and each point of ``loopformer sweep``)."""
    from loopformer.config import build_config, find_recipe, read_recipe

    raw = read_recipe(find_recipe(recipe))
    raw.pop("run", None)
    return build_config(raw, list(overrides), out_dir=out_dir)


def split_overrides(overrides: tuple[str, ...]) -> tuple[list[str], list[str], list[str]]:
    """(main config overrides, ``run.*`` overrides, ``baseline.*`` overrides without the prefix)."""
    main, run, base = [], [], []
    for given in overrides:
        key = given.split("=", 1)[0].strip().lstrip("+")  # Hydra's +key / ++key: the main config checks +
        text = given if not key.startswith(("run.", "baseline.")) else given.lstrip("+")
        if key.startswith("run."):
            run.append(text[len("run."):])
        elif key.startswith("baseline."):
            base.append(text[len("baseline."):])
        else:
            main.append(text)
    return main, run, base


def build_run_configs(
    recipe: str | Path, overrides: tuple[str, ...], out: Path
) -> tuple[Any, Any | None, RunSection, str]:
    """(main RunConfig, baseline RunConfig or None, the run table, baseline description)."""
    from loopformer.config import (
        ConfigError,
        apply_overrides,
        build_config,
        find_recipe,
        from_dict,
        parse_override,
        read_recipe,
    )
    from loopformer.config.checks import check_counts, check_loop_counts, check_unique
    from loopformer.config.recipes import merge

    check_unique(overrides)
    raw = read_recipe(find_recipe(recipe))
    run_raw = raw.pop("run", {}) or {}
    main_over, run_over, base_over = split_overrides(overrides)
    for text in run_over:  # run.* overrides: dotted paths inside the run table
        parts, value = parse_override(text)
        node = run_raw
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"run.{'.'.join(parts)}: {part!r} is a value, not a table")
        node[parts[-1]] = value
    section: RunSection = from_dict(RunSection, run_raw, "run")
    if section.budget_mode not in ("capped", "fixed"):
        raise ConfigError(f"run.budget_mode: {section.budget_mode!r} is not 'capped' or 'fixed'")
    check_counts("run.", 1, budgets=section.budgets, analysis_examples=section.analysis_examples)
    check_counts("run.", 0, lens_loops=section.lens_loops, signal_loops=section.signal_loops)
    main_raw = apply_overrides(raw, main_over)
    main_raw["out_dir"] = str(out / "model")
    main_cfg = build_config(main_raw, ())
    check_loop_counts(main_cfg, {"run.budgets": section.budgets, "run.lens_loops": section.lens_loops,
                                 "run.signal_loops": section.signal_loops})  # fmt: skip

    base_cfg = None
    spec = section.baseline
    description = ""
    if spec.enabled:
        from loopformer.models.registry import model_classes

        base_raw = json.loads(json.dumps(main_raw))
        base_model = dict(spec.model)
        base_name = str(base_model.get("name", "transformer"))
        _, config_cls = model_classes(base_name)
        valid = {f.name for f in dataclasses.fields(config_cls)}
        inherited = {k: v for k, v in main_cfg.model.fields.items() if k in SHARED_MODEL_FIELDS and k in valid}
        base_raw["model"] = {**inherited, **base_model, "name": base_name}
        base_raw["train"] = merge(base_raw.get("train", {}), spec.train)
        base_raw["loop_train"] = dict(spec.loop_train)
        base_raw["loop_eval"] = dict(spec.loop_eval)
        base_raw["out_dir"] = str(out / "baseline")
        base_cfg = build_config(base_raw, base_over)
        if (base_cfg.data.task, base_cfg.data.options) != (main_cfg.data.task, main_cfg.data.options):
            raise ConfigError(
                f"baseline.data.task / baseline.data.options: the baseline is evaluated on the looped model's "
                f"task {main_cfg.data.task!r} {main_cfg.data.options}, so it must be trained on that task, not on "
                f"{base_cfg.data.task!r} {base_cfg.data.options}"
            )
        description = spec.label
    return main_cfg, base_cfg, section, description


def task_description(cfg: Any) -> str:
    dc = cfg.data
    opts = ", ".join(f"{k}={v}" for k, v in dc.options.items())
    gen = ", ".join(f"{k}={v}" for k, v in dc.eval_generate.items())
    text = dc.task + (f" ({opts})" if opts else "")
    return text + (f", held-out set: {gen}" if gen else "")


def _train(cfg: Any, label: str, echo: Any) -> dict[str, Any]:
    from loopformer.runs.folder import finished_summary
    from loopformer.train.trainer import Trainer

    if cfg.train.resume:  # --resume: a model whose training finished before the interruption is kept
        done = finished_summary(Path(cfg.out_dir), cfg.train.steps)  # its checkpoint confined to its checkpoints/
        if done is not None:
            echo(f"[bold]{label}[/bold]: trained earlier ({done['steps']} steps), kept -> {cfg.out_dir}")
            return {**done, "wall_time": done.get("wall_time") or 0.0}

    echo(f"[bold]training {label}[/bold]: {cfg.model.name}, {cfg.train.steps} steps of {cfg.train.batch_size} "
         f"({cfg.train.mode}) -> {cfg.out_dir}")
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    echo(f"  {trainer.model.num_parameters():,} parameters, {len(trainer.train_data)} training examples")
    summary = trainer.fit()
    summary["wall_time"] = round(time.perf_counter() - t0, 1)
    return summary


def run_folder_for(out_dir: str | Path | None, overwrite: bool, resume: bool = False) -> Path:
    """The folder of a ``loopformer run``: ``--out`` (refused when it holds a previous run, unless
    ``overwrite`` or ``resume``, or something other than a previous run), else a new ``runs/<timestamp>``
    (``-2``, ``-3``... when that name is taken)."""
    from loopformer.commands.common import check_job_folder
    from loopformer.runs.folder import RunFolderError, holds_run

    if resume and (not out_dir or overwrite):
        raise click.UsageError("--resume continues the run in --out: give --out, and not --overwrite")
    if out_dir:
        out = Path(out_dir)
        previous = out.is_dir() and ((out / "summary.json").is_file() or holds_run(out / "model")
                                     or holds_run(out / "baseline"))  # fmt: skip
        check_job_folder(out, "`loopformer run`", previous, own=("model", "baseline"))
        if resume and not (holds_run(out / "model") or holds_run(out / "baseline")):
            raise RunFolderError(f"--resume: {out} holds no `loopformer run` to continue (no model/ checkpoints)")
        if previous and not overwrite and not resume:
            raise RunFolderError(f"{out} holds a previous `loopformer run`; pass another --out, leave --out "
                                 f"out for a new runs/<timestamp> folder, or replace it with --overwrite")
        return out
    stamp = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    out, n = stamp, 1
    while True:  # mkdir claims the name atomically (two runs started in the same second)
        try:
            out.mkdir(parents=True)
            return out
        except FileExistsError:
            n += 1
            out = stamp.with_name(f"{stamp.name}-{n}")


@click.command("run")
@click.option("--recipe", "-r", default=DEFAULT_RECIPE, show_default=True, help="recipe name (in recipes/) or path")
@out_option("run folder (default: a new runs/<timestamp>)")
@overwrite_option("replace the previous run in --out (each model's folder swapped in whole once its first "
                  "checkpoint is written)")
@click.option("--resume", is_flag=True, help="continue the run in --out after an interruption (SIGTERM, "
              "Ctrl-C): each model resumes from its latest checkpoint, a finished one is kept")
@device_option()
@print_config_option("print the resolved configurations (YAML) and exit")
@click.argument("overrides", nargs=-1)
def run(recipe: str, out_dir: Path | None, overwrite: bool, resume: bool, overrides: tuple[str, ...], device: str,
        print_config: bool) -> None:
    """Train the recipe's looped model and an equal-size plain transformer, evaluate both, report.

    OVERRIDES are key=value pairs: train.steps=200 (both models), run.lens_loops=0, baseline.train.lr=1e-3.
    Without --out every run gets a new folder runs/<timestamp>; an --out folder holding a previous run is
    refused unless --overwrite is given. --device sets where both models train and are evaluated (the
    recipe's `device` when auto).
    """
    dev = resolve_device(device)
    if device != "auto":
        if dev.type == "cuda" and dev.index is not None:
            import torch

            torch.cuda.set_device(dev)
        overrides = (*overrides, f"device={dev.type}")
    if print_config:
        from loopformer.config.recipes import print_config_yaml

        main_cfg, base_cfg, _, _ = build_run_configs(recipe, overrides, Path(out_dir or "runs/<timestamp>"))
        click.echo("# the looped model\n" + print_config_yaml(main_cfg), nl=False)
        if base_cfg is not None:
            click.echo("---\n# the baseline\n" + print_config_yaml(base_cfg), nl=False)
        return

    from loopformer.commands.common import resume_hint
    from loopformer.files import check_inside
    from loopformer.nn import autocast
    from loopformer.train.stop import TrainingInterrupted

    console = plain_console()  # whole lines in a log file
    given = overrides
    if overwrite:
        overrides = (*overrides, "train.overwrite=true")
    if resume:
        overrides = (*overrides, "train.resume=true")
    # every override checked (as `train` checks them) before a run folder is claimed or anything written
    build_run_configs(recipe, overrides, Path(out_dir or "runs/<timestamp>"))
    out = run_folder_for(out_dir, overwrite, resume)
    for part in ("model", "baseline", "plots"):  # the folders `run` owns in OUT: never through a link
        check_inside(out / part / "x", out)
    main_cfg, base_cfg, section, base_desc = build_run_configs(recipe, overrides, out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    try:
        trained = [_train(main_cfg, "the looped model", console.print)]
        if base_cfg is not None:
            trained.append(_train(base_cfg, "the baseline", console.print))
    except TrainingInterrupted as err:  # SIGTERM / SIGINT: checkpointed and unlocked; say how to go on
        kept = [o for o in given if o.split("=", 1)[0] not in ("train.resume", "train.overwrite")]
        resume_hint(err, ["loopformer", "run", "-r", recipe, *kept, "-o", str(out), "--resume"])
    with autocast(dev, main_cfg.bf16):  # evaluate in the precision the run trained in
        summary = _evaluate_job(out, [c for c in (main_cfg, base_cfg) if c is not None], trained, section, base_desc, dev, console.print)
    if summary is not None:
        from loopformer.eval.report import write_json

        summary.update(wall_time=round(time.perf_counter() - t_start, 1), recipe=str(_recipe_path(recipe)),
                       overrides=list(overrides))  # fmt: skip
        write_json(out / "summary.json", summary)
        console.print(f"report: {summary['report']}   plots: {out / 'plots'}   summary: {out / 'summary.json'}")


def _recipe_path(recipe: str) -> Path:
    from loopformer.config import find_recipe

    return find_recipe(recipe)


def _evaluate_job(out: Path, configs: list[Any], trained: list[dict[str, Any]], section: RunSection,
                  base_desc: str, dev: Any, echo: Any) -> dict[str, Any] | None:  # fmt: skip
    """Both trained models on the looped model's held-out set: the report (``loopformer.eval.suite``) and
    what ``summary.json`` records (returned; None for a text job, whose summary is written here: held-out loss
    and bits per byte of each model)."""
    from loopformer.eval.report import accuracy_table, describe_loop, write_json
    from loopformer.eval.suite import ModelUnderTest, ReportOptions, run_suite, spearman_text
    from loopformer.runs import eval_dataset, load_run, training_depth
    from loopformer.runs.folder import heldout_record

    runs = [load_run(summary["checkpoint"], use_ema=cfg.eval.use_ema, device=str(dev))
            for cfg, summary in zip(configs, trained)]  # fmt: skip
    main_cfg, main_run = configs[0], runs[0]
    dataset = eval_dataset(main_run.task, main_run.config)
    label = main_cfg.model.name
    labels = [label, *(f"baseline ({c.model.name})" for c in configs[1:])]
    if not main_run.task.has_validator:  # language modelling: held-out loss and bits per byte, no report
        from loopformer.eval.evaluate import evaluate_lm

        results = {}
        for name, r in zip(labels, runs):
            lm = evaluate_lm(r.model, r.task, dataset, loop=r.loop_eval, batch_size=r.config.eval.batch_size,
                             seed=r.config.seed)  # fmt: skip
            results[name] = {"checkpoint": str(r.path), **lm.to_dict()}
            echo(f"[bold]{name}[/bold]: held-out loss {lm.loss:.4f} nats/token, bits per byte {lm.bits_per_byte:.4f}")
        write_json(out / "summary.json", {"task": task_description(main_cfg), "model": label, "results": results,
                                          "heldout": heldout_record(main_run.config, dataset)})  # fmt: skip
        echo(f"summary: {out / 'summary.json'}")
        return None
    main = ModelUnderTest.from_run(main_run, label, training_depth(main_run))
    baselines = [ModelUnderTest.from_run(r, name) for name, r in zip(labels[1:], runs[1:])]
    options = ReportOptions(budgets=section.budgets, budget_mode=section.budget_mode, lens_loops=section.lens_loops,
                            signal_loops=section.signal_loops, spectral=section.spectral,
                            analysis_examples=section.analysis_examples, batch_size=main_cfg.eval.batch_size)  # fmt: skip
    params = {name: summary.get("parameters") for name, summary in zip(labels, trained)}
    walls = [f"{label} {trained[0]['wall_time']} s", *(f"baseline {s['wall_time']} s" for s in trained[1:])]
    notes = [
        *([f"Baseline: {base_desc}."] if base_desc else []),
        f"Task: {task_description(main_cfg)}; {len(dataset)} held-out examples.",
        "Parameters: " + ", ".join(f"{k} {v:,}" for k, v in params.items() if v is not None) + ".",
        f"Training: {main_cfg.train.steps} steps of batch {main_cfg.train.batch_size} for each model "
        f"(wall time: {', '.join(walls)}).",
    ]
    title = section.title or (f"loopformer run: {label} ({describe_loop(main.loop)}) vs "
                              f"{labels[1] if baselines else 'no baseline'} on {main_cfg.data.task}")  # fmt: skip
    suite = run_suite(out, title, main_run.task, dataset, main, baselines, options, notes=notes, log=echo,
                      extra={"heldout": heldout_record(main_run.config, dataset)})  # what compare checks reports agree on
    results, stats, eh = suite["results"], suite["difficulty"][label], suite["easy_hard"]
    r_main, r_base = results[label], results[labels[1]] if baselines else None
    echo("")
    echo(accuracy_table(results))
    echo(f"[bold]held-out accuracy[/bold] (independent validator): {label} {100 * r_main.valid_accuracy:.1f}%"
         + (f", baseline {100 * r_base.valid_accuracy:.1f}% ({base_desc})" if r_base else ""))
    echo(f"[bold]mean loop steps[/bold]: easy (difficulty <= {eh['split_difficulty']:g}) "
         f"{eh['easy_mean_steps']:.2f}, hard {eh['hard_mean_steps']:.2f}; {spearman_text(stats)}")
    echo(f"checkpoint: {main_run.path}")
    return {
        "task": task_description(main_cfg),
        "model": label,
        "heldout_accuracy": r_main.valid_accuracy,
        "heldout_exact_accuracy": r_main.exact_accuracy,
        "heldout_token_accuracy": r_main.token_accuracy,
        "baseline": base_desc or None,
        "baseline_model": configs[1].model.name if baselines else None,
        "baseline_accuracy": r_base.valid_accuracy if r_base else None,
        "baseline_exact_accuracy": r_base.exact_accuracy if r_base else None,
        "heldout_examples": len(dataset),
        "parameters": params,
        "mean_steps": r_main.mean_steps,
        "mean_steps_by_difficulty": stats.mean_steps_by_difficulty(),
        "steps_difficulty_spearman": {"rho": stats.spearman_rho, "p": stats.spearman_p},
        "easy_hard_steps": eh,
        "checkpoint": str(main_run.path),
        "baseline_checkpoint": str(runs[1].path) if baselines else None,
        "report": str(suite["report"]),
        "metrics": str(suite["metrics"]),
        "plots": {k: str(v) for k, v in suite["plots"].items()},
        "train_wall_time": {label: trained[0]["wall_time"], **({"baseline": trained[1]["wall_time"]} if baselines else {})},
    }
