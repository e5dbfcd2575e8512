"""Recipe composition (issue 25): ``base:`` by shipped recipe name from any folder, ``~key`` deletions in a
recipe and on the command line, a model change that drops the old model's keys with a note, and
``--print-config`` listing every model and loop field with its effective value."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from loopformer.cli import cli
from loopformer.config import ConfigError, build_config, load_config, read_recipe
from loopformer.loop import LoopConfig
from loopformer.loop.config import plugin_options


@pytest.fixture
def notes() -> list[str]:
    """Messages of the ``loopformer.config`` logger while the test runs."""
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger("loopformer.config")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield seen
    logger.removeHandler(handler)
    logger.setLevel(level)


def _write(folder: Path, name: str, data: dict) -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_base_names_a_shipped_recipe_from_any_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no ./recipes here: the name is found among the shipped recipes
    (tmp_path / "elsewhere").mkdir()
    mine = _write(tmp_path / "elsewhere", "mine.yaml", {"base": "sudoku4_fprm", "train": {"steps": 7}})
    cfg = load_config(mine)
    assert (
        cfg.train.steps == 7 and cfg.model.fields["conv"] == "grid2d" and cfg.train.mode == "deep_supervision"
    )
    # a file beside the recipe still wins over a shipped name, with or without .yaml
    _write(mine.parent, "sudoku4_fprm.yaml", {"train": {"lr": 0.005}})
    assert load_config(mine).train.lr == 0.005
    with pytest.raises(ConfigError, match=r"base 'sudoku4_fpr'.*did you mean 'sudoku4_fprm'"):
        load_config(_write(mine.parent, "typo.yaml", {"base": "sudoku4_fpr"}))


def test_tilde_key_deletes_in_a_recipe_and_on_the_command_line(tmp_path: Path) -> None:
    child = _write(tmp_path, "child.yaml", {"base": "sudoku4_fprm", "~model.conv": None,
                                            "train": {"~eval_every": None, "steps": 5}})  # fmt: skip
    raw = read_recipe(child)
    assert "conv" not in raw["model"] and "eval_every" not in raw["train"] and raw["train"]["steps"] == 5
    cfg = build_config(raw)
    assert cfg.train.eval_every == 0 and cfg.model_config().conv == "none"  # the defaults apply
    cli_cfg = load_config("sudoku4_fprm", ["~model.conv", "~loop_eval.tol"])
    assert "conv" not in cli_cfg.model.fields and "tol" not in cli_cfg.loop_eval.changes
    assert cli_cfg.loop_config(cli_cfg.model_config().loop, "eval").tol == 0.1  # the model's own tol now
    with pytest.raises(ConfigError, match="takes no value"):
        read_recipe(_write(tmp_path, "bad.yaml", {"base": "sudoku4_fprm", "~model.conv": "x"}))
    with pytest.raises(ConfigError, match="unknown config key 'trian'"):
        load_config("sudoku4_fprm", ["~trian.steps"])


def test_changing_the_model_drops_the_old_models_keys_with_a_note(tmp_path: Path, notes: list[str]) -> None:
    cfg = load_config("sudoku4_fprm", ["model.name=trm"])
    assert cfg.model.name == "trm" and "conv" not in cfg.model.fields and cfg.model.fields["d_model"] == 64
    assert any("model.conv" in n and "'trm'" in n for n in notes), notes
    child = _write(tmp_path, "trm.yaml", {"base": "sudoku4_fprm", "model": {"name": "trm", "n_inner": 2}})
    assert load_config(child).model.fields == {"d_model": 64, "n_heads": 4, "n_layers": 2, "n_inner": 2}
    # a key the user sets for the new model is still checked
    with pytest.raises(ConfigError, match="model 'trm' has no field 'conv'"):
        load_config("sudoku4_fprm", ["model.name=trm", "model.conv=grid2d"])


def test_print_config_lists_every_model_and_loop_field() -> None:
    result = CliRunner().invoke(cli, ["train", "sudoku4_fprm", "train.steps=4", "--print-config"])
    assert result.exit_code == 0, result.output
    printed = yaml.safe_load(result.output)
    loop_fields = (set(LoopConfig.__dataclass_fields__) - {"plugins"}) | set(plugin_options())  # options beside
    for phase in ("loop_train", "loop_eval", "loop_periodic"):
        assert set(printed[phase]) == loop_fields, phase
    assert printed["loop_eval"]["anderson"]["m"] == 5  # a default the recipe never names
    assert printed["model"]["expansion"] == 4.0 and printed["model"]["conv"] == "grid2d"
    # what the task fixes is printed with its value; only the data's width waits for training
    assert printed["model"]["vocab_size"] == 6 and printed["model"]["grid"] == [4, 4]
    assert printed["model"]["causal"] is False and printed["model"]["num_puzzle_ids"] == 0
    assert "seq_len" not in printed["model"] and "model.seq_len" in result.output
    again = build_config(printed)  # it loads back to the same model and loops
    cfg = load_config("sudoku4_fprm", ["train.steps=4"])
    assert again.model_config() == cfg.model_config(vocab_size=6, grid=(4, 4), causal=False)
    for phase in ("train", "eval", "periodic"):
        assert again.loop_config(again.model_config().loop, phase) == cfg.loop_config(
            cfg.model_config().loop, phase
        )


def test_print_config_shows_what_training_records(tmp_path: Path) -> None:
    """Every model field ``--print-config`` prints is the value the trained run's config.yaml holds."""
    args = ["train", "sudoku4_fprm", "train.steps=1", "train.eval_every=0", "data.train_size=8",
            "data.eval_size=4", "train.batch_size=4"]
    printed = yaml.safe_load(CliRunner().invoke(cli, [*args, "--print-config"]).output)
    result = CliRunner().invoke(cli, [*args, f"out_dir={tmp_path / 'run'}"])
    assert result.exit_code == 0, result.output
    recorded = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]
    for key, value in printed["model"].items():
        assert recorded[key] == value, key
    assert set(recorded) - set(printed["model"]) == {"seq_len"}


def test_print_config_says_why_a_task_could_not_be_built(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_arc"
    result = CliRunner().invoke(cli, ["train", "paper_arc1_fprm", f"data.options.source={missing}", "--print-config"])
    assert result.exit_code == 0, result.output
    note = next(line for line in result.output.splitlines() if "not built here" in line)
    assert "task 'arc'" in note and "no_such_arc" in note
    assert "vocab_size" not in yaml.safe_load(result.output)["model"]


def test_a_renamed_recipe_is_refused_naming_its_new_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from loopformer.config import RECIPE_DIR
    from loopformer.config.recipes import RENAMED_RECIPES, find_recipe

    monkeypatch.chdir(tmp_path)
    for old, new in RENAMED_RECIPES.items():
        assert not (RECIPE_DIR / f"{old}.yaml").exists() and (RECIPE_DIR / f"{new}.yaml").is_file()
        with pytest.raises(ConfigError, match=rf"recipe '{old}' was renamed: use '{new}'"):
            find_recipe(old)
    result = CliRunner().invoke(cli, ["train", "fprm_sudoku4", "--print-config"])
    assert result.exit_code == 1 and "use 'default_800steps'" in result.output
    child = _write(tmp_path, "child.yaml", {"base": "fprm_sudoku4"})  # in a base: too
    with pytest.raises(ConfigError, match="renamed: use 'default_800steps'"):
        read_recipe(child)


def test_no_shipped_recipe_silences_its_progress() -> None:
    """A 3,000-step CPU run prints its plain progress lines in a log (loopformer.train.metrics.TrainProgress)."""
    from loopformer.config import RECIPE_DIR

    silent = [p.stem for p in sorted(RECIPE_DIR.glob("*.yaml"))
              if read_recipe(p).get("train", {}).get("progress") is False]  # fmt: skip
    assert silent == []
