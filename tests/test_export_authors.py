"""Exports run by the authors' own code (issue 49).

``tools/parity/export_authors.py`` trained tiny loopformer runs on the CPU in float32, exported them with
``loopformer export`` and ran each export through TinyRecursiveModels' / HRM's own code as their scripts do
(``PretrainConfig`` of all_config.yaml, ``create_dataloader``, ``create_model`` with ``torch.compile``, TRM's
``load_checkpoint`` / HRM's ``evaluate.py`` strict load, their evaluation loop: ``halt_max_steps`` = 8 steps
on 50 test puzzles); the fixtures hold the export and what their model computed. Three runs: ``export_trm``
(no puzzle embedding, as every CPU TRM recipe), ``export_trm_puzzle`` (TRM's puzzle tokens) and
``export_hrm`` (``model.l_layers`` at its default 0).

Here, without the authors' code: the exported checkpoint goes through ``loopformer convert`` (the path a
user walks back) and loopformer's forward must give their logits and halting decisions; ``loopformer
export`` of that run must write every key their ``PretrainConfig`` requires, none of the keys their
``create_model`` passes itself beside ``arch``, the dtype the run trained in, and the same weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner
from torch import Tensor

from loopformer.cli import cli
from loopformer.convert.fixtures import FIXTURE_DIR, load_fixture, prefixed
from loopformer.runs import load_run

NAMES = {"export_trm": "trm", "export_trm_puzzle": "trm", "export_hrm": "hrm"}
# float32 against float32 with other kernels and operation orders, carried through 8 steps of 2 cycles x 3
# net calls: at generation the largest differences were 7.9e-6 (TRM), 4.8e-5 (TRM with puzzle tokens) and
# 9.1e-6 (HRM), and loopformer's float64 forward of the same weights is as far from the authors' float32
# logits (checked below): what is left is float32 rounding.
ATOL = 2e-4


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> the run ``loopformer convert`` writes from the exported checkpoint (all_config.yaml beside)."""
    out = tmp_path_factory.mktemp("converted")
    runs = {}
    for name, system in NAMES.items():
        _, meta = load_fixture(name)
        run = out / name
        args = ["convert", system, str(FIXTURE_DIR / meta["checkpoint"]), "-o", str(run)]
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
        runs[name] = run
    return runs


def forward(model: Any, batch: dict[str, Tensor], steps: int, system: str) -> tuple[Tensor, Tensor, Tensor]:
    """Chained forwards from the initial state: logits [S, N, T, V], Q logits [S, N, 2 or 1], halting
    decisions (TRM: q_halt > 0, no_ACT_continue; HRM: q_halt > q_continue)."""
    logits, q, halt, state = [], [], [], None
    with torch.no_grad():
        for _ in range(steps):
            out = model(batch["inputs"].long(), state=state, puzzle_ids=batch["puzzle_identifiers"].long())
            state = out.state
            logits.append(out.logits)
            if system == "hrm":
                qv = model.q_values(out.state)
                q.append(qv)
                halt.append(qv[:, 0] > qv[:, 1])
            else:
                q.append(out.q_logits.unsqueeze(-1))
                halt.append(out.q_logits > 0)
    return torch.stack(logits), torch.stack(q), torch.stack(halt)


@pytest.mark.parametrize("name", list(NAMES))
def test_loopformer_gives_the_authors_logits_and_halting(name: str, converted: dict[str, Path]) -> None:
    tensors, meta = load_fixture(name)
    system, batch = NAMES[name], prefixed(tensors, "batch")
    theirs, steps = tensors["authors.logits"], tensors["authors.logits"].shape[0]
    assert meta["authors"]["forward_dtype"] == "float32" and theirs.dtype == torch.float32
    model = load_run(converted[name]).model.eval()
    logits, q, halt = forward(model, batch, steps, system)
    diff = (logits - theirs).abs()
    assert diff.max() <= ATOL, f"{name}: largest logit difference {diff.max():.3g}"
    assert torch.equal(logits.argmax(-1), theirs.argmax(-1))
    assert torch.equal(halt, tensors["authors.halt"])
    assert 0 < int(halt.sum()) < halt.numel()  # the run halts on some puzzles, not on all
    theirs_q = torch.stack([tensors["authors.q_halt"], tensors["authors.q_continue"]], -1)[..., : q.shape[-1]]
    torch.testing.assert_close(q, theirs_q, rtol=0, atol=ATOL)
    # the difference is float32's: loopformer in float64 is as far from the authors' float32 logits
    logits64, _, halt64 = forward(model.double(), batch, steps, system)
    diff64 = (logits64.float() - theirs).abs()
    assert diff.max() <= 4 * diff64.max() + 1e-5, (float(diff.max()), float(diff64.max()))
    assert torch.equal(halt64, halt)


def authors_config_problems(config: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    """What in an all_config.yaml the authors' code (as recorded by the fixture script) would refuse."""
    authors, arch = meta["authors"], config.get("arch", {})
    problems = [f"missing {k!r} (their PretrainConfig requires it)"
                for k in authors["pretrain_config_required"] if k not in config]  # fmt: skip
    problems += [f"arch.{k}: create_model passes it itself (TypeError: multiple values)"
                 for k in authors["create_model_supplies"] if k in arch]  # fmt: skip
    problems += [f"arch lacks {k!r} (their model config requires it)"
                 for k in authors["model_config_required"]
                 if k not in arch and k not in authors["create_model_supplies"]]  # fmt: skip
    if arch.get("forward_dtype") != meta["dtype"]:
        problems.append(f"arch.forward_dtype {arch.get('forward_dtype')!r}, trained in {meta['dtype']}")
    return problems


@pytest.mark.parametrize("name", list(NAMES))
def test_export_writes_what_the_authors_code_reads(
    name: str, converted: dict[str, Path], tmp_path: Path
) -> None:
    _, meta = load_fixture(name)
    system = NAMES[name]
    committed = yaml.safe_load((FIXTURE_DIR / name / "all_config.yaml").read_text())
    assert authors_config_problems(committed, meta) == []  # the file their code loaded
    # export of the converted run, as it is today: the same config keys and dtype, the same weights
    ckpt = tmp_path / "out" / Path(meta["checkpoint"]).name
    result = CliRunner().invoke(cli, ["export", system, str(converted[name]), "-o", str(ckpt)])
    assert result.exit_code == 0, result.output
    fresh = yaml.safe_load((ckpt.parent / "all_config.yaml").read_text())
    assert authors_config_problems(fresh, meta) == []
    assert ("data_path" in fresh) == (system == "hrm") and ("data_paths" in fresh) == (system == "trm")
    ours = torch.load(ckpt, weights_only=True)
    saved = torch.load(FIXTURE_DIR / meta["checkpoint"], weights_only=True)
    assert set(ours) == set(saved) and all(torch.equal(ours[k], saved[k]) for k in saved)
    assert fresh["arch"] == committed["arch"]
    if system == "hrm":  # the run kept model.l_layers: 0 (= n_layers); the export writes the count
        assert meta["run"]["model"]["l_layers"] == 0
        layers = meta["run"]["model"]["n_layers"]
        assert committed["arch"]["L_layers"] == committed["arch"]["H_layers"] == layers


def test_export_writes_the_dtype_the_run_trained_in() -> None:
    """bf16 autocast (true, or auto on a CUDA device) -> bfloat16; otherwise float32; a run with bf16 auto
    and no record of its device (a converted one) keeps the authors' default."""
    from loopformer.config import build_config
    from loopformer.convert.export import trained_dtype

    cfg = build_config({"model": {"name": "trm"}, "data": {"task": "sudoku", "options": {"size": 4}}})
    expected = {(True, "auto"): "bfloat16", (False, "auto"): "float32", ("auto", "cpu"): "float32",
                ("auto", "cuda"): "bfloat16", ("auto", "auto"): "bfloat16"}  # fmt: skip
    for (bf16, device), dtype in expected.items():
        cfg.bf16, cfg.device = bf16, device
        assert trained_dtype(cfg)[0] == dtype, (bf16, device)
    for name in NAMES:  # the fixture runs: bf16 auto, and their provenance records say the CPU
        notes = load_fixture(name)[1]["export_notes"]
        assert notes[0] == "arch.forward_dtype: float32 (bf16: auto, trained on cpu)", notes
