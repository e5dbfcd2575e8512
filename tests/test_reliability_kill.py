"""Issue 16 kill test: one tiny training run SIGKILLed several times (at random moments and inside
checkpoint writes), resumed after each kill; the final weights and EMA equal an uninterrupted run's and
metrics.jsonl holds one record per step (tests/reliability_harness.kill_resume_rounds).

The default run kills a 30-step run 4 times (a few seconds: the training processes are forked from a
parent that has imported everything); the ``slow`` variant kills longer runs 8 times, for three seeds
of the random moments."""

from __future__ import annotations

import pytest
from reliability_harness import kill_resume_rounds


def _check(record: dict, kills: int, steps: int) -> None:
    assert record["identical_weights"], record
    assert record["metric_steps"] == list(range(1, steps + 1))
    moments = [e["moment"] for e in record["events"]]
    assert len(moments) == kills and sum("random" in m for m in moments) == kills // 2
    assert (
        sum("manifest" in m for m in moments) == sum("model.safetensors" in m for m in moments) == kills // 4
    )
    assert all(e["killed_while_running"] for e in record["events"] if e["moment"] != "random")
    resumed = [e["resumed_at_step"] for e in record["events"]]
    assert resumed == sorted(resumed) and resumed[-1] > 0, resumed  # each round went on from the last


@pytest.mark.timeout(300)
def test_sigkill_and_resume_reach_the_uninterrupted_weights(tmp_path) -> None:
    _check(kill_resume_rounds(tmp_path, kills=4, steps=30), kills=4, steps=30)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_many_sigkills_and_resumes_reach_the_uninterrupted_weights(tmp_path, seed: int) -> None:
    _check(kill_resume_rounds(tmp_path, kills=8, steps=64, seed=seed), kills=8, steps=64)
