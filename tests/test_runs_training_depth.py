"""``runs.training_depth``: the loop count a run trained at, read from the sampler's own declaration."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from loopformer.config import build_config
from loopformer.runs import training_depth


@pytest.mark.parametrize(
    ("sampler", "options", "expected"),
    [("fixed", {"n": 5}, 5), ("fixed", {}, 7), ("poisson", {"mean": 3.0}, 7), ("none", {}, 7)],
)
def test_training_depth_from_the_sampler(sampler: str, options: dict, expected: int) -> None:
    cfg = build_config({"train": {"loop_sampler": sampler, "loop_sampler_options": options}})
    run = SimpleNamespace(config=cfg, loop_train=SimpleNamespace(max_steps=7))
    assert training_depth(run) == expected  # type: ignore[arg-type]
