"""Shared helpers of the Loop, Think & Generalize experiments (arXiv 2604.07822).

- the knowledge-graph data: the paper's training mix (ALL atomic facts plus up to ``paths_per_hop``
  train-split k-hop paths for k = 2..k_train, right-padded to one width) and unpadded held-out
  test-split sets per hop count (``loopformer.tasks.kg.KGDepthTask``);
- ``train_or_load``: train a recipe through ``loopformer.train.Trainer`` (the library's harness), or
  reuse the finished run folder when its resolved config matches (so the depth, overthinking and
  halting scripts share the two recurrent models and the baseline, trained once each);
- small JSON / figure helpers.

Every script imports this file by path (``experiments/`` is not a package).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loopformer.config import RunConfig, apply_overrides, load_config, read_recipe
from loopformer.models.base import LoopedModel
from loopformer.tasks.base import TokenDataset
from loopformer.tasks.kg import KGDepthTask

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"

# the three KG models: recipe name -> label in tables and plots
KG_MODELS = {
    "fixed": ("ltg_kg_fixed", "recurrent, fixed R=4"),
    "poisson": ("ltg_kg_poisson", "recurrent, R~Poisson(4) in [2,8]"),
    "transformer": ("ltg_kg_transformer", "plain transformer (equal params)"),
}
K_TRAIN = 4
TEST_HOPS = (2, 3, 4, 5, 6, 7, 8)
PATHS_PER_HOP = 2000
TEST_PER_HOP = 300

QUICK_OVERRIDES = ("train.steps=30", "data.curriculum.check_every=10", "train.log_every=10")


def kg_task(cfg: RunConfig) -> KGDepthTask:
    if cfg.data.task != "kg_depth":
        raise ValueError(f"recipe task is {cfg.data.task!r}, expected 'kg_depth'")
    return KGDepthTask(**cfg.data.options)


def kg_path_count(task: KGDepthTask, k: int, split: str) -> int:
    """How many distinct k-hop paths the split holds (enumerated; only for small path spaces)."""
    space = task.num_entities * task.num_relations**k
    if space > 1 << 22:
        return space  # effectively unlimited for our sample sizes
    index = np.arange(space, dtype=np.int64)
    relations = np.empty((space, k), dtype=np.int64)
    for i in range(k - 1, -1, -1):
        relations[:, i] = index % task.num_relations
        index //= task.num_relations
    test = task.is_test_path(index, relations)
    return int(test.sum()) if split == "test" else int((~test).sum())


def _concat(parts: list[TokenDataset], meta: dict[str, Any], seed: int) -> TokenDataset:
    x = np.concatenate([p.inputs for p in parts])
    y = np.concatenate([p.labels for p in parts])
    d = np.concatenate([p.difficulty for p in parts])
    order = np.random.default_rng([seed, 0x4C54]).permutation(len(x))
    return TokenDataset(x[order], y[order], d[order], meta=meta)


def kg_training_set(
    task: KGDepthTask, k_train: int, paths_per_hop: int, seed: int, width: int
) -> TokenDataset:
    """ALL atomic facts + min(paths_per_hop, available) train-split paths for each k = 2..k_train."""
    parts = [task.atomic_facts(width)]
    for k in range(2, k_train + 1):
        n = min(paths_per_hop, kg_path_count(task, k, "train"))
        parts.append(task.generate(n, seed + 7919 * k, hops=k, split="train", pad_to=width))
    meta = {
        "task": task.name,
        "split": "train",
        "k_train": k_train,
        "paths_per_hop": paths_per_hop,
        "seed": seed,
    }
    return _concat(parts, meta, seed)


def kg_test_sets(task: KGDepthTask, hops: tuple[int, ...], n: int, seed: int) -> dict[int, TokenDataset]:
    """Per hop count k: min(n, available) held-out test-split paths, unpadded (width k + 1)."""
    out = {}
    for k in hops:
        m = min(n, kg_path_count(task, k, "test"))
        out[k] = task.generate(m, seed + 104729 * k, hops=k, split="test")
    return out


def kg_curriculum_eval(task: KGDepthTask, k_train: int, n: int, seed: int, width: int) -> TokenDataset:
    """Held-out paths k = 2..k_train, padded to the training width: the curriculum's check set."""
    parts = [
        task.generate(
            min(n, kg_path_count(task, k, "test")), seed + 31 * k, hops=k, split="test", pad_to=width
        )
        for k in range(2, k_train + 1)
    ]
    return _concat(parts, {"task": task.name, "split": "test"}, seed)


def config_key(recipe: str, overrides: list[str]) -> str:
    """Identity of a run: the raw recipe table (base chain merged) with the overrides written in, minus
    out_dir. Raw, not the resolved RunConfig, so new schema fields with defaults do not change it."""
    data = apply_overrides(read_recipe(recipe), list(overrides))
    data.pop("out_dir", None)
    return json.dumps(data, sort_keys=True)


def train_or_load(
    recipe: str,
    overrides: list[str],
    train_data: TokenDataset,
    eval_data: TokenDataset,
    retrain: bool = False,
    log: Any = print,
) -> tuple[LoopedModel, dict[str, Any]]:
    """Train ``recipe`` with the Trainer (or reuse its finished run); returns (model, info).

    ``info``: wall_time (s, of the training run), steps, parameters, curriculum history and final level,
    final training metrics, run_dir, reused (bool).
    """
    from loopformer.runs import load_run
    from loopformer.train.trainer import Trainer

    cfg = load_config(recipe, overrides)
    run_dir = ROOT / cfg.out_dir if not Path(cfg.out_dir).is_absolute() else Path(cfg.out_dir)
    info_path = run_dir / "ltg_info.json"
    key = config_key(recipe, overrides)
    if not retrain and info_path.is_file():
        info = json.loads(info_path.read_text())
        if info.get("config_key") == key:
            run = load_run(run_dir, use_ema=False)
            log(f"reusing {run_dir} (trained in {info['wall_time']:.0f} s)")
            info["reused"] = True
            info["curriculum_advances"] = _advances(info["curriculum_history"], cfg.data.curriculum.threshold)
            return run.model, info
    cfg.out_dir = str(run_dir)
    task = kg_task(cfg) if cfg.data.task == "kg_depth" else None
    trainer = Trainer(cfg, task=task, train_data=train_data, eval_data=eval_data)
    log(
        f"training {recipe}: {trainer.model.num_parameters():,} parameters, {cfg.train.steps} steps -> {run_dir}"
    )
    t0 = time.perf_counter()
    summary = trainer.fit()
    wall = time.perf_counter() - t0
    cur = trainer.curriculum
    info = {
        "recipe": recipe,
        "overrides": list(overrides),
        "config_key": key,
        "run_dir": str(run_dir),
        "wall_time": wall,
        "steps": summary["steps"],
        "parameters": summary["parameters"],
        "train_final": summary["train"],
        "eval_final": summary["eval"],
        "curriculum_level": cur.level if cur else None,
        "curriculum_history": cur.history if cur else [],
        "curriculum_advances": _advances(cur.history, cur.threshold) if cur else [],
        "reused": False,
    }
    info_path.write_text(json.dumps(info, indent=2))
    log(
        f"  done in {wall:.0f} s, curriculum level {info['curriculum_level']}, advances {info['curriculum_advances']}"
    )
    trainer.model.eval()
    return trainer.model, info


def _advances(history: list[dict[str, float]], threshold: float) -> list[dict[str, float]]:
    """The checks at which the curriculum moved past a level (accuracy reached the threshold)."""
    return [dict(h) for h in history if h["accuracy"] >= threshold]


def train_kg_models(
    names: tuple[str, ...], quick: bool = False, retrain: bool = False, log: Any = print
) -> tuple[KGDepthTask, dict[str, tuple[LoopedModel, dict[str, Any]]]]:
    """Train (or reuse) the KG models ``names`` (keys of KG_MODELS) on one shared training set."""
    torch.set_num_threads(1)
    overrides = list(QUICK_OVERRIDES) if quick else []
    models = {}
    task = None
    for name in names:
        recipe, _ = KG_MODELS[name]
        extra = overrides + ([f"out_dir=runs/ltg_quick/{name}"] if quick else [])
        cfg = load_config(recipe, extra)
        task = kg_task(cfg)
        width = int(cfg.data.train_generate.get("pad_to", task.max_hops + 1))
        train = kg_training_set(task, K_TRAIN, 200 if quick else PATHS_PER_HOP, cfg.data.train_seed, width)
        check = kg_curriculum_eval(task, K_TRAIN, 40 if quick else 120, cfg.data.eval_seed, width)
        models[name] = train_or_load(recipe, extra, train, check, retrain=retrain, log=log)
    assert task is not None
    return task, models


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_default))


def _default(x: Any) -> Any:
    if isinstance(x, np.integer | np.floating):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")


def figure_dir(name: str, quick: bool) -> Path:
    """docs/figures/<name>/ (or runs/ltg_quick/figures/<name>/ for --quick dry runs)."""
    out = (ROOT / "runs" / "ltg_quick" / "figures" / name) if quick else (FIGURES / name)
    out.mkdir(parents=True, exist_ok=True)
    return out


def script_parser(doc: str, retrain: bool = True) -> argparse.ArgumentParser:
    """The experiment scripts' command line: ``--quick`` (dry run) and, with ``retrain``, ``--retrain``;
    the description is the first line of the script's docstring ``doc``."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few training steps at tiny size (dry run)")
    if retrain:
        parser.add_argument("--retrain", action="store_true", help="train even when a matching run exists")
    return parser


def run_from_command_line(run: Any, doc: str, argv: list[str] | None = None) -> None:
    """``run(quick=..., retrain=...)`` with the flags of ``script_parser(doc)`` parsed from ``argv``."""
    args = script_parser(doc).parse_args(argv)
    run(quick=args.quick, retrain=args.retrain)


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    """Lay out ``fig``, write it to ``path`` (80 dpi) and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    pyplot().close(fig)
