"""Sharded FSDP2 checkpoints (loopformer.runs.checkpoint) on CPU with gloo: 2 ranks save, 2 and 1 resume.

The oracle of the 2 -> 2 resume is the uninterrupted 2-rank run: the resumed run's step-4 checkpoint
(weights, EMA, every optimiser tensor, param_groups), its params and its metrics lines equal the
uninterrupted run's bit for bit. 2 -> 1: one process restores exactly the full tensors of the 2-rank
step-2 checkpoint (bit for bit), continues bit-identically to a one-process resume from the same
checkpoint consolidated into the safetensors format (``loopformer consolidate``), and stays within the
float32 tolerance of tests/test_dist.py of the uninterrupted 2-rank run (FSDP's reduce-scatter sums the
ranks' gradients in another order than one process does, so no bit identity is possible there).
Also: the shard files are one per rank and no file holds a full tensor; the folder has no pickle.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
from test_dist import WEIGHT_ATOL, TinyDet, _flat_params, _gather, run_ranks
from test_train_utils import tiny_config, tiny_dataset

from loopformer.runs.checkpoint import (
    consolidate,
    is_sharded,
    load_checkpoint,
    load_training_state,
    read_full,
    verify_checkpoint,
)
from loopformer.train import Trainer, dist

pytest.importorskip("torch.distributed.checkpoint.hf_storage")

RUN = ("train.strategy=fsdp", "train.ema=0.9", "train.grad_clip=1.0", "train.batch_size=8",
       "train.checkpoint_every=2", "train.keep_checkpoints=0", "data.eval_size=0", "seed=5",
       "train.loop_sampler=poisson", "train.loop_sampler_options={mean: 3, low: 1, high: 4}")  # fmt: skip
METRICS = ("loss", "grad_norm", "lr", "loops", "token_acc", "state_norm")


def _trainer(out: Path, *extra: str) -> Trainer:
    return Trainer(tiny_config(out, *RUN, *extra), model=TinyDet(seed=3), train_data=tiny_dataset(48),
                   eval_data=None)  # fmt: skip


def _metrics(run: Path, steps: set[int]) -> list[dict]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: m[k] for k in METRICS if k in m} for m in lines if m.get("step") in steps and "loss" in m]


def _equal_tables(a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]) -> None:
    for part in ("model", "ema", "optim"):
        assert a[part].keys() == b[part].keys() and a[part], part
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), f"{part}.{k} differs"


def _ranks(rank: int, world: int, tmp: str) -> None:
    root = Path(tmp)
    full = _trainer(root / "full", "train.steps=4")
    full.fit()
    first = _trainer(root / "dist", "train.steps=2")
    first.fit()
    step2 = root / "dist" / "checkpoints" / "step_00000002"
    resumed = _trainer(root / "dist", "train.steps=4", "train.resume=true")
    assert resumed.step == 2 and resumed.resumed_from == step2
    resumed.fit()
    for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a.to_local(), b.to_local())  # this rank's shard, bit for bit
    for a, b in zip(full.optimizer.state.values(), resumed.optimizer.state.values(), strict=True):
        assert all(torch.equal(dist.full_tensor(a[k]), dist.full_tensor(b[k])) for k in a)
    flat = torch.cat([dist.full_tensor(p.detach()).reshape(-1) for p in resumed.model.parameters()])
    assert all(torch.equal(x, flat) for x in _gather(flat))
    tdist.barrier()
    if rank == 0:
        assert _metrics(root / "dist", {3, 4}) == _metrics(root / "full", {3, 4})
        names = sorted(p.name for p in step2.iterdir() if p.name.startswith("shard-"))
        assert len(names) == 2 and not (step2 / "model.safetensors").exists()
        _equal_tables(read_full(root / "full" / "checkpoints" / "step_00000004"),
                      read_full(root / "dist" / "checkpoints" / "step_00000004"))  # fmt: skip
    tdist.barrier()


@pytest.mark.slow  # ~2 min on the loaded 2-core machine (3 spawned runs + 2 in the parent): pytest -m slow
@pytest.mark.dist
@pytest.mark.timeout(900)
def test_sharded_checkpoints_resume_on_two_ranks_and_on_one_bit_identically(tmp_path) -> None:
    run_ranks(_ranks, str(tmp_path), timeout=800)
    step2 = tmp_path / "dist" / "checkpoints" / "step_00000002"
    assert is_sharded(step2) and verify_checkpoint(step2) is None
    assert not list(step2.glob("*.distcp")) and not (step2 / ".metadata").exists()  # no pickle
    state = load_training_state(step2)
    assert state["optimizer_layout"] == "dcp" and state["sharded"]["world_size"] == 2
    saved = read_full(step2)
    gate = saved["model"]["gate"]
    for shard in step2.glob("shard-*.safetensors"):  # each rank wrote its rows of every weight
        from safetensors import safe_open

        with safe_open(str(shard), framework="pt") as fh:
            assert fh.get_slice("model.gate").get_shape()[0] == gate.shape[0] // 2

    # 2 -> 1: the restored state is the 2-rank checkpoint, bit for bit
    one = _trainer(tmp_path / "one", "train.steps=4", f"train.resume={step2}")
    assert one.step == 2
    for name, p in one.model.named_parameters():
        assert torch.equal(p.detach(), saved["model"][name]), name
    for name, p in one.model.named_parameters():
        st = one.optimizer.state[p]
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), saved["optim"][f"{name}.{k}"]), f"{name}.{k}"
        assert torch.equal(one.ema.shadow[name], saved["ema"][name])
    one.fit()

    # ... and continues exactly as a one-process FSDP-layout resume from the consolidated checkpoint
    merged = consolidate(step2, tmp_path / "merged")
    assert (merged / "model.safetensors").is_file() and verify_checkpoint(merged) is None
    assert load_training_state(merged)["optimizer_layout"] == "fsdp_full"
    loaded = load_checkpoint(
        step2, model=TinyDet(seed=0)
    ).model  # eval / solve / push read a sharded checkpoint directly
    assert all(torch.equal(p, saved["model"][n]) for n, p in loaded.named_parameters())
    two = _trainer(
        tmp_path / "two", "train.steps=4", f"train.resume={merged}", "train.checkpoint_format=full"
    )
    two.fit()
    assert torch.equal(_flat_params(one.model), _flat_params(two.model))
    assert _metrics(tmp_path / "one", {3, 4}) == _metrics(tmp_path / "two", {3, 4})

    # ... and within the float32 tolerance of the uninterrupted 2-rank run
    ref = read_full(tmp_path / "full" / "checkpoints" / "step_00000004")["model"]
    torch.testing.assert_close(
        _flat_params(one.model), torch.cat([ref[n].reshape(-1) for n, _ in one.model.named_parameters()]),
        rtol=0, atol=WEIGHT_ATOL,
    )  # fmt: skip
