"""``loopformer train RECIPE --plan``: the trainer's side of the memory plan.

The memory model, the counting on the meta device and the printed plan are ``loopformer.config.memory``'s
(the same terms the configuration's memory check bounds). What only the training layer knows is handed to it
as a ``Probe``: the run's model as the trainer builds it (``loopformer.train.setup.build_run_model``), one
training forward and loss as the trainer computes it (``training_forward``: the training loop at its cap,
``loopformer.config.memory.plan_loop``), the optimiser the run builds, and two rows of the recipe's width.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from loopformer.config import ConfigError, RunConfig, memory
from loopformer.config.memory import Plan, Probe, plan_loop, sequence_length
from loopformer.tasks.base import TaskDataError, TokenDataset
from loopformer.train.losses import q_halt_loss, sequence_loss


def training_forward(
    model: nn.Module, cfg: RunConfig, inputs: Tensor, labels: Tensor, pids: Tensor | None
) -> tuple[Tensor, Tensor]:
    """One training forward and loss as the trainer computes it (no randomness that matters): (the loss,
    the final state)."""
    tc = cfg.train
    loop = plan_loop(cfg, model)
    state = None
    if tc.mode == "deep_supervision":  # one segment from a detached (carried) state
        with torch.no_grad():
            state = model.init_state(model.embed(inputs, pids)).detach()
    out = model(inputs, loop=loop, state=state, puzzle_ids=pids)
    loss = sequence_loss(out.logits, labels, tc.loss, tc.label_smoothing)
    if out.q_logits is not None and tc.q_loss_weight > 0:
        loss = loss + tc.q_loss_weight * q_halt_loss(
            out.q_logits, torch.zeros_like(out.q_logits, dtype=torch.bool)
        )
    if out.aux_loss is not None and tc.ponder_weight > 0:
        loss = loss + tc.ponder_weight * out.aux_loss
    if tc.q_learning and hasattr(model, "q_values"):
        loss = loss + model.q_values(out.state).sum()
    return loss, out.state


def plan_rows(cfg: RunConfig, task: Any) -> tuple[TokenDataset, str]:
    """Two example rows at the recipe's sequence length: synthetic tokens (the token values do not
    change what a forward saves) when the length is known, else the first rows of the training data."""
    from loopformer.runs import task_dataset

    T = sequence_length(cfg, task)
    vocab = int(cfg.model.fields.get("vocab_size") or getattr(task, "vocab_size", 0) or 2)
    n_ids = int(cfg.model.fields.get("num_puzzle_ids") or getattr(task, "num_puzzle_ids", 0) or 0)
    if T:
        inputs = np.arange(2 * T).reshape(2, T) % vocab
        pids = np.zeros(2, dtype=np.int64) if n_ids else None
        rows = TokenDataset(inputs, inputs.copy(), np.zeros(2), puzzle_ids=pids)
        return rows, f"synthetic rows of {T} tokens"
    try:
        data = task_dataset(task, cfg.data, "train")
    except (OSError, ValueError, TaskDataError) as err:
        raise ConfigError(f"--plan: the recipe's sequence length is unknown and its data cannot be read ({err}); "
                          "set model.seq_len=N") from err  # fmt: skip
    rows = data.subset(np.arange(min(2, len(data))))
    return rows, f"the first rows of the training data ({data.inputs.shape[1]} tokens)"


def make_plan(cfg: RunConfig, gpus: int, gpu_memory: int) -> tuple[Plan, str]:
    """The plan of ``cfg`` on ``gpus`` GPUs of ``gpu_memory`` bytes each, and where its rows came from."""
    from loopformer.runs import run_task

    try:
        task, missing = run_task(cfg.data), ""
    except (OSError, TaskDataError) as err:  # the task reads files that are not here: the recipe's fields decide
        task = None
        missing = f"; the task's files are not here ({type(err).__name__}), so the model fields decide"
    rows, source = plan_rows(cfg, task)
    probe = run_probe(cfg, task, rows, source + missing)
    return memory.make_plan(cfg, gpus, gpu_memory, probe), probe.source


def run_probe(cfg: RunConfig, task: Any, rows: TokenDataset, source: str = "") -> Probe:
    """What the memory model measures of ``cfg``'s run (``loopformer.config.memory.Probe``)."""
    from loopformer.train.setup import build_run_model, make_optimizer

    return Probe(
        build=lambda: build_run_model(copy.deepcopy(cfg), task, rows),
        forward=lambda model, inputs, labels, pids: training_forward(model, cfg, inputs, labels, pids),
        optimizer=lambda model: make_optimizer(model, cfg.train),
        rows=rows,
        source=source,
    )
