"""Issue 24, hostile inputs found by driving the CLI: each is refused in one line naming the key or option,
before the work it would break (never an "internal error"). Only the ``loopformer`` CLI, ``loopformer.config``
and files on disk are used, so the file runs against the code from before the fixes
(``tools/reliability_before_after.py --group "issue 24"``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from reliability_common import PUZZLE, fails_cleanly, newest_checkpoint, rewrite_manifest, tiny_recipe
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from loopformer.cli import cli
from loopformer.config import build_config

HUGE = "1000000000000"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a tiny trained 4x4 Sudoku run, its recipe file)."""
    from loopformer.train.trainer import Trainer

    root = tmp_path_factory.mktemp("inputs")
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(), sort_keys=False))
    Trainer(build_config({**tiny_recipe(), "out_dir": str(root / "run")})).fit()
    return root / "run", recipe


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


# (eval arguments after the run, what the message names): loop counts whose per-step history cannot fit,
# variants and auto-solver options checked before any evaluation
EVAL_CASES = [
    (["-s", f"loop_eval.max_steps={HUGE}"], f"loop_eval.max_steps={HUGE}"),
    (["--max-steps", HUGE], f"--max-steps {HUGE}"),
    (["--lens-loops", HUGE, "--analyses"], f"--lens-loops {HUGE}"),
    (["--variant", "loop_eval.max_steps=0"], "--variant 'loop_eval.max_steps=0'"),
    (["--variant", f"loop_eval.max_steps={HUGE}"], f"loop_eval.max_steps={HUGE}"),
    (["--variant", "eval.segments=0"], "eval.segments must be >= 1"),
    (["--auto-solver", "--auto-solver-slice", "2"], "--auto-solver-slice"),
    (["--auto-solver", "--auto-solver-slice", "nan"], "--auto-solver-slice"),
    (["--auto-solver", "--auto-solver-tolerance", "nan"], "--auto-solver-tolerance"),
    (["-s", "loop_eval.max_steps=3", "-s", "loop_eval.max_steps=4"], "loop_eval.max_steps is already given"),
    (["-t", "min_blanks=abc"], "data.eval_generate.min_blanks"),
    (["-s", "data.options.box=3"], "data.options.box"),
]


@pytest.mark.parametrize(("args", "needle"), EVAL_CASES, ids=[" ".join(a) for a, _ in EVAL_CASES])
def test_eval_refuses_hostile_options_before_evaluating(trained, tmp_path, args, needle) -> None:
    run, _ = trained
    out = tmp_path / "report"
    analyses = [] if "--analyses" in args else ["--no-analyses"]
    args = [a for a in args if a != "--analyses"]
    text = fails_cleanly(invoke("eval", str(run), *analyses, "-o", str(out), *args), needle)
    assert "evaluating" not in text  # refused before the held-out set was scored
    assert not out.exists() or not any(out.iterdir())


TRAIN_CASES = [
    (f"loop_train.max_steps={HUGE}", f"loop_train.max_steps={HUGE}"),
    (f"loop_eval.max_steps={HUGE}", f"loop_eval.max_steps={HUGE}"),
    ("model.vocab_size=3", "model.vocab_size=3"),
    ("model.seq_len=3", "model.seq_len=3"),
    ("model.grid=[3, 3]", "model.grid"),
    ("data.options.box=3", "data.options.box"),
    ("data.options.size=1.5", "data.options.size"),
    ("data.train_generate.min_blanks=abc", "data.train_generate.min_blanks"),
]


@pytest.mark.parametrize(("override", "needle"), TRAIN_CASES, ids=[o for o, _ in TRAIN_CASES])
def test_train_refuses_sizes_the_task_or_memory_cannot_hold(trained, tmp_path, override, needle) -> None:
    _, recipe = trained
    fails_cleanly(invoke("train", str(recipe), "-o", str(tmp_path / "r"), override), needle)
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_train_takes_a_whole_float_task_size(trained, tmp_path) -> None:
    _, recipe = trained
    result = invoke("train", str(recipe), "-o", str(tmp_path / "r"), "data.options.size=4.0", "train.steps=1")
    assert result.exit_code == 0, result.output


def test_train_refuses_a_key_given_twice(trained, tmp_path) -> None:
    _, recipe = trained
    fails_cleanly(invoke("train", str(recipe), "-o", str(tmp_path / "r"), "train.steps=1", "train.steps=2"),
                  "train.steps is already given")  # fmt: skip


@pytest.mark.parametrize(("override", "needle"), [
    (f"run.budgets=[{HUGE}]", f"run.budgets {HUGE}"),
    (f"run.lens_loops={HUGE}", f"run.lens_loops {HUGE}"),
    (f"run.signal_loops={HUGE}", f"run.signal_loops {HUGE}"),
    ("model.vocab_size=3", "model.vocab_size=3"),
])  # fmt: skip
def test_run_refuses_loop_counts_and_sizes_before_training(trained, tmp_path, override, needle) -> None:
    _, recipe = trained
    fails_cleanly(invoke("run", "-r", str(recipe), "-o", str(tmp_path / "out"), override), needle)
    assert not (tmp_path / "out" / "model" / "checkpoints").exists()


@pytest.mark.parametrize(("grid", "needle"), [
    (["loop_eval.max_steps=0,2"], "max_steps must be an integer >= 1"),
    (["bogus.key=1,2"], "unknown config key 'bogus'"),
    (["--max-steps", HUGE, "train.lr=1e-3,1e-4"], f"--max-steps {HUGE}"),
])  # fmt: skip
def test_sweep_checks_every_point_before_creating_its_folder(trained, tmp_path, grid, needle) -> None:
    _, recipe = trained
    fails_cleanly(invoke("sweep", str(recipe), "-o", str(tmp_path / "sweep"), *grid), needle)
    assert not (tmp_path / "sweep").exists()


def test_eval_refuses_budgets_without_a_count(trained) -> None:
    run, _ = trained
    result = invoke("eval", str(run), "--no-analyses", "--max-steps", ",")
    assert result.exit_code == 2 and "no step count" in result.output, result.output


@pytest.mark.parametrize("grid", [["train.lr=1e-3,1e-3"], ["train.lr=1e-3", "train.lr=1e-4,1e-5"]])
def test_sweep_refuses_a_repeated_value_or_key(trained, tmp_path, grid) -> None:
    _, recipe = trained
    result = invoke("sweep", str(recipe), "-o", str(tmp_path / "sweep"), *grid)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert not (tmp_path / "sweep").exists()


def test_a_maze_run_is_not_evaluated_on_another_maze_size(tmp_path) -> None:
    from loopformer.train.trainer import Trainer

    recipe = tiny_recipe(data={"task": "maze", "options": {"size": 7}, "train_generate": {"min_path": 4},
                               "eval_generate": {"min_path": 4}, "train_size": 8, "eval_size": 4},
                         model={"conv": "causal1d"})  # fmt: skip
    Trainer(build_config({**recipe, "out_dir": str(tmp_path / "maze")})).fit()
    for size in (9, 5):
        fails_cleanly(invoke("eval", str(tmp_path / "maze"), "--no-analyses", "-s", f"data.options.size={size}"),
                      f"{size}x{size} grid")  # fmt: skip


def _retyped(run: Path, dest: Path, change) -> Path:
    """A copy of ``run`` whose newest checkpoint's first matrix (model and EMA) went through ``change``."""
    shutil.copytree(run, dest)
    folder = newest_checkpoint(dest)
    for name in ("model.safetensors", "ema.safetensors"):
        tensors = load_file(str(folder / name))
        with safe_open(str(folder / name), framework="pt") as handle:
            metadata = handle.metadata()
        key = next(k for k, v in tensors.items() if v.is_floating_point() and v.dim() == 2)
        tensors[key] = change(tensors[key])
        save_file(tensors, str(folder / name), metadata=metadata)
    rewrite_manifest(folder)
    return dest


@pytest.mark.parametrize(("how", "change", "needle"), [
    ("float64", lambda t: t.double(), "float64 in the checkpoint"),
    ("int64", lambda t: t.round().long(), "int64 in the checkpoint"),
])  # fmt: skip
def test_a_checkpoint_mixing_dtypes_is_refused_not_rounded(trained, tmp_path, how, change, needle) -> None:
    run, _ = trained
    bad = _retyped(run, tmp_path / how, change)
    fails_cleanly(invoke("eval", str(bad), "--no-analyses", "-o", str(tmp_path / "report")), needle)
    fails_cleanly(invoke("solve", "sudoku", PUZZLE, "-c", str(bad)), needle)
    fails_cleanly(invoke("push", str(bad), "me/x", "--to-folder", str(tmp_path / "pushed")), needle)
    assert not (tmp_path / "pushed").exists()


def test_a_half_precision_checkpoint_still_loads(trained, tmp_path) -> None:
    run, _ = trained
    ok = _retyped(run, tmp_path / "half", lambda t: t.to(torch.bfloat16))
    result = invoke("solve", "sudoku", PUZZLE, "-c", str(ok))
    assert result.exit_code == 0, result.output


def test_push_refuses_weights_eval_would_refuse(trained, tmp_path) -> None:
    run, _ = trained
    bad = _retyped(run, tmp_path / "shape", lambda t: torch.zeros(3, 3))
    fails_cleanly(invoke("push", str(bad), "me/x", "--to-folder", str(tmp_path / "pushed")), "shape (3, 3)")
    assert not (tmp_path / "pushed").exists()


@pytest.mark.parametrize("tol", ["inf", "nan", "true", "-0.1"])
def test_eval_refuses_a_tolerance_that_is_not_a_positive_number(trained, tmp_path, tol) -> None:
    run, _ = trained
    out = tmp_path / "report"
    fails_cleanly(invoke("eval", str(run), "--no-analyses", "-o", str(out), "-s", f"loop_eval.tol={tol}"), "tol")
    assert not out.exists()


def test_compare_refuses_one_evaluation_given_twice(trained, tmp_path) -> None:
    run, _ = trained
    report = tmp_path / "report"
    assert invoke("eval", str(run), "--no-analyses", "-o", str(report)).exit_code == 0
    result = invoke("compare", str(report), str(tmp_path / "." / "report"), "-o", str(tmp_path / "c"))
    assert result.exit_code == 2 and "already gave" in result.output, result.output  # a usage error
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(("option", "value"), [("--revision", ""), ("--revision", " main"), ("--message", " ")])
def test_push_refuses_an_empty_revision_or_message(trained, tmp_path, option, value) -> None:
    run, _ = trained
    result = invoke("push", str(run), "me/model", option, value, "--to-folder", str(tmp_path / "p"))
    assert result.exit_code == 2 and option in result.output, result.output  # a usage error
    assert not (tmp_path / "p").exists()
