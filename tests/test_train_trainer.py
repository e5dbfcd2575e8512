"""Trainer: both modes, loop-count sampling, deep-supervision carry, divergence, bit-exact resume."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from test_train_utils import SEQ, TinyLooped, tiny_config, tiny_dataset

from loopformer.config import load_config_file
from loopformer.loop import make_sampler
from loopformer.runs.checkpoint import load_checkpoint, step_dirs
from loopformer.train import Trainer, TrainingDivergedError


def _trainer(cfg, seed: int = 0) -> Trainer:
    return Trainer(
        cfg, model=TinyLooped(seed=seed), train_data=tiny_dataset(64), eval_data=tiny_dataset(32, seed=1)
    )


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_simple_mode_learns_and_writes_the_run_folder(tmp_path) -> None:
    cfg = tiny_config(tmp_path, "train.steps=40", "train.lr=0.03", "train.batch_size=32", "train.log_every=5")
    summary = _trainer(cfg).fit()
    lines = [m for m in _metrics(tmp_path) if "loss" in m]
    assert [m["step"] for m in lines] == [5, 10, 15, 20, 25, 30, 35, 40]
    first, last = lines[0], lines[-1]
    assert last["task_loss"] < first["task_loss"] - 0.5  # the toy task is learnable
    for key in ("loss", "token_acc", "exact_acc", "loop_steps", "lr", "state_norm", "residual", "time"):
        assert key in last
    assert summary["steps"] == 40 and summary["eval"]["n"] == 32
    assert load_config_file(tmp_path / "config.yaml", check=False) == cfg
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 40


def test_simple_mode_loop_counts_follow_the_step_seeded_sampler(tmp_path) -> None:
    cfg = tiny_config(
        tmp_path,
        "train.loop_sampler=poisson",
        "train.loop_sampler_options={mean: 4, low: 2, high: 8}",
        "seed=5",
        "train.steps=8",
    )
    _trainer(cfg).fit()
    sampler = make_sampler("poisson", mean=4, low=2, high=8, seed=5)
    lines = [m for m in _metrics(tmp_path) if "loss" in m]
    expected = [sampler.sample(s) for s in range(8)]
    assert [m["loops"] for m in lines] == expected
    assert [m["loop_steps"] for m in lines] == [float(r) for r in expected]  # the engine ran R steps
    assert len(set(expected)) > 1


def test_deep_supervision_carries_states_and_replaces_halted_slots(tmp_path) -> None:
    cfg = tiny_config(tmp_path, "train.mode=deep_supervision", "train.max_segments=3", "train.steps=7")
    tr = _trainer(cfg)
    seen_index, carried = [], []
    for step in range(7):
        before = (
            None
            if tr.carry is None
            else (tr.carry.index.clone(), tr.carry.state.clone(), tr.carry.halted.clone())
        )
        metrics = tr.train_step()
        tr.step += 1
        seen_index.append(tr.carry.index.clone())
        assert metrics["segments"] == float(step % 3 + 1)
        assert metrics["halted"] == (8 if step % 3 == 2 else 0)
        if before is not None and not before[2].any():
            carried.append(before)
    # the same examples for 3 segments, then 8 new ones from the stream
    assert torch.equal(seen_index[0], seen_index[2]) and not torch.equal(seen_index[2], seen_index[3])
    assert torch.equal(seen_index[3], seen_index[5])
    # the carried state is the previous segment's output state, detached
    assert not tr.carry.state.requires_grad
    assert len(carried) >= 2


def test_deep_supervision_fresh_rows_get_init_state_and_others_keep_theirs(tmp_path) -> None:
    """As the references (TRM: ``torch.where(halted, new_batch, carry)``): every step reads the next batch
    of the stream, and a halted slot takes that batch's row at its own position with that row's fresh state."""
    cfg = tiny_config(tmp_path, "train.mode=deep_supervision", "train.max_segments=4", "train.steps=3")
    tr = _trainer(cfg)
    tr.train_step()
    tr.step += 1
    c = tr.carry
    c.halted = torch.tensor([True, False] * 4)
    old_state, old_index = c.state.clone(), c.index.clone()
    stream = copy.deepcopy(tr.stream)
    tr.mode.batch(tr.step)  # refills the halted slots
    new_rows = torch.from_numpy(stream.take(8))
    keep = ~torch.tensor([True, False] * 4)
    assert torch.equal(c.state[keep], old_state[keep]) and torch.equal(c.index[keep], old_index[keep])
    assert torch.equal(c.index[~keep], new_rows[~keep])
    assert (c.segments[~keep] == 0).all() and (c.segments[keep] == 1).all()
    inputs = torch.from_numpy(tr.train_data.inputs[new_rows.numpy()])
    fresh = tr.fresh_states(inputs, None, tr.step)
    assert torch.equal(c.state[~keep], fresh[~keep])


def test_q_head_halting_stops_slots_whose_q_logit_is_positive(tmp_path) -> None:
    cfg = tiny_config(
        tmp_path,
        "train.mode=deep_supervision",
        "train.max_segments=16",
        "train.halt_on_q=true",
        "train.halt_exploration=0.0",
        "train.lr=1e-9",
    )
    model = TinyLooped()
    with torch.no_grad():
        model.q.weight.zero_()
        model.q.bias.fill_(3.0)  # every slot says "halt"
    tr = Trainer(cfg, model=model, train_data=tiny_dataset(64), eval_data=None)
    m = tr.train_step()
    assert m["halted"] == 8
    with torch.no_grad():
        model.q.bias.fill_(-3.0)
    tr.step += 1
    assert tr.train_step()["halted"] == 0


def test_non_finite_loss_raises_naming_step_and_quantity_and_keeps_checkpoint(tmp_path) -> None:
    cfg = tiny_config(tmp_path, "train.steps=6", "train.checkpoint_every=2")
    tr = _trainer(cfg)
    original = tr.train_step

    def poisoned() -> dict:
        if tr.step == 3:
            with torch.no_grad():
                tr.model.out.bias.fill_(float("nan"))
        return original()

    tr.train_step = poisoned
    with pytest.raises(TrainingDivergedError, match=r"at step 3: loss = nan.*step_00000002"):
        tr.fit()
    assert [p.name for p in step_dirs(tmp_path / "checkpoints")] == ["step_00000002"]
    assert _metrics(tmp_path)[-1]["diverged"] == "loss"


def test_exploding_state_norm_is_divergence(tmp_path) -> None:
    cfg = tiny_config(tmp_path, "train.max_state_norm=1e-3")
    with pytest.raises(TrainingDivergedError, match="at step 0: state norm"):
        _trainer(cfg).fit()


def _run_with_kill(cfg, kill_at: int) -> None:
    tr = _trainer(cfg, seed=0)
    original = tr.train_step

    def killing() -> dict:
        if tr.step == kill_at:
            raise KeyboardInterrupt("simulated kill")
        return original()

    tr.train_step = killing
    with pytest.raises(KeyboardInterrupt):
        tr.fit()


@pytest.mark.parametrize(
    "mode_overrides",
    [
        ("train.mode=simple", "train.loop_sampler=poisson", "train.schedule=cosine"),
        (
            "train.mode=deep_supervision",
            "train.max_segments=3",
            "train.halt_on_q=true",
            "train.halt_exploration=0.5",
            "train.loss=stablemax",
            "data.curriculum.enabled=true",
            "data.curriculum.start=2",
            "data.curriculum.check_every=2",
            "data.curriculum.threshold=0.0",
        ),
    ],
    ids=["simple", "deep_supervision"],
)
def test_resume_reproduces_the_uninterrupted_run_bit_exactly(tmp_path, mode_overrides) -> None:
    common = (
        "train.steps=8",
        "train.ema=0.9",
        "train.checkpoint_every=4",
        "train.eval_every=3",
        *mode_overrides,
    )
    full_dir, killed_dir = tmp_path / "full", tmp_path / "killed"
    full = _trainer(tiny_config(full_dir, *common))
    full.fit()

    _run_with_kill(tiny_config(killed_dir, *common), kill_at=6)  # dies two steps after the step-4 checkpoint
    # a fresh process-like trainer, with a differently initialised model, resumes from the run folder
    resumed = Trainer(
        tiny_config(killed_dir, *common, "train.resume=true"),
        model=TinyLooped(seed=123),
        train_data=tiny_dataset(64),
        eval_data=tiny_dataset(32, seed=1),
    )
    assert resumed.step == 4
    summary = resumed.fit()
    assert summary["resumed_from"].endswith("step_00000004")
    for (name, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name
    for name in full.ema.shadow:
        assert torch.equal(full.ema.shadow[name], resumed.ema.shadow[name]), name
    if full.curriculum is not None:
        assert full.curriculum.level == resumed.curriculum.level > 2
    # the metric logs agree line by line (the killed run's lines past the checkpoint were dropped)
    strip = [{k: v for k, v in m.items() if k != "time"} for m in _metrics(full_dir)]
    assert strip == [{k: v for k, v in m.items() if k != "time"} for m in _metrics(killed_dir)]


def test_resume_true_without_checkpoint_starts_fresh_and_bad_path_errors(tmp_path) -> None:
    tr = _trainer(tiny_config(tmp_path, "train.resume=true"))
    assert tr.step == 0 and tr.resumed_from is None
    with pytest.raises(Exception, match="does not exist"):
        _trainer(tiny_config(tmp_path, f"train.resume={tmp_path / 'nope'}"))


def test_ema_weights_are_evaluated_and_saved(tmp_path) -> None:
    cfg = tiny_config(tmp_path, "train.ema=0.5", "train.steps=3")
    tr = _trainer(cfg)
    tr.fit()
    assert tr.last_eval["weights"] == "ema"
    ckpt = load_checkpoint(tmp_path, model=TinyLooped(seed=9), use_ema=True)
    assert ckpt.weights == "ema" and ckpt.step == 3
    for name, p in ckpt.model.named_parameters():
        assert torch.equal(p, tr.ema.shadow[name])
    with torch.no_grad():
        manual = tr.score(tr.eval_data)
    with tr.ema.applied(tr.model):
        ema_eval = tr.score(tr.eval_data)
    assert ema_eval == {k: v for k, v in tr.last_eval.items() if k != "weights"}
    assert manual["n"] == 32


def test_curriculum_restricts_training_examples_until_it_advances(tmp_path) -> None:
    cfg = tiny_config(
        tmp_path,
        "data.curriculum.enabled=true",
        "data.curriculum.start=1",
        "data.curriculum.threshold=1.01",
        "train.steps=4",
        "data.curriculum.check_every=1",
    )
    tr = _trainer(cfg)
    taken = []
    original = tr.stream.take
    tr.stream.take = lambda k: taken.append(original(k)) or taken[-1]
    tr.fit()
    rows = np.concatenate(taken)
    assert (tr.train_data.difficulty[rows] <= 1).all()  # threshold never met: level stays 1
    assert tr.curriculum.level == 1 and len(tr.curriculum.history) == 4


def test_curriculum_advances_when_threshold_met(tmp_path) -> None:
    cfg = tiny_config(
        tmp_path,
        "data.curriculum.enabled=true",
        "data.curriculum.start=1",
        "data.curriculum.threshold=0.0",
        "train.steps=2",
        "data.curriculum.check_every=1",
    )
    tr = _trainer(cfg)
    tr.fit()
    assert tr.curriculum.level == 3.0
    assert SEQ == tr.train_data.inputs.shape[1]


def test_overwrite_run_starts_over_and_resume_checks_batch_size(tmp_path) -> None:
    cfg = tiny_config(tmp_path, "train.mode=deep_supervision", "train.steps=4", "train.checkpoint_every=2")
    _trainer(cfg).fit()
    assert [p.name for p in step_dirs(tmp_path / "checkpoints")] == ["step_00000002", "step_00000004"]
    _trainer(tiny_config(tmp_path, "train.steps=1", "train.overwrite=true")).fit()  # the folder starts over
    assert [p.name for p in step_dirs(tmp_path / "checkpoints")] == ["step_00000001"]
    _trainer(
        tiny_config(tmp_path, "train.mode=deep_supervision", "train.steps=2", "train.overwrite=true")
    ).fit()
    with pytest.raises(Exception, match=r"differs .* in train.batch_size \(train.batch_size: 8 -> 4\)"):
        _trainer(
            tiny_config(
                tmp_path,
                "train.mode=deep_supervision",
                "train.steps=4",
                "train.batch_size=4",
                "train.resume=true",
            )
        )
    with pytest.raises(Exception, match="carries 8 deep-supervision slots but train.batch_size is 4"):
        _trainer(
            tiny_config(
                tmp_path,
                "train.mode=deep_supervision",
                "train.steps=4",
                "train.batch_size=4",
                "train.resume=true",
                "train.allow_config_change=true",
            )
        )
