"""Issue 49, the researcher's records: ``compare`` reads runs straight out of ``train`` (their final held-out
evaluation, each row saying which evaluation it is); ``export`` -> ``convert`` -> ``eval`` gives back the
original run's numbers (data spec, held-out set, evaluation protocol and EMA weights travel in
``all_config.yaml``'s ``loopformer_data.run``); metrics that do not apply are left out (no convergence share
under fixed halting, no exact accuracy for a language model, step budgets clipped to the model's cap);
``translate`` names every key it did not translate."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from loopformer.cli import cli
from loopformer.eval.budget import clip_budgets

FPRM = {
    "base": "sudoku4_fprm",
    "model": {"d_model": 16, "n_heads": 2, "n_layers": 1},
    "data": {"train_size": 16, "eval_size": 6, "train_generate": {"min_blanks": 4, "max_blanks": 8},
             "eval_generate": {"min_blanks": 4, "max_blanks": 8}},
    "train": {"steps": 3, "batch_size": 8, "max_segments": 2, "progress": False, "threads": 1, "eval_every": 0,
              "checkpoint_every": 0},
    "loop_train": {"max_steps": 2, "grad_steps": 2},
    "loop_eval": {"max_steps": 8},
    "device": "cpu",
}  # fmt: skip
TRM = {
    "base": "sudoku4_trm",
    "model": {"d_model": 16, "n_heads": 2, "n_layers": 1, "n_inner": 2},
    "data": {"train_size": 16, "eval_size": 12},
    "train": {"steps": 4, "batch_size": 8, "max_segments": 2, "progress": False, "threads": 1, "eval_every": 0,
              "checkpoint_every": 0},
    "eval": {"segments": 2},
    "device": "cpu",
}  # fmt: skip


def invoke(*args: str) -> str:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def train(folder: Path, recipe: dict, name: str, *overrides: str) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    invoke("train", path, "-o", folder / name, *overrides)
    return folder / name


def test_compare_reads_runs_straight_out_of_train(tmp_path: Path) -> None:
    a = train(tmp_path, FPRM, "a")
    b = train(tmp_path, FPRM, "b", "model.n_layers=2")
    out = tmp_path / "cmp"
    text = invoke("compare", a, b, "-o", out)
    assert "end of training" in text
    rows = json.loads((out / "comparison.json").read_text())["rows"]
    for row, run, layers in zip(rows, (a, b), (1, 2), strict=True):
        final = json.loads((run / "summary.json").read_text())["eval"]
        assert row["evaluation"] == f"end of training, step 3 ({final['weights']} weights)"
        assert (row["valid_accuracy"], row["mean_loops"], row["examples"]) == (
            final["valid_acc"], final["loop_steps"], final["n"])  # fmt: skip
        assert row["test_time_compute"] == pytest.approx(final["loop_steps"] * layers)  # FPRM: loops x n_layers
    assert "`evaluation`" in (out / "comparison.md").read_text()
    # a run's final evaluation and an eval report of another run share the held-out set: they compare
    invoke("eval", b, "-o", tmp_path / "b_eval", "--no-analyses")
    invoke("compare", a, tmp_path / "b_eval", "-o", tmp_path / "cmp2")
    rows = json.loads((tmp_path / "cmp2" / "comparison.json").read_text())["rows"]
    assert rows[1]["evaluation"].startswith("eval report b_eval of ")


def test_export_convert_eval_gives_back_the_run(tmp_path: Path) -> None:
    run = train(tmp_path, TRM, "trm")
    invoke("export", "trm", run, "-o", tmp_path / "ckpt" / "step_4")
    record = yaml.safe_load((tmp_path / "ckpt" / "all_config.yaml").read_text())["loopformer_data"]["run"]
    assert record["weights"] == "ema" and record["config"]["data"]["eval_size"] == 12
    back = tmp_path / "trm_back"
    assert "restored" in invoke("convert", "trm", tmp_path / "ckpt" / "step_4", "-o", back)
    original, converted = json.loads((run / "config.json").read_text()), json.loads((back / "config.json").read_text())
    for section in ("data", "eval", "loop_eval", "seed"):
        assert converted[section] == original[section], section
    metrics = {}
    for name, folder in (("original", run), ("converted", back)):
        invoke("eval", folder, "-o", tmp_path / f"{name}_eval", "--no-analyses", "--max-steps", "1,2")
        metrics[name] = json.loads((tmp_path / f"{name}_eval" / "metrics.json").read_text())
    ours, theirs = metrics["original"], metrics["converted"]
    assert ours["heldout"] == theirs["heldout"] and ours["heldout"]["rows"] == 12
    for key in ("n", "valid_accuracy", "exact_accuracy", "token_accuracy", "mean_steps", "mean_blocks"):
        assert ours["results"]["trm"][key] == theirs["results"]["trm"][key], key
    assert ours["budget"] == theirs["budget"]
    # the original's evaluation used its EMA weights: so did the converted run's, which holds only them
    assert ours["checkpoint"]["label"].startswith("latest") and "ema" in (tmp_path / "ckpt" / "all_config.yaml").read_text()


def test_metrics_that_do_not_apply_are_left_out() -> None:
    import torch

    from loopformer.eval.evaluate import evaluate, evaluate_lm
    from loopformer.loop import LoopConfig
    from loopformer.models.registry import build_model, make_config
    from loopformer.tasks.sudoku import SudokuTask
    from loopformer.tasks.text import TextTask

    task = SudokuTask(4)
    data = task.generate(6, seed=1)
    torch.manual_seed(0)
    model = build_model("fprm", config=make_config("fprm", vocab_size=task.vocab_size, seq_len=16, d_model=16,
                                                   n_heads=2, n_layers=1, grid=(4, 4))).eval()  # fmt: skip
    fixed = evaluate(model, task, data, loop=LoopConfig(halting="fixed", max_steps=3))
    assert math.isnan(fixed.converged_fraction) and "converged" not in fixed.summary()
    residual = evaluate(model, task, data, loop=LoopConfig(halting="residual", max_steps=3, tol=1e9))
    assert residual.converged_fraction == 1.0 and residual.summary()["converged"] == 1.0
    text = TextTask(seq_len=8)
    lm = build_model("recurrent", config=make_config("recurrent", vocab_size=text.vocab_size, seq_len=8,
                                                      d_model=16, n_heads=2, n_layers=1)).eval()  # fmt: skip
    result = evaluate_lm(lm, text, text.generate(4, seed=0), loop=LoopConfig(halting="fixed", max_steps=2))
    assert "exact_acc" not in result.summary() and "exact_accuracy" not in result.to_dict()
    # capped budgets above the cap give way to the cap, with a note; fixed budgets are kept
    budgets, note = clip_budgets([1, 2, 4, 8, 16], "capped", 3)
    assert budgets == [1, 2, 3] and note is not None
    assert note.startswith("Step budgets 4, 8, 16 exceed the evaluation loop's cap (3 steps)")
    assert clip_budgets([1, 8], "fixed", 3) == ([1, 8], None) and clip_budgets([1, 3], "capped", 3) == ([1, 3], None)


def test_translate_names_every_key_it_did_not_translate() -> None:
    words = ["python", "pretrain.py", "arch=trm", "data_path=data/sudoku-extreme-1k-aug-1000", "epochs=50000",
             "eval_interval=5000", "lr=1e-4", "arch.L_cycles=4"]  # fmt: skip
    text = invoke("translate", "trm", *words)
    untranslated = next(line for line in text.splitlines() if line.startswith("not translated"))
    for key in ("data_path", "epochs", "eval_interval"):
        assert key in untranslated
    assert "train.lr=0.0001" in text and "model.n_inner=4" in text


def test_data_writes_parquet_the_datasets_library_reads(tmp_path: Path) -> None:
    """``loopformer data sudoku --format parquet``: one row per example, the generated set's tokens as they are
    (pyarrow's reader; ``datasets.load_dataset("parquet")`` too where the library is installed)."""
    import importlib.util

    import numpy as np

    pq = pytest.importorskip("pyarrow.parquet")
    from loopformer.tasks.sudoku import SudokuTask

    out = tmp_path / "sudoku.parquet"
    invoke("data", "sudoku", "--size", "4", "--count", "5", "--seed", "3", "--format", "parquet", "-o", out)
    expected = SudokuTask(4).generate(5, seed=3)
    table = pq.read_table(out)
    assert table.column_names == ["inputs", "labels", "difficulty"] and table.num_rows == 5
    assert np.array_equal(np.array(table.column("inputs").to_pylist()), expected.inputs)
    assert np.array_equal(np.array(table.column("labels").to_pylist()), expected.labels)
    assert json.loads(table.schema.metadata[b"loopformer"])["task"] == expected.meta["task"]
    if importlib.util.find_spec("datasets") is not None:
        import datasets

        rows = datasets.load_dataset("parquet", data_files=str(out), split="train")
        assert rows[0]["inputs"] == expected.inputs[0].tolist()
