"""Issue 16 kill test: one tiny training run SIGKILLed several times (at random moments and inside
checkpoint writes), resumed after each kill; the final weights and EMA equal an uninterrupted run's and
metrics.jsonl holds one record per step (tests/reliability_harness.kill_resume_rounds)."""

from __future__ import annotations

import pytest
from reliability_harness import kill_resume_rounds


@pytest.mark.timeout(900)
def test_sigkill_and_resume_reach_the_uninterrupted_weights(tmp_path) -> None:
    record = kill_resume_rounds(tmp_path, kills=4, steps=30)
    assert record["identical_weights"], record
    assert record["metric_steps"] == list(range(1, 31))
    moments = [e["moment"] for e in record["events"]]
    assert sum("random" in m for m in moments) == 2 and len(moments) == 4
    assert all(e["killed_while_running"] for e in record["events"] if e["moment"] != "random")
