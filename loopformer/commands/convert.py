"""``loopformer convert SYSTEM CHECKPOINT [--config FILE] -o DIR``: import an official checkpoint.

Without ``--config`` the reference's configuration is looked for beside the checkpoint (TRM / HRM:
``all_config.yaml``; the Attractor: ``config.json``, ``model_config.json``, ``all_config.yaml``); with none
found the conversion is refused unless ``--allow-defaults``. ``--set KEY=VALUE`` overrides are applied
before the key mapping runs (an error that suggests one is fixed by passing it).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import click

from loopformer.commands.common import PATH
from loopformer.convert import CONVERTERS


@click.command("convert")
@click.argument("system", type=click.Choice(["fprm", "attractor", "trm", "hrm", "ltg"]))
@click.argument("checkpoint", type=click.Path(dir_okay=False))
@click.option(
    "--config",
    "config_file",
    type=PATH,
    default=None,
    help="the reference's training configuration (e.g. TRM / HRM all_config.yaml)",
)
@click.option(
    "--out",
    "-o",
    "out_dir",
    required=True,
    type=PATH,
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
    config_file: Path | None,
    out_dir: Path,
    overrides: tuple[str, ...],
    allow_defaults: bool = False,
    overwrite: bool = False,
) -> None:
    """Turn an authors' checkpoint (a PyTorch state dict, loaded with weights_only=True) into a run
    folder that `loopformer eval`, `solve` and the analyses accept."""
    from loopformer.convert import convert_checkpoint

    if system not in CONVERTERS:
        raise NotImplementedError(
            f"no key mapping for {system!r} yet (available: {', '.join(sorted(CONVERTERS))})"
        )
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
    click.echo(f"wrote {folder} ({len(converted.weights)} tensors); evaluate with: loopformer eval {shlex.quote(str(out_dir))}")


@click.command("consolidate")
@click.argument("checkpoint", type=click.Path(exists=True))
@click.option("--out", "out_dir", required=True, type=PATH,
              help="folder to write step_N/ (and its latest pointer) into")  # fmt: skip
@click.option("--overwrite", is_flag=True, help="replace an earlier consolidation of the same step in --out")
def consolidate_cmd(checkpoint: str, out_dir: Path, overwrite: bool = False) -> None:
    """Turn a sharded (FSDP2) checkpoint into a full safetensors checkpoint.

    A sharded checkpoint is what train.checkpoint_format=sharded writes; the full one (model.safetensors,
    ema.safetensors, the optimiser in full) is what push, convert and a resume with train.strategy=fsdp or
    one process read. eval / solve read sharded checkpoints directly. --out is a folder of checkpoints:
    the checkpoint's own run's checkpoints/, or a folder holding no other run and no dataset; nothing is
    written through a symbolic link, and an earlier step_N there is replaced only with --overwrite."""
    from loopformer.files import check_inside, missing_parts, remove_empty
    from loopformer.runs.folder import RunFolderError, RunLock, inside_run, training_run
    from loopformer.runs.sharded import consolidate

    out = Path(out_dir)
    source = Path(checkpoint)
    source_run = inside_run(source) or ((source, False) if training_run(source) else None)
    enclosing = inside_run(out) or ((out, False) if training_run(out) else None)
    own = source_run is not None and enclosing is not None and Path(source_run[0]).resolve() == enclosing[0].resolve()
    if enclosing is not None and not own:
        raise RunFolderError(f"--out {out} is or lies in the training run {enclosing[0]}, not the run of {checkpoint}: "
                             f"choose a folder outside it")  # fmt: skip
    check_consolidate_out(out, enclosing[0] if own else None)
    created = missing_parts(out)
    try:
        # the run's own lock when writing into its checkpoints (a training there would race), else --out's
        with RunLock(enclosing[0] if own else out, "consolidate"):
            check_inside(out, enclosing[0] if own else out)
            folder = consolidate(checkpoint, out, replace=overwrite)
    except BaseException:
        remove_empty(created)
        raise
    click.echo(f"wrote {folder}")


def check_consolidate_out(out: Path, run: Path | None) -> None:
    """Refuse an ``--out`` of ``consolidate`` that is a symbolic link, a file, or (outside the checkpoint's own
    ``run``) a folder holding another run or a dataset."""
    from loopformer.files import UnsafePathError
    from loopformer.runs.folder import RunFolderError, nested_run
    from loopformer.runs.outputs import holds_dataset

    if out.is_symlink():
        raise UnsafePathError(f"--out {out} is a symbolic link (to {out.readlink()}); consolidate does not write "
                              f"through links: name the folder itself")  # fmt: skip
    if out.exists() and not out.is_dir():
        raise RunFolderError(f"--out {out} is a file, not a folder: name a folder to write into")
    if run is None and out.is_dir():
        nested = nested_run(out)
        if nested is not None or holds_dataset(out):
            what = f"the training run {nested}" if nested is not None else "a dataset"
            raise RunFolderError(f"--out {out} holds {what}; consolidate writes step_N/ and latest into a folder "
                                 f"of checkpoints: choose another --out")  # fmt: skip
