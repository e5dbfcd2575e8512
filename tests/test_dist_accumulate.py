"""Gradient accumulation under torchrun (gloo, 2 ranks on CPU; tests/test_dist.py's conventions).

Oracle: one process on the full batch without accumulation, in float64. Two ranks with
``train.grad_accum_steps=2`` (each rank's 4 rows as 2 micro-batches of 2), deep supervision with
TRM's Q halting and exploration (the carry refills halted slots between steps):

- DDP: the loss, every gradient, the weights after each step and the global carry equal the
  single process's to 1e-10; a counting comm hook shows the gradient all-reduce runs as often
  per step as without accumulation (the inner micro-step runs in ``no_sync()``);
- FSDP2: the weights and the carry equal the single process's; ``set_requires_gradient_sync``
  is switched off for the inner micro-step and back on for the last, every step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
from safetensors.torch import load_file, save_file
from test_dist import TinyDet, run_ranks
from test_train_utils import tiny_config, tiny_dataset

from loopformer.train import Trainer, dist

TOL = {"rtol": 1e-10, "atol": 1e-10}
STEPS = 2
RUN = ("train.mode=deep_supervision", "train.max_segments=2", "train.halt_on_q=true", "train.halt_exploration=0.5",
       "train.batch_size=8", "train.lr=0.001", "data.eval_size=0", "seed=4", "train.ema=0.9")  # fmt: skip


def _trainer(out: Path, *extra: str) -> Trainer:
    torch.set_default_dtype(torch.float64)
    return Trainer(
        tiny_config(out, *RUN, *extra), model=TinyDet(seed=3), train_data=tiny_dataset(48), eval_data=None
    )


def _record(tr: Trainer, rec: dict[str, torch.Tensor], step: int, metrics: dict) -> None:
    rec[f"{step}.loss"] = torch.tensor(metrics["loss"], dtype=torch.float64)
    for name, p in tr.model.named_parameters():
        rec[f"{step}.param.{name}"] = dist.full_tensor(p.detach()).clone()
        if p.grad is not None:
            rec[f"{step}.grad.{name}"] = dist.full_tensor(p.grad.detach()).clone()
    for k, v in tr.mode.state_dict().items():
        if isinstance(v, torch.Tensor):
            rec[f"{step}.carry.{k}"] = v.detach().clone().to(torch.float64)


def _run(tr: Trainer) -> dict[str, torch.Tensor]:
    rec: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        _record(tr, rec, step, tr.train_step())
        tr.step += 1
    return rec


def _compare(got: dict, expected: dict, what: str, keys: tuple[str, ...]) -> None:
    checked = 0
    for key, want in expected.items():
        if any(f".{k}" in key for k in keys):
            torch.testing.assert_close(got[key], want, **TOL, msg=lambda m, k=key: f"{what} {k}: {m}")
            checked += 1
    assert checked > 0


def _ranks(rank: int, world: int, tmp: str, ref: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    expected = load_file(ref)
    counts: dict[str, list[int]] = {}
    for k in (1, 2):
        tr = _trainer(Path(tmp) / f"ddp{k}", f"train.grad_accum_steps={k}")
        calls: list[int] = []

        def hook(state, bucket, calls=calls):
            calls.append(1)
            return allreduce_hook(state, bucket)

        tr.forward_model.register_comm_hook(None, hook)
        rec = _run(tr)
        counts[str(k)] = [len(calls)]
        if k == 2:
            assert tr.accum_steps == 2
            _compare(rec, expected, "ddp", ("loss", "grad", "param", "carry"))
    assert counts["1"] == counts["2"] and counts["1"][0] >= STEPS  # one all-reduce per bucket per step

    tr = _trainer(Path(tmp) / "fsdp", "train.grad_accum_steps=2", "train.strategy=fsdp")
    assert dist.is_fsdp(tr.model)
    switches: list[bool] = []
    original = tr.model.set_requires_gradient_sync

    def spy(flag: bool, **kw) -> None:
        switches.append(flag)
        original(flag, **kw)

    tr.model.set_requires_gradient_sync = spy  # type: ignore[method-assign]
    rec = _run(tr)
    assert switches == [False, True] * STEPS
    _compare(rec, expected, "fsdp", ("loss", "param", "carry"))
    tdist.barrier()


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_accumulation_under_ddp_and_fsdp_equals_one_process_on_the_full_batch(tmp_path) -> None:
    before = torch.get_default_dtype()
    try:
        ref = _run(_trainer(tmp_path / "one"))
    finally:
        torch.set_default_dtype(before)
    save_file(ref, str(tmp_path / "ref.safetensors"))
    run_ranks(_ranks, str(tmp_path), str(tmp_path / "ref.safetensors"), timeout=220.0)
