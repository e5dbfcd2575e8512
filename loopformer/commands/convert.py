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

from loopformer.commands.common import (
    PATH,
    best_option,
    ema_option,
    json_option,
    out_option,
    overwrite_option,
)
from loopformer.convert import CONVERTERS


@click.command("convert")
@click.argument("system", type=click.Choice(["fprm", "attractor", "trm", "hrm", "ltg"]))
@click.argument("checkpoint", type=click.Path(dir_okay=False))
@click.option("--config", "config_file", type=PATH, default=None,
              help="the reference's training configuration (e.g. TRM / HRM all_config.yaml)")  # fmt: skip
@out_option("run folder to write (config.yaml + checkpoints/step_00000000)", required=True)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="loopformer config override for the run folder, e.g. data.eval_path=data/test")  # fmt: skip
@click.option("--allow-defaults", is_flag=True,
              help="convert without the reference's configuration, taking its defaults (refused otherwise)")  # fmt: skip
@overwrite_option("replace what --out holds (moved aside once the new run folder is complete)")
def convert(system: str, checkpoint: str, config_file: Path | None, out_dir: Path, overrides: tuple[str, ...],
            allow_defaults: bool = False, overwrite: bool = False) -> None:  # fmt: skip
    """Turn an authors' checkpoint (a PyTorch state dict, loaded with weights_only=True) into a run
    folder that loopformer eval, solve and the analyses accept."""
    from loopformer.convert import convert_checkpoint

    if system not in CONVERTERS:
        raise NotImplementedError(
            f"no key mapping for {system!r} yet (available: {', '.join(sorted(CONVERTERS))})"
        )
    from loopformer.runs.folder import staged_output

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
@out_option("folder to write step_N/ (and its latest pointer) into", required=True, short=False)
@overwrite_option("replace an earlier consolidation of the same step in --out")
def consolidate_cmd(checkpoint: str, out_dir: Path, overwrite: bool = False) -> None:
    """Turn a sharded (FSDP2) checkpoint into a full safetensors checkpoint.

    A sharded checkpoint is what train.checkpoint_format=sharded writes; the full one (model.safetensors,
    ema.safetensors, the optimiser in full) is what push, convert and a resume with train.strategy=fsdp or
    one process read. eval / solve read sharded checkpoints directly. --out is a folder of checkpoints:
    the checkpoint's own run's checkpoints/, or a folder holding no other run and no dataset; nothing is
    written through a symbolic link, and an earlier step_N there is replaced only with --overwrite."""
    from loopformer.files import check_inside, missing_parts, remove_empty
    from loopformer.runs.checkpoint import consolidate
    from loopformer.runs.folder import RunFolderError, RunLock, run_at_or_above

    out = Path(out_dir)
    source_run, enclosing = run_at_or_above(checkpoint), run_at_or_above(out)
    own = source_run is not None and enclosing is not None and source_run.resolve() == enclosing.resolve()
    if enclosing is not None and not own:
        raise RunFolderError(f"--out {out} is or lies in the training run {enclosing}, not the run of {checkpoint}: "
                             f"choose a folder outside it")  # fmt: skip
    run = enclosing if own else None
    check_consolidate_out(out, run)
    created = missing_parts(out)
    try:
        # the run's own lock when writing into its checkpoints (a training there would race), else --out's
        with RunLock(run or out, "consolidate"):
            check_inside(out, run or out)
            folder = consolidate(checkpoint, out, replace=overwrite)
    except BaseException:
        remove_empty(created)
        raise
    click.echo(f"wrote {folder}")


def check_consolidate_out(out: Path, run: Path | None) -> None:
    """Refuse an ``--out`` of ``consolidate`` that is a symbolic link, a file, or (outside the checkpoint's own
    ``run``) a folder holding another run or a dataset."""
    from loopformer.runs.folder import RunFolderError, holds_dataset, nested_run, output_folder

    output_folder(out, "--out", "consolidate")
    if run is None and out.is_dir():
        nested = nested_run(out)
        if nested is not None or holds_dataset(out):
            what = f"the training run {nested}" if nested is not None else "a dataset"
            raise RunFolderError(f"--out {out} holds {what}; consolidate writes step_N/ and latest into a folder "
                                 f"of checkpoints: choose another --out")  # fmt: skip


@click.command("export")
@click.argument("system", type=click.Choice(["trm", "hrm", "fprm"]))
@click.argument("run")
@out_option("checkpoint file to write (all_config.yaml is written beside it)", required=True)
@ema_option("export the EMA weights when the run has them")
@best_option("the run's best checkpoint (train.keep_best) instead of its latest")
@click.option("--compiled-keys/--plain-keys", default=True, show_default=True,
              help="key prefix _orig_mod.model.inner. (the authors' torch.compile'd model, their default) or "
              "model.inner. (a DISABLE_COMPILE=1 load)")  # fmt: skip
@overwrite_option("replace an existing checkpoint file and all_config.yaml")
def export_cmd(system: str, run: str, out_dir: Path, ema: bool, best: bool, compiled_keys: bool,
               overwrite: bool) -> None:  # fmt: skip
    """Write RUN as a checkpoint of the authors' code for SYSTEM (the inverse of loopformer convert).

    The weights go to --out as their pretrain.py saves them (torch.save of the state dict) and the model and
    training settings to all_config.yaml beside it, so their evaluation scripts load it with
    load_checkpoint=PATH. Before anything is written, loopformer convert reads the export back and must give
    the run's weights bit for bit and its model settings; a model the authors' code cannot express is
    refused, naming the setting. Nothing is written through a symbolic link, nor inside a training run.
    """
    from loopformer.convert.export import export_weights, write_export
    from loopformer.runs import load_run

    out = Path(out_dir)
    check_export_out(out, overwrite)
    loaded = load_run(run, use_ema=ema, device="cpu", best=best)
    exported = export_weights(system, loaded.config, loaded.model.state_dict(), loaded.path, loaded.weights)
    path, config = write_export(exported, out, compiled=compiled_keys)
    click.echo(f"wrote {path} ({len(exported.state)} tensors, {loaded.weights} weights of {loaded.path}) and {config}; "
               f"read back by: loopformer convert {system} {path} -o DIR")  # fmt: skip
    for note in exported.notes:
        click.echo(f"note: {note}")


def check_export_out(out: Path, overwrite: bool) -> None:
    """Refuse an ``--out`` of ``export`` (a checkpoint file, ``all_config.yaml`` beside it) that is a symbolic link
    or a folder, that lies inside a training run, or that exists unless ``overwrite`` (as ``consolidate``)."""
    from loopformer.files import UnsafePathError
    from loopformer.runs.folder import RunFolderError, inside_run

    config_file = out.parent / "all_config.yaml"
    for path in (out, config_file):
        if path.is_symlink():
            raise UnsafePathError(f"{path} is a symbolic link (to {path.readlink()}); export does not write "
                                  f"through links: name a file itself")  # fmt: skip
        if path.is_dir():
            raise RunFolderError(f"{path} is a folder; --out names the checkpoint file to write")
        if path.exists() and not overwrite:
            raise RunFolderError(f"{path} exists; choose another --out or pass --overwrite to replace it")
    if inside_run(out) is not None:
        raise RunFolderError(f"--out {out} lies in a training run's folder; write the export outside it")


@click.command("translate", context_settings={"ignore_unknown_options": True})
@click.argument("system", type=click.Choice(["trm", "hrm", "fprm"]))
@click.argument("words", nargs=-1, type=click.UNPROCESSED, metavar="KEY=VALUE...")
@json_option("print one JSON object instead of the table")
def translate_cmd(system: str, words: tuple[str, ...], as_json: bool) -> None:
    """Translate the authors' config keys or command line for SYSTEM into loopformer overrides.

    KEY=VALUE are the authors' overrides as their pretrain.py takes them (Hydra: arch.L_cycles=4,
    global_batch_size=384, +key=value, ++key=value), or a whole command line (python pretrain.py arch=trm
    ...). Each key is translated by loopformer convert's own mapping: the authors' default configuration is
    converted with and without the key changed, and the loopformer keys that move are its translation. Keys
    the conversion does not read (epochs, eval_interval, ...) are listed as not translated.
    """
    import json

    from loopformer.convert.translate import translate

    result = translate(system, list(words))
    if as_json:
        click.echo(json.dumps({"system": system, "overrides": result.overrides, "sources": result.sources,
                               "not_translated": result.unread, "skipped": result.skipped,
                               "recipe": result.recipe, "command": result.command()}, indent=1))  # fmt: skip
        return
    width = max((len(k) for k in result.sources), default=0)
    for key, targets in result.sources.items():
        click.echo(f"{key.ljust(width)}  ->  " + "  ".join(f"{t}={result.overrides[t]}" for t in targets))
    if result.unread:
        click.echo(f"not translated (loopformer convert does not read them): {', '.join(result.unread)}")
    if result.skipped:
        click.echo(f"skipped: {' '.join(result.skipped)}")
    click.echo(result.command())
