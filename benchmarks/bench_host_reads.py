"""Benchmark 13: host reads per optimiser step (issue 33).

A host read is any place where the CPU needs a value the device computed before it can go on: a scalar read
(``float(t)``, ``int(t)``, ``bool(t)``, ``.item()``: ``aten._local_scalar_dense``), an op whose output shape
depends on the values (``nonzero``, boolean indexing, ``unique``, ...), or a copy to the host (``tolist``,
``numpy``, ``cpu``). On a GPU each one stalls the CPU until the device has caught up, so the next step cannot
be queued while this one runs. ``loopformer.devices.HostReads`` counts them (a ``TorchDispatchMode`` over the
aten ops and a ``TorchFunctionMode`` over the Tensor methods) during steady-state steps (two warm-up steps,
then three counted; ``train.log_every`` beyond them) of every paper recipe family and training mode at a small
size on the CPU (``benchmarks.paper_small``), with gradient accumulation, Graves ACT, and the CPU recipes the
issue counted (53 / 36 / 106 reads per step before: ``sudoku4_fprm`` / ``sudoku4_trm`` /
``attractor_puzzle_sudoku4``). Deterministic counts, not timings. Target: <= 1 per step (the trainer's one read
per logged record is not in a steady-state step).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks.common import Result
from benchmarks.paper_small import CPU_RECIPES, FAMILIES, VARIANTS, small_trainer, steady_state_reads

BEFORE = {"sudoku4_fprm": 53, "sudoku4_trm": 36, "attractor_puzzle_sudoku4": 106}  # issue 33, counted on main


def run(quick: bool = False) -> list[Result]:
    import torch

    torch.set_num_threads(1)
    names = [*CPU_RECIPES, "trm"] if quick else [*CPU_RECIPES, *FAMILIES, *VARIANTS]
    results = []
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            tr = small_trainer(name, Path(tmp) / "run")
            try:
                per_step, counts = steady_state_reads(tr, warmup=2, steps=3)
                recipe = FAMILIES.get(name, (name,))[0]
                details = {"counts_over_3_steps": counts, "recipe": recipe, "mode": tr.config.train.mode,
                           "before": BEFORE.get(name), "loop_train": tr.loop_train.halting}  # fmt: skip
            finally:
                tr.folder.close()
        before = f"; {BEFORE[name]} before (issue 33)" if name in BEFORE else ""
        results.append(
            Result(
                "host_reads",
                f"host_reads.{name}",
                per_step,
                "reads/step",
                "<= 1",
                per_step <= 1,
                f"{recipe} at a small size, {tr.config.train.mode}{before}",
                details,
            )
        )
    return results
