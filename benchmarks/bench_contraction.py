"""Benchmark 17: what the contraction term costs a training step (issue 32, item 5; loopformer's addition).

``train.jacobian_weight`` adds the Hutchinson estimate of ||dF/dz||_F^2 / dim at each segment's last iterate
(``loopformer.train.losses.jacobian_frobenius``: one more application of the step and its double backward) to
FPRM's loss. Two trainers of the 9x9 head-to-head's FPRM (``experiments/sudoku9_cpu.py``: ``fprm_authors`` and
``fprm_authors_jac``, the authors' architecture at the CPU width, their segment protocol) from the same weights
(head-to-head seed 0's shipped 60-minute EMA weights, so the loop runs as many iterations as a trained model's
does; random weights when they are absent or in ``--quick``), the same seed and so the same batches, curriculum
off (every blank count), one thread, take interleaved steps; process CPU time per step. Figure: with / without
the term, median of the per-round ratios. Beside it, the FLOPs ratio of one step each
(``torch.utils.flop_counter.FlopCounterMode``) and each side's mean loop iterations a step, which must match
for the time ratio to be the term's alone. Informational (no target).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Result, paired_ratio, side_by_side, summary

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "benchmarks" / "checkpoints" / "sudoku9_fprm_seed0"
PAIR = ("fprm_authors", "fprm_authors_jac")


def _trainers(tmp: Path, quick: bool) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "experiments"))
    try:
        import sudoku9_cpu  # the head-to-head's configurations (experiments/sudoku9_cpu.py)
        from fprm_common import probe_config
    finally:
        sys.path.remove(str(REPO / "experiments"))
    from loopformer.train.trainer import Trainer

    cfgs = sudoku9_cpu.configs(tmp, quick, ["train.progress=false", "train.threads=1"], seed=0)
    out = {}
    for name in PAIR:
        out[name] = Trainer(probe_config(cfgs[name], tmp / name, curriculum=False))
    return out


def _stepper(trainer: Any, loops: list[float]):
    def one() -> None:
        metrics = trainer.train_step()
        trainer.step += 1
        if "loop_steps" in metrics:
            loops.append(float(metrics["loop_steps"]))

    return one


def run(quick: bool = False) -> list[Result]:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    torch.set_num_threads(1)
    details: dict[str, Any] = {"threads": 1, "pair": list(PAIR)}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = _trainers(Path(tmp), quick)
        try:
            if not quick and SHIPPED.is_dir():
                from loopformer.runs import load_run

                state = load_run(SHIPPED, use_ema=True).model.state_dict()
                for tr in trainers.values():
                    tr.model.load_state_dict(state)
                details["weights"] = str(SHIPPED.relative_to(REPO))
            else:
                details["weights"] = "random (seed 0)"
                trainers[PAIR[1]].model.load_state_dict(trainers[PAIR[0]].model.state_dict())
            flops = {}
            for name, tr in trainers.items():  # one step each under the FLOP counter (also the warm-up)
                with FlopCounterMode(display=False) as counter:
                    tr.train_step()
                tr.step += 1
                flops[name] = counter.get_total_flops()
            loops: dict[str, list[float]] = {name: [] for name in PAIR}
            times = side_by_side({name: _stepper(tr, loops[name]) for name, tr in trainers.items()},
                                 repeats=2 if quick else 12, warmup=0, clock=time.process_time)  # fmt: skip
        finally:
            for tr in trainers.values():
                tr.folder.close()
    ratio = paired_ratio(times, PAIR[1], PAIR[0])
    details.update(
        times=summary(times),
        gflop_per_step={k: round(v / 1e9, 2) for k, v in flops.items()},
        flops_ratio=round(flops[PAIR[1]] / flops[PAIR[0]], 3),
        loop_steps_mean={k: round(statistics.mean(v), 2) if v else None for k, v in loops.items()},
        batch_size=trainers[PAIR[0]].config.train.batch_size,
    )
    return [
        Result("contraction", "contraction.fprm_h2h_step_time", ratio, "x", None, None,
               "informational: a training step of the 9x9 head-to-head's FPRM with the contraction term "
               "(train.jacobian_weight) / without, same weights and batches, one thread", details)  # fmt: skip
    ]
