"""``loopformer solve`` / ``loopformer.solve`` with a per-puzzle embedding (TRM / HRM on ARC): the answer
uses the given row of the table, a multi-row table needs the id, and a bad id is a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_eval_segments import TINY_TRM

import loopformer
from loopformer.cli import cli
from loopformer.config import build_config
from loopformer.eval.analysis import trace_loops
from loopformer.runs import eval_dataset, load_run

PUZZLE_TABLE = {"num_puzzle_ids": 3, "puzzle_emb_len": 1, "puzzle_emb_dim": 16}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loopformer.train.trainer import Trainer

    out = tmp_path_factory.mktemp("trm_puzzle_ids")
    raw = {**TINY_TRM, "model": {**TINY_TRM["model"], **PUZZLE_TABLE}, "out_dir": str(out)}
    raw["train"] = {**raw["train"], "steps": 2}
    Trainer(build_config(raw)).fit()
    return out


def _distinct_table(run) -> None:
    """The table is zero-initialised (every id alike after 2 steps): give each id its own row."""
    g = torch.Generator().manual_seed(0)
    (table,) = [p for n, p in run.model.named_parameters() if "puzzle_emb" in n]
    with torch.no_grad():
        table.copy_(torch.randn(table.shape, generator=g) * 3)


def _by_hand(run, tokens, puzzle_id: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(run.config.seed)
    run.model.eval()
    with torch.no_grad():
        _, logits = trace_loops(run.model, torch.as_tensor(tokens[None]), run.loop_eval, lambda *a: None,
                                puzzle_ids=torch.tensor([puzzle_id]), generator=g,
                                segments=run.config.eval.segments)  # fmt: skip
    return logits[0].argmax(-1)


def test_solve_reads_the_given_puzzle_row(run_dir: Path) -> None:
    run = load_run(run_dir)
    _distinct_table(run)
    tokens = eval_dataset(run.task, run.config).inputs[0]
    answers = {k: _by_hand(run, tokens, k) for k in range(3)}
    assert any(not torch.equal(answers[0], answers[k]) for k in (1, 2))  # the id changes the answer
    for k in range(3):
        got = loopformer.solve(run, tokens, puzzle_id=k)
        assert torch.equal(torch.as_tensor(got.tokens), answers[k]), k


def test_multi_row_table_needs_an_id_and_a_bad_id_is_named(run_dir: Path) -> None:
    run = load_run(run_dir)
    tokens = eval_dataset(run.task, run.config).inputs[0]
    with pytest.raises(ValueError, match="per-puzzle embedding of 3 rows"):
        loopformer.solve(run, tokens)
    with pytest.raises(ValueError, match="puzzle id 3 is out of range.*0..2"):
        loopformer.solve(run, tokens, puzzle_id=3)


def test_cli_puzzle_id(run_dir: Path) -> None:
    run = load_run(run_dir)
    text = loopformer.api.format_answer(run.task, eval_dataset(run.task, run.config).inputs[0])
    ok = CliRunner().invoke(cli, ["solve", "sudoku", text, "-c", str(run_dir), "--puzzle-id", "2", "--json"])
    assert ok.exit_code == 0, ok.output
    bad = CliRunner().invoke(cli, ["solve", "sudoku", text, "-c", str(run_dir), "--puzzle-id", "7"])
    assert bad.exit_code != 0 and "puzzle id 7 is out of range" in (bad.output + str(bad.exception))


def test_puzzle_id_for_a_model_without_a_table_is_refused(tmp_path: Path) -> None:
    from loopformer.train.trainer import Trainer

    raw = {**TINY_TRM, "out_dir": str(tmp_path / "r"), "train": {**TINY_TRM["train"], "steps": 1}}
    Trainer(build_config(raw)).fit()
    run = load_run(tmp_path / "r")
    with pytest.raises(ValueError, match="has no per-puzzle embedding"):
        loopformer.solve(run, eval_dataset(run.task, run.config).inputs[0], puzzle_id=0)
