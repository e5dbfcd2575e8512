"""Experiment tracking beside ``metrics.jsonl``: TensorBoard (``train.tensorboard``) and Weights & Biases
(``train.wandb``), both optional extras (``pip install 'loopformer[tensorboard]'`` / ``'loopformer[wandb]'``)
and both off by default.

``train.wandb_mode``: ``online`` (needs ``wandb login``), ``offline`` (files under ``<run>/wandb``, upload
later with ``wandb sync``) or ``disabled``.  The W&B run id is kept in ``<run>/wandb_id`` so a resumed
run continues the same W&B run.  Only rank 0 tracks.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

log = logging.getLogger("loopformer.train")


class Trackers:
    """The open trackers of one run: ``log(numbers, step)`` to all, ``close()`` at the end."""

    def __init__(self, tensorboard: Any = None, wandb_run: Any = None) -> None:
        self.tensorboard, self.wandb_run = tensorboard, wandb_run

    def log(self, numbers: dict[str, float], step: int) -> None:
        if self.tensorboard is not None:
            for key, value in numbers.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb_run is not None:
            self.wandb_run.log(numbers, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _wandb_run(config: Any, run_dir: Path) -> Any:
    try:
        import wandb
    except ImportError:
        log.warning("train.wandb is on but wandb is not installed (pip install 'loopformer[wandb]')")
        return None
    from loopformer.config import to_dict

    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
    from loopformer.files import atomic_write_text

    atomic_write_text(id_file, run_id, root=run_dir)
    tc = config.train
    return wandb.init(project=tc.wandb_project, name=run_dir.name, id=run_id, resume="allow", dir=str(run_dir),
                      config=to_dict(config), mode=tc.wandb_mode)  # fmt: skip


def open_trackers(config: Any, run_dir: Path) -> Trackers | None:
    """The trackers ``config.train`` asks for, or None when there are none."""
    tb = None
    if config.train.tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.warning("train.tensorboard is on but tensorboard is not installed (pip install tensorboard)")
        else:
            tb = SummaryWriter(str(run_dir / "tensorboard"))
    wb = _wandb_run(config, run_dir) if getattr(config.train, "wandb", False) else None
    return Trackers(tb, wb) if tb is not None or wb is not None else None
