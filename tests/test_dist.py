"""Multi-process training (loopformer.train.dist + the trainer under DDP / FSDP2), on CPU with gloo.

The spawned tests follow OLMo-core's pattern (distributed tests on CPU): world size 2 on 127.0.0.1 with a
free port, assertions inside each rank, the process group destroyed in ``finally``, a 2-minute
limit. The oracle is always a single process: the parent runs the same config in one process
and the ranks compare against it (loss and gradients of a step on the concatenated batch,
weights after several steps, a resumed run).

Tolerances (float32): gradients and losses agree to rtol 1e-5 / atol 1e-7 (DDP averages the two
ranks' mean gradients; one process sums in another order); weights after a few AdamW steps to
atol 2e-6. Weights are bit-identical across ranks.

Run time on the loaded 2-core machine: the DDP + FSDP equivalence test ~32 s (default run); the
deep-supervision resume test and the torchrun test ~30 s each (marked slow: ``pytest -m slow``).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from test_train_utils import TinyLooped, tiny_config, tiny_dataset
from torch import Tensor

from loopformer.loop import make_sampler
from loopformer.runs.checkpoint import step_dirs, stored_weights
from loopformer.train import Trainer, dist

REPO = Path(__file__).resolve().parent.parent
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-7}
WEIGHT_ATOL = 2e-6


class TinyDet(TinyLooped):
    """TinyLooped with a deterministic initial state (init noise is drawn per rank, see the trainer)."""

    def init_state(self, ctx: tuple[Tensor, ...], generator: torch.Generator | None = None) -> Tensor:
        return 0.1 * torch.tanh(ctx[0])


# --------------------------------------------------------------------------------------------
# spawning
# --------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    tdist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        fn(rank, world, *args)
    finally:
        tdist.destroy_process_group()


def run_ranks(fn, *args, world: int = 2, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned gloo processes; re-raise a rank's failure."""
    ctx = mp.start_processes(
        _entry, args=(world, _free_port(), fn, args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"distributed test {fn.__name__} timed out after {timeout:.0f} s")


def _gather(x: Tensor) -> list[Tensor]:
    out = [torch.empty_like(x) for _ in range(tdist.get_world_size())]
    tdist.all_gather(out, x.contiguous())
    return out


def _flat_params(model: torch.nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# --------------------------------------------------------------------------------------------
# pure helpers (no processes)
# --------------------------------------------------------------------------------------------
def test_env_from_environ_reads_torchrun_and_rejects_bad_values() -> None:
    assert dist.env_from_environ({}) == dist.DistEnv()
    env = dist.env_from_environ(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.is_main) == (
        3,
        4,
        1,
        2,
        False,
    )
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        dist.env_from_environ({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="RANK=2"):
        dist.env_from_environ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "x", "MASTER_PORT": "1"})
    with pytest.raises(ValueError, match="not an integer"):
        dist.env_from_environ({"WORLD_SIZE": "two"})


def test_shards_partition_each_global_batch() -> None:
    rows = np.arange(100, 112)
    shards = [dist.shard(rows, r, 3) for r in range(3)]
    assert np.array_equal(np.concatenate(shards), rows) and all(len(s) == 4 for s in shards)
    with pytest.raises(ValueError, match="cannot be split evenly over 5 ranks"):
        dist.shard(rows, 0, 5)
    parts = [dist.eval_shard(10, r, 4) for r in range(4)]
    assert np.array_equal(np.concatenate(parts), np.arange(10)) and {len(p) for p in parts} <= {2, 3}
    assert dist.shard(rows) is not None and len(dist.shard(rows)) == 12  # one process: everything


def test_single_process_helpers_are_identities() -> None:
    assert not dist.is_distributed() and dist.rank() == 0 and dist.world_size() == 1
    assert dist.all_reduce_mean({"a": 2.5}) == {"a": 2.5}
    t = torch.arange(4)
    assert dist.all_gather_rows(t) is t
    model = torch.nn.Linear(2, 2)
    assert dist.wrap_model(model, "ddp", torch.device("cpu")) is model
    with pytest.raises(ValueError, match="unknown train.strategy"):
        dist.wrap_model(model, "zero3", torch.device("cpu"))
    lock = dist.LockstepHalting(True)
    assert not lock.enabled and lock.drain() == 0


# --------------------------------------------------------------------------------------------
# which families leave parameters without gradient (decides DDP's find_unused_parameters)
# --------------------------------------------------------------------------------------------
SMALL = ("model.d_model=16", "model.n_heads=2", "model.n_layers=1", "model.vocab_size=8")
DEEP = ("train.mode=deep_supervision", "train.max_segments=2")

# family, training setup (the family's recipe defaults at tiny size), parameters without gradient
UNUSED_TABLE = [
    ("transformer", (), set()),
    (
        "recurrent",
        ("train.loop_sampler=poisson", "train.loop_sampler_options={mean: 3, low: 1, high: 4}"),
        set(),
    ),
    ("fprm", (*DEEP, "train.loss=stablemax", "loop_train.max_steps=3", "loop_train.grad_steps=3"), set()),
    (
        "fprm",
        (*DEEP, "loop_train.max_steps=3", "loop_train.grad_steps=3", "train.q_loss_weight=0"),
        {"q_linear.weight", "q_linear.bias"},
    ),
    ("attractor", ("loop_train.max_steps=5",), set()),
    ("ut_act", ("loop_train.max_steps=4",), set()),
    ("trm", (*DEEP, "train.halt_on_q=true", "model.n_inner=2"), set()),
    ("trm", (*DEEP, "model.n_inner=2", "model.learned_init=true"), {"y_init", "z_init"}),
    ("trm", ("model.n_inner=2", "model.learned_init=true"), {"y_init", "z_init"}),  # simple mode, truncated
    ("trm", ("model.n_inner=2", "model.learned_init=true", "loop_train.grad=bptt"), set()),
    ("hrm", (*DEEP, "train.halt_on_q=true"), set()),
    ("hrm", (*DEEP, "model.learned_init=true"), {"h_init", "l_init"}),
]


@pytest.mark.parametrize(
    ("family", "overrides", "unused"),
    UNUSED_TABLE,
    ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(UNUSED_TABLE)],
)
def test_unused_parameters_per_family(tmp_path, family: str, overrides: tuple, unused: set) -> None:
    cfg = tiny_config(tmp_path, f"model.name={family}", *SMALL, *overrides)
    tr = Trainer(cfg, train_data=tiny_dataset(8), eval_data=None)
    before = [p.detach().clone() for p in tr.model.parameters()]
    found = set(tr.probe_unused_parameters())
    assert found == unused, f"{family} {overrides}: unused {sorted(found)}"
    assert all(p.grad is None for p in tr.model.parameters())  # the probe leaves no gradient behind
    assert all(torch.equal(a, p) for a, p in zip(before, tr.model.parameters(), strict=True))


# --------------------------------------------------------------------------------------------
# 2 ranks against 1 process: simple mode (DDP and FSDP2), lockstep loop counts and halting
# --------------------------------------------------------------------------------------------
SIMPLE = (
    "train.loop_sampler=poisson",
    "train.loop_sampler_options={mean: 3, low: 1, high: 5}",
    "train.grad_clip=0",
    "train.steps=3",
    "train.batch_size=8",
    "data.eval_size=0",
    "seed=3",
)


def _simple_trainer(out: Path, *extra: str, strategy: str | None = None) -> Trainer:
    cfg = tiny_config(out, *SIMPLE, *extra)
    if strategy is not None:
        cfg.train.strategy = strategy  # read with getattr until TrainConfig has the field
    return Trainer(
        cfg, model=TinyDet(seed=1), train_data=tiny_dataset(64), eval_data=tiny_dataset(10, seed=1)
    )


def _three_steps(tr: Trainer) -> tuple[dict, dict[str, Tensor], list[int]]:
    """(metrics of step 0, gradients of step 0, loop counts of the 3 steps)."""
    first = tr.train_step()
    grads = {n: p.grad.detach().clone() for n, p in tr.model.named_parameters()}
    tr.step += 1
    loops = [first["loops"]]
    while tr.step < 3:
        loops.append(tr.train_step()["loops"])
        tr.step += 1
    return first, grads, loops


def _simple_ranks(rank: int, world: int, tmp: str, ref: str) -> None:
    tmp_path = Path(tmp)
    expected = load_file(ref)
    # DDP: loss and gradients of step 0 = one process on the concatenated batch; then 2 more steps
    tr = _simple_trainer(tmp_path / "ddp")
    assert isinstance(tr.forward_model, torch.nn.parallel.DistributedDataParallel)
    assert tr.strategy.find_unused_parameters is False and tr.strategy.unused_parameters == []
    first, grads, loops = _three_steps(tr)
    torch.testing.assert_close(
        torch.tensor(first["loss"], dtype=torch.float64), expected["loss"], rtol=1e-6, atol=1e-7
    )
    for name, g in grads.items():
        torch.testing.assert_close(g, expected[f"grad.{name}"], **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")
    # loop counts: every rank drew the step-seeded sampler's count, without communication
    sampler = make_sampler("poisson", mean=3, low=1, high=5, seed=3)
    assert loops == [sampler.sample(s) for s in range(3)]
    assert all(torch.equal(x, torch.tensor(loops)) for x in _gather(torch.tensor(loops)))
    # weights: bit-identical on the ranks, and equal to the single-process run
    flat = _flat_params(tr.model)
    assert all(torch.equal(x, flat) for x in _gather(flat))
    torch.testing.assert_close(flat, expected["params"], rtol=0, atol=WEIGHT_ATOL)
    # sharded evaluation sums over ranks to the single-process numbers (with and without lockstep)
    ev = tr.score(tr.eval_data)
    assert ev["n"] == 10 and ev["token_acc"] == pytest.approx(float(expected["eval_token_acc"]), abs=1e-12)
    tr.strategy.sync_halting = True
    assert tr.score(tr.eval_data) == ev

    # lockstep halting: rank 0 loops 2 times, rank 1 five times; both end on 5
    lock = dist.LockstepHalting(True)
    for t in range(2 if rank == 0 else 5):
        lock.callback(t + 1, torch.zeros(1), torch.zeros(1))
    assert lock.drain() == 5 and lock.local_steps == (2 if rank == 0 else 5)

    # a loss that leaves the Q head without gradient switches find_unused_parameters on
    tr_q = _simple_trainer(tmp_path / "noq", "train.q_loss_weight=0")
    assert tr_q.strategy.find_unused_parameters is True and tr_q.strategy.unused_parameters == [
        "q.weight",
        "q.bias",
    ]
    for _ in range(2):  # DDP would raise on the second step without find_unused_parameters
        tr_q.train_step()
        tr_q.step += 1

    # FSDP2 (fully_shard on a CPU device mesh): same step-0 gradients and final weights
    tr_f = _simple_trainer(tmp_path / "fsdp", strategy="fsdp")
    assert dist.is_fsdp(tr_f.model)
    first_f, _, _ = _three_steps(tr_f)
    torch.testing.assert_close(
        torch.tensor(first_f["loss"], dtype=torch.float64), expected["loss"], rtol=1e-6, atol=1e-7
    )
    full = torch.cat([dist.full_tensor(p.detach()).reshape(-1) for p in tr_f.model.parameters()])
    torch.testing.assert_close(full, expected["params"], rtol=0, atol=WEIGHT_ATOL)
    tr_f.save()  # every rank writes its shards (train.checkpoint_format=auto: sharded under FSDP)
    if rank == 0:
        saved = stored_weights(tr_f.last_checkpoint)[0]
        torch.testing.assert_close(
            torch.cat([saved[n].reshape(-1) for n, _ in tr.model.named_parameters()]),
            expected["params"],
            rtol=0,
            atol=WEIGHT_ATOL,
        )
    tdist.barrier()


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_two_ranks_match_one_process_ddp_and_fsdp(tmp_path) -> None:
    one = _simple_trainer(tmp_path / "one")
    first, grads, _ = _three_steps(one)
    ref = {
        "loss": torch.tensor(first["loss"], dtype=torch.float64),
        "params": _flat_params(one.model),
        "eval_token_acc": torch.tensor(one.score(one.eval_data)["token_acc"], dtype=torch.float64),
        **{f"grad.{n}": g for n, g in grads.items()},
    }
    save_file(ref, str(tmp_path / "ref.safetensors"))
    run_ranks(_simple_ranks, str(tmp_path), str(tmp_path / "ref.safetensors"))


# --------------------------------------------------------------------------------------------
# deep supervision: checkpoint written once, resumable under 2 ranks and under another world size
# --------------------------------------------------------------------------------------------
DEEP_RUN = (
    "train.mode=deep_supervision",
    "train.max_segments=2",
    "train.halt_on_q=true",
    "train.halt_exploration=0.5",
    "train.ema=0.9",
    "train.grad_clip=0",
    "train.batch_size=8",
    "train.checkpoint_every=2",
    "data.eval_size=0",
    "seed=4",
)


def _deep_trainer(out: Path, *extra: str) -> Trainer:
    return Trainer(
        tiny_config(out, *DEEP_RUN, *extra),
        model=TinyDet(seed=2),
        train_data=tiny_dataset(48),
        eval_data=None,
    )


def _deep_ranks(rank: int, world: int, tmp: str, ref: str) -> None:
    import loopformer.train.trainer as trainer_module

    run = Path(tmp) / "dist"
    expected = load_file(ref)
    writes = []
    real_save = trainer_module.save_checkpoint
    trainer_module.save_checkpoint = lambda *a, **k: writes.append(a[1]) or real_save(*a, **k)
    try:
        first = _deep_trainer(run, "train.steps=2")
        first.fit()
        # each rank holds its half of the carry: the single-process carry's slots, in rank order
        torch.testing.assert_close(first.carry.index, dist.shard(expected["carry_index_2"]))
        resumed = _deep_trainer(run, "train.steps=4", "train.resume=true")
        assert resumed.step == 2 and len(resumed.carry.index) == 4
        resumed.fit()
    finally:
        trainer_module.save_checkpoint = real_save
    # only rank 0 wrote (steps 2 and 4), every rank agrees on the folder
    assert writes == ([2, 4] if rank == 0 else [])
    assert first.last_checkpoint == run / "checkpoints" / "step_00000002"
    flat = _flat_params(resumed.model)
    assert all(torch.equal(x, flat) for x in _gather(flat))
    torch.testing.assert_close(flat, expected["params_4"], rtol=0, atol=WEIGHT_ATOL)
    if rank == 0:
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in lines if "loss" in m] == [1, 2, 3, 4]  # one line per step, not per rank


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_deep_supervision_checkpoint_once_and_resume_across_world_sizes(tmp_path) -> None:
    full = _deep_trainer(tmp_path / "full", "train.steps=4")
    full.fit()
    carry_2 = load_file(str(full.ckpt_dir / "step_00000002" / "state.safetensors"))
    index_key = next(k for k in carry_2 if k.endswith("carry.index"))
    ref = {"params_4": _flat_params(full.model), "carry_index_2": carry_2[index_key]}
    save_file(ref, str(tmp_path / "ref.safetensors"))
    run_ranks(_deep_ranks, str(tmp_path), str(tmp_path / "ref.safetensors"))
    # world size 2 -> 1: resume the 2-rank step-2 checkpoint in one process
    two = tmp_path / "dist" / "checkpoints" / "step_00000002"
    one = _deep_trainer(tmp_path / "one", "train.steps=4", f"train.resume={two}")
    assert one.step == 2 and len(one.carry.index) == 8
    torch.testing.assert_close(one.carry.index, ref["carry_index_2"])
    one.fit()
    torch.testing.assert_close(_flat_params(one.model), ref["params_4"], rtol=0, atol=WEIGHT_ATOL)


# --------------------------------------------------------------------------------------------
# the command line under torchrun
# --------------------------------------------------------------------------------------------
@pytest.mark.dist
@pytest.mark.timeout(240)
def test_torchrun_trains_the_tiny_recipe(tmp_path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "loopformer",
        "train",
        str(REPO / "recipes" / "tiny_dist.yaml"),
        f"out_dir={out}",
        "train.threads=1",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "loss" in m] == [1, 2, 3, 4]
    assert [d.name for d in step_dirs(out / "checkpoints")] == ["step_00000002", "step_00000004"]
    state = json.loads((out / "checkpoints" / "step_00000004" / "state.json").read_text())
    assert state["step"] == 4 and state["stream"]["position"] > 0
    weights = load_file(str(out / "checkpoints" / "step_00000004" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert any("eval_exact_acc" in m for m in lines)  # the sharded evaluation reached rank 0's log


# --------------------------------------------------------------------------------------------
# SIGTERM under torchrun (issue 33)
# --------------------------------------------------------------------------------------------
def _signal_ranks(rank: int, world: int, tmp: str) -> None:
    """Rank 1 alone receives SIGTERM before step 3 (a scheduler's signal reaches the ranks at different
    times); the flag travels in the step's all-reduce, so both ranks stop after the same step, write its
    checkpoint together and raise TrainingInterrupted; the run resumes from it."""
    import signal

    from loopformer.train.stop import TrainingInterrupted

    run = Path(tmp) / "sig"
    tr = _deep_trainer(run, "train.steps=50", "train.checkpoint_every=0", "train.log_every=4")
    original = tr.train_step

    def train_step():
        if rank == 1 and tr.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return original()

    tr.train_step = train_step
    with pytest.raises(TrainingInterrupted) as stopped:
        tr.fit()
    assert stopped.value.step == 5  # the flag of step 4's all-reduce, read one step later by every rank
    assert (
        stopped.value.signum == signal.SIGTERM
        and stopped.value.checkpoint == run / "checkpoints" / "step_00000005"
    )
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    tdist.barrier()
    assert [p.name for p in step_dirs(run / "checkpoints")] == ["step_00000005"]
    resumed = _deep_trainer(run, "train.steps=6", "train.resume=true")
    assert resumed.step == 5
    resumed.fit()
    assert resumed.step == 6


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigterm_under_torchrun_checkpoints_every_rank_at_the_same_step(tmp_path) -> None:
    run_ranks(_signal_ranks, str(tmp_path))
