"""Test-time compute is what the models compute: ``compare``'s column (transformer blocks per example, each
loop step counted by its model: ``LoopedModel.blocks_per_step``) times the FLOPs of one block, plus the
readout and Q head of each forward call, equals the FLOPs ``torch.utils.flop_counter.FlopCounterMode``
counts over the evaluation pass that produced it.

Tolerance: exact (1e-9 relative) for TRM and FPRM, whose only matrix products are their blocks' and the
head's; 2% for the Attractor puzzle model, whose inner Anderson solve adds its own small products (the
Gram matrix and its solve), which are solver work, not blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from loopformer.eval.compare import load_entries
from loopformer.eval.suite import ModelUnderTest, ReportOptions, run_suite
from loopformer.models.registry import build_model, make_config
from loopformer.tasks.sudoku import SudokuTask


def _flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


CASES = [  # family, its fields, segments, relative tolerance
    ("trm", {"n_inner": 2}, 3, 1e-9),
    ("fprm", {"grid": (4, 4)}, 1, 1e-9),
    ("attractor_puzzle", {}, 2, 0.02),
]


@pytest.mark.parametrize("name,fields,segments,tolerance", CASES, ids=[c[0] for c in CASES])
def test_compare_column_is_the_counted_flops(name: str, fields: dict, segments: int, tolerance: float,
                                             tmp_path: Path) -> None:  # fmt: skip
    task = SudokuTask(4)
    data = task.generate(8, seed=3)
    torch.manual_seed(0)
    config = make_config(name, vocab_size=task.vocab_size, seq_len=16, d_model=32, n_heads=2, n_layers=2, **fields)
    model = build_model(name, config=config).eval()
    main = ModelUnderTest(name, model, model.config.loop, segments=segments)
    counted = _flops(lambda: run_suite(tmp_path, name, task, data, main, options=ReportOptions(analyses=False)))
    (row,) = [e.row() for e in load_entries([tmp_path])]

    ctx = model.embed(torch.as_tensor(data.inputs[:1]))
    state = model.init_state(ctx)
    block = (model.net.layers if hasattr(model, "net") else model.layers)[0]
    per_block = _flops(lambda: block(torch.randn(1, ctx[0].shape[1], 32)))
    per_call = _flops(lambda: (model.readout(state, *ctx), model.q_head(state, *ctx)))  # head of one call
    expected = row["test_time_compute"] * len(data) * per_block + segments * len(data) * per_call
    assert counted == pytest.approx(expected, rel=tolerance)
    assert counted >= expected  # never more blocks than were computed


def test_each_model_counts_its_step() -> None:
    """TRM applies its net n_inner + 1 times a cycle, HRM its L module l_cycles times and H once; the
    Attractor puzzle model reports the evaluations its inner solve made (measured, not its cap)."""
    common = {"vocab_size": 6, "seq_len": 16, "d_model": 16, "n_heads": 2, "n_layers": 2}
    assert build_model("trm", config=make_config("trm", **common, n_inner=3)).blocks_per_step() == 8
    assert build_model("hrm", config=make_config("hrm", **common, l_cycles=2, l_layers=3)).blocks_per_step() == 8
    assert build_model("ut_act", config=make_config("ut_act", **{**common, "n_layers": 1})).blocks_per_step() == 1
    model = build_model("attractor_puzzle", config=make_config("attractor_puzzle", **common)).eval()
    cap = model.blocks_per_step()  # before any forward: the inner solve at its cap
    assert cap == (model.solve_loop.max_steps + model.config.bptt_through + 1) * 2
    with torch.no_grad():
        out = model(torch.randint(1, 6, (4, 16)))
    inner = float(torch.cat(model.inner_steps).double().mean())
    assert len(model.inner_steps) == int(out.loop.steps.max()) and 1 <= inner <= model.solve_loop.max_steps
    assert model.blocks_per_step() == pytest.approx((inner + model.config.bptt_through + 1) * 2)
