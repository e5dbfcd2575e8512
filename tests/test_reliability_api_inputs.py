"""Issue 24: the Python API (``loopformer.api``) refuses bad input with clear exception types: puzzle token
ids that are no integers (``TaskDataError``), loop counts out of range or beyond memory (``ConfigError``),
a device that is no string (``ValueError``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from reliability_common import PUZZLE, tiny_recipe

from loopformer import api
from loopformer.config import ConfigError, build_config
from loopformer.tasks.base import TaskDataError


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    from loopformer.train.trainer import Trainer

    root = tmp_path_factory.mktemp("api")
    Trainer(build_config({**tiny_recipe(), "out_dir": str(root / "run")})).fit()
    return api.load(Path(root / "run"), device="cpu")


@pytest.mark.parametrize(("puzzle", "needle"), [
    ([1.5] * 16, "must be integers"),
    ([True] * 16, "must be integers"),
    (["a"] * 16, "must be integers"),
    (None, "must be integers"),
    (b".2.34....4.2..3.", "bytes"),
    ([[1], [1, 2]], "ragged"),
    ([2**70] * 16, "far beyond"),
    ([], "empty"),
    ([9] * 16, "must lie in"),
])  # fmt: skip
def test_solve_refuses_token_ids_that_are_no_integers(run, puzzle, needle) -> None:
    with pytest.raises(TaskDataError, match=needle):
        api.solve(run, puzzle)


def test_whole_float_token_ids_are_taken(run) -> None:
    tokens = api.parse_puzzle(run.task, PUZZLE)
    assert api.solve(run, tokens.astype(float)).steps >= 1
    assert api.solve(run, np.asarray(tokens).reshape(4, 4)).steps >= 1


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"max_steps": 0}, "max_steps must be an integer >= 1"),
    ({"max_steps": 1.5}, "max_steps must be an integer >= 1"),
    ({"max_steps": True}, "max_steps must be an integer >= 1"),
    ({"max_steps": 10**12}, "keeping every loop's answer"),
    ({"segments": 0}, "segments must be an integer >= 1"),
    ({"puzzle_id": -1}, "puzzle_id must be an integer >= 0"),
])  # fmt: skip
def test_solve_refuses_loop_counts_by_name(run, kwargs, needle) -> None:
    with pytest.raises(ConfigError, match=needle):
        api.solve(run, PUZZLE, **kwargs)


@pytest.mark.parametrize("device", [5, "tpu", "cpu:abc"])
def test_load_refuses_a_device_that_is_none(run, device) -> None:
    with pytest.raises(ValueError, match="device"):
        api.load(run.path, device=device)
