"""``loopformer convert SYSTEM CHECKPOINT [--config FILE] -o DIR``: import an official checkpoint.

Without ``--config`` the reference's configuration is looked for beside the checkpoint (TRM / HRM:
``all_config.yaml``; the Attractor: ``config.json``, ``model_config.json``, ``all_config.yaml``); with none
found the conversion is refused unless ``--allow-defaults``. ``--set KEY=VALUE`` overrides are applied
before the key mapping runs (an error that suggests one is fixed by passing it).
"""

from __future__ import annotations

import click

from loopformer.convert import CONVERTERS


@click.command("convert")
@click.argument("system", type=click.Choice(["fprm", "attractor", "trm", "hrm", "ltg"]))
@click.argument("checkpoint", type=click.Path(dir_okay=False))
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="the reference's training configuration (e.g. TRM / HRM all_config.yaml)",
)
@click.option(
    "--out",
    "-o",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="run folder to write (config.yaml + checkpoints/step_00000000)",
)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="loopformer config override for the run folder, e.g. data.eval_path=data/test",
)
@click.option(
    "--allow-defaults",
    is_flag=True,
    help="convert without the reference's configuration, taking its defaults (refused otherwise)",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="replace what --out holds (moved aside once the new run folder is complete)",
)
def convert(
    system: str,
    checkpoint: str,
    config_file: str | None,
    out_dir: str,
    overrides: tuple[str, ...],
    allow_defaults: bool = False,
    overwrite: bool = False,
) -> None:
    """Turn an authors' checkpoint (a PyTorch state dict, loaded with weights_only=True) into a run
    folder that loopformer eval, solve and the analyses accept."""
    from loopformer.convert import convert_checkpoint

    if system not in CONVERTERS:
        raise NotImplementedError(
            f"no key mapping for {system!r} yet (available: {', '.join(sorted(CONVERTERS))})"
        )
    from pathlib import Path

    from loopformer.runs.outputs import staged_output

    out = Path(out_dir)
    # built aside and swapped in whole; an earlier conversion may be replaced, a trained run never
    with staged_output(
        out, "convert", overwrite, "--out", protect_runs=not (out / "converted.json").is_file()
    ) as tmp:
        staged, converted = convert_checkpoint(
            system, checkpoint, out, config_file, overrides, write_to=tmp, allow_defaults=allow_defaults
        )
    folder = out / staged.relative_to(tmp)
    for note in converted.notes:
        click.echo(f"note: {note}")
    click.echo(f"wrote {folder} ({len(converted.weights)} tensors); evaluate with: loopformer eval {out_dir}")


@click.command("consolidate")
@click.argument("checkpoint", type=click.Path(exists=True))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="folder to write step_N/ (and its latest pointer) into")  # fmt: skip
def consolidate_cmd(checkpoint: str, out_dir: str) -> None:
    """Turn a sharded (FSDP2) checkpoint into a full safetensors checkpoint.

    A sharded checkpoint is what train.checkpoint_format=sharded writes; the full one (model.safetensors,
    ema.safetensors, the optimiser in full) is what push, convert and a resume with train.strategy=fsdp or
    one process read. eval / solve read sharded checkpoints directly."""
    from pathlib import Path

    from loopformer.runs.folder import RunFolderError, RunLock, inside_run, training_run
    from loopformer.runs.sharded import consolidate

    out = Path(out_dir)
    source = Path(checkpoint)
    source_run = inside_run(source) or ((source, False) if training_run(source) else None)
    enclosing = inside_run(out)
    if enclosing is not None and (source_run is None or Path(source_run[0]).resolve() != enclosing[0].resolve()):
        raise RunFolderError(f"--out {out} is inside the training run {enclosing[0]}, not the run of {checkpoint}: "
                             f"choose a folder outside it")  # fmt: skip
    # the run's own lock when writing into its checkpoints (a training there would race), else --out's
    with RunLock(enclosing[0] if enclosing is not None else out, "consolidate"):
        folder = consolidate(checkpoint, out_dir)
    click.echo(f"wrote {folder}")
