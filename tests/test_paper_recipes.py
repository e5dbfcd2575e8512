"""Every recipe loads with all keys valid (fast); the paper-scale recipes dry-run on the user's kind of files (slow).

The dry runs write small files of the formats the paper recipes name (Sudoku-Extreme and Maze-Hard CSV,
a folder of ARC task JSON files, a plain text corpus) into tmp_path, point the recipe at them with
overrides, shrink the model to a tiny width and train a couple of steps through the real Trainer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from loopformer.config import ConfigError, RunConfig, load_config, read_recipe
from loopformer.tasks.token_file import prepare_text

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
PAPER_TASKS = ("sudoku_extreme", "maze_hard", "arc1")
PAPER_MODELS = ("fprm", "attractor", "trm", "hrm")
PAPER_LM = ("attractor", "transformer", "parcae")


def _load_any(path: Path, tmp_path: Path) -> RunConfig:
    """A recipe's RunConfig; recipes with a ``run:`` table (for ``loopformer run``) go through its loader."""
    if "run" in read_recipe(path):
        from loopformer.commands.run import build_run_configs

        main, _baseline, _section, _label = build_run_configs(str(path), (), tmp_path)
        return main
    return load_config(path)


def test_recipes_found() -> None:
    names = {p.stem for p in RECIPES}
    expected = {f"paper_{t}_{m}" for t in PAPER_TASKS for m in PAPER_MODELS}
    expected |= (
        {f"paper_lm_{m}_140m" for m in PAPER_LM} | {f"lm_{m}" for m in PAPER_LM} | {"attractor_sudoku4"}
    )
    assert expected <= names, sorted(expected - names)


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_loads(path: Path, tmp_path: Path) -> None:
    cfg = _load_any(path, tmp_path)
    assert isinstance(cfg, RunConfig)
    model_cfg = cfg.model_config()  # the family's config builds: every model key is a field of it
    loop = cfg.loop_config(model_cfg.loop, "train")
    assert loop.max_steps >= 1


def test_a_misspelled_key_in_a_paper_recipe_is_an_error(tmp_path: Path) -> None:
    """The loader the fast test relies on rejects unknown keys (so 'loads' means 'all keys valid')."""
    raw = yaml.safe_load((ROOT / "recipes" / "paper_sudoku_extreme_attractor_head.yaml").read_text())
    raw["model"]["n_backbones"] = 4
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="n_backbone"):
        load_config(bad)


@pytest.mark.parametrize(("task", "gamma"), [("sudoku_extreme", 0.997), ("maze_hard", 0.996)])
def test_fprm_paper_recipes_evaluate_under_the_published_protocol(task: str, gamma: float) -> None:
    """The model card of the released checkpoints (huggingface.co/fixed-point-reasoners/fprm): max_iter 35000,
    step decay 0.997 (Sudoku) / 0.996 (maze), patience 10, best checkpoint; the trainer's own evaluations keep
    the authors' in-run protocol (config/cfg_pretrain_*.yaml: max_iter_eval 1000, decay 0.99, patience 5)."""
    from click.testing import CliRunner

    from loopformer.cli import cli

    cfg = load_config(ROOT / "recipes" / f"paper_{task}_fprm.yaml")
    base = cfg.model_config().loop
    published, periodic = cfg.loop_config(base, "eval"), cfg.loop_config(base, "periodic")
    assert (published.max_steps, published.options_for("damped").gamma, published.options_for("damped").patience) == (35000, gamma, 10)
    assert (periodic.max_steps, periodic.options_for("damped").gamma, periodic.options_for("damped").patience) == (1000, 0.99, 5)
    for loop in (published, periodic):
        assert (loop.solver, loop.halting, loop.tol, loop.residual_norm) == (
            "damped",
            "batch_residual",
            0.1,
            "rel_sup",
        )
        assert loop.options_for("damped").min_step == 1e-3
    assert cfg.train.keep_best == "exact_acc" and cfg.train.keep_best_mode == "max"
    # the reference's precision: FixedPointOptimizer keeps the iterate and its step size in bf16
    assert {cfg.loop_config(base, p).state_dtype for p in ("train", "eval", "periodic")} == {"bfloat16"}
    assert cfg.bf16 is True
    shown = CliRunner().invoke(cli, ["train", f"paper_{task}_fprm", "--print-config"])
    assert shown.exit_code == 0, shown.output
    printed = yaml.safe_load(shown.output)
    assert printed["loop_eval"]["max_steps"] == 35000
    damped = {"gamma": gamma, "patience": 10, "min_step": 1e-3, "min_improvement": 0.0}
    assert printed["loop_eval"]["damped"] == damped
    assert printed["train"]["keep_best"] == "exact_acc"


def _reference_block(d: int, inter: int) -> int:
    """One TransformerPreNormBlock of github jacobfa/Attractor: q, k, v, out (d x d, no bias), BaseMLP d x inter
    and inter x d, two RMSNorm gains (its qk-norm is parameter-free)."""
    return 4 * d * d + 2 * d * inter + 2 * d


def _value_embeddings(vocab: int, d: int, heads: int, n_layers: int) -> int:
    """The reference's value embeddings (attractor/modules/mixer.py has_ve: layers i with i % 2 == (n - 1) % 2,
    a vocab x d table each and a ve_gate Linear(32, heads))."""
    return sum(vocab * d + 32 * heads for i in range(n_layers) if i % 2 == (n_layers - 1) % 2)


def _reference_gpt(vocab: int) -> tuple[int, int]:
    """attractor/configs/gpt/gpt-small-140m.py in closed form: (all parameters, value-embedding part)."""
    d, inter, layers, heads = 768, 3072, 6, 6
    ve = _value_embeddings(vocab, d, heads, layers)
    return layers * _reference_block(d, inter) + vocab * d + d + ve, ve  # blocks, tied wte, ln_f


def _reference_parcae(vocab: int) -> tuple[int, int]:
    """attractor/configs/parcae/parcae-small-140m.py with attractor/models/parcae/parcae.py in closed form:
    prelude 2 + core 2 + coda 2 blocks, tied wte, ln_f, ln_prelude, C (d x d), the diagonal injection's A_log,
    dt_bias (d each) and B (d x d), value embeddings on 3 of the 6 effective layers."""
    d, inter, heads = 768, 3072, 6
    ve = _value_embeddings(vocab, d, heads, 6)
    return 6 * _reference_block(d, inter) + vocab * d + 2 * d + d * d + 2 * d + d * d + ve, ve


def test_paper_lm_recipes_have_the_reference_parameter_counts() -> None:
    """Each 140M LM recipe builds (on the meta device) with the parameter count of its authors' config at
    byte-level vocabulary and at the authors' 32768 (the paper's ~140M), counted independently in closed form
    from the configs' dimensions (docs/fidelity.md, "Attractor paper baselines")."""
    import torch

    from loopformer.models.registry import build_model

    def count(name: str, vocab: int) -> int:
        cfg = load_config(ROOT / "recipes" / f"paper_lm_{name}_140m.yaml")
        model_cfg = cfg.model_config(vocab_size=vocab, seq_len=2048, causal=True)
        with torch.device("meta"):
            model = build_model(cfg.model.name, config=model_cfg)
        return sum(p.numel() for p in model.parameters())

    counts = {name: count(name, 256) for name in PAPER_LM}
    # the Attractor recipe has the authors' 140M architecture (attractor-small-140m.py: 134.24M with their
    # 32768-token vocabulary, 100.94M at 256 bytes; tests/test_parity_attractor_lm.py checks its layers)
    assert counts["attractor"] == 134_237_184 - (32768 - 256) * 1024, counts
    for name, reference in (("transformer", _reference_gpt), ("parcae", _reference_parcae)):
        total, ve = reference(256)
        assert counts[name] == total and ve > 0, (name, counts[name], total, ve)
        # a tokenized corpus at the authors' vocabulary (data.options.vocab_size)
        total, ve = reference(32768)
        assert 140e6 < total < 146e6, name  # the paper's "140M" size class
        assert count(name, 32768) == total, name
    assert counts["transformer"] == 43_264_320 and counts["parcae"] == 44_446_272, counts


@pytest.mark.parametrize("task", ["sudoku_extreme", "maze_hard"])
def test_paper_attractor_head_recipes_are_the_authors_sudoku_27m_config(task: str) -> None:
    """``paper_*_attractor_head`` build the architecture of github jacobfa/Attractor
    ``attractor/configs/attractor/attractor-sudoku-27m.py``: 4 backbone + 4 head blocks at d 512 with a ReLU^2 MLP
    of 2304, qk-norm, two per-channel gates per head block, tied embedding, final norm; counted in closed form
    (the reference pads the 11-token vocabulary to 16 rows, loopformer does not: 5 rows fewer)."""
    import torch

    from loopformer.models.registry import build_model

    cfg = load_config(ROOT / "recipes" / f"paper_{task}_attractor_head.yaml")
    vocab, seq = (11, 81) if task == "sudoku_extreme" else (6, 900)
    mc = cfg.model_config(vocab_size=vocab, seq_len=seq, causal=False)
    assert (mc.n_backbone, mc.n_layers, mc.mlp, mc.qk_norm) == (4, 4, "relu2", True)
    assert (mc.layer_scale_init, mc.gamma_max, mc.norm_eps, mc.init) == (0.5, 0.75, 1e-5, "scaled_zero")
    with torch.device("meta"):
        model = build_model(cfg.model.name, config=mc)
    d = 512
    expected = 8 * _reference_block(d, 2304) + 4 * 2 * d + vocab * d + d
    assert sum(p.numel() for p in model.parameters()) == expected
    loop = cfg.loop_config(mc.loop, "train")
    assert (loop.solver, loop.halting, loop.tol, loop.min_steps, loop.max_steps) == (
        "anderson_attractor", "batch_residual", 3e-4, 4, 12,
    )  # fmt: skip
    assert (loop.grad, loop.grad_steps, loop.options_for("neumann").clip) == ("neumann", 1, 1.0)
    assert (cfg.train.head_lr_scale, cfg.train.head_weight_decay) == (0.5, 0.0)


# ------------------------------------------------------------------------------------------------
# slow: dry runs on small generated files
# ------------------------------------------------------------------------------------------------
TINY = [
    "model.d_model=16",
    "model.n_heads=2",
    "train.steps=2",
    "train.batch_size=4",
    "train.warmup_steps=1",
    "train.log_every=1",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "train.progress=false",
    "train.threads=1",
    "eval.batch_size=8",
    "device=cpu",
]


def _sudoku_files(tmp_path: Path) -> tuple[Path, Path]:
    from loopformer.tasks.sudoku import SudokuTask

    task = SudokuTask(9)
    full = tmp_path / "sudoku_train_full.csv"
    task.save(task.generate(12, seed=0, min_blanks=20, max_blanks=30), full)
    test = tmp_path / "sudoku_test.csv"
    task.save(task.generate(6, seed=1, min_blanks=20, max_blanks=30), test)
    train = tmp_path / "sudoku_1k_aug.csv"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "experiments" / "attractor_paper_data.py"),
            "sudoku",
            "--csv",
            str(full),
            "--out",
            str(train),
            "--subset",
            "4",
            "--augment",
            "2",
        ],
        check=True,
        cwd=ROOT,
    )
    assert len(task.load(train)) == 12  # 4 puzzles + 2 augmented copies each
    return train, test


def _maze_files(tmp_path: Path) -> tuple[Path, Path]:
    from loopformer.tasks.maze import MazeTask

    task = MazeTask(30)
    full = tmp_path / "maze_train.csv"
    task.save(task.generate(4, seed=0), full)
    test = tmp_path / "maze_test.csv"
    task.save(task.generate(3, seed=1), test)
    train = tmp_path / "maze_train_aug.csv"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "experiments" / "attractor_paper_data.py"),
            "maze",
            "--csv",
            str(full),
            "--out",
            str(train),
            "--augment",
            "1",
        ],
        check=True,
        cwd=ROOT,
    )
    assert len(task.load(train)) == 8
    return train, test


def _arc_folder(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    folder = tmp_path / "arc" / "evaluation"
    folder.mkdir(parents=True)
    for t in range(3):

        def pair() -> dict:
            grid = rng.integers(0, 10, size=(3, 4)).tolist()
            return {"input": grid, "output": [row[::-1] for row in grid]}  # mirror task

        (folder / f"task{t}.json").write_text(json.dumps({"train": [pair(), pair()], "test": [pair()]}))
    return tmp_path / "arc"


def _loop_overrides(recipe: Path) -> list[str]:
    """Short solver caps for the dry run, only where the recipe sets its own loop tables."""
    raw = read_recipe(recipe)
    out = []
    for table in ("loop_train", "loop_eval", "loop_periodic"):
        if "max_steps" in (raw.get(table) or {}):
            out += [f"{table}.min_steps=1", f"{table}.max_steps={2 if table == 'loop_train' else 4}"]
            if (raw.get(table) or {}).get("grad") == "truncated":
                out.append(f"{table}.grad_steps=2")
    return out


def _dry_run(recipe: Path, overrides: list[str], tmp_path: Path) -> dict:
    from loopformer.train import Trainer

    # a puzzle row as wide as d_model (FPRM / TRM: puzzle_emb_dim = hidden size) shrinks with it
    tied = ["model.puzzle_emb_dim=16"] if "puzzle_emb_dim" in (read_recipe(recipe).get("model") or {}) else []
    cfg = load_config(
        recipe, [*TINY, *tied, *_loop_overrides(recipe), *overrides, f"out_dir={tmp_path / recipe.stem}"]
    )
    summary = Trainer(cfg).fit()
    assert summary["steps"] == 2
    assert np.isfinite(summary["train"]["loss"])
    assert summary["eval"]["n"] > 0
    return summary


@pytest.mark.slow
@pytest.mark.parametrize("model", PAPER_MODELS)
def test_paper_sudoku_extreme_dry_run(model: str, tmp_path: Path) -> None:
    train, test = _sudoku_files(tmp_path)
    _dry_run(
        ROOT / "recipes" / f"paper_sudoku_extreme_{model}.yaml",
        [f"data.train_path={train}", f"data.eval_path={test}", "train.max_segments=2", "eval.segments=2"],
        tmp_path,
    )


@pytest.mark.slow
@pytest.mark.parametrize("model", PAPER_MODELS)
def test_paper_maze_hard_dry_run(model: str, tmp_path: Path) -> None:
    train, test = _maze_files(tmp_path)
    _dry_run(
        ROOT / "recipes" / f"paper_maze_hard_{model}.yaml",
        [
            f"data.train_path={train}",
            f"data.eval_path={test}",
            "train.max_segments=2",
            "eval.segments=2",
            "eval.batch_size=4",
        ],
        tmp_path,
    )


@pytest.mark.slow
@pytest.mark.parametrize("model", PAPER_MODELS)
def test_paper_arc1_dry_run(model: str, tmp_path: Path) -> None:
    folder = _arc_folder(tmp_path)
    subsets = ["data.options.subsets=[evaluation]"]  # TRM / HRM protocol (all four recipes)
    if model == "attractor":  # TRM-DEQ at 900 tokens: 8 layers x 8 evaluations x 3 cycles takes minutes
        subsets += ["model.n_layers=2", "model.deq_max_iter=3", "model.deq_min_iter=2"]
    _dry_run(
        ROOT / "recipes" / f"paper_arc1_{model}.yaml",
        [
            f"data.options.source={folder}",
            "data.options.augmentations=1",
            "data.train_size=8",
            "data.eval_size=4",
            "train.max_segments=2",
            "eval.segments=2",
            *subsets,
        ],
        tmp_path,
    )


@pytest.mark.slow
@pytest.mark.parametrize("model", PAPER_LM)
def test_paper_lm_dry_run(model: str, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    words = ["loop", "fixed", "point", "attractor", "the", "model", "solves", "a", "puzzle", "with", "depth"]
    (corpus / "a.txt").write_text(" ".join(rng.choice(words, size=1500)))
    (corpus / "b.md").write_text(" ".join(rng.choice(words, size=1500)))
    tokens = tmp_path / "tokens"  # as the recipes' headers say: a token file, streamed
    tokens.mkdir()
    prepare_text(tokens, corpus, shuffle=True)
    _dry_run(
        ROOT / "recipes" / f"paper_lm_{model}_140m.yaml",
        [
            f"data.options.path={tokens}",
            "data.options.seq_len=32",
            "data.options.val_fraction=0.25",
            "data.eval_size=8",
            "model.n_layers=2",
            "bf16=false",
            "train.micro_batch_size=2",  # the recipes' 32 at batch 4: micro-batches of 2 ...
            "loop_train.halt_group=2",  # ... and the Attractor's halting groups inside them
        ],
        tmp_path,
    )
