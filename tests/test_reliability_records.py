"""One reader for the library's own files (issue 35): every JSON file loopformer writes into a run, sweep or
report folder is read back through one function with its schema, so a malformed or crafted one is one line
naming the file and the field, never an internal error or a bare key name.

Cases: a crafted ``sweep.json``, ``metrics.json`` (a report), ``summary.json`` and ``provenance.json``; a
lock file with a huge pid, or naming pid 1 (it held the folder for ever); a sharded checkpoint whose alias
names a missing tensor; an authors' state dict missing a key the mapping reads. Only the CLI, files on disk
and ``loopformer.runs.checkpoint.save_sharded`` (through ``reliability_common.make_sharded``) are used.
"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from reliability_common import (
    cli_text,
    fails_cleanly,
    make_sharded,
    newest_checkpoint,
    tiny_recipe,
)

from loopformer.cli import cli

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "parity"


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("records")
    recipe = root / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(train={"steps": 1, "eval_every": 0})))
    result = CliRunner().invoke(cli, ["sweep", str(recipe), "loop_eval.max_steps=2,3", "-o", str(root / "s")])
    assert result.exit_code == 0, cli_text(result)[-600:]
    return root / "s", recipe


def _copy(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    return dest


@pytest.mark.parametrize(
    "content, field",
    [
        ('{"reports": 5}', "reports"),
        ('{"points": [{"name": 1, "report": "run/eval-max_steps=2"}]}', "points[0].name"),
        ('{"points": [{"name": "p"}]}', "points[0].report"),
        ("[1, 2]", "the file"),
    ],
    ids=["reports-a-number", "name-a-number", "no-report", "a-list"],
)
def test_a_crafted_sweep_json_is_one_line_naming_the_field(swept, tmp_path, content, field) -> None:
    sweep = _copy(swept[0], tmp_path / "s")
    (sweep / "sweep.json").write_text(content)
    fails_cleanly(
        CliRunner().invoke(cli, ["compare", str(sweep), "-o", str(tmp_path / "c")]), "sweep.json", field
    )


@pytest.mark.parametrize(
    "content, field",
    [
        ('{"results": {"m": {"valid_accuracy": "high"}}}', "results.m.valid_accuracy"),
        ('{"results": {"m": {"n": 3}}, "models": {"m": {"blocks": "two"}}}', "models.m.blocks"),
        (
            '{"results": {"m": {"n": 3}}, "budget": {"m": {"points": [{"budget": "x"}]}}}',
            "budget.m.points[0].budget",
        ),
        ('{"results": [1]}', "results"),
    ],
    ids=["accuracy-a-string", "blocks-a-string", "budget-a-string", "results-a-list"],
)
def test_a_crafted_report_metrics_json_is_one_line_naming_the_field(swept, tmp_path, content, field) -> None:
    report = _copy(swept[0] / "run" / "eval-max_steps=2", tmp_path / "report")
    (report / "metrics.json").write_text(content)
    fails_cleanly(
        CliRunner().invoke(cli, ["compare", str(report), "-o", str(tmp_path / "c")]), "metrics.json", field
    )


@pytest.mark.parametrize(
    "content, field",
    [('{"steps": "many", "checkpoint": "x"}', "steps"), ('{"steps": 1, "checkpoint": 7}', "checkpoint")],
    ids=["steps-a-string", "checkpoint-a-number"],
)
def test_a_crafted_summary_json_is_one_line_naming_the_field(swept, tmp_path, content, field) -> None:
    sweep, recipe = swept
    sweep = _copy(sweep, tmp_path / "s")
    (sweep / "run" / "summary.json").write_text(content)
    args = ["sweep", str(recipe), "loop_eval.max_steps=2,3", "-o", str(sweep)]
    fails_cleanly(CliRunner().invoke(cli, args), "summary.json", field)


def test_a_crafted_provenance_json_is_one_line_naming_the_field(swept, tmp_path) -> None:
    run = _copy(swept[0] / "run", tmp_path / "run")
    (run / "provenance.json").write_text('{"records": [{"step": "zero"}]}')
    fails_cleanly(CliRunner().invoke(cli, ["eval", str(run), "--no-analyses", "-o", str(tmp_path / "r")]),
                  "provenance.json", "records[0].step")  # fmt: skip
    (run / "provenance.json").write_text('{"records": 3}')
    recipe = swept[1]
    fails_cleanly(CliRunner().invoke(cli, ["train", str(recipe), "-o", str(run), "--resume"]),
                  "provenance.json", "records")  # fmt: skip


@pytest.mark.parametrize("pid", [10**30, 2**40, 1], ids=["huge", "beyond-pid-max", "init"])
def test_a_lock_file_naming_no_holder_never_blocks_nor_crashes(swept, tmp_path, pid) -> None:
    """A lock file whose pid no process of ours can have (too large for the OS, or pid 1: the init
    process, alive for ever) and that nobody holds (no ``flock``) is stale: the folder is free."""
    run = _copy(swept[0] / "run", tmp_path / "run")
    (run / ".loopformer.lock").write_text(
        json.dumps({"pid": pid, "host": socket.gethostname(), "purpose": "train"})
    )
    result = CliRunner().invoke(cli, ["train", str(swept[1]), "-o", str(run), "--resume"])
    assert result.exit_code == 0, cli_text(result)[-400:]


def test_a_sharded_alias_naming_a_missing_tensor_is_one_line(swept, tmp_path) -> None:
    step = make_sharded(
        swept[0] / "run", tmp_path / "sharded", aliases={"model.tied": "model.no_such_tensor"}
    )
    text = fails_cleanly(CliRunner().invoke(cli, ["eval", str(step), "--no-analyses", "-o", str(tmp_path / "r")]),
                         "state.json", "no_such_tensor")  # fmt: skip
    assert "aliases" in text


def test_an_authors_state_dict_missing_a_key_names_it_as_missing(tmp_path) -> None:
    ref = tmp_path / "ref"
    shutil.copytree(FIXTURES / "trm_attn", ref)
    state = torch.load(ref / "step_1", weights_only=True)
    key = next(k for k in state if k.endswith("embed_tokens.embedding_weight"))
    del state[key]
    torch.save(state, ref / "step_1")
    text = fails_cleanly(
        CliRunner().invoke(cli, ["convert", "trm", str(ref / "step_1"), "-o", str(tmp_path / "o")])
    )
    assert "missing" in text and "embed_tokens.embedding_weight" in text and str(ref / "step_1") in text


def test_a_run_from_a_crafted_summary_checkpoint_stays_in_its_folder(swept, tmp_path) -> None:
    """``run --resume`` reads each model's ``summary.json`` and loads its ``checkpoint``: a path naming
    another folder is read as a step folder name inside this run, never followed."""
    from loopformer.runs.folder import finished_summary

    run = _copy(swept[0] / "run", tmp_path / "run")
    other = _copy(swept[0] / "run", tmp_path / "other")
    summary = json.loads((run / "summary.json").read_text())
    summary["checkpoint"] = str(newest_checkpoint(other))
    (run / "summary.json").write_text(json.dumps(summary))
    found = finished_summary(run, 1)
    assert found is not None and Path(found["checkpoint"]).parent == run / "checkpoints"
