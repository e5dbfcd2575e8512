"""Deep supervision with ``train.carry_solver_state`` (FPRM, nilskiKonjIzDunava/fprm): the damped solver's
per-sample state (step size, patience, best residual) spans a slot's segments and restarts with a new
example; a slot whose step size falls below the solver's ``min_step`` halts."""

from __future__ import annotations

import torch
from test_train_utils import TinyLooped, tiny_config, tiny_dataset

from loopformer.train import Trainer
from loopformer.train.carry import carry_solver_state

DAMPED = "loop_train={solver: damped, halting: fixed, max_steps: 3, tol: 1.0e-9, damp_patience: 1}"


def _spy(tr: Trainer) -> tuple[list, list]:
    given, outs = [], []
    forward = tr.model.forward

    def spy(*args, **kw):
        given.append(kw.get("solver_state"))
        out = forward(*args, **kw)
        outs.append(out)
        return out

    tr.model.forward = spy
    return given, outs


def test_the_damped_solver_state_carries_across_segments_and_resets_with_the_slot(tmp_path) -> None:
    cfg = tiny_config(
        tmp_path,
        "train.mode=deep_supervision",
        "train.max_segments=3",
        "train.steps=5",
        "train.carry_solver_state=true",
        DAMPED,
    )
    tr = Trainer(cfg, model=TinyLooped(seed=0), train_data=tiny_dataset(64), eval_data=None)
    given, outs = _spy(tr)
    for _ in range(4):
        tr.train_step()
        tr.step += 1
    assert given[0] is None  # the first segment starts every solver fresh
    for seg in (1, 2):  # segments 2 and 3 of the same slots resume the previous segment's final state
        for key in ("eta", "best", "patience"):
            torch.testing.assert_close(given[seg][key], outs[seg - 1].loop.stats[key])
    # after max_segments every slot took a new example: its solver restarts (eta 1, best inf, patience 1)
    fresh = given[3]
    assert torch.equal(fresh["eta"], torch.ones_like(fresh["eta"]))
    assert torch.isinf(fresh["best"]).all() and (fresh["patience"] == 1).all()
    saved = tr.mode.state_dict()
    assert {"solver.eta", "solver.best", "solver.patience"} <= set(saved)


def test_without_the_option_every_segment_starts_the_solver_fresh(tmp_path) -> None:
    cfg = tiny_config(
        tmp_path, "train.mode=deep_supervision", "train.max_segments=3", "train.steps=3", DAMPED
    )
    tr = Trainer(cfg, model=TinyLooped(seed=0), train_data=tiny_dataset(64), eval_data=None)
    given, _ = _spy(tr)
    for _ in range(2):
        tr.train_step()
        tr.step += 1
    assert given == [None, None] and tr.carry.solver == {}


def test_a_slot_whose_step_size_fell_below_min_step_halts(tmp_path) -> None:
    cfg = tiny_config(
        tmp_path,
        "train.mode=deep_supervision",
        "train.max_segments=8",
        "train.steps=2",
        "train.carry_solver_state=true",
        DAMPED,
    )
    tr = Trainer(cfg, model=TinyLooped(seed=0), train_data=tiny_dataset(64), eval_data=None)
    _, outs = _spy(tr)
    tr.train_step()
    out = outs[0]
    out.loop.stats["eta"] = torch.tensor([1.0, 5e-4] + [1.0] * (len(out.loop.stats["eta"]) - 2))
    tr.carry.halted = torch.zeros_like(tr.carry.halted)
    carry_solver_state(tr.carry, out, tr.mode.solver)
    assert tr.carry.halted.tolist() == [False, True] + [False] * (len(tr.carry.halted) - 2)
