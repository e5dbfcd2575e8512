"""Training: the trainer (one class, ``trainer``), what it builds from the config (``setup``), the training
modes and deep supervision's carry (``modes``), the distributed layer and strategies (``dist``), the data
stream, curriculum and per-step seeds (``data``), losses, optimisers (``optim``), what a run reports
(``metrics``: device metrics, logs, progress), stop signals (``stop``), the whole step compiled
(``compiled``), ``--plan`` and tracking. Checkpoints are written through run storage
(``loopformer.runs.checkpoint``), which takes the trainer's ``state_dict()``.

Public API::

    from loopformer.train import Trainer
    summary = Trainer(config).fit()                       # config: loopformer.config.RunConfig

The names are imported on first use, so importing one module of the package does not import the trainer.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
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
    "Strategy": "dist",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'loopformer.train' has no attribute {name!r}")
    return getattr(importlib.import_module(f"loopformer.train.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
