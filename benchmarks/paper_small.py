"""The paper recipes at a small size on the CPU: one recipe per model family and training mode, its model
shrunk to a tiny width and its data replaced by small generated sets of the same task (4x4 Sudoku for the
puzzle recipes, a tiny text corpus for the language models), everything else (training mode, solver, halting,
gradient mode, optimiser, EMA, precision) as the recipe sets it. Used by the host-read, compile and plan
benchmarks and by tests/test_train_host_reads.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from loopformer.config import RunConfig, load_config, read_recipe

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "model.d_model=16",
    "model.n_heads=2",
    "train.steps=1000",
    "train.batch_size=8",
    "train.warmup_steps=1",
    "train.log_every=1000",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "train.progress=false",
    "train.threads=1",
    "eval.batch_size=8",
    "device=cpu",
]
SUDOKU4 = [
    "~data.train_path",
    "~data.eval_path",
    "data.options={size: 4}",
    "data.train_generate={min_blanks: 4, max_blanks: 10}",
    "data.eval_generate={min_blanks: 4, max_blanks: 10}",
    "data.train_size=64",
    "data.eval_size=8",
    "train.max_segments=4",
]
# family -> (recipe, data overrides); every paper recipe's model family and training mode appears once
FAMILIES: dict[str, tuple[str, list[str]]] = {
    "fprm": ("paper_sudoku_extreme_fprm", SUDOKU4),
    "trm": ("paper_sudoku_extreme_trm", SUDOKU4),
    "hrm": ("paper_sudoku_extreme_hrm", SUDOKU4),
    "attractor_puzzle": ("paper_sudoku_extreme_attractor", SUDOKU4),
    "attractor_head": ("paper_sudoku_extreme_attractor_head", SUDOKU4),
    "lm_attractor": ("paper_lm_attractor_140m", ["LM"]),
    "lm_parcae": ("paper_lm_parcae_140m", ["LM"]),
    "lm_transformer": ("paper_lm_transformer_140m", ["LM"]),
    # the LTG recipes read the authors' knowledge-graph files; the same model and training on a generated graph
    "ltg_recurrent": (
        "paper_ltg_kg_depth",
        [
            "data.task=kg_depth",
            "data.options={num_entities: 20, num_relations: 3, max_hops: 4, seed: 0}",
            "~data.train_path",
            "~data.eval_path",
            "data.train_generate={min_hops: 1, max_hops: 3, split: train, pad_to: 5}",
            "data.eval_generate={min_hops: 2, max_hops: 4, split: test, pad_to: 5}",
            "data.train_size=64",
            "data.eval_size=8",
            "data.curriculum.enabled=false",
        ],
    ),  # fmt: skip
}
# the CPU recipes the issue counted (53 / 36 / 106 host reads per step before)
CPU_RECIPES = ("sudoku4_fprm", "sudoku4_trm", "attractor_puzzle_sudoku4")
# the training modes again with gradient accumulation, and Graves ACT (the Universal Transformer baseline)
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "trm+accumulation": ("trm", ["train.grad_accum_steps=2"]),
    "fprm+accumulation": ("fprm", ["train.grad_accum_steps=2"]),
    "lm_parcae+accumulation": ("lm_parcae", ["train.grad_accum_steps=2"]),
    # the recipe's micro-batches with its batch-wide solver stop per halting group inside each one
    "lm_attractor+accumulation": ("lm_attractor", ["train.micro_batch_size=4", "loop_train.halt_group=2"]),
    "ut_act": (
        "sudoku4_fprm",
        [
            "model.name=ut_act",
            "train.mode=simple",
            "train.loop_sampler=none",
            "train.ponder_weight=0.01",
            "loop_train={solver: picard, halting: act, grad: bptt, max_steps: 6}",
            "train.q_loss_weight=0",
        ],
    ),  # fmt: skip
}


def corpus(folder: Path) -> Path:
    """A tiny plain-text corpus (two files) for the language-model recipes."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    words = ["loop", "fixed", "point", "attractor", "the", "model", "solves", "a", "puzzle", "with", "depth"]
    (folder / "a.txt").write_text(" ".join(rng.choice(words, size=1500)))
    (folder / "b.md").write_text(" ".join(rng.choice(words, size=1500)))
    return folder


def _loop_caps(recipe: str) -> list[str]:
    """Short caps where the recipe sets its own loop tables (as tests/test_paper_recipes.py's dry runs)."""
    raw = read_recipe(ROOT / "recipes" / f"{recipe}.yaml")
    out = []
    for table in ("loop_eval", "loop_periodic"):
        if "max_steps" in (raw.get(table) or {}):
            out += [f"{table}.min_steps=1", f"{table}.max_steps=4"]
    return out


def token_file(folder: Path) -> Path:
    """``corpus`` prepared as a token file (``loopformer data prepare text``), once per folder."""
    from loopformer.tasks.token_file import prepare_text

    if not (folder / "tokens.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        prepare_text(folder, corpus(folder.parent / "corpus"), shuffle=True)
    return folder


def small_config(family_or_recipe: str, out_dir: Path, *extra: str) -> RunConfig:
    """The RunConfig of a family (``FAMILIES``) or a CPU recipe at a small size, writing into ``out_dir``."""
    if family_or_recipe in VARIANTS:
        base, more = VARIANTS[family_or_recipe]
        return small_config(base, out_dir, *more, *extra)
    recipe, data = FAMILIES.get(family_or_recipe, (family_or_recipe, []))
    raw = read_recipe(ROOT / "recipes" / f"{recipe}.yaml")
    if data == ["LM"]:  # as the recipes train: windows streamed from a token file (one pass, train_size 0)
        data = [
            f"data.options.path={token_file(out_dir.parent / 'tokens')}",
            "data.options.seq_len=32",
            "data.options.val_fraction=0.25",
            "data.eval_size=8",
            "model.n_layers=2",
            "train.micro_batch_size=0",  # the recipes' micro-batches of 32: the +accumulation variants
        ]
    tied = ["model.puzzle_emb_dim=16"] if "puzzle_emb_dim" in (raw.get("model") or {}) else []
    small = TINY if recipe.startswith("paper_") else [o for o in TINY if not o.startswith("model.")]
    size = ["model.d_model=32"] if not recipe.startswith("paper_") else []
    return load_config(
        ROOT / "recipes" / f"{recipe}.yaml",
        [*small, *size, *tied, *_loop_caps(recipe), *data, *extra, f"out_dir={out_dir}"],
    )


def small_trainer(family_or_recipe: str, out_dir: Path, *extra: str) -> Any:
    """A ``Trainer`` for ``small_config``."""
    from loopformer.train import Trainer

    return Trainer(small_config(family_or_recipe, out_dir, *extra))


def steady_state_reads(trainer: Any, warmup: int = 2, steps: int = 3) -> tuple[float, dict[str, int]]:
    """Host reads per optimiser step after ``warmup`` steps, as ``Trainer.fit`` runs them between two logged
    records (``train_step`` then ``StepMeter.add``); (mean per step, counts by op over the measured steps)."""
    from loopformer.devices import HostReads

    for _ in range(warmup):
        trainer.meter.add(trainer.train_step())
        trainer.step += 1
    with HostReads() as reads:
        for _ in range(steps):
            trainer.meter.add(trainer.train_step())
            trainer.step += 1
    return reads.total / steps, dict(reads.counts)
