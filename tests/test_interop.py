"""Interop with the authors' ecosystems (issue 34): ``loopformer export`` writes a checkpoint their code
loads, ``loopformer translate`` maps their config keys and command lines, Hydra's ``+key`` / ``++key``.

Oracles: the parity fixtures hold state dicts the authors' own code saved (``tools/parity/``): convert
then export must give them back key for key, tensor for tensor (the Q head's continue row excepted where
the converter drops it, and FPRM's all-ones dropout masks, which the fixture files leave out); export then
convert must give a run's weights back bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_parity_fprm import reference_state

from loopformer.cli import cli
from loopformer.config import ConfigError, apply_overrides, build_config
from loopformer.convert import build_converted, convert_checkpoint, converter, load_state_dict, strip_prefixes
from loopformer.convert.export import COMPILED_PREFIX, export_weights
from loopformer.convert.fixtures import FIXTURE_DIR, load_fixture, prefixed
from loopformer.convert.translate import translate
from loopformer.runs import load_run
from loopformer.runs.checkpoint import CheckpointError
from loopformer.train import Trainer


@pytest.mark.parametrize(("name", "system"), [("trm_attn", "trm"), ("trm_mlp", "trm"), ("hrm", "hrm")])
def test_export_gives_back_the_authors_checkpoint(name: str, system: str, tmp_path: Path) -> None:
    convert_checkpoint(system, FIXTURE_DIR / name / "step_1", tmp_path / "run")
    run = load_run(tmp_path / "run", use_ema=False)
    exported = export_weights(system, run.config, run.model.state_dict())
    authors = strip_prefixes(
        load_state_dict(FIXTURE_DIR / name / "step_1"), ("_orig_mod.", "model.", "inner.")
    )
    assert set(exported.state) == set(authors)
    for key, value in authors.items():
        got = exported.state[key]
        if key.startswith("q_head.") and system == "trm":  # the continue row: the authors' init, never read
            got, value = got[:1], value[:1]
        assert got.shape == value.shape and torch.equal(got, value), key
    assert all(k.startswith(COMPILED_PREFIX) for k in exported.saved())


@pytest.mark.parametrize("name", ["fprm_sudoku", "fprm_maze"])
def test_fprm_export_gives_back_the_authors_checkpoint(name: str) -> None:
    tensors, meta = load_fixture(name)
    authors = reference_state(prefixed(tensors, "weights"))  # prefixed as pretrain.py saves it, masks added
    converted = converter("fprm")(authors, meta["reference_config"])
    converted.run["data"] = {"task": "sudoku" if "sudoku" in name else "maze", "options": {"size": 4}}
    config, model = build_converted(converted)
    exported = export_weights("fprm", config, model.state_dict())
    saved = exported.saved(compiled=True)
    assert set(saved) == set(authors)
    for key, value in authors.items():
        got = saved[key]
        if key.endswith(("q_head.weight", "q_head.bias")):
            got, value = got[:1], value[:1]
        assert torch.equal(got, value), key


@pytest.fixture(scope="module")
def trm_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trm")
    overrides = [f"out_dir={out / 'run'}", "model.d_model=32", "model.n_heads=2", "data.train_size=16",
                 "data.eval_size=4", "train.steps=2", "train.batch_size=4", "train.max_segments=2",
                 "train.progress=false", "train.threads=1", "device=cpu"]  # fmt: skip
    from loopformer.config import read_recipe

    Trainer(build_config(read_recipe("sudoku4_trm"), overrides)).fit()
    return out / "run"


def test_export_then_convert_gives_identical_weights(trm_run: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "exp" / "ckpt"
    result = CliRunner().invoke(cli, ["export", "trm", str(trm_run), "-o", str(ckpt)])
    assert result.exit_code == 0, result.output
    assert (ckpt.parent / "all_config.yaml").is_file()
    saved = torch.load(ckpt, weights_only=True)  # a plain state dict, as the authors' load_checkpoint reads
    assert all(k.startswith(COMPILED_PREFIX) for k in saved)
    back = tmp_path / "back"
    result = CliRunner().invoke(cli, ["convert", "trm", str(ckpt), "-o", str(back)])
    assert result.exit_code == 0, result.output
    ours = load_run(trm_run, use_ema=True).model.state_dict()
    theirs = load_run(back, use_ema=True).model.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    again = CliRunner().invoke(cli, ["export", "trm", str(trm_run), "-o", str(ckpt)])
    assert again.exit_code != 0 and "--overwrite" in again.output
    wrong = CliRunner().invoke(cli, ["export", "hrm", str(trm_run), "-o", str(tmp_path / "h" / "ckpt")])
    assert wrong.exit_code != 0 and "'trm', not 'hrm'" in wrong.output


def test_export_follows_the_output_rules(trm_run: Path, tmp_path: Path) -> None:
    """``export --out`` (issue 35's rules): never through a symbolic link, never a folder, never in a run."""
    elsewhere = tmp_path / "elsewhere.pt"
    elsewhere.write_bytes(b"theirs")
    link = tmp_path / "link" / "ckpt"
    link.parent.mkdir()
    link.symlink_to(elsewhere)
    for out, said in ((link, "symbolic link"), (tmp_path, "is a folder"), (trm_run / "exp" / "ckpt", "training run")):
        result = CliRunner().invoke(cli, ["export", "trm", str(trm_run), "-o", str(out), "--overwrite"])
        assert result.exit_code != 0 and said in result.output, result.output
    assert elsewhere.read_bytes() == b"theirs" and not (trm_run / "exp").exists()
    config_link = tmp_path / "cfg" / "all_config.yaml"  # the config written beside it: no link either
    config_link.parent.mkdir()
    config_link.symlink_to(elsewhere)
    result = CliRunner().invoke(cli, ["export", "trm", str(trm_run), "-o", str(config_link.parent / "ckpt")])
    assert result.exit_code != 0 and "symbolic link" in result.output
    assert elsewhere.read_bytes() == b"theirs" and not (config_link.parent / "ckpt").exists()


def test_export_refuses_what_the_authors_model_cannot_hold(trm_run: Path) -> None:
    run = load_run(trm_run, use_ema=True)
    weights = dict(run.model.state_dict(), **{"net.layers.0.norm1.weight": torch.ones(32)})
    with pytest.raises(CheckpointError, match="no place in the authors' model"):
        export_weights("trm", run.config, weights)
    run.config.model.fields["n_inner"] = run.config.model.fields["n_inner"] + 0.5  # no integer L_cycles
    with pytest.raises(CheckpointError, match="model.n_inner"):
        export_weights("trm", run.config, run.model.state_dict())


def test_translate_maps_the_authors_keys_through_convert() -> None:
    words = ["python", "pretrain.py", "arch=trm", "arch.L_cycles=4", "arch.H_cycles=2", "global_batch_size=384",
             "lr=1e-4", "epochs=50000", "++arch.pos_encodings=none", "arch.halt_max_steps=8"]  # fmt: skip
    t = translate("trm", words)
    assert t.overrides["model.n_inner"] == 4 and t.overrides["model.loop.max_steps"] == 2
    assert t.overrides["train.batch_size"] == 384 and t.overrides["train.lr"] == pytest.approx(1e-4)
    assert t.overrides["model.rope"] is False and t.overrides["train.max_segments"] == 8
    assert t.overrides["loop_eval.max_steps"] == 16  # the authors evaluate halt_max_steps x H_cycles
    assert t.unread == ["epochs"] and t.skipped == ["python", "pretrain.py", "arch=trm"]
    assert t.recipe == "paper_sudoku_extreme_trm" and t.command().startswith("loopformer train paper_sudoku")
    cfg = build_config(apply_overrides({"model": {"name": "trm"}, "data": {"task": "sudoku"}},
                                       [f"{k}={v}" for k, v in t.overrides.items()]))  # fmt: skip
    assert cfg.model.fields["n_inner"] == 4 and cfg.train.batch_size == 384  # loopformer reads them back
    fprm = translate("fprm", ["arch.fp_thresh=0.05", "arch.n_backwards_L=4"])
    assert fprm.overrides["loop_eval.tol"] == 0.05 and fprm.overrides["loop_train.grad_steps"] == 4
    with pytest.raises(ValueError, match=r"\+ adds a key"):
        translate("trm", ["+lr=1e-3"])
    result = CliRunner().invoke(cli, ["translate", "hrm", "arch.H_layers=2", "arch.L_cycles=3"])
    assert result.exit_code == 0 and "arch.H_layers  ->  model.n_layers=2" in result.output


def test_hydra_plus_and_double_plus_overrides() -> None:
    recipe = {"model": {"name": "fprm"}, "train": {"steps": 10}}
    data = apply_overrides(recipe, ["++train.steps=3", "+train.ema=0.5"])
    assert data["train"] == {"steps": 3, "ema": 0.5}
    with pytest.raises(ConfigError, match=r"\+ adds a key .* train.steps is already set"):
        apply_overrides(recipe, ["+train.steps=3"])
    from loopformer.config.checks import check_unique

    with pytest.raises(ConfigError, match="already given"):
        check_unique(["train.lr=1", "++train.lr=2"])
