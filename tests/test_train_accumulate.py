"""Gradient accumulation (``train.grad_accum_steps``, loopformer/train/accumulate.py) equals the full-batch step.

Oracle: the same run without accumulation. In float64 (the default dtype while the trainers are
built, so weights, states, EMA and optimiser moments are float64) every training mode takes three
optimiser steps with ``grad_accum_steps=4`` and with 1; after each step the loss, every gradient
(as clipped), the parameters after the optimiser step, the EMA, the mode's carried state (deep
supervision slots: states, segment counts, halted flags, examples; the carried solver state), the
data stream and the global RNG state agree to 1e-10. A spy on the model's forward shows the
accumulated run really ran 4 forwards of a quarter of the rows per step.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_train_utils import TinyLooped, tiny_config, tiny_dataset

from loopformer.config import ConfigError
from loopformer.tasks.base import TokenDataset
from loopformer.train import Trainer
from loopformer.train.setup import AccumulationError, micro_steps

TOL = {"rtol": 1e-10, "atol": 1e-10}
K = 4
SMALL = ("model.d_model=16", "model.n_heads=2", "model.n_layers=1", "model.vocab_size=8")
DAMPED = ("loop_train={solver: damped, halting: fixed, max_steps: 3, tol: 1.0e-9, damped: {patience: 1, gamma: 0.5}, "
          "residual_norm: rel_sup, grad: truncated, grad_steps: 3}")  # fmt: skip
DEEP = ("train.mode=deep_supervision", "train.max_segments=2")
GROUPED = ("loop_train={solver: anderson, halting: batch_residual, halt_group: 2, tol: 0.3, max_steps: 8, "
           "grad: truncated, grad_steps: 2}")  # fmt: skip
ATTRACTOR_GROUPED = ("loop_train={solver: anderson_attractor, halting: batch_residual, halt_group: 2, tol: 1.0e-3, "
                     "min_steps: 2, max_steps: 8, grad: neumann, grad_steps: 1}")  # fmt: skip

# (model: "tiny" = TinyLooped, else a family name; overrides)
MODES: dict[str, tuple[str, tuple[str, ...]]] = {
    # simple: a fresh batch, a step-seeded loop count; random initial states from the step's generator,
    # the Hutchinson Jacobian penalty (its probes drawn for the whole batch), EMA
    "simple_sampler_jacobian": ("tiny", ("train.loop_sampler=poisson", "train.loop_sampler_options={mean: 3, low: 1, high: 4}",
                                         "train.jacobian_weight=0.3", "train.ema=0.9")),
    # simple, the loop as configured: per-sample residual halting (compaction), Anderson, truncated gradient
    "simple_per_sample_halting": ("tiny", ("train.loop_sampler=none", "loop_train={solver: anderson, halting: residual, "
                                           "tol: 0.05, max_steps: 8, grad: truncated, grad_steps: 2}")),
    # implicit gradient (IFT adjoint solved per sample) on a solve to tolerance
    "simple_implicit_ift": ("tiny", ("train.loop_sampler=none", "loop_train={solver: anderson, halting: residual, "
                                     "tol: 1.0e-3, max_steps: 12, grad: ift}")),
    # ACT (learned per-sample halting, ponder cost): the universal transformer
    "simple_act": ("ut_act", ("loop_train.max_steps=4",)),
    # the Attractor's own training loop (its solver and gradient mode)
    "simple_attractor": ("attractor", ("train.loop_sampler=none", "loop_train.max_steps=5")),
    # batch-wide halting per group of rows (loop_train.halt_group = the micro-batch: the Attractor LM's
    # solver stops on its 32-sequence micro-batch): the engine's Anderson, and the Attractor LM's own loop
    "simple_batch_halting_groups": ("tiny", ("train.loop_sampler=none", GROUPED)),
    "simple_attractor_halting_groups": ("attractor", ("train.loop_sampler=none", ATTRACTOR_GROUPED)),
    # deep supervision: TRM's Q halting with exploration, refill of halted slots; AdamATan2, sign-SGD puzzle rows
    "deep_trm_q_halting": ("trm", (*DEEP, "train.halt_on_q=true", "train.halt_exploration=0.5", "model.n_inner=2",
                                   "train.optimizer=adam_atan2", "train.puzzle_emb_optimizer=sign_sgd",
                                   "model.num_puzzle_ids=4", "model.puzzle_emb_len=2", "model.puzzle_emb_dim=16",
                                   "train.ema=0.9")),
    # deep supervision: HRM's Q-learning (a no-grad target segment per micro-batch)
    "deep_hrm_q_learning": ("hrm", (*DEEP, "train.halt_on_q=true", "train.q_learning=true")),
    # deep supervision: FPRM's carried damped-solver state, halting on convergence / stall, stablemax
    "deep_fprm_solver_carry": ("tiny", (*DEEP, "train.max_segments=3", DAMPED, "train.carry_solver_state=true",
                                        "train.halt_on_converged=true", "train.loss=stablemax")),
    # deep supervision with the FPRM family and its puzzle table
    "deep_fprm_family": ("fprm", (*DEEP, "train.halt_on_converged=true", "train.loss=stablemax", "loop_train.max_steps=3",
                                  "loop_train.grad_steps=2", "model.num_puzzle_ids=4", "model.puzzle_emb_len=2")),
}  # fmt: skip


@pytest.fixture
def float64() -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _data(n: int, seed: int = 0) -> TokenDataset:
    d = tiny_dataset(n, seed)
    return TokenDataset(d.inputs, d.labels, d.difficulty, puzzle_ids=np.arange(n) % 4)


def _trainer(out: Path, model: str, overrides: tuple[str, ...], k: int) -> Trainer:
    extra = () if model == "tiny" else (f"model.name={model}", *SMALL)
    cfg = tiny_config(out, *extra, "train.lr=0.001", "train.batch_size=8", "data.eval_size=0", "seed=5",
                      *overrides, f"train.grad_accum_steps={k}")  # fmt: skip
    torch.manual_seed(0)  # the same initial weights for both runs
    return Trainer(
        cfg, model=TinyLooped(seed=0) if model == "tiny" else None, train_data=_data(64), eval_data=None
    )


def _spy(tr: Trainer) -> list[int]:
    rows: list[int] = []
    forward = tr.forward_model

    def spy(inputs: torch.Tensor, **kw: Any) -> Any:
        rows.append(int(inputs.shape[0]))
        return forward(inputs, **kw)

    tr.forward_model = spy  # type: ignore[assignment]
    return rows


def _flat(value: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor (and number) inside a state dict, by path."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}{key}.").items()}
    if isinstance(value, list | tuple):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{prefix}{i}.").items()}
    if isinstance(value, torch.Tensor):
        return {prefix: value.detach().cpu()}
    if isinstance(value, int | float | np.ndarray | np.integer):
        return {prefix: torch.as_tensor(np.asarray(value))}
    return {}


def _snapshot(tr: Trainer, metrics: dict[str, Any]) -> dict[str, torch.Tensor]:
    snap = {f"metric.{k}": torch.tensor(float(v)) for k, v in metrics.items()
            if k in ("loss", "task_loss", "q_loss", "q_continue_loss", "ponder", "jacobian", "token_acc",
                     "exact_acc", "grad_norm", "state_norm", "loop_steps", "segments", "halted", "loops")}  # fmt: skip
    for name, p in tr.model.named_parameters():
        snap[f"param.{name}"] = p.detach().clone()
        if p.grad is not None:
            snap[f"grad.{name}"] = p.grad.detach().clone()
    snap.update({f"carry.{k}": v for k, v in _flat(tr.mode.state_dict()).items()})
    snap.update({f"ema.{k}": v for k, v in _flat(tr.ema.state_dict() if tr.ema else {}).items()})
    snap.update({f"optim.{k}": v for k, v in _flat(tr.optimizer.state_dict()["state"]).items()})
    snap.update({f"stream.{k}": v for k, v in _flat(tr.stream.state_dict()).items()})
    snap["rng"] = torch.get_rng_state()
    return snap


@pytest.mark.parametrize("mode", list(MODES))
def test_accumulated_step_equals_the_full_batch_step_in_float64(tmp_path, float64, mode: str) -> None:
    model, overrides = MODES[mode]
    full = _trainer(tmp_path / "full", model, overrides, 1)
    acc = _trainer(tmp_path / "acc", model, overrides, K)
    assert full.accum_steps == 1 and acc.accum_steps == K
    assert next(full.model.parameters()).dtype == torch.float64
    rows = _spy(acc)
    for step in range(3):
        a, b = _snapshot(full, full.train_step()), _snapshot(acc, acc.train_step())
        full.step += 1
        acc.step += 1
        assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
        assert any(k.startswith("grad.") for k in a) and (
            not mode.startswith("deep") or any(k.startswith("carry.") for k in a)
        )
        for key, x in a.items():
            y = b[key]
            assert x.shape == y.shape, key
            if x.is_floating_point():
                torch.testing.assert_close(
                    y, x, **TOL, equal_nan=True, msg=lambda m, k=key, s=step: f"step {s} {k}: {m}"
                )
            else:
                assert torch.equal(x, y), f"step {step} {key}"
    assert rows == [8 // K] * (3 * K)  # K forwards of a quarter of the rows per step


def test_micro_batch_size_is_the_other_way_to_say_it() -> None:
    cfg = tiny_config(Path("unused"), "train.batch_size=16", "train.micro_batch_size=2")
    assert micro_steps(cfg.train) == 8 and micro_steps(cfg.train, world_size=2) == 4
    cfg = tiny_config(
        Path("unused"), "train.batch_size=16", "train.micro_batch_size=2", "train.grad_accum_steps=4"
    )
    assert micro_steps(cfg.train, world_size=2) == 4
    with pytest.raises(ConfigError, match="disagree"):
        micro_steps(cfg.train, world_size=1)
    cfg = tiny_config(Path("unused"), "train.batch_size=12", "train.grad_accum_steps=4")
    with pytest.raises(ConfigError, match="does not divide the 6 rows per rank"):
        micro_steps(cfg.train, world_size=2)


def test_config_rejects_accumulation_that_does_not_divide_the_batch(tmp_path) -> None:
    from loopformer.config import validate

    with pytest.raises(ConfigError, match=r"grad_accum_steps=3 does not divide train.batch_size=8"):
        validate(tiny_config(tmp_path, "train.grad_accum_steps=3"))
    with pytest.raises(ConfigError, match=r"grad_accum_steps must be >= 1"):
        validate(tiny_config(tmp_path, "train.grad_accum_steps=0"))


def test_batch_wide_halting_is_refused_with_the_reason(tmp_path) -> None:
    over = (
        "train.loop_sampler=none",
        "loop_train={solver: anderson, halting: batch_residual, tol: 0.05, max_steps: 6}",
    )
    with pytest.raises(AccumulationError, match="batch-wide.*largest residual of the whole batch"):
        _trainer(tmp_path / "a", "tiny", over, 2)
    assert _trainer(tmp_path / "b", "tiny", over, 1).accum_steps == 1  # without accumulation it runs
    # groups that a micro-batch would split are refused too; groups inside micro-batches are exact (above)
    with pytest.raises(AccumulationError, match="halt_group=4 rows.*micro-batches of 2 rows"):
        _trainer(tmp_path / "c", "tiny", (over[0], over[1][:-1] + ", halt_group: 4}"), 4)
    assert _trainer(tmp_path / "d", "tiny", (over[0], over[1][:-1] + ", halt_group: 2}"), 4).accum_steps == 4


@pytest.mark.parametrize("mode", ["simple_batch_halting_groups", "simple_attractor_halting_groups"])
def test_halting_groups_change_the_step(tmp_path, float64, mode: str) -> None:
    """The grouped modes above are not the ungrouped step in disguise: the groups stop at other steps."""
    model, overrides = MODES[mode]
    grouped = _trainer(tmp_path / "g", model, overrides, 1)
    ungrouped = (overrides[0], overrides[1].replace("halt_group: 2", "halt_group: 0"))
    whole = _trainer(tmp_path / "w", model, ungrouped, 1)
    loops = [tr.train_step()["loop_steps"] for tr in (grouped, whole)]
    assert loops[0] < loops[1]  # without groups every row waits for the slowest row of the batch
    a, b = _snapshot(grouped, {}), _snapshot(whole, {})
    assert any(not torch.equal(a[k], b[k]) for k in a if k.startswith("grad."))
