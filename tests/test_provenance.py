"""Provenance records (issue 25): a fresh run writes one record to ``provenance.json``, a resume appends
one (the first is kept), and ``record_for_step`` finds the record that trained a given step."""

from __future__ import annotations

from pathlib import Path

from reliability_common import tiny_recipe

from loopformer.config import build_config
from loopformer.runs.provenance import describe, read_records, record_for_step
from loopformer.train.trainer import Trainer


def test_a_resume_appends_a_provenance_record(tmp_path: Path) -> None:
    run = tmp_path / "run"
    Trainer(build_config({**tiny_recipe(), "out_dir": str(run)})).fit()
    first = read_records(run)
    assert len(first) == 1 and first[0]["step"] == 0 and first[0]["resumed"] is False
    assert first[0]["threads"] == 1 and first[0]["device"] == "cpu" and first[0]["torch"]
    resumed = tiny_recipe(train={"steps": 3, "resume": True})
    Trainer(build_config({**resumed, "out_dir": str(run)})).fit()
    records = read_records(run)
    assert len(records) == 2 and records[0] == first[0]  # appended, the first one kept as it was
    assert records[1]["step"] == 2 and records[1]["resumed"] is True
    assert record_for_step(run, 2) == records[0] and record_for_step(run, 3) == records[1]
    line = describe(records[1])
    assert f"torch {records[1]['torch']}" in line and "threads 1" in line and "device cpu" in line
