"""Training-harness gaps: text tasks scored by loss / bits per byte (trainer and ``loopformer eval``),
HRM folders as training data, size 0 = all rows, ``train.loop_sampler: none`` and ARC pass@2."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from test_tasks_arc import write_tasks
from test_train_utils import SEQ, VOCAB, TinyLooped, tiny_config

from loopformer.cli import cli
from loopformer.config import build_config
from loopformer.eval.evaluate import arc_pass_at_k, evaluate_lm
from loopformer.loop import LoopConfig
from loopformer.models.base import ModelOutput
from loopformer.runs import eval_dataset
from loopformer.tasks.arc import ArcTask, decode_grid
from loopformer.tasks.base import IGNORE_INDEX, Task, TokenDataset
from loopformer.tasks.formats import save_hrm_folder
from loopformer.tasks.sudoku import SudokuTask
from loopformer.tasks.text import TextTask
from loopformer.train import Trainer

TEXT_RUN = {
    "model": {"name": "transformer", "d_model": 16, "n_heads": 2, "n_layers": 1},
    "data": {"task": "text", "options": {"seq_len": 16}, "train_generate": {"split": "train"},
             "eval_generate": {"split": "val"}, "train_size": 64, "eval_size": 12},
    "train": {"steps": 2, "batch_size": 4, "progress": False, "threads": 1, "warmup_steps": 0},
    "eval": {"batch_size": 8, "use_ema": False},  # eval.check stays at its default (true)
    "device": "cpu",
}


@pytest.fixture(scope="module")
def text_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Trainer, dict]:
    out = tmp_path_factory.mktemp("text_run")
    trainer = Trainer(build_config({**TEXT_RUN, "out_dir": str(out)}))
    summary = trainer.fit()
    return out, trainer, summary


def test_text_run_saves_its_checkpoint_and_reports_loss_and_bits_per_byte(text_run) -> None:
    out, trainer, summary = text_run
    assert not trainer.task.has_validator
    assert summary["checkpoint"] and (Path(summary["checkpoint"]) / "model.safetensors").is_file()
    ev = summary["eval"]
    # oracle: float64 cross-entropy of the trained weights over the held-out windows
    data = trainer.eval_data
    with torch.no_grad():
        logits = trainer.model(torch.from_numpy(data.inputs), loop=trainer.loop_eval).logits.double()
    expected = F.cross_entropy(logits.reshape(-1, 256), torch.from_numpy(data.labels).reshape(-1)).item()
    assert ev["n"] == 12 and "valid_acc" not in ev
    assert ev["loss"] == pytest.approx(expected, rel=1e-5)
    assert ev["bits_per_byte"] == pytest.approx(expected / math.log(2), rel=1e-5)
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1]["eval_bits_per_byte"] == ev["bits_per_byte"]


def test_eval_command_prints_bits_per_byte_for_a_text_checkpoint(text_run, tmp_path) -> None:
    out, _, summary = text_run
    result = CliRunner().invoke(cli, ["eval", str(out), "--out", str(tmp_path / "ev")])
    assert result.exit_code == 0, result.output
    bpb = summary["eval"]["bits_per_byte"]  # the same held-out windows (same seed), the same weights
    assert f"bits per byte {bpb:.4f}" in result.output
    metrics = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    assert metrics["bits_per_byte"] == pytest.approx(bpb, rel=1e-6)


class _Uniform(torch.nn.Module):
    """Zero logits over ``vocab`` tokens: cross-entropy ln(vocab) at every position."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(loop=LoopConfig(max_steps=1))

    def forward(self, inputs, loop=None, puzzle_ids=None, generator=None, **_):
        logits = torch.zeros(*inputs.shape, self.vocab) + 0 * self.dummy
        return ModelOutput(logits=logits, state=torch.zeros(len(inputs), 1), loop=None)

    def blocks_per_step(self) -> int:
        return 1


def test_evaluate_lm_closed_form_and_validator_detection() -> None:
    task = TextTask(seq_len=8)
    data = task.generate(5, 0, split="val")
    data.labels[:, :3] = IGNORE_INDEX  # only labelled positions count
    res = evaluate_lm(_Uniform(256), task, data, batch_size=2)
    assert res.loss == pytest.approx(math.log(256)) and res.bits_per_byte == pytest.approx(8.0)
    assert res.tokens == 5 * 5 and res.n == 5
    assert not task.has_validator
    sudoku = SudokuTask(size=4)
    assert sudoku.has_validator


class _ToyTask(Task):
    """A finite pool of 20 rows (``generate(0)`` = all) or, with ``finite=False``, rows on demand only."""

    name = "toy"
    vocab_size = VOCAB

    def __init__(self, finite: bool = True) -> None:
        self.finite = finite

    def generate(self, n: int, seed: int, **_: object) -> TokenDataset:
        return _rows(n if n > 0 else (20 if self.finite else 0), seed)

    def check(self, inputs: np.ndarray, prediction: np.ndarray) -> bool:
        return True


def _rows(n: int, seed: int) -> TokenDataset:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, size=(n, SEQ))
    y = (3 * x + 1) % (VOCAB - 1) + 1  # no label 0: HRM's format reserves it for "no loss"
    y[:, : SEQ // 2] = IGNORE_INDEX
    return TokenDataset(x, y, rng.integers(1, 5, size=n).astype(float))


def test_trainer_reads_hrm_folders(tmp_path) -> None:
    train, test = _rows(24, 0), _rows(10, 1)
    save_hrm_folder(train, tmp_path / "hrm", "train", vocab_size=VOCAB)
    save_hrm_folder(test, tmp_path / "hrm", "test", vocab_size=VOCAB)
    for eval_path in (tmp_path / "hrm", tmp_path / "hrm" / "test"):  # the root or the split folder
        cfg = tiny_config(tmp_path / "run", f"data.train_path={tmp_path / 'hrm'}", f"data.eval_path={eval_path}")
        tr = Trainer(cfg, model=TinyLooped(), task=_ToyTask())
        for got, want in ((tr.train_data, train), (tr.eval_data, test)):
            np.testing.assert_array_equal(got.inputs, want.inputs)
            np.testing.assert_array_equal(got.labels, want.labels)
            np.testing.assert_array_equal(got.difficulty, want.difficulty)
        assert len(eval_dataset(_ToyTask(), cfg)) == 10
    assert tr.fit()["eval"]["n"] == 10


def test_size_zero_means_all_rows(tmp_path) -> None:
    cfg = tiny_config(tmp_path, "data.train_size=0", "data.eval_size=0")
    tr = Trainer(cfg, model=TinyLooped(), task=_ToyTask())
    assert len(tr.train_data) == 20 and len(tr.eval_data) == 20
    with pytest.raises(ValueError, match="train_size"):  # a generator has no "all rows"
        Trainer(cfg, model=TinyLooped(), task=_ToyTask(finite=False))
    with pytest.raises(ValueError, match="eval_size"):
        Trainer(tiny_config(tmp_path, "data.eval_size=-1"), model=TinyLooped(), task=_ToyTask())
    assert Trainer(tiny_config(tmp_path, "data.eval_size=0"), model=TinyLooped(),
                   task=_ToyTask(finite=False)).eval_data is None


def test_loop_sampler_none_keeps_the_configured_halting(tmp_path) -> None:
    loop = ["loop_train.halting=residual", "loop_train.tol=100.0", "loop_train.max_steps=8", "train.steps=2"]
    fixed = Trainer(tiny_config(tmp_path / "a", *loop), model=TinyLooped(), task=_ToyTask())
    m = fixed.train_step()
    assert m["loops"] == 8 and m["loop_steps"] == 8.0  # the default sampler forces exactly max_steps
    adaptive = Trainer(tiny_config(tmp_path / "b", *loop, "train.loop_sampler=none"), model=TinyLooped(),
                       task=_ToyTask())
    m = adaptive.train_step()
    assert "loops" not in m and m["loop_steps"] < 8.0  # residual halting (tol 100) stops at once
    assert adaptive.fit()["steps"] == 2


# ------------------------------------------------------------------------------------------------ ARC


class _ArcOracle(torch.nn.Module):
    """Answers each known input canvas with ``answers[input]``; ``garbage`` rows get an all-PAD canvas."""

    def __init__(self, answers: dict[bytes, np.ndarray]) -> None:
        super().__init__()
        self.answers = answers
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(loop=LoopConfig(max_steps=1))

    def forward(self, inputs, loop=None, puzzle_ids=None, generator=None, **_):
        rows = [self.answers.get(x.numpy().tobytes(), np.zeros(x.shape[0], dtype=np.int64)) for x in inputs]
        target = torch.as_tensor(np.stack(rows))
        return ModelOutput(logits=F.one_hot(target, 12).float(), state=torch.zeros(len(inputs), 1), loop=None)

    def blocks_per_step(self) -> int:
        return 1


def test_arc_pass_at_2_votes_over_augmentations(tmp_path) -> None:
    write_tasks(tmp_path / "tasks")
    task = ArcTask(tmp_path / "tasks", augmentations=3)
    test = task.generate(0, 0, part="test")
    right = {x.tobytes(): y for x, y in zip(test.inputs, test.labels)}
    res = arc_pass_at_k(_ArcOracle(right), task, batch_size=3)
    assert res["score"] == 1.0 and res["outputs"] == 3 and res["rows"] == len(test)
    # only the identity version answers (the others emit invalid canvases, dropped from the vote)
    versions = np.asarray([task.task_version(p)[1] for p in test.puzzle_ids])
    only_v0 = {x.tobytes(): y for x, y, v in zip(test.inputs, test.labels, versions) if v == 0}
    assert arc_pass_at_k(_ArcOracle(only_v0), task)["score"] == 1.0
    # copying the input is wrong everywhere
    copy = {x.tobytes(): x for x in test.inputs}
    assert arc_pass_at_k(_ArcOracle(copy), task)["score"] == 0.0
    # task aaa right, bbb: pair 0 right, pair 1 wrong -> (1 + 1/2) / 2
    half = dict(right)
    for x in test.inputs:
        if decode_grid(x).size == 1:  # bbb's [[7]] under every augmentation
            half[x.tobytes()] = x
    res = arc_pass_at_k(_ArcOracle(half), task)
    assert res["score"] == pytest.approx(0.75) and res["all_solved"] == 0.5


def test_eval_command_prints_arc_pass_at_2(tmp_path) -> None:
    write_tasks(tmp_path / "tasks")
    raw = {
        "model": {"name": "transformer", "d_model": 8, "n_heads": 2, "n_layers": 1, "puzzle_emb_len": 1},
        "data": {"task": "arc", "options": {"source": str(tmp_path / "tasks"), "augmentations": 1},
                 "train_size": 0, "eval_size": 0, "eval_generate": {"part": "test"}},
        "train": {"steps": 1, "batch_size": 2, "progress": False, "threads": 1},
        "eval": {"batch_size": 8},
        "device": "cpu", "out_dir": str(tmp_path / "run"),
    }
    trainer = Trainer(build_config(raw))
    assert len(trainer.train_data) == 3 * 2 and len(trainer.eval_data) == 3 * 2  # all rows x 2 versions
    trainer.fit()
    result = CliRunner().invoke(cli, ["eval", str(tmp_path / "run"), "--no-analyses", "--out", str(tmp_path / "ev")])
    assert result.exit_code == 0, result.output
    assert "ARC pass@2" in result.output
    metrics = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    assert metrics["arc_pass_at_2"]["outputs"] == 3


def test_run_command_scores_a_text_recipe_by_bits_per_byte(tmp_path) -> None:
    import yaml

    recipe = tmp_path / "lm.yaml"
    recipe.write_text(yaml.safe_dump({**TEXT_RUN, "model": {"name": "recurrent", "d_model": 16, "n_heads": 2,
                                                             "n_layers": 1}}))
    result = CliRunner().invoke(cli, ["run", "-r", str(recipe), "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "out" / "summary.json").read_text())["results"]
    assert list(results) == ["recurrent", "baseline (transformer)"]
    for r in results.values():
        assert r["n"] == 12 and r["bits_per_byte"] == pytest.approx(r["loss"] / math.log(2))
