"""Training: the trainer (pluggable training modes and distributed strategies), losses, optimiser, checkpoints.

Public API::

    from loopformer.train import Trainer, load_checkpoint
    summary = Trainer(config).fit()                       # config: loopformer.config.RunConfig
    ckpt = load_checkpoint("runs/x", use_ema=True)        # -> Checkpoint(model, config, step, ...)

The names are imported on first use, so ``import loopformer.train.checkpoint`` (which
``loopformer.runs`` needs to read a checkpoint) does not import the trainer.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Checkpoint": "checkpoint",
    "CheckpointError": "checkpoint",
    "latest_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "read_checkpoint_config": "checkpoint",
    "resolve_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "accuracy": "losses",
    "q_halt_loss": "losses",
    "sequence_loss": "losses",
    "stablemax_log_probs": "losses",
    "token_losses": "losses",
    "EMA": "optim",
    "build_optimizer": "optim",
    "lr_at": "optim",
    "Trainer": "trainer",
    "TrainingDivergedError": "trainer",
    "TrainingMode": "modes",
    "SegmentBatch": "modes",
    "register_training_mode": "modes",
    "Strategy": "strategy",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'loopformer.train' has no attribute {name!r}")
    return getattr(importlib.import_module(f"loopformer.train.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
