"""LoopConfig: plug-in options typed by their registered classes, registry-driven choices, every recipe loads,
and an old flat option name refused naming the key that replaced it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from loopformer.config import (
    ConfigError,
    build_config,
    from_dict,
    load_config,
    load_config_file,
    read_recipe,
    to_dict,
)
from loopformer.config.strict import RENAMED
from loopformer.loop import GRADS, HALTINGS, SOLVERS, LoopConfig
from loopformer.loop.solvers import DampedOptions

RECIPES = sorted((Path(__file__).parents[1] / "loopformer" / "recipes").glob("*.yaml"))


def test_plugin_options_are_typed_by_their_registered_class() -> None:
    options = {"damped": {"gamma": 0.95, "patience": 10}, "anderson": {"m": 3}}
    cfg = LoopConfig(solver="damped", plugins=options)
    assert cfg.plugins["damped"] == DampedOptions(gamma=0.95, patience=10)
    assert cfg.options_for("damped") == DampedOptions(gamma=0.95, patience=10)
    assert cfg.options_for("anderson").m == 3  # given
    assert cfg.options_for("broyden").m == 16  # else the defaults
    assert LoopConfig(solver="damped").plugins == {"damped": DampedOptions()}  # the plug-ins run are recorded
    other = dataclasses.replace(cfg, max_steps=7)  # replace keeps (and re-checks) the options
    assert other.options_for("damped").patience == 10
    with pytest.raises(ValueError, match=r"damped\.gamma must be in \(0, 1\)"):
        dataclasses.replace(cfg, plugins={"damped": {"gamma": 1.5}})
    with pytest.raises(ValueError, match="no plug-in is registered as 'dampd'"):
        LoopConfig(plugins={"dampd": {"gamma": 0.5}})
    with pytest.raises(ValueError, match="plug-in 'picard' takes no options"):
        LoopConfig(plugins={"picard": {}})


def test_the_loop_config_imports_no_plugin() -> None:
    source = (Path(__file__).parents[1] / "loopformer" / "loop" / "config.py").read_text()
    assert "loopformer.loop.solvers" not in source and "loopformer.loop.halting" not in source
    assert "loopformer.loop.grad" not in source


def test_valid_names_come_from_the_registries() -> None:
    for name, registry in (("solver", SOLVERS), ("halting", HALTINGS), ("grad", GRADS)):
        with pytest.raises(ValueError, match=", ".join(map(repr, registry.names()))):
            LoopConfig(**{name: "nope"})


def test_recipe_keys_nested_partial_tables_and_errors() -> None:
    a = build_config({}, ["model.name=fprm", "loop_eval.damped.gamma=0.99", "loop_eval.damped.patience=7"])
    b = build_config({}, ["model.name=fprm", "loop_eval.damped={gamma: 0.99, patience: 7}"])
    base = a.model_config().loop
    assert a.loop_config(base, "eval") == b.loop_config(base, "eval")
    assert a.loop_config(base, "eval").options_for("damped").min_step == base.options_for("damped").min_step
    with pytest.raises(ConfigError, match=r"loop_eval.damped.gama"):
        build_config({}, ["model.name=fprm", "loop_eval.damped={gama: 0.9}"])
    nearest = r"unknown config key 'loop_eval.dampd'; did you mean 'loop_eval.damped'\?"
    with pytest.raises(ConfigError, match=nearest):
        build_config({}, ["model.name=fprm", "loop_eval.dampd.gamma=0.9"])


@pytest.mark.parametrize("old", sorted(RENAMED["LoopConfig"]))
def test_an_old_flat_name_is_refused_naming_its_new_key(old: str, tmp_path: Path) -> None:
    new = RENAMED["LoopConfig"][old]
    message = rf"config key 'loop_eval.{old}' was renamed: write 'loop_eval.{new}'"
    with pytest.raises(ConfigError, match=message):  # an override
        build_config({}, [f"loop_eval.{old}=1"])
    recipe = tmp_path / "old.yaml"
    recipe.write_text(f"base: sudoku4_fprm\nloop_eval: {{{old}: 1}}\n")
    with pytest.raises(ConfigError, match=message):  # a recipe
        load_config(recipe)
    in_model = rf"config key 'model.loop.{old}' was renamed: write 'model.loop.{new}'"
    with pytest.raises(ConfigError, match=in_model):
        build_config({"model": {"name": "fprm", "loop": {old: 1}}})


def test_a_stored_run_config_with_the_old_flat_names_still_loads(tmp_path: Path) -> None:
    model = {"name": "fprm", "d_model": 16, "n_heads": 2}
    cfg = build_config({"model": model}, ["loop_eval.damped.gamma=0.99"])
    stored = json.loads(json.dumps(to_dict(cfg)))
    stored["model"]["loop"] = {"solver": "damped", "damp_gamma": 0.95, "damp_patience": 7, "plugins": {}}
    stored["loop_eval"] = {"damp_gamma": 0.99}
    (tmp_path / "config.json").write_text(json.dumps(stored))
    old = load_config_file(tmp_path)
    base = old.model_config().loop
    assert base.options_for("damped") == DampedOptions(gamma=0.95, patience=7)
    assert old.loop_config(base, "eval").options_for("damped").gamma == 0.99


def test_a_dump_loads_back() -> None:
    cfg = LoopConfig(solver="anderson", plugins={"anderson": {"m": 3}, "damped": {"gamma": 0.5}})
    table = to_dict(cfg)
    assert table["anderson"]["m"] == 3 and "plugins" not in table  # beside the fields, as a recipe writes
    assert from_dict(LoopConfig, table) == cfg
    assert from_dict(LoopConfig, {**table, "plugins": {}}) == cfg  # the layout of earlier dumps


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_every_recipe_loads_and_resolves_its_loops(recipe: Path) -> None:
    data = read_recipe(recipe)
    data.pop("run", None)  # the suite table of default.yaml, read by `loopformer run`
    cfg = build_config(data)
    base = cfg.model_config().loop
    for phase in ("train", "eval"):
        loop = cfg.loop_config(base, phase)
        assert isinstance(loop, LoopConfig) and loop.solver in SOLVERS.names()
        for group, table in data.get(f"loop_{phase}", {}).items():  # every option the recipe sets applies
            if isinstance(table, dict):
                for key, value in table.items():
                    assert getattr(loop.options_for(group), key) == pytest.approx(value)
