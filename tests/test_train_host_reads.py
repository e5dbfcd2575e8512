"""Issue 33: a training step reads nothing back from the device. Between two logged records a step of every
paper recipe family and training mode (and of the CPU recipes) makes no host read (``HostReads``: scalar reads,
``nonzero`` and other data-dependent ops, ``tolist`` / ``numpy`` / ``cpu``); the logged step makes exactly one.
The logged averages, the divergence check (decided on the device, the failed update skipped) and a resume keep
their meaning."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from test_train_utils import TinyLooped, tiny_config, tiny_dataset

from loopformer.devices import HostReads
from loopformer.train import Trainer, TrainingDivergedError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.paper_small import CPU_RECIPES, FAMILIES, VARIANTS, small_trainer, steady_state_reads

SLOW = {"attractor_puzzle", "fprm+accumulation", "trm+accumulation", "lm_attractor+accumulation"}  # > ~10 s each on the loaded machine


def _cases() -> list:
    names = [*CPU_RECIPES, *FAMILIES, *VARIANTS]
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in names]


@pytest.mark.parametrize("name", _cases())
def test_a_training_step_reads_nothing_from_the_device(name: str, tmp_path: Path) -> None:
    tr = small_trainer(name, tmp_path / "run")
    try:
        per_step, counts = steady_state_reads(tr, warmup=2, steps=2)
    finally:
        tr.folder.close()
    assert per_step == 0, f"{name}: {per_step} host reads per step {counts}"


def test_the_counter_sees_a_host_read_added_to_the_step(tmp_path: Path) -> None:
    """The guard above fails when someone adds ``float(loss)`` (or ``.item()`` / ``nonzero``) to the step."""
    tr = small_trainer("sudoku4_trm", tmp_path / "run")
    original = tr.train_step

    def with_a_read():
        metrics = original()
        float(metrics.raw["loss"])  # the kind of line this test guards against
        torch.nonzero(tr.carry.halted)
        return metrics

    tr.train_step = with_a_read
    try:
        per_step, counts = steady_state_reads(tr, warmup=1, steps=2)
    finally:
        tr.folder.close()
    assert per_step == 2 and counts == {"_local_scalar_dense": 2, "nonzero": 2}


def _steps(tr: Trainer, n: int) -> None:
    for _ in range(n):
        metrics = tr.train_step()
        tr.step += 1
        tr._after_step(metrics)


def test_one_host_read_per_logged_step(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "train.mode=deep_supervision", "train.max_segments=3", "train.log_every=4",
                      "train.steps=100")  # fmt: skip
    tr = Trainer(cfg, model=TinyLooped(), train_data=tiny_dataset(64), eval_data=None)
    tr.log.open(tr.config, False, 0, tr.device)
    _steps(tr, 2)
    with HostReads() as reads:
        _steps(tr, 6)  # steps 3..8: logged at 4 and 8
    tr.folder.close()
    assert reads.total == 2 and reads.counts == {"Tensor.tolist": 2}


def _records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_a_logged_record_is_the_mean_of_its_steps(tmp_path: Path) -> None:
    common = ("train.mode=deep_supervision", "train.max_segments=3", "train.steps=8", "data.eval_size=0")
    every = {}
    for log_every in (1, 4):
        tr = Trainer(tiny_config(tmp_path / str(log_every), *common, f"train.log_every={log_every}"),
                     model=TinyLooped(), train_data=tiny_dataset(64), eval_data=None)  # fmt: skip
        tr.fit()
        every[log_every] = {r["step"]: r for r in _records(tmp_path / str(log_every)) if "loss" in r}
    assert sorted(every[4]) == [4, 8]
    for end in (4, 8):
        steps = range(end - 3, end + 1)
        for key in ("loss", "task_loss", "q_loss", "token_acc", "grad_norm", "segments", "halted"):
            mean = sum(every[1][s][key] for s in steps) / 4
            assert every[4][end][key] == pytest.approx(mean, rel=1e-12, abs=1e-12), key
        assert every[4][end]["lr"] == every[1][end]["lr"]  # a host value: the last step's


def test_divergence_is_decided_on_the_device_and_the_update_is_skipped(tmp_path: Path) -> None:
    """A non-finite loss at step 3 (0-based) with log_every 4: the step and every later one are skipped on the
    device, the read at step 4 raises naming step 3, and the weights, EMA and optimiser state are those after
    3 steps; no checkpoint of a later step is written."""
    common = ("train.steps=8", "train.log_every=4", "train.checkpoint_every=0", "train.ema=0.9")
    ref = Trainer(tiny_config(tmp_path / "ref", *common, "train.steps=3"), model=TinyLooped(),
                  train_data=tiny_dataset(64), eval_data=None)  # fmt: skip
    _steps(ref, 3)
    ref.folder.close()
    tr = Trainer(
        tiny_config(tmp_path / "run", *common),
        model=TinyLooped(),
        train_data=tiny_dataset(64),
        eval_data=None,
    )
    loss = tr.loss

    def poisoned(out, batch, *args):
        total, parts, acc = loss(out, batch, *args)
        return (total * float("inf") if tr.step == 3 else total), parts, acc

    tr.loss = poisoned
    with pytest.raises(TrainingDivergedError, match=r"at step 3: loss = (nan|inf)"):
        tr.fit()
    for (name, p), q in zip(tr.model.named_parameters(), ref.model.parameters()):
        assert torch.equal(p, q), name
    for name in ref.ema.shadow:
        assert torch.equal(tr.ema.shadow[name], ref.ema.shadow[name]), name
    for p, q in zip(tr.model.parameters(), ref.model.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(tr.optimizer.state[p][key], ref.optimizer.state[q][key])
    last = _records(tmp_path / "run")[-1]
    assert (last["step"], last["diverged"]) == (4, "loss")
    checkpoints = tmp_path / "run" / "checkpoints"
    assert not checkpoints.exists() or not list(checkpoints.iterdir())


def test_a_resumed_run_logs_the_same_averages(tmp_path: Path) -> None:
    """The metrics summed since the last logged record travel in the checkpoint (checkpoint every 3 steps,
    log every 4): the resumed run's records equal the uninterrupted run's."""
    common = ("train.steps=8", "train.log_every=4", "train.checkpoint_every=3", "train.mode=deep_supervision",
              "train.max_segments=3", "data.eval_size=0")  # fmt: skip
    full = Trainer(
        tiny_config(tmp_path / "full", *common),
        model=TinyLooped(),
        train_data=tiny_dataset(64),
        eval_data=None,
    )
    full.fit()
    killed = Trainer(tiny_config(tmp_path / "killed", *common), model=TinyLooped(), train_data=tiny_dataset(64),
                     eval_data=None)  # fmt: skip
    original = killed.train_step

    def killing():
        if killed.step == 5:
            raise KeyboardInterrupt("simulated kill")
        return original()

    killed.train_step = killing
    with pytest.raises(KeyboardInterrupt):
        killed.fit()
    resumed = Trainer(tiny_config(tmp_path / "killed", *common, "train.resume=true"), model=TinyLooped(seed=9),
                      train_data=tiny_dataset(64), eval_data=None)  # fmt: skip
    assert resumed.step == 3
    resumed.fit()

    def train_records(folder: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "time"} for r in _records(folder) if "loss" in r]

    records = train_records(tmp_path / "full")
    assert [r["step"] for r in records] == [4, 8]
    assert train_records(tmp_path / "killed") == records
