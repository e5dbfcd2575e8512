"""Checkpoints: safetensors + JSON round trips, atomic folders, clear errors, no pickle anywhere."""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train_utils import TinyConfig, TinyLooped, tiny_config

from loopformer.models.registry import build_model
from loopformer.runs.checkpoint import (
    CheckpointError,
    flatten_state,
    latest_checkpoint,
    load_checkpoint,
    load_training_state,
    load_weights,
    resolve_checkpoint,
    rng_state,
    save_checkpoint,
    save_weights,
    set_rng_state,
    step_dirs,
    unflatten_state,
)


def test_nested_state_round_trips_through_json_and_tensors() -> None:
    state = {
        "step": 7,
        "opt": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3)}}, "groups": [{"betas": (0.9, 0.95)}]},
        "none": None,
        "arr": np.arange(5, dtype=np.int64),
        "flags": [True, 1.5, "x"],
    }
    skeleton, tensors = flatten_state(state)
    back = unflatten_state(skeleton, tensors)
    assert back["step"] == 7 and back["none"] is None and back["flags"] == [True, 1.5, "x"]
    assert list(back["opt"]["state"]) == [0]
    assert torch.equal(back["opt"]["state"][0]["exp_avg"], state["opt"]["state"][0]["exp_avg"])
    assert back["opt"]["groups"][0]["betas"] == (0.9, 0.95)
    assert np.array_equal(back["arr"], state["arr"])
    with pytest.raises(TypeError, match="cannot checkpoint a object"):
        flatten_state({"bad": object()})


def test_rng_states_restore_every_generator() -> None:
    state = rng_state()
    draws = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(unflatten_state(*flatten_state(state)))
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(draws[0], again[0]) and np.array_equal(draws[1], again[1]) and draws[2] == again[2]


def test_tied_tensors_are_stored_once_and_restored(tmp_path) -> None:
    shared = torch.randn(4, 3)
    save_weights({"a.weight": shared, "b.weight": shared, "c": torch.ones(2)}, tmp_path / "w.safetensors")
    back = load_weights(tmp_path / "w.safetensors")
    assert set(back) == {"a.weight", "b.weight", "c"} and torch.equal(back["b.weight"], shared)


def _save(tmp_path: Path, step: int, model: torch.nn.Module | None = None, keep: int = 0) -> Path:
    model = model or TinyLooped()
    ema = {n: p.detach() + 1 for n, p in model.named_parameters()}
    return save_checkpoint(
        tmp_path / "checkpoints", step, model, tiny_config(tmp_path), ema_state=ema,
        training_state={"carry": {"state": torch.randn(2, 3)}, "stream": {"epoch": 1}}, keep=keep,
    )


def test_checkpoint_folder_layout_latest_pointer_and_pruning(tmp_path) -> None:
    for step in (1, 2, 3, 4):
        folder = _save(tmp_path, step, keep=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "ema.safetensors", "manifest.json", "model.safetensors", "state.json", "state.safetensors"
    ]
    assert [p.name for p in step_dirs(root)] == ["step_00000003", "step_00000004"]
    assert (root / "latest").read_text().strip() == "step_00000004"
    assert latest_checkpoint(root) == folder
    assert resolve_checkpoint(tmp_path) == folder == resolve_checkpoint(root) == resolve_checkpoint(folder)
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no temporaries left behind
    state = load_training_state(folder)
    assert state["step"] == 4 and state["stream"] == {"epoch": 1} and state["carry"]["state"].shape == (2, 3)


def test_load_restores_weights_and_ema_into_a_given_model(tmp_path) -> None:
    source = TinyLooped(seed=1)
    folder = _save(tmp_path, 5, source)
    ckpt = load_checkpoint(folder, model=TinyLooped(seed=2))
    assert ckpt.step == 5 and ckpt.weights == "model" and ckpt.family == "TinyLooped"
    for (name, a), (_, b) in zip(source.state_dict().items(), ckpt.model.state_dict().items()):
        assert torch.equal(a, b), name
    ema = load_checkpoint(folder, model=TinyLooped(seed=2), use_ema=True)
    assert ema.weights == "ema"
    assert torch.equal(ema.model.w.weight, source.w.weight + 1)
    assert ckpt.config == tiny_config(tmp_path)


def test_missing_and_corrupt_checkpoints_name_the_problem(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere", model=TinyLooped())
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        load_checkpoint(tmp_path / "empty", model=TinyLooped())
    folder = _save(tmp_path, 1)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-40])  # truncated
    with pytest.raises(CheckpointError, match=re.escape(str(weights)) + " is corrupt or truncated"):
        load_checkpoint(folder, model=TinyLooped())
    weights.write_bytes(b"\x00" * 3)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint(folder, model=TinyLooped())


def test_wrong_model_is_rejected_naming_parameter_and_shapes(tmp_path) -> None:
    folder = _save(tmp_path, 1, TinyLooped())
    wider = TinyLooped(TinyConfig(d_model=24))
    with pytest.raises(CheckpointError, match=r"parameter 'emb.weight' has shape \(8, 16\) in the checkpoint but \(8, 24\)"):
        load_checkpoint(folder, model=wider)
    fprm = build_model("fprm", vocab_size=8, seq_len=6, d_model=16, n_heads=2)
    with pytest.raises(CheckpointError, match="holds a 'TinyLooped' model, but the given model is 'fprm'"):
        load_checkpoint(folder, model=fprm)


def test_registry_model_is_rebuilt_from_the_checkpoint_config(tmp_path) -> None:
    cfg = tiny_config(tmp_path, "model.name=recurrent", "model.d_model=16", "model.n_heads=2", "model.vocab_size=8",
                      "model.seq_len=6")
    model = build_model("recurrent", config=cfg.model_config())
    folder = save_checkpoint(tmp_path / "ck", 3, model, cfg)
    ckpt = load_checkpoint(folder)
    assert ckpt.family == "recurrent" and type(ckpt.model) is type(model)
    for (name, a), (_, b) in zip(model.state_dict().items(), ckpt.model.state_dict().items()):
        assert torch.equal(a, b), name


def test_the_training_package_never_unpickles() -> None:
    root = Path(__file__).resolve().parent.parent / "loopformer"
    for path in [*(root / "train").glob("*.py"), *(root / "config").glob("*.py"), *(root / "runs").glob("*.py")]:
        text = path.read_text()
        assert "import pickle" not in text, path
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            assert "weights_only=True" in call, (path, call)
