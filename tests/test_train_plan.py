"""``loopformer train RECIPE --plan`` (loopformer/config/memory.py, measured through loopformer/train/plan.py): its
activation bytes against what a CPU step saves.

Oracle for the activation count: the same training forward and loss run on the CPU with real
tensors, and the tensors saved for backward found by walking the autograd graph from the loss
(every node's ``_saved_*`` attributes and a custom Function's ``saved_tensors``), unique storages
by data pointer, parameters and buffers left out (and 0-d tensors: the Python scalars autograd keeps
as wrapped numbers, which never pass through the saved-tensor hooks). No hooks: an independent count. The plan's
per-example bytes (meta device, saved_tensors_hooks, fused attention) must equal the CPU count's
slope exactly, and the CPU count must be linear in the batch.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from test_train_utils import tiny_config, tiny_dataset

from loopformer.cli import cli
from loopformer.config import ConfigError
from loopformer.config.memory import MARGIN_FRACTION, MEASURED_AT, GiB, parse_memory
from loopformer.runs import run_task
from loopformer.train.plan import make_plan, training_forward
from loopformer.train.setup import build_run_model

# float32 runs (bf16=false): the CPU oracle below runs in float32; the bf16 count (a GPU run's) is checked
# against real CPU autocast in tests/test_train_plan_measured.py
SMALL = ("model.d_model=16", "model.n_heads=2", "model.n_layers=1", "model.vocab_size=8", "bf16=false")
CASES = {
    "fprm_deep_supervision": ("model.name=fprm", *SMALL, "train.mode=deep_supervision", "train.loss=stablemax",
                              "loop_train.max_steps=3", "loop_train.grad_steps=2"),
    "trm_deep_supervision": ("model.name=trm", *SMALL, "model.n_inner=2", "train.mode=deep_supervision"),
    "transformer_simple": ("model.name=transformer", *SMALL),
    "recurrent_sampler": ("model.name=recurrent", *SMALL, "train.loop_sampler=poisson",
                          "train.loop_sampler_options={mean: 3, low: 1, high: 4}"),
}  # fmt: skip


def _graph_saved_bytes(loss: torch.Tensor, exclude: set[int]) -> int:
    """Bytes of the unique storages the autograd graph of ``loss`` holds for backward."""
    seen: dict[int, int] = {}
    stack, visited = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        values: list = (
            list(getattr(node, "saved_tensors", ()) or ()) if hasattr(node, "saved_tensors") else []
        )
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                values.extend(value if isinstance(value, tuple | list) else [value])
        for t in values:
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in exclude:
                    seen[ptr] = t.untyped_storage().nbytes()
        stack.extend(fn for fn, _ in node.next_functions)
    return sum(seen.values())


def _cpu_counts(cfg, batches: tuple[int, ...]) -> list[int]:
    rows = tiny_dataset(8)
    model = build_run_model(copy.deepcopy(cfg), run_task(cfg.data), rows)
    model.train()
    exclude = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    out = []
    for b in batches:
        inputs = torch.as_tensor(rows.inputs[np.arange(b) % len(rows)])
        labels = torch.as_tensor(rows.labels[np.arange(b) % len(rows)])
        out.append(_graph_saved_bytes(training_forward(model, cfg, inputs, labels, None)[0], exclude))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_plan_activation_bytes_match_what_a_cpu_step_saves(tmp_path, case: str) -> None:
    cfg = tiny_config(tmp_path, "train.batch_size=8", *CASES[case])
    cfg.model.fields["seq_len"] = 6  # the tiny rows' length
    plan, source = make_plan(cfg, 1, parse_memory("1GB"))
    assert "synthetic rows of 6 tokens" in source
    c2, c4, c6 = _cpu_counts(cfg, (2, 4, 6))
    assert c4 - c2 == c6 - c4 > 0  # linear in the batch: a slope per example
    assert plan.per_example == (c4 - c2) // 2
    assert MEASURED_AT == (2, 4) and plan.measured == (c2, c4)
    assert plan.fixed == max(c2 - 2 * plan.per_example, 0)


def test_plan_picks_the_largest_micro_batch_that_fits(tmp_path) -> None:
    cfg = tiny_config(tmp_path, "train.batch_size=8", *CASES["transformer_simple"])
    cfg.model.fields["seq_len"] = 6
    plan, _ = make_plan(cfg, 1, parse_memory("10GB"))
    assert plan.best_micro() == 8 and plan.accum_steps() == 1  # a tiny model fits whole
    import dataclasses

    budget = plan.peak(2) + (plan.peak(4) - plan.peak(2)) // 2  # between micro-batch 2 and 4
    tight = dataclasses.replace(plan, gpu_memory=budget)
    assert tight.best_micro() == 2 and tight.accum_steps() == 4
    assert dataclasses.replace(plan, gpu_memory=plan.peak(1) - 1).best_micro() is None
    assert plan.peak(8) - plan.peak(4) == pytest.approx(4 * plan.per_example * (1 + MARGIN_FRACTION), abs=2)


def test_parse_memory_units() -> None:
    assert (
        parse_memory("80GB") == 80 * 10**9
        and parse_memory("80GiB") == 80 * GiB
        and parse_memory("141") == 141 * 10**9
    )
    with pytest.raises(ConfigError, match="expected a size"):
        parse_memory("lots")


def test_cli_prints_the_plan_and_a_micro_batch(tmp_path) -> None:
    result = CliRunner().invoke(
        cli, ["train", "default_800steps", "--plan", "--gpu-memory", "2GB", "--gpus", "2"]
    )
    assert result.exit_code == 0, result.output
    assert "saved activations" in result.output and "per example" in result.output
    assert "2 GPU(s) of 2 GB" in result.output
    assert "micro-batch" in result.output
    # the optimiser's state is measured, or the line says what could not be measured and why
    assert "measured (" in result.output or "state could not be measured, as" in result.output
