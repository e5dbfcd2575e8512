"""``train.carry_solver_state`` under torchrun (gloo, 2 ranks on CPU): each rank carries the damped
solver's state of its own slots, the checkpoint holds one global carry, and a run resumes under
another world size. Oracle: the same run in one process (tests/test_dist.py's conventions).
``pytest -m slow tests/test_dist_fprm_carry.py`` (~30 s)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_dist import WEIGHT_ATOL, TinyDet, _flat_params, run_ranks
from test_train_utils import tiny_config, tiny_dataset

from loopformer.train import Trainer, dist

KEYS = ("eta", "best", "patience")
CARRY = (
    "train.mode=deep_supervision", "train.max_segments=3", "train.carry_solver_state=true",
    "train.halt_on_converged=true", "train.grad_clip=0", "train.batch_size=8", "train.checkpoint_every=2",
    "data.eval_size=0", "seed=4",
    "loop_train={solver: damped, halting: fixed, max_steps: 3, tol: 1.0e-9, damped: {patience: 1, gamma: 0.5}, "
    "residual_norm: rel_sup, grad: truncated, grad_steps: 3}",
)  # fmt: skip


def _trainer(out: Path, *extra: str) -> Trainer:
    return Trainer(tiny_config(out, *CARRY, *extra), model=TinyDet(seed=2), train_data=tiny_dataset(48),
                   eval_data=None)  # fmt: skip


def _saved_solver(step_dir: Path) -> dict[str, torch.Tensor]:
    state = load_file(str(step_dir / "state.safetensors"))
    return {k: next(v for name, v in state.items() if name.endswith(f"carry.solver.{k}")) for k in KEYS}


def _carry_ranks(rank: int, world: int, tmp: str, ref: str) -> None:
    expected = load_file(ref)
    run = Path(tmp) / "dist"
    first = _trainer(run, "train.steps=2")
    first.fit()
    for k in KEYS:  # each rank holds its slots' solver state: the one-process carry, sharded
        torch.testing.assert_close(
            first.carry.solver[k], dist.shard(expected[f"solver_{k}_2"]), rtol=1e-5, atol=1e-7
        )
    resumed = _trainer(run, "train.steps=4", "train.resume=true")
    assert resumed.step == 2 and len(resumed.carry.solver["eta"]) == 4
    resumed.fit()
    torch.testing.assert_close(_flat_params(resumed.model), expected["params_4"], rtol=0, atol=WEIGHT_ATOL)


@pytest.mark.slow  # ~30 s on the loaded 2-core machine (pytest -m slow)
@pytest.mark.dist
@pytest.mark.timeout(180)
def test_the_carried_solver_state_is_sharded_checkpointed_once_and_resumed_across_world_sizes(
    tmp_path,
) -> None:
    full = _trainer(tmp_path / "full", "train.steps=4")
    full.fit()
    saved = _saved_solver(full.ckpt_dir / "step_00000002")
    assert (saved["eta"] < 1).any()  # the step sizes decayed: there is state to carry
    ref = {"params_4": _flat_params(full.model), **{f"solver_{k}_2": v for k, v in saved.items()}}
    save_file(ref, str(tmp_path / "ref.safetensors"))
    run_ranks(_carry_ranks, str(tmp_path), str(tmp_path / "ref.safetensors"))
    two = tmp_path / "dist" / "checkpoints" / "step_00000002"
    for k, v in _saved_solver(two).items():  # the 2-rank checkpoint holds the global carry, in slot order
        torch.testing.assert_close(v, saved[k], rtol=1e-5, atol=1e-7)
    one = _trainer(tmp_path / "one", "train.steps=4", f"train.resume={two}")  # world size 2 -> 1
    assert one.step == 2 and len(one.carry.solver["eta"]) == 8
    one.fit()
    torch.testing.assert_close(_flat_params(one.model), ref["params_4"], rtol=0, atol=WEIGHT_ATOL)
