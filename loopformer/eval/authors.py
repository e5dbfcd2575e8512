"""The Attractor puzzle authors' evaluation of TRM-DEQ, beside the clean one (``eval.protocol``).

The Attractor paper's Sudoku-Extreme 91.4% / Maze-Hard 93.1% (arXiv 2605.12466) can only come from the one
evaluation in the authors' code, github jacobfa/Attractor ``experiments/attractor_puzzles/trm/train_trm_deq.py``
``_eval`` (``debug_eval.py`` is a 5-batch smoke test). It differs from ``loopformer.eval.evaluate`` (every test
example, eval mode, ``eval.segments`` chained segments, every example scored):

- the model is in **training mode**: ``main`` calls ``model.train()`` before each training pass and ``_eval``
  never calls ``model.eval()``, so ``TRMDEQ.forward`` halts with the Q head (``q_halt > 0``) and its
  exploration (with probability ``halt_exploration`` a sample must first run a random 2..16 calls);
- ``_eval`` makes up to ``halt_max_steps`` (16) calls per batch from ``initial_carry`` (every sample halted), and
  the carry **resets a halted sample** at the next call (fresh ``H_init`` / ``L_init`` state, step count 0, the
  same puzzle) and runs it again; the batch stops early when every sample halted at the same call;
- the metrics are those of the **last call only**, summed over the samples **halted at that call** (and with a
  labelled token: ``losses_deq.py`` ``ACTLossHeadDEQ``: ``valid_metrics = new_carry.halted & (loss_counts > 0)``);
  ``exact_accuracy`` and ``accuracy`` (each sample's token fraction) are divided by that count;
- it stops after ``eval_max_batches`` (200) batches per rank. ``PuzzleDataset._iter_test``
  (``experiments/attractor_puzzles/data/puzzle_dataset.py``) cuts the test set into windows of the global batch
  and gives rank r the r-th local batch of each window, so on W ranks the evaluated rows are the test set's
  first ``200 x W`` local batches, in order.

Batches here are the test set's consecutive ``batch_size``-row blocks, dealt round-robin to the processes
(``EvalComm.local_batches``: block j to process ``j mod W``, as ``_iter_test`` deals its windows), and
``max_batches`` counts blocks over all processes: the same rows in the same batches on any number of
processes, the reference's first rows (its per-rank cap times its ranks; ``batch_size`` its per-rank batch).

``evaluate_authors_trm_deq`` does this with any model that carries its state between calls (``state=``) and has a
Q head (TRM, HRM's halt logit, the Attractor puzzle model). The exploration draws come from a generator seeded
by ``(seed, block)`` for each block (so a block's draws do not depend on which process runs it): per call
``torch.rand(B)`` (explore?) then ``torch.randint(2, calls + 1, (B,))`` (the minimum), as the reference draws
``rand_like`` then ``randint_like`` from the global RNG. In training mode the reference's
Jacobian regulariser runs inside ``torch.inference_mode`` and raises for ``jacobian_reg_lambda > 0``; here the
evaluation runs without gradient, where the model skips the regulariser (it does not change the forward).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from loopformer.eval.evaluate import EvalComm, batch_tensors, model_device, score_predictions
from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel
from loopformer.nn import autocast
from loopformer.numerics import check_output
from loopformer.tasks.base import Task, TokenDataset

PROTOCOLS = ("clean", "authors_trm_deq", "both")


@dataclass
class AuthorsEvalResult:
    """Sums of the authors' protocol (this rank's rows, summed over ranks by ``comm``)."""

    evaluated: int  # examples run (rows of the evaluated batches)
    count: int  # examples halted at the last call (the reference's ``count``): the denominator
    exact: int  # of those, every labelled position right
    valid: int  # of those, accepted by the task's validator (0 when not checked)
    token_fraction_sum: float  # of those, the sum of each one's fraction of right labelled positions
    steps_sum: int  # of those, the calls since their last reset
    calls_sum: int  # calls made, summed over batches
    batches: int
    checked: bool

    def summary(self) -> dict[str, Any]:
        """The metric names of ``loopformer.eval.evaluate.EvalResult.summary`` plus the protocol's own."""
        n = max(self.count, 1)
        out: dict[str, Any] = {
            "protocol": "authors_trm_deq",
            "n": self.count,
            "evaluated": self.evaluated,
            "token_acc": self.token_fraction_sum / n,
            "exact_acc": self.exact / n,
        }
        if self.checked:
            out["valid_acc"] = self.valid / n
        out["segments"] = self.steps_sum / n  # the reference's eval/steps
        out["calls"] = self.calls_sum / max(self.batches, 1)  # the reference's eval/avg_inference_steps
        return out


def evaluate_authors_trm_deq(
    model: LoopedModel,
    task: Task | None,
    dataset: TokenDataset,
    loop: LoopConfig | None = None,
    batch_size: int = 768,
    max_batches: int = 200,
    calls: int = 16,
    exploration: float = 0.1,
    device: torch.device | str | None = None,
    seed: int = 0,
    *,
    check: bool = True,
    bf16: bool = False,
    comm: EvalComm | None = None,
) -> AuthorsEvalResult:
    """The authors' ``_eval`` (module docstring): ``calls`` calls per batch of ``batch_size`` rows in training
    mode, halting on ``q > 0`` with ``exploration``, halted rows restarted, only rows halted at the last call
    counted, the first ``max_batches`` blocks of ``batch_size`` rows of the dataset over all processes (0: all),
    this process running its share (``comm.local_batches``). ``loop`` is one call's loop (the model's default
    when None); the model's training mode is restored on exit."""
    if len(dataset) == 0:
        raise ValueError("cannot evaluate on an empty dataset")
    if batch_size < 1 or calls < 1 or max_batches < 0 or not 0.0 <= exploration <= 1.0:
        raise ValueError(
            f"need batch_size >= 1, calls >= 1, max_batches >= 0 and exploration in [0, 1]; got {batch_size}, "
            f"{calls}, {max_batches}, {exploration}"
        )
    comm = comm if comm is not None else EvalComm()
    dev = torch.device(device) if device is not None else model_device(model)
    cfg = loop if loop is not None else model.config.loop
    validator = task if check and task is not None and task.has_validator else None
    n_batches = math.ceil(len(dataset) / batch_size)
    if max_batches:
        n_batches = min(n_batches, max_batches)
    # evaluated, count, exact, valid, token fraction, steps, calls, batches
    sums = np.zeros(8, dtype=np.float64)
    was_training = model.training
    model.to(dev)
    model.train()  # the reference's _eval runs the model in training mode
    try:
        with torch.no_grad(), autocast(dev, bf16) if bf16 else contextlib.nullcontext():
            for b in comm.local_batches(n_batches):
                index = np.arange(b * batch_size, min((b + 1) * batch_size, len(dataset)), dtype=np.int64)
                g = block_generator(seed, b)
                sums += _batch(model, dataset, index, cfg, calls, exploration, g, dev, validator)
    finally:
        model.train(was_training)
    total = comm.sum([float(x) for x in sums])
    return AuthorsEvalResult(
        evaluated=int(total[0]),
        count=int(total[1]),
        exact=int(total[2]),
        valid=int(total[3]),
        token_fraction_sum=float(total[4]),
        steps_sum=int(total[5]),
        calls_sum=int(total[6]),
        batches=int(total[7]),
        checked=validator is not None,
    )


def block_generator(seed: int, block: int) -> torch.Generator:
    """The exploration draws of block ``block``: a CPU generator seeded by ``(seed, block)``."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, int(block)]).generate_state(1)[0]))


def _batch(
    model: LoopedModel,
    dataset: TokenDataset,
    index: np.ndarray,
    cfg: LoopConfig,
    calls: int,
    exploration: float,
    g: torch.Generator,
    dev: torch.device,
    validator: Task | None,
) -> np.ndarray:
    """One batch of ``_eval``; returns its sums (the order of ``sums`` in the caller)."""
    inputs, labels, puzzle_ids = batch_tensors(dataset, index, dev)
    B = len(index)
    fresh = model.init_state(model.embed(inputs, puzzle_ids))  # the reset state (TRM: its fixed buffers)
    state = fresh
    halted = torch.ones(B, dtype=torch.bool)  # initial_carry: every sample halted
    steps = torch.zeros(B, dtype=torch.long)
    made = 0
    for _ in range(calls):
        # TRMDEQ.forward: halted samples restart (fresh state, step count 0) on the same puzzle
        state = torch.where(halted.to(dev).view(-1, *([1] * (state.ndim - 1))), fresh, state)
        steps = torch.where(halted, torch.zeros_like(steps), steps) + 1
        out = model(inputs, loop=cfg, state=state, puzzle_ids=puzzle_ids)
        check_output(out, f"authors' evaluation rows {index[0]}..{index[-1] + 1}")
        if out.q_logits is None:
            raise ValueError(
                f"eval.protocol authors_trm_deq halts on the Q head; {type(model).__name__} returned no q_logits"
            )
        state, made = out.state, made + 1
        q = out.q_logits.detach().float().reshape(B).cpu()
        explore = torch.rand(B, generator=g) < exploration
        minimum = torch.randint(2, calls + 1, (B,), generator=g)
        min_halt = torch.where(explore, minimum, torch.zeros_like(minimum))
        halted = ((steps >= calls) | (q > 0)) & (steps >= min_halt)
        if bool(halted.all()):
            break
    pred = out.logits.argmax(dim=-1).cpu().numpy()
    x, y = dataset.inputs[index], dataset.labels[index]
    exact, valid, right, count = score_predictions(validator, x, y, pred)
    counted = halted.numpy() & (count > 0)
    fraction = np.where(count > 0, right / np.maximum(count, 1), 0.0)
    return np.array(
        [
            B,
            counted.sum(),
            (counted & exact).sum(),
            (counted & valid).sum(),
            fraction[counted].sum(),
            steps.numpy()[counted].sum(),
            made,
            1,
        ],
        dtype=np.float64,
    )


__all__ = ["PROTOCOLS", "AuthorsEvalResult", "block_generator", "evaluate_authors_trm_deq"]
