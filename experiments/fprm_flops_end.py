"""Training FLOPs per step at the *end* of the fprm_sudoku runs (issue 7, item 2, compute accounting).

``experiments/fprm_sudoku.py`` matches training FLOPs with a probe of each model's first training steps.
For models whose compute per step changes while they learn (UT + ACT ponders more; TRM / FPRM do not:
fixed cycles / fixed K iterations per segment) the probe underestimates the spend. This resumes every
finished run in ``runs/fprm_sudoku4/<model>`` from its final checkpoint (``train.resume``, exact state:
weights, optimiser, carried batch) and counts the FLOPs of 3 further training steps with
``FlopCounterMode``; it also copies each run's ``metrics.jsonl`` (training loss / accuracy / mean loop
steps every 50 steps) next to the results. Bounds on the total spend: steps x start-probe and
steps x end-probe.

Usage: ``python experiments/fprm_flops_end.py [--runs runs/fprm_sudoku4]``; writes
``docs/figures/fprm_sudoku/flops_end.json`` and ``train_metrics/<model>.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from fprm_common import REPO, write_json
from torch.utils.flop_counter import FlopCounterMode

from loopformer.config import load_config_file
from loopformer.train.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=REPO / "runs" / "fprm_sudoku4")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "figures" / "fprm_sudoku")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = json.loads((args.runs / "flops_per_step.json").read_text())
    out: dict[str, dict[str, float]] = {}
    for name in ("fprm", "transformer", "trm", "ut_act"):
        run = args.runs / name
        if not (run / "checkpoints").is_dir():
            continue
        (args.out / "train_metrics").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(run / "metrics.jsonl", args.out / "train_metrics" / f"{name}.jsonl")
        cfg = load_config_file(run / "config.json")
        cfg.train.resume = True
        cfg.train.steps += args.steps
        cfg.out_dir = str(args.runs / "flops_end" / name)
        shutil.copytree(run / "checkpoints", Path(cfg.out_dir) / "checkpoints", dirs_exist_ok=True)
        trainer = Trainer(cfg)
        total, loops = 0, 0.0
        for _ in range(args.steps):
            with FlopCounterMode(display=False) as counter:
                m = trainer.train_step()
            trainer.step += 1
            total += counter.get_total_flops()
            loops += m.get("loop_steps", 1.0)
        out[name] = {"resumed_step": trainer.step - args.steps, "flops_per_step_start": start[name],
                     "flops_per_step_end": total / args.steps, "loop_steps_end": loops / args.steps}
        print(name, out[name], flush=True)
    write_json(args.out / "flops_end.json", {"command": "python experiments/fprm_flops_end.py", "models": out})


if __name__ == "__main__":
    main()
