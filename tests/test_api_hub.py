"""The Python API (``loopformer.load`` / ``loopformer.solve``), ``--device``, and sharing: ``loopformer push``
against a patched ``HfApi`` and a local folder standing in for the hub, then loading by hub id (patched
``snapshot_download``: no network)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import loopformer
import loopformer.api
from loopformer.cli import cli
from loopformer.config import build_config
from loopformer.tasks.sudoku import SudokuTask

TINY = {
    "model": {"name": "fprm", "d_model": 16, "n_heads": 2, "n_layers": 1, "conv": "grid2d"},
    "data": {"task": "sudoku", "options": {"size": 4}, "train_generate": {"min_blanks": 4, "max_blanks": 8},
             "eval_generate": {"min_blanks": 4, "max_blanks": 8}, "train_size": 24, "eval_size": 8},
    "train": {"mode": "deep_supervision", "steps": 3, "batch_size": 8, "max_segments": 2, "progress": False,
              "ema": 0.9, "log_every": 1},
    "loop_train": {"max_steps": 3, "grad": "truncated", "grad_steps": 2},
    "loop_eval": {"max_steps": 5},
    "eval": {"batch_size": 16},
}  # fmt: skip
PUZZLE = "1.3.....2...4.2."


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loopformer.train.trainer import Trainer

    out = tmp_path_factory.mktemp("tiny_run")
    Trainer(build_config({**TINY, "out_dir": str(out)})).fit()
    return out


def test_load_and_solve_match_the_cli(tiny_run: Path) -> None:
    run = loopformer.load(tiny_run, device="cpu")
    assert run.task.name == "sudoku" and run.loop_eval.max_steps == 5 and run.weights == "ema"
    sol = loopformer.solve(run, PUZZLE)
    task = SudokuTask(4)
    assert sol.valid == task.check(task.parse_grid(PUZZLE), sol.tokens)  # the validator's verdict
    assert sol.steps == len(sol.trajectory) >= 1 and np.array_equal(sol.trajectory[-1], sol.tokens)
    assert sol.answer == loopformer.api.format_answer(task, sol.tokens) and sol.changes()[0] == 16
    cli_json = json.loads(CliRunner().invoke(cli, ["solve", "sudoku", PUZZLE, "-c", str(tiny_run), "--json",
                                                   "--device", "cpu"]).output)  # fmt: skip
    mine = sol.to_dict(run.task)
    assert {k: cli_json[k] for k in ("solution_tokens", "valid", "steps")} == {
        k: mine[k] for k in ("solution_tokens", "valid", "steps")
    }  # the CLI is built on loopformer.solve
    # one type per field in Python and JSON (issue 25): text as text, tokens as tokens; to_dict() is the record
    assert mine == sol.to_dict() and {k: cli_json[k] for k in mine} == mine
    assert isinstance(sol.answer, str | None) and cli_json["solution"] == sol.answer
    assert cli_json["trajectory"] == sol.trajectory_text and all(
        isinstance(t, str | None) for t in sol.trajectory_text
    )
    assert cli_json["trajectory_tokens"] == [f.tolist() for f in sol.trajectory]
    assert cli_json["puzzle"] == sol.puzzle_text == task.format_grid(task.parse_grid(PUZZLE))
    capped = loopformer.solve(str(tiny_run), PUZZLE, max_steps=1)  # a path works too
    assert capped.steps == 1
    tokens = loopformer.solve(run, task.parse_grid(PUZZLE))  # token ids work too
    assert np.array_equal(tokens.tokens, sol.tokens)
    with pytest.raises(ValueError, match="4 characters, expected 16"):
        loopformer.solve(run, "1.3.")


def test_device_flags(tiny_run: Path) -> None:
    from loopformer.devices import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(
        ValueError, match=r"expected auto \(CUDA when present, else CPU\), cpu, cuda or cuda:N"
    ):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda:0")
        bad = CliRunner().invoke(cli, ["eval", str(tiny_run), "--device", "cuda:1", "--no-analyses"])
        assert bad.exit_code != 0 and "CUDA is not available" in bad.output
    for command in (["eval"], ["solve"], ["run"]):
        assert "--device" in CliRunner().invoke(cli, [*command, "--help"]).output


def test_cpu_bf16_evaluation_follows_the_run(tiny_run: Path, tmp_path: Path) -> None:
    """A run trained with bf16: true is evaluated under CPU bf16 autocast."""
    from loopformer.train.trainer import Trainer

    out = tmp_path / "bf16"
    summary = Trainer(build_config({**TINY, "out_dir": str(out), "bf16": True})).fit()
    assert np.isfinite(summary["eval"]["exact_acc"])
    seen = []
    run = loopformer.load(out, device="cpu")
    run.model.register_forward_hook(lambda m, i, o: seen.append(torch.is_autocast_enabled("cpu")))
    loopformer.solve(run, PUZZLE)
    assert seen and all(seen)


class FakeApi:
    """HfApi stand-in: a 'hub' that is a local folder (repo_id -> folder)."""

    def __init__(self, root: Path) -> None:
        self.root, self.calls = root, []

    def create_repo(self, repo_id, repo_type="model", private=False, exist_ok=False):
        self.calls.append(("create_repo", repo_id, private))
        (self.root / repo_id).mkdir(parents=True, exist_ok=True)

    def upload_folder(self, folder_path, repo_id, repo_type="model", revision=None, commit_message=""):
        self.calls.append(("upload_folder", repo_id, commit_message))
        for f in Path(folder_path).iterdir():
            (self.root / repo_id / f.name).write_bytes(f.read_bytes())
        return type("Commit", (), {"oid": "abc123"})()


def test_push_then_load_by_hub_id(tiny_run: Path, tmp_path: Path, monkeypatch) -> None:
    import huggingface_hub

    from loopformer.runs.hub import push

    hub_root = tmp_path / "hub"
    api = FakeApi(hub_root)
    sent = push(tiny_run, "me/tiny-sudoku", api=api)
    repo = hub_root / "me" / "tiny-sudoku"
    assert set(sent["files"]) == {
        "model.safetensors",
        "ema.safetensors",
        "config.json",
        "summary.json",
        "README.md",
    }
    assert not (repo / "state.safetensors").exists()  # optimiser state stays home
    card = (repo / "README.md").read_text()
    assert "# fprm on sudoku" in card and "arXiv:2606.18206" in card and "held-out accuracy" in card
    summary = json.loads((tiny_run / "summary.json").read_text())
    assert f"{summary['eval']['exact_acc']:.4f}" in card
    # the usage lines name the repository pushed to, no OWNER/NAME placeholder (issue 25)
    assert "loopformer eval me/tiny-sudoku" in card and "loopformer.load('me/tiny-sudoku')" in card
    assert "OWNER" not in card and "<owner>" not in card
    assert api.calls[0] == ("create_repo", "me/tiny-sudoku", False) and sent["commit"] == "abc123"

    calls = []

    def fake_snapshot(repo_id, revision=None, cache_dir=None, allow_patterns=None, **kw):
        calls.append((repo_id, revision))
        return str(hub_root / repo_id)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    monkeypatch.chdir(tmp_path)
    by_id = loopformer.load("me/tiny-sudoku@v1", device="cpu")
    assert calls == [("me/tiny-sudoku", "v1")]
    local = loopformer.load(tiny_run, device="cpu")
    for (name, p), (_, q) in zip(by_id.model.named_parameters(), local.model.named_parameters()):
        assert torch.equal(p, q), name
    assert (
        loopformer.solve(by_id, PUZZLE).to_dict()["solution_tokens"]
        == loopformer.solve(local, PUZZLE).to_dict()["solution_tokens"]
    )
    result = CliRunner().invoke(cli, ["eval", "hf://me/tiny-sudoku", "--no-analyses", "--out", str(tmp_path / "ev"),
                                      "--device", "cpu"])  # fmt: skip
    assert result.exit_code == 0, result.output
    folder = CliRunner().invoke(cli, ["push", str(tiny_run), "me/x", "--to-folder", str(tmp_path / "staged")])
    assert folder.exit_code == 0 and (tmp_path / "staged" / "README.md").is_file()
    assert "loopformer.load('me/x')" in (tmp_path / "staged" / "README.md").read_text()
    from loopformer.runs.hub import model_card

    unnamed = model_card({}, None, "fprm", 1)  # no repository known: a placeholder that says so
    assert "loopformer.load('<owner>/<name>')" in unnamed and "Replace `<owner>/<name>`" in unnamed


def test_missing_run_and_missing_hub_library(tmp_path: Path, monkeypatch) -> None:
    import sys

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(FileNotFoundError, match=r"pip install 'loopformer\[hub\]'"):
        loopformer.load("someone/model")
    (tmp_path / "runs").mkdir()
    with pytest.raises(Exception, match="does not exist"):  # a local-looking path is never sent to the hub
        loopformer.load("runs/nothing")


def test_model_card_fits_the_hub(tmp_path: Path, monkeypatch) -> None:
    """Hub metadata (licence, the Hub dataset the run read, model-index with the held-out results), the
    family's own paper only, and a plug-in model's module shipped with the exact command to use it."""
    import importlib
    import sys

    import yaml

    from loopformer.runs.hub import model_card, ship_plugins

    config = {"data": {"task": "sudoku", "train_path": "data/sx", "options": {"size": 9}}, "model": {"name": "fprm"},
              "train": {"steps": 10, "batch_size": 4, "lr": 1e-3}}  # fmt: skip
    summary = {
        "eval": {"valid_acc": 0.625, "exact_acc": 0.5, "loop_steps": 3.0},
        "eval_label": "final (step 10)",
    }
    card = model_card(config, summary, "fprm", 10, "me/m", license="apache-2.0")
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["license"] == "apache-2.0" and meta["datasets"] == ["sapientinc/sudoku-extreme"]
    assert meta["tags"][0] == "looped-transformer"
    result = meta["model-index"][0]["results"][0]
    assert result["dataset"]["type"] == "sapientinc/sudoku-extreme"
    assert {"type": "accuracy", "name": "held-out accuracy (independent validator)", "value": 62.5} in result[
        "metrics"
    ]
    assert card.count("arXiv:") == 1 and "arXiv:2606.18206" in card  # FPRM's paper, not all five
    trm = model_card({**config, "model": {"name": "trm"}}, summary, "trm", 10, "me/t")
    assert trm.count("arXiv:") == 1 and "2510.04871" in trm
    plain = model_card(
        {"data": {"task": "sudoku"}, "model": {"name": "transformer"}}, summary, "transformer", 1, "me/p"
    )
    meta = yaml.safe_load(plain.split("---")[1])
    assert "arXiv" not in plain and "looped-transformer" not in meta["tags"] and "datasets" not in meta
    # the Hub's own reader: generated data names no Hub dataset (no owner/name that does not exist)
    from huggingface_hub import ModelCard

    parsed = ModelCard(model_card({"data": {"task": "sudoku"}, "model": {"name": "fprm"}}, summary, "fprm", 1,
                                  "me/g")).data  # fmt: skip
    assert parsed.datasets is None and {r.dataset_type for r in parsed.eval_results} == {"sudoku"}
    assert {r.metric_value for r in parsed.eval_results} >= {62.5, 50.0}

    (tmp_path / "my_card_plugin.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("my_card_plugin")
    try:
        shipped = ship_plugins(["my_card_plugin", "numpy"], tmp_path / "out")
    finally:
        sys.modules.pop("my_card_plugin", None)
    assert (
        shipped == ["my_card_plugin.py"]
        and (tmp_path / "out" / "my_card_plugin.py").read_text() == "VALUE = 1\n"
    )
    card = model_card({**config, "plugins": ["my_card_plugin", "numpy"]}, summary, "my_card_plugin", 10, "me/m",
                      shipped=shipped)  # fmt: skip
    assert "huggingface-cli download me/m --local-dir m" in card
    assert "PYTHONPATH=m loopformer --import my_card_plugin --import numpy eval me/m" in card
    assert "Module `numpy`: install `pip install numpy`" in card
    assert "loopformer --import my_card_plugin --import numpy eval me/m --device auto" in card


@pytest.mark.parametrize("family", sorted(__import__("loopformer.models.registry").models.registry.MODELS))
def test_save_pretrained_then_from_pretrained(family: str, tmp_path: Path) -> None:
    """Every family round-trips through the Hugging Face idiom: same config (a non-default loop with plug-in
    options included), same weights, same logits."""
    from loopformer.loop import LoopConfig
    from loopformer.models.registry import build_model, model_classes

    loop = LoopConfig(solver="anderson", max_steps=3, tol=1e-4, plugins={"anderson": {"m": 3}})
    model = build_model(family, d_model=16, n_heads=2, n_layers=1, vocab_size=8, seq_len=16, grid=(4, 4), loop=loop)
    model.save_pretrained(tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json", "model.safetensors"]
    back = model_classes(family)[0].from_pretrained(tmp_path / "m")
    assert back.config == model.config and back.config.loop.options_for("anderson").m == 3
    assert not back.training and back.state_dict().keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(value, back.state_dict()[key]), key
    x = torch.randint(0, 8, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = []
    for m in (model.eval(), back):
        torch.manual_seed(0)  # families whose init_state draws noise draw the same
        with torch.no_grad():
            logits.append(m(x).logits)
    assert torch.equal(*logits)


def test_push_to_hub_then_from_pretrained_by_hub_id(tmp_path: Path, monkeypatch) -> None:
    import huggingface_hub

    from loopformer.models.fprm import FPRM
    from loopformer.models.registry import build_model
    from loopformer.models.trm import TRM

    model = build_model("fprm", d_model=16, n_heads=2, n_layers=1, vocab_size=8, seq_len=16, grid=(4, 4))
    api = FakeApi(tmp_path / "hub")
    assert model.push_to_hub("me/fprm-tiny", api=api) == "abc123"
    repo = tmp_path / "hub" / "me" / "fprm-tiny"
    assert sorted(p.name for p in repo.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    card = huggingface_hub.ModelCard.load(repo / "README.md")
    assert card.data.library_name == "loopformer" and "FPRM.from_pretrained('me/fprm-tiny')" in card.text
    calls = []

    def fake_snapshot(repo_id, revision=None, cache_dir=None, allow_patterns=None, **kw):
        calls.append((repo_id, revision, tuple(allow_patterns)))
        return str(tmp_path / "hub" / repo_id)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    monkeypatch.chdir(tmp_path)
    back = FPRM.from_pretrained("me/fprm-tiny", revision="v1")
    assert calls == [("me/fprm-tiny", "v1", ("config.json", "model.safetensors"))]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), back.parameters(), strict=True))
    with pytest.raises(TypeError, match=r"holds a FPRM; load it with FPRM.from_pretrained"):
        TRM.from_pretrained(repo)
    with pytest.raises(FileNotFoundError, match="does_not_exist"):  # a local-looking path never goes to the hub
        FPRM.from_pretrained("./does_not_exist")


def test_from_pretrained_refuses_what_it_did_not_write(tiny_run: Path, tmp_path: Path) -> None:
    from loopformer.models.fprm import FPRM
    from loopformer.models.registry import build_model
    from loopformer.runs.checkpoint import resolve_checkpoint

    ckpt = resolve_checkpoint(tiny_run)
    with pytest.raises(ValueError, match=r"loopformer.load"):  # a run's checkpoint: the run loader's job
        FPRM.from_pretrained(ckpt)
    before = (ckpt / "config.json").read_bytes()
    with pytest.raises(ValueError, match="save_pretrained did not write"):
        build_model("fprm", d_model=16, n_heads=2, n_layers=1).save_pretrained(ckpt)
    assert (ckpt / "config.json").read_bytes() == before
    model = build_model("fprm", d_model=16, n_heads=2, n_layers=1)
    model.save_pretrained(tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    raw["config"]["d_modle"] = raw["config"].pop("d_model")
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(KeyError, match=r"no config field 'd_modle'; did you mean 'd_model'"):
        FPRM.from_pretrained(tmp_path / "m")
