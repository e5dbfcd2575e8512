"""The trainer's checkpoints: what a bit-exact resume needs, written and read back.

``save(trainer)`` writes ``checkpoints/step_N/`` through ``loopformer.runs.checkpoint.save_checkpoint``:
the weights (FSDP: gathered to full tensors by the strategy), the EMA, and ``training_state``:
the optimiser (in the strategy's layout, tagged ``optimizer_layout``), the data stream, the
curriculum, the training mode's carried state (``carry``), the RNG states, the elapsed time and the
metrics summed since the last logged record (so a resumed run logs the same averages).
``resume_folder`` finds the folder ``train.resume`` names (``true``: the run's newest good one, by
its manifest; none -> a fresh start; only corrupt ones -> an error naming them), ``check(trainer,
folder)`` refuses another run's checkpoint or a config that changes the training stream
(``loopformer.runs.resume_checks``) and ``restore(trainer, folder)`` loads every piece back. Under torchrun every rank
calls ``save`` (the mode's carry is gathered); only rank 0 writes.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loopformer.files import atomic_write_text
from loopformer.numerics import nonfinite_names
from loopformer.runs import checkpoint as ckpt
from loopformer.runs.checkpoint import (
    latest_good_checkpoint,
    load_training_state,
    model_family,
    resolve_checkpoint,
    save_checkpoint,
)
from loopformer.runs.layout import CheckpointError, load_weights
from loopformer.runs.manifest import verify_checkpoint
from loopformer.runs.resume_checks import (
    branch_origin,
    check_config,
    check_data,
    check_origin,
    no_good_checkpoint,
    record_changes,
    record_origin,
)
from loopformer.runs.sharded import is_sharded, load_sharded, save_sharded
from loopformer.runs.state import rng_state, set_rng_state
from loopformer.train import dist

if TYPE_CHECKING:
    from loopformer.train.trainer import Trainer

log = logging.getLogger("loopformer.train")


def training_state(tr: Trainer, optimizer: bool = True) -> dict[str, Any]:
    """Everything but the weights that a bit-exact resume needs (collective under FSDP / with a carry);
    ``optimizer`` False: without the optimiser (a sharded checkpoint stores it in the shards)."""
    opt = {
        "optimizer": tr.strategy.optimizer_state(tr.model, tr.optimizer),
        "optimizer_layout": tr.strategy.layout,
    }
    return {
        **(opt if optimizer else {}),
        "stream": tr.stream.state_dict(),
        "curriculum": tr.curriculum.state_dict() if tr.curriculum else None,
        "carry": tr.mode.state_dict(),
        "rng": rng_state(),
        "elapsed": tr.elapsed(),
        "best": tr.best.state_dict(),  # train.keep_best's record (BestTracker)
        "data": tr.data_record,  # the fingerprints of the training and held-out sets (runs/fingerprint.py)
        "meter": tr.meter.state_dict(),  # the metrics since the last logged record (step_metrics.StepMeter)
    }


def save(tr: Trainer) -> Path:
    """Checkpoint the current step (atomic; keeps the newest ``train.keep_checkpoints``)."""
    if tr.strategy.sharded_checkpoints(tr.config.train):
        tr.last_checkpoint = _save_sharded(tr)
        return _after_save(tr)
    state = training_state(tr)
    ema_state = tr.strategy.full_ema(tr.ema.state_dict() if tr.ema else None)
    weights = tr.strategy.full_weights(tr.model)
    bad = nonfinite_names(weights if weights is not None else tr.model.state_dict())
    if bad:  # never write (or call good) a checkpoint of blown-up weights
        tr.diverged("weights", float("nan"), f"non-finite parameter {bad[0]!r}")
    if tr.strategy.is_main:
        tr.last_checkpoint = save_checkpoint(
            tr.ckpt_dir,
            tr.step,
            tr.model,
            tr.config,
            ema_state=ema_state,
            training_state=state,
            keep=tr.config.train.keep_checkpoints,
            weights=weights,
        )
    else:
        tr.last_checkpoint = tr.ckpt_dir / f"step_{tr.step:08d}"
    return _after_save(tr)


def _save_sharded(tr: Trainer) -> Path:
    """Every rank writes its shards (``loopformer.runs.sharded``); nothing is gathered."""
    local = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in tr.model.state_dict().items()}
    bad = nonfinite_names(local)
    if dist.all_reduce_max(float(bool(bad))) > 0:  # every rank stops, whichever holds the bad shard
        tr.diverged(
            "weights", float("nan"), f"non-finite parameter {bad[0]!r}" if bad else "non-finite shard"
        )
    return save_sharded(
        tr.ckpt_dir, tr.step, model_family(tr.model), tr.model, tr.optimizer, tr.config,
        tr.ema.state_dict() if tr.ema else None, training_state(tr, optimizer=False),
        tr.config.train.keep_checkpoints, tr.strategy.is_main,
    )  # fmt: skip


def _after_save(tr: Trainer) -> Path:
    if tr.folder.staging is not None:  # --overwrite: the old run is moved aside only now
        tr.folder.complete_overwrite()
        tr.run_dir, tr.ckpt_dir = tr.folder.write_dir, tr.folder.write_dir / "checkpoints"
        tr.log.run_dir = tr.run_dir
        tr.last_checkpoint = tr.ckpt_dir / tr.last_checkpoint.name
    tr.strategy.barrier()
    return tr.last_checkpoint


def resume_folder(resume: bool | str, ckpt_dir: Path) -> Path | None:
    """The checkpoint ``train.resume`` asks for: None (a fresh run), the latest one, or a named one."""
    if resume is False or resume == "":
        return None
    if resume is True:
        folder, skipped = latest_good_checkpoint(ckpt_dir)
        if folder is None and skipped:  # checkpoints, none of them usable: never a silent restart
            raise no_good_checkpoint(ckpt_dir, skipped)
        for reason in skipped:
            log.warning("resume: skipped %s", reason)
        if folder is None:  # a branch killed before its first checkpoint goes on from where it branched
            folder = branch_origin(ckpt_dir.parent)
        if folder is None:
            log.info("resume: no usable checkpoint in %s, starting from scratch", ckpt_dir)
        return folder
    return resolve_checkpoint(resume)


def check(tr: Trainer, folder: Path) -> None:
    """Before ``restore``: ``folder`` is this run's (or this run is a new branch of it), the config
    trains the same stream and the data holds the same rows (or the change is allowed):
    ``loopformer.runs.resume_checks``."""
    tr.resumed_origin = check_origin(folder, tr.ckpt_dir, tr.run_dir)
    tr.config_changes = check_config(tr.config, folder, tr.run_dir)
    tr.config_changes.update(check_data(tr.config, folder, tr.run_dir, tr.data_record))


def record(tr: Trainer, folder: Path) -> None:
    """After ``restore`` (rank 0): the branch's ``origin.json`` and the allowed config change."""
    if not tr.strategy.is_main:
        return
    if tr.resumed_origin is not None:
        record_origin(tr.run_dir, folder, tr.resumed_origin, tr.step)
    record_changes(tr.run_dir, folder, tr.step, tr.config_changes)


def restore(tr: Trainer, folder: Path) -> None:
    """Restore weights, EMA, optimiser, data stream, curriculum, mode state and RNG from ``folder``
    (a sharded checkpoint: on any world size and strategy, ``loopformer.runs.sharded``)."""
    state = load_training_state(folder)
    if is_sharded(folder):
        if tr.ema is not None and not state.get("sharded", {}).get("ema"):
            raise CheckpointError(f"{folder} holds no EMA weights but this run keeps an EMA (train.ema > 0)")
        load_sharded(folder, tr.model, tr.optimizer, tr.ema.shadow if tr.ema else None, state)
    else:
        _restore_full(tr, folder, state)
    if tr.curriculum is not None and state.get("curriculum"):
        tr.curriculum.load_state_dict(state["curriculum"])
        tr.stream.set_eligible(tr.curriculum.eligible())
    tr.stream.load_state_dict(state["stream"])
    tr.mode.load_state_dict(state.get("carry"), folder)
    set_rng_state(state["rng"])
    tr.step = int(state["step"])
    tr.elapsed_before = float(state.get("elapsed", 0.0))
    tr.best.restore(state.get("best"), tr.ckpt_dir, tr.step)
    tr.meter.load_state_dict(state.get("meter"))
    tr.resumed_from = folder
    tr.last_checkpoint = folder
    log.info("resumed from %s at step %d", folder, tr.step)


def _restore_full(tr: Trainer, folder: Path, state: dict[str, Any]) -> None:
    tr.strategy.load_weights(tr.model, folder / "model.safetensors")
    _restore_ema(tr, folder)
    tr.strategy.check_layout(state.get("optimizer_layout", "torch"), folder)
    try:
        tr.strategy.load_optimizer_state(tr.model, tr.optimizer, state["optimizer"])
    except (ValueError, KeyError, RuntimeError) as err:
        raise CheckpointError(f"optimizer state in {folder} does not fit this model: {err}") from None


def _restore_ema(tr: Trainer, folder: Path) -> None:
    if tr.ema is None:
        return
    if not (folder / "ema.safetensors").is_file():
        raise CheckpointError(f"{folder} has no ema.safetensors but this run keeps an EMA (train.ema > 0)")
    ema = load_weights(folder / "ema.safetensors")
    tr.ema.load_state_dict({k: tr.strategy.like(tr.ema.shadow.get(k), v) for k, v in ema.items()})


def quarantine_after(root: str | Path, step: int) -> Path | None:
    """After divergence at ``step``: rename checkpoints from ``step`` on (their weights produced the
    divergence) and any with non-finite weights to ``diverged_step_N``; point ``latest`` at the newest
    remaining good one and return it (None when there is none)."""
    root = Path(root)
    good = None
    for folder in ckpt.candidate_checkpoints(root):
        m = ckpt._STEP_DIR.match(folder.name)
        if (
            good is None
            and int(m.group(1)) < step
            and verify_checkpoint(folder, hashes=False) is None
            and ckpt._nonfinite_reason(folder) is None
        ):
            good = folder
        elif good is None:
            os.replace(folder, folder.with_name(f"diverged_{folder.name}"))
            log.warning("divergence: %s renamed to diverged_%s (not a good checkpoint)", folder, folder.name)
    if good is not None:
        atomic_write_text(root / ckpt.LATEST, good.name + "\n", root=root)
    elif (root / ckpt.LATEST).is_file():
        (root / ckpt.LATEST).unlink()
    return good
