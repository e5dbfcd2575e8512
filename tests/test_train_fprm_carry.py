"""Deep supervision with ``train.carry_solver_state`` (FPRM, nilskiKonjIzDunava/fprm): the damped
solver's per-sample state (step size, patience, best residual) spans a slot's segments and restarts
only when the slot takes a new example; with ``halt_on_converged`` a slot whose step size fell below
``min_step`` halts.

Oracle: the reference's ``FixedPointOptimizer.step`` / ``reset``
(``models/fixed_point_reasoning/model_utils.py``) written out below in float64 and run on a float64
copy of the weights each segment saw, chained across segments by its own state only."""

from __future__ import annotations

import copy

import pytest
import torch
from test_train_utils import TinyLooped, tiny_config, tiny_dataset

from loopformer.config import ConfigError
from loopformer.train import Trainer

GAMMA, PATIENCE, STEPS = 0.5, 1, 3
DAMPED = (
    f"loop_train={{solver: damped, halting: fixed, max_steps: {STEPS}, tol: 1.0e-9, "
    f"damped: {{patience: {PATIENCE}, gamma: {GAMMA}}}, residual_norm: rel_sup, grad: truncated, grad_steps: {STEPS}}}"
)


def _spy(tr: Trainer) -> list[dict]:
    """Record, for every forward call: the weights, the starting state, the solver state given and the output."""
    calls: list[dict] = []
    forward = tr.model.forward

    def spy(*args, **kw):
        record = {"weights": copy.deepcopy(tr.model.state_dict()), "state": kw["state"].detach().clone()}
        record["inputs"], record["solver"] = args[0].clone(), kw.get("solver_state")
        record["out"] = forward(*args, **kw)
        calls.append(record)
        return record["out"]

    tr.model.forward = spy
    return calls


def _fresh(b: int) -> dict[str, torch.Tensor]:  # FixedPointOptimizer.reset: stepsize 1, patience, best inf
    f64 = torch.float64
    return {"eta": torch.ones(b, dtype=f64), "best": torch.full((b,), torch.inf, dtype=f64),
            "patience": torch.full((b,), float(PATIENCE), dtype=f64)}  # fmt: skip


def _reference_segment(
    weights: dict, inputs: torch.Tensor, z: torch.Tensor, s: dict
) -> tuple[torch.Tensor, dict]:
    """``STEPS`` calls of the reference's FixedPointOptimizer.step (tol = fp_thresh 1e-9), float64."""
    model = TinyLooped().double()
    model.load_state_dict(weights)
    s = dict(s)
    with torch.no_grad():
        (x,) = model.embed(inputs)
        for _ in range(STEPS):
            fz = model.step(z, x)
            res = ((z - fz).abs().amax(-1) / (fz.abs().amax(-1) + 1e-8)).amax(-1)
            z = fz * s["eta"][:, None, None] + z * (1 - s["eta"][:, None, None])
            improved = res < s["best"]
            s["best"] = torch.where(improved, res, s["best"])
            s["patience"] = torch.where(improved, float(PATIENCE), s["patience"] - 1)
            adapt = (s["patience"] <= 0) & (res >= 1e-9)
            s["patience"] = torch.where(adapt, float(PATIENCE), s["patience"])
            s["eta"] = s["eta"] * torch.where(adapt, GAMMA, 1.0)
    return z, s


def _trainer(tmp_path, *overrides: str) -> Trainer:
    cfg = tiny_config(tmp_path, "train.mode=deep_supervision", "train.max_segments=3", DAMPED, *overrides)
    return Trainer(cfg, model=TinyLooped(seed=0), train_data=tiny_dataset(64), eval_data=None)


def _steps(tr: Trainer, n: int) -> None:
    for _ in range(n):
        tr.train_step()
        tr.step += 1


def test_the_solver_state_carries_across_segments_as_the_reference_computes(tmp_path) -> None:
    tr = _trainer(tmp_path, "train.carry_solver_state=true", "train.steps=5")
    calls = _spy(tr)
    _steps(tr, 4)  # segments 1..3 of the first examples, then segment 1 of new ones
    assert calls[0]["solver"] is None  # the first segment starts every solver fresh
    z, s = calls[0]["state"].double(), _fresh(len(calls[0]["state"]))
    reset_z, reset_s = z, s
    for seg in range(3):
        call = calls[seg]
        z, s = _reference_segment(call["weights"], call["inputs"], z, s)
        stats = call["out"].loop.stats
        torch.testing.assert_close(call["out"].state.double(), z, rtol=1e-5, atol=1e-5)
        for key in ("eta", "best", "patience"):
            torch.testing.assert_close(stats[key].double(), s[key], rtol=1e-5, atol=1e-6)
        # a solver restarted at every segment (the behaviour without the option) is another computation
        reset_z, reset_s = _reference_segment(call["weights"], call["inputs"], reset_z, _fresh(len(z)))
    assert (s["eta"] < 1).any() and not torch.equal(s["eta"], reset_s["eta"])
    assert (reset_z - z).abs().max() > 1e-3
    # after max_segments every slot took a new example: its solver restarted
    given = calls[3]["solver"]
    assert torch.equal(given["eta"], torch.ones_like(given["eta"]))
    assert torch.isinf(given["best"]).all() and (given["patience"] == PATIENCE).all()
    assert {"solver.eta", "solver.best", "solver.patience"} <= set(tr.mode.state_dict())


def test_a_halted_slot_restarts_its_solver_and_the_others_keep_theirs(tmp_path) -> None:
    tr = _trainer(tmp_path, "train.carry_solver_state=true", "train.steps=3")
    calls = _spy(tr)
    _steps(tr, 1)
    carried = {k: v.clone() for k, v in tr.carry.solver.items()}
    tr.carry.halted = torch.tensor([True, False] * 4)
    _steps(tr, 1)
    given, keep = calls[1]["solver"], torch.tensor([False, True] * 4)
    for key in ("eta", "best", "patience"):
        assert torch.equal(given[key][keep], carried[key][keep]), key
    assert (given["eta"][~keep] == 1).all() and torch.isinf(given["best"][~keep]).all()
    assert (given["patience"][~keep] == PATIENCE).all()


def test_without_the_option_every_segment_starts_the_solver_fresh(tmp_path) -> None:
    tr = _trainer(tmp_path, "train.steps=3")
    calls = _spy(tr)
    _steps(tr, 2)
    assert [c["solver"] for c in calls] == [None, None] and tr.carry.solver == {}


@pytest.mark.parametrize("halt_on_converged", [True, False])
def test_a_slot_whose_step_size_fell_below_min_step_halts(tmp_path, halt_on_converged: bool) -> None:
    tr = _trainer(
        tmp_path,
        "train.carry_solver_state=true",
        "train.max_segments=8",
        "train.steps=4",
        f"train.halt_on_converged={str(halt_on_converged).lower()}",
        "loop_train.damped.min_step=0.3",  # two decays by 0.5 (0.25) stall a sample
    )
    calls = _spy(tr)
    z, s = None, None
    for seg in range(3):
        _steps(tr, 1)
        call = calls[seg]
        if seg == 0:
            z, s = call["state"].double(), _fresh(len(call["state"]))
        z, s = _reference_segment(call["weights"], call["inputs"], z, s)
        expected = (s["eta"] < 0.3) if halt_on_converged else torch.zeros(len(z), dtype=torch.bool)
        assert tr.carry.halted.tolist() == expected.tolist(), seg
        if expected.any():
            break
    assert (s["eta"] < 0.3).any()  # the case stalls some sample within three segments


def test_resume_with_a_carried_solver_state_is_bit_exact(tmp_path) -> None:
    common = (
        "train.carry_solver_state=true",
        "train.steps=6",
        "train.checkpoint_every=3",
        "train.max_segments=4",
    )
    full = _trainer(tmp_path / "full", *common)
    full.fit()
    killed = _trainer(tmp_path / "killed", *common)
    original = killed.train_step

    def killing() -> dict:
        if killed.step == 4:  # dies one step after the step-3 checkpoint, mid-way through the slots' segments
            raise KeyboardInterrupt("simulated kill")
        return original()

    killed.train_step = killing
    with pytest.raises(KeyboardInterrupt):
        killed.fit()
    resumed = Trainer(
        tiny_config(tmp_path / "killed", "train.mode=deep_supervision", DAMPED, *common, "train.resume=true"),
        model=TinyLooped(seed=123),
        train_data=tiny_dataset(64),
        eval_data=None,
    )
    assert resumed.step == 3 and set(resumed.mode.carry.solver) == {"eta", "best", "patience"}
    assert (resumed.mode.carry.solver["eta"] < 1).any()  # a decayed step size was saved and restored
    resumed.fit()
    for (name, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name
    for key in ("eta", "best", "patience"):
        assert torch.equal(full.mode.carry.solver[key], resumed.mode.carry.solver[key]), key


def test_the_option_is_refused_where_nothing_carries(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"loop_train.solver 'picard' keeps no per-sample state.*'damped'"):
        _trainer(tmp_path / "a", "train.carry_solver_state=true", "loop_train.solver=picard")
    cfg = tiny_config(tmp_path / "b", "train.mode=simple", "train.carry_solver_state=true")
    with pytest.raises(ConfigError, match="only train.mode=deep_supervision"):
        Trainer(cfg, model=TinyLooped(seed=0), train_data=tiny_dataset(64), eval_data=None)


@pytest.mark.parametrize("group", ["a5", "s5"])
def test_the_state_tracking_paper_recipes_train_with_the_carry(tmp_path, group: str) -> None:
    from pathlib import Path

    from loopformer.config import build_config, read_recipe

    raw = read_recipe(
        Path(__file__).resolve().parents[1] / "loopformer" / "recipes" / f"groups_{group}_fprm.yaml"
    )
    overrides = ["model.d_model=16", "model.n_heads=2", "model.n_layers=1", "data.options.length=6",
                 "data.train_generate.length=6", "data.eval_generate.length=6", "data.train_size=32",
                 "data.eval_size=8", "train.batch_size=8", "train.steps=3", "train.progress=false",
                 "train.threads=1", "train.checkpoint_every=0", "eval.batch_size=8", "bf16=false", "device=cpu",
                 f"out_dir={tmp_path}"]  # fmt: skip
    tr = Trainer(build_config(raw, overrides))
    assert tr.config.train.carry_solver_state and tr.config.train.max_segments == 128
    summary = tr.fit()
    assert summary["steps"] == 3 and set(tr.carry.solver) == {"eta", "best", "patience"}
    assert summary["eval"]["n"] == 8
