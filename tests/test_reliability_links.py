"""No write leaves its folder (issue 35): a command that writes a folder it owns never writes through a
symbolic link there, never into a folder holding another run or a dataset, replaces an earlier output only
with ``--overwrite``, and follows a path read from a file it wrote only inside the folder holding the file.

Cases: a sweep whose ``compare/`` is a link (a plain rerun emptied and refilled the link's target);
``sweep.json`` naming a report outside the sweep folder (``compare`` followed it); ``compare -o`` and
``consolidate --out`` a dataset folder or another run's folder (replaced, or ``step_N`` and ``latest``
written into it); ``consolidate`` twice into one folder (the earlier consolidation replaced silently); a
failed output that left the folders it created, and an error naming the hidden staging folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from reliability_common import cli_text, fails_cleanly, make_sharded, tiny_recipe

from loopformer.cli import cli


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _dataset(folder: Path) -> Path:
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "dataset.json").write_text('{"seq_len": 16}')
    (folder / "train" / "all__inputs.npy").write_bytes(b"precious")
    return folder


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("links")
    recipe = root / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(train={"steps": 1, "eval_every": 0})))
    args = ["sweep", str(recipe), "loop_eval.max_steps=2,3", "-o", str(root / "sweep")]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, cli_text(result)[-600:]
    return root / "sweep", args


def test_a_linked_compare_folder_in_a_sweep_is_refused_and_its_target_untouched(swept, tmp_path) -> None:
    folder, args = swept
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("precious\n")
    shutil.copytree(folder, tmp_path / "sweep")
    sweep = tmp_path / "sweep"
    shutil.rmtree(sweep / "compare")
    (sweep / "compare").symlink_to(victim)
    before = _files(victim)
    rerun = [*args[:-1], str(sweep)]  # a plain rerun: no --overwrite
    fails_cleanly(CliRunner().invoke(cli, rerun), "symbolic link")
    assert _files(victim) == before  # the link's target is untouched


def test_report_paths_in_sweep_json_stay_inside_the_sweep_folder(swept, tmp_path) -> None:
    folder, _ = swept
    sweep = tmp_path / "sweep"
    shutil.copytree(folder, sweep)
    outside = tmp_path / "elsewhere"
    shutil.copytree(sweep / "run" / "eval-max_steps=2", outside)
    record = json.loads((sweep / "sweep.json").read_text())
    for bad in ("../elsewhere", str(outside)):
        record["reports"] = [bad]
        record["points"] = [{**record["points"][0], "report": bad}]
        (sweep / "sweep.json").write_text(json.dumps(record))
        text = fails_cleanly(CliRunner().invoke(cli, ["compare", str(sweep), "-o", str(tmp_path / "cmp")]))
        assert "sweep.json" in text or "outside" in text, text
        assert not (tmp_path / "cmp").exists()


def test_compare_out_never_replaces_a_dataset_and_leaves_no_folder_it_made(swept, tmp_path) -> None:
    folder, _ = swept
    report = folder / "run" / "eval-max_steps=2"
    data = _dataset(tmp_path / "data")
    before = _files(data)
    fails_cleanly(
        CliRunner().invoke(cli, ["compare", str(report), "-o", str(data), "--overwrite"]), "dataset"
    )
    assert _files(data) == before
    broken = tmp_path / "broken"
    shutil.copytree(report, broken)
    (broken / "metrics.json").write_text('{"results": {"m": {"valid_accuracy": "high"}}}')
    deep = tmp_path / "new" / "deep" / "out"
    fails_cleanly(CliRunner().invoke(cli, ["compare", str(broken), "-o", str(deep)]))
    assert not (tmp_path / "new").exists()  # the folders the failed command created are gone again


def test_consolidate_out_follows_the_output_rules(swept, tmp_path) -> None:
    folder, _ = swept
    step = make_sharded(folder / "run", tmp_path / "sharded")
    other = tmp_path / "other"
    shutil.copytree(folder / "run", other)  # another training run
    data = _dataset(tmp_path / "data")
    before = {p: _files(p) for p in (other, data)}
    for out in (other, data):
        fails_cleanly(CliRunner().invoke(cli, ["consolidate", str(step), "--out", str(out)]))
    assert {p: _files(p) for p in (other, data)} == before
    out = tmp_path / "full"
    first = CliRunner().invoke(cli, ["consolidate", str(step), "--out", str(out)])
    assert first.exit_code == 0, cli_text(first)
    written = _files(out)
    fails_cleanly(CliRunner().invoke(cli, ["consolidate", str(step), "--out", str(out)]), "--overwrite")
    assert _files(out) == written
    again = CliRunner().invoke(cli, ["consolidate", str(step), "--out", str(out), "--overwrite"])
    assert again.exit_code == 0, cli_text(again)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "target", target_is_directory=True)
    (tmp_path / "target").mkdir()
    fails_cleanly(CliRunner().invoke(cli, ["consolidate", str(step), "--out", str(link)]), "symbolic link")
    assert not any((tmp_path / "target").iterdir())


def test_an_error_inside_a_staged_output_names_the_users_folder(tmp_path) -> None:
    from loopformer.runs.folder import staged_output

    out = tmp_path / "report"
    with pytest.raises(ValueError) as raised:
        with staged_output(out, "eval", overwrite=False) as staging:
            raise ValueError(f"{staging / 'plots' / 'x.png'}: cannot draw")
    assert str(out / "plots" / "x.png") in str(raised.value) and ".staging-" not in str(raised.value)
    assert not out.exists()


def test_an_output_folder_that_is_a_link_is_refused_and_its_target_untouched(swept, tmp_path) -> None:
    folder, _ = swept
    report = folder / "run" / "eval-max_steps=2"
    target = tmp_path / "target"
    target.mkdir()
    (target / "notes.txt").write_text("precious\n")
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    for args in (["compare", str(report)], ["eval", str(folder / "run"), "--no-analyses", "--examples", "2"]):
        fails_cleanly(CliRunner().invoke(cli, [*args, "-o", str(link), "--overwrite"]), "symbolic link")
        assert _files(target) == {"notes.txt": b"precious\n"}
