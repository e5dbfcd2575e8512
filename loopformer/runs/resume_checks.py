"""What a resume checks before it loads a checkpoint: that it is this run's, that a good one exists,
and that the configuration still describes the same training stream.

- ``check_origin``: a ``train.resume`` path naming a checkpoint outside this run's ``checkpoints/``
  (another run's) is refused when this run folder already holds a run: that run's weights would
  continue under this run's step names, mixed with its own checkpoints and metrics. Into a folder
  that holds no run it is a branch: the new run continues from that state and records where it came
  from in ``<run>/origin.json`` (the checkpoint, its run folder, its step, when).
- ``no_good_checkpoint``: ``train.resume=true`` where every checkpoint is corrupt (or holds
  non-finite weights) stops with an error naming each file and reason, never a silent restart.
  A folder with no checkpoint at all still starts from step 0 (a run killed before its first one),
  unless it is a branch (``origin.json``): then it continues from the checkpoint it branched from
  (``branch_origin``), or is refused naming ``origin.json`` when that checkpoint is gone.
- ``check_data``: the training and held-out sets must hold the rows the checkpoint recorded
  (``loopformer.runs.fingerprint``: a data file regenerated since, another file at the same path), else
  the resume is refused as a config change is (``--allow-config-change`` records it).
- ``config_changes(saved, current)``: the dotted keys whose value differs between the checkpoint's
  ``config.json`` and this run's config, leaving out the keys that cannot change what is trained
  (``STREAM_FREE``, plus a few that are free only in some runs, see ``_free``). Anything else (the
  seed, the model, every ``data.*`` key, the optimiser, the batch size, the schedule, the loops,
  the training mode, bf16, ...) changes the stream: the resume is refused with the list of keys
  unless ``train.allow_config_change=true`` (``loopformer train --allow-config-change``), which
  appends the change (time, step, checkpoint, each key's old and new value) to
  ``<run>/config_changes.jsonl`` and goes on.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from loopformer.config import RunConfig, config_to_json, to_dict
from loopformer.config.recipes import stored_table
from loopformer.files import append_line, atomic_write_json, read_json, read_record
from loopformer.loop import LoopConfig
from loopformer.loop.config import plugin_defaults
from loopformer.runs.folder import holds_run
from loopformer.runs.layout import CheckpointError, step_dirs

log = logging.getLogger("loopformer.train")

CHANGES = "config_changes.jsonl"
ORIGIN = "origin.json"

# keys that never change the training stream (what is logged, evaluated or kept, and where)
STREAM_FREE = frozenset(
    {
        "out_dir",
        "device",
        "compile",
        "tf32",  # the hardware's float32 arithmetic on CUDA, as device and compile
        "train.resume",
        "train.overwrite",
        "train.allow_config_change",
        "train.log_every",
        "train.eval_every",
        "train.checkpoint_every",
        "train.keep_checkpoints",
        "train.checkpoint_format",  # how checkpoints are stored (full or sharded), not what is trained
        "train.keep_best",
        "train.keep_best_mode",
        "train.max_state_norm",
        "train.max_loss",
        "train.progress",
        "train.tensorboard",
        "train.wandb",
        "train.wandb_project",
        "train.wandb_mode",
        "train.threads",
        "train.strategy",
        "train.find_unused_parameters",
    }
)
_MISSING = object()


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    """``{"train.lr": 0.001, ...}``: nested mappings as dotted keys (lists are values)."""
    if not isinstance(data, dict) or (prefix and not data):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _free(key: str, current: dict[str, Any]) -> bool:
    """Whether ``key`` may change on a resume of a run whose (flat) config is ``current``.

    ``train.steps`` is free only under a constant schedule without Muon's weight-decay taper (a
    cosine / trapezoid schedule or the taper is a function of it); the evaluation settings
    (``eval.*``, ``loop_eval``, ``loop_periodic``) only without a curriculum, whose level-ups
    depend on an evaluation.
    """
    if key in STREAM_FREE:
        return True
    if key == "train.steps":
        taper = current.get("train.optimizer") == "muon_adamw" and current.get(
            "train.muon_weight_decay_taper"
        )
        return current.get("train.schedule") == "constant" and not taper
    if key.startswith(("eval.", "loop_eval", "loop_periodic")):
        return not current.get("data.curriculum.enabled")
    return False


def config_changes(saved: dict[str, Any], current: RunConfig) -> dict[str, dict[str, Any]]:
    """``{key: {"old": ..., "new": ...}}`` for the stream-changing keys where the checkpoint's
    ``config.json`` (``saved``) and ``current`` differ; a key one side lacks compares with its default."""
    # family / step / plugins: what the checkpoint records beside the config (loopformer.runs.checkpoint)
    old = _flat(stored_table({k: v for k, v in saved.items() if k not in ("family", "step", "plugins")}))
    new = _flat(json.loads(config_to_json(current)))
    default = _flat(to_dict(RunConfig()))
    # the model's resolved loop: a field added since the checkpoint was written compares with its default, a
    # plug-in's options an earlier version listed for every plug-in with the plug-in's defaults
    loop_defaults = {**to_dict(LoopConfig()), **to_dict(plugin_defaults())}
    default.update({f"model.loop.{k}": v for k, v in _flat(loop_defaults).items()})
    changes = {}
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, default.get(key, _MISSING)), new.get(key, default.get(key, _MISSING))
        if a != b and not _free(key, new):
            changes[key] = {"old": None if a is _MISSING else a, "new": None if b is _MISSING else b}
    return changes


def check_config(config: RunConfig, folder: Path, run_dir: Path) -> dict[str, dict[str, Any]]:
    """The stream-changing differences between ``config`` and the checkpoint ``folder``'s; refused
    (CheckpointError listing them) unless ``train.allow_config_change`` (``record_changes`` then
    writes them once the checkpoint is loaded)."""
    saved = read_json(folder / "config.json", CheckpointError)
    if not isinstance(saved, dict):
        raise CheckpointError(f"{folder / 'config.json'} does not hold a config object")
    changes = config_changes(saved, config)
    if changes and not config.train.allow_config_change:
        listed = "; ".join(f"{k}: {v['old']!r} -> {v['new']!r}" for k, v in changes.items())
        raise CheckpointError(
            f"resume: this config differs from the one checkpoint {folder} was trained with in "
            f"{', '.join(changes)} ({listed}); a resume continues the same training, so these must match. "
            f"Resume with the run's config, or pass --allow-config-change (train.allow_config_change=true) "
            f"to continue with the change (recorded in {run_dir / CHANGES})"
        )
    return changes


def check_data(config: RunConfig, folder: Path, run_dir: Path, current: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The data sets whose rows differ between the checkpoint ``folder``'s record (``state.json`` ``data``,
    ``loopformer.runs.fingerprint``) and this run's (``current``): a data file regenerated or replaced since.
    Refused (CheckpointError naming them) unless ``train.allow_config_change``; a checkpoint written before
    data was recorded has nothing to compare."""
    from loopformer.runs.fingerprint import data_changes
    from loopformer.runs.records import check_state

    path = folder / "state.json"
    saved = check_state(read_json(path, CheckpointError), path).get("data") if path.is_file() else None
    changes = data_changes(saved, current)
    if changes and not config.train.allow_config_change:
        listed = "; ".join(f"{k}: {v['old']} -> {v['new']}" for k, v in changes.items())
        raise CheckpointError(
            f"resume: checkpoint {folder} was trained on other data than this run reads ({listed}); a resume "
            f"continues the same training on the same rows. Restore the data, or pass --allow-config-change "
            f"(train.allow_config_change=true) to continue on the new rows (recorded in {run_dir / CHANGES})"
        )
    return changes


def record_changes(run_dir: Path, folder: Path, step: int, changes: dict[str, dict[str, Any]]) -> None:
    """Append the allowed change to ``run_dir/config_changes.jsonl`` (time, step, checkpoint, each key's
    old and new value)."""
    if changes:
        record = {"time": _now(), "step": step, "checkpoint": str(folder), "changes": changes}
        append_line(run_dir / CHANGES, json.dumps(record), root=run_dir, fsync=True)


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def check_origin(folder: Path, ckpt_dir: Path, run_dir: Path) -> Path | None:
    """None for a checkpoint of this run; for another run's: refused when ``run_dir`` holds a run (of
    its own: not the same branch started again before its first checkpoint), else its run folder
    (``record_origin`` writes ``origin.json`` once the checkpoint is loaded)."""
    if _real(folder).is_relative_to(_real(ckpt_dir)):
        return None
    source = folder.parent.parent if folder.parent.name == "checkpoints" else folder.parent
    # the same branch started again before its first checkpoint (killed early) may go on
    again = _origin(run_dir) == str(_real(folder)) and not step_dirs(ckpt_dir)
    if step_dirs(ckpt_dir) or (holds_run(run_dir) and not again):
        raise CheckpointError(
            f"train.resume names {folder}, a checkpoint of another run ({source}), but {run_dir} holds a "
            f"run of its own; resuming would write that run's weights under this run's step names. Resume "
            f"this run with train.resume=true, or continue the other one in a new, empty out_dir"
        )
    return source


def record_origin(run_dir: Path, folder: Path, source: Path, step: int) -> None:
    """``run_dir/origin.json``: the checkpoint this branch started from, its run folder, step and time."""
    record = {"checkpoint": str(_real(folder)), "run": str(_real(source)), "step": step, "time": _now()}
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir / ORIGIN, record, root=run_dir, indent=1)
    from loopformer.runs.provenance import FILE, read_records

    if not (run_dir / FILE).is_file():  # the branch's history starts with the trainings that led to its weights
        try:
            earlier = [{**r, "run": str(_real(source))} for r in read_records(source) if r.get("step", 0) < step]
        except ValueError as err:  # the other run's file is malformed: the branch starts its own history
            log.warning("%s; the branch's provenance starts here", err)
            earlier = []
        if earlier:
            atomic_write_json(run_dir / FILE, {"records": earlier}, root=run_dir, indent=2, newline=True)


def read_origin(run_dir: Path) -> dict[str, Any] | None:
    """``run_dir/origin.json`` (``loopformer.runs.records.ORIGIN``), None when there is none;
    CheckpointError naming the file and field when it is malformed."""
    from loopformer.runs.records import ORIGIN as SCHEMA

    path = run_dir / ORIGIN
    if not path.is_file():
        return None
    return read_record(path, SCHEMA, CheckpointError)


def _origin(run_dir: Path) -> str | None:
    """The checkpoint ``run_dir/origin.json`` names (None without one)."""
    record = read_origin(run_dir)
    return None if record is None else record["checkpoint"]


def branch_origin(run_dir: Path) -> Path | None:
    """For ``train.resume=true`` in a run folder without a checkpoint: the checkpoint its ``origin.json``
    names (a branch killed before its first checkpoint continues from where it branched, never from step 0),
    None without an ``origin.json``; CheckpointError naming ``origin.json`` when that checkpoint is gone or
    does not verify."""
    from loopformer.runs.manifest import verify_checkpoint

    record = read_origin(run_dir)
    if record is None:
        return None
    folder = Path(record["checkpoint"])
    why = verify_checkpoint(folder)
    if why is None:
        log.info("resume: %s is a branch of %s (%s) with no checkpoint of its own: continuing from there",
                 run_dir, folder, ORIGIN)  # fmt: skip
        return folder
    raise CheckpointError(
        f"resume: {run_dir} is a branch of {folder} ({run_dir / ORIGIN}) with no checkpoint of its own, and that "
        f"checkpoint cannot be used ({why}); restore it, or start afresh with --overwrite"
    )


def no_good_checkpoint(ckpt_dir: Path, skipped: list[str]) -> CheckpointError:
    """The error of a ``train.resume=true`` whose every checkpoint is unusable (``skipped``: why)."""
    return CheckpointError(
        f"resume: no usable checkpoint in {ckpt_dir}; every one is corrupt: {'; '.join(skipped)}. "
        f"Nothing was loaded or overwritten; repair or remove them (or start afresh with --overwrite, without --resume)"
    )


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
