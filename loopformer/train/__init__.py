"""Training: the trainer (simple looped training and deep supervision), losses, optimiser, checkpoints.

Public API::

    from loopformer.train import Trainer, load_checkpoint
    summary = Trainer(config).fit()                       # config: loopformer.config.RunConfig
    ckpt = load_checkpoint("runs/x", use_ema=True)        # -> Checkpoint(model, config, step, ...)
"""

from loopformer.train.checkpoint import (
    Checkpoint,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint_config,
    resolve_checkpoint,
    save_checkpoint,
)
from loopformer.train.losses import accuracy, q_halt_loss, sequence_loss, stablemax_log_probs, token_losses
from loopformer.train.optim import EMA, build_optimizer, lr_at
from loopformer.train.trainer import Trainer, TrainingDivergedError

__all__ = [
    "EMA",
    "Checkpoint",
    "CheckpointError",
    "Trainer",
    "TrainingDivergedError",
    "accuracy",
    "build_optimizer",
    "latest_checkpoint",
    "load_checkpoint",
    "lr_at",
    "q_halt_loss",
    "read_checkpoint_config",
    "resolve_checkpoint",
    "save_checkpoint",
    "sequence_loss",
    "stablemax_log_probs",
    "token_losses",
]
