"""Run configuration: strict overrides with suggestions, type coercion, recipes, dump / load round trip."""

from __future__ import annotations

import json

import pytest
import yaml

from loopformer.config import (
    RECIPE_DIR,
    ConfigError,
    RunConfig,
    build_config,
    config_to_yaml,
    load_config,
    load_config_file,
    parse_override,
    read_recipe,
    save_config,
    to_dict,
)
from loopformer.loop import LoopConfig


def test_overrides_are_parsed_with_yaml_and_coerced_to_field_types() -> None:
    cfg = build_config(
        {},
        [
            "train.lr=3e-4",  # YAML 1.1 reads this as a string: coerced to float
            "train.steps=12",
            "train.betas=[0.8, 0.9]",
            "train.resume=true",
            "data.curriculum.max_level=7",
            "data.options={size: 4}",
            "bf16=yes",
            "out_dir=runs/x",
        ],
        check=False,
    )
    assert cfg.train.lr == 3e-4 and isinstance(cfg.train.lr, float)
    assert cfg.train.steps == 12 and cfg.train.betas == (0.8, 0.9)
    assert cfg.train.resume is True
    assert cfg.data.curriculum.max_level == 7.0 and isinstance(cfg.data.curriculum.max_level, float)
    assert cfg.data.options == {"size": 4}
    assert cfg.bf16 is True and cfg.out_dir == "runs/x"
    assert build_config({}, ["train.resume=runs/a/checkpoints"], check=False).train.resume == "runs/a/checkpoints"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.lrr=1", "unknown config key 'train.lrr'; did you mean 'train.lr'?"),
        ("trian.lr=1", "unknown config key 'trian'; did you mean 'train'?"),
        ("data.curriculum.treshold=0.9", "did you mean 'data.curriculum.threshold'?"),
        ("train.steps=many", "train.steps: expected an integer, got 'many'"),
        ("train.steps=true", "train.steps: expected an integer, got True"),
        ("train.mode=deep", "train.mode: 'deep' is not one of ['simple', 'deep_supervision']; did you mean 'deep_supervision'?"),
        ("train.lr.x=1", "config key 'train.lr' is a value, not a table"),
        ("train.betas=[0.9]", "train.betas: expected 2 values, got 1"),
        ("train.progress=maybe", "train.progress: expected true or false"),
        ("lr", "is not of the form key=value"),
    ],
)
def test_bad_overrides_name_the_key_and_suggest_the_nearest(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_config({}, [override], check=False)
    assert message in str(err.value)


def test_model_and_loop_fields_are_validated_against_the_family_and_loopconfig() -> None:
    cfg = build_config({}, ["model.name=fprm", "model.d_model=64", "loop_train.max_steps=8", "loop_eval.damped.gamma=0.99"])
    assert cfg.model.fields == {"d_model": 64}
    with pytest.raises(ConfigError, match=r"'model.d_modle'.*did you mean 'model.d_model'\?"):
        build_config({}, ["model.d_modle=64"])
    with pytest.raises(ConfigError, match=r"'loop_train.max_step'; did you mean 'loop_train.max_steps'\?"):
        build_config({}, ["loop_train.max_step=8"])
    with pytest.raises(ConfigError, match=r"loop_eval.tol: expected a number"):
        build_config({}, ["loop_eval.tol=small"])
    with pytest.raises(ConfigError, match=r"damped\.gamma must be in"):  # the damped solver's own range check
        build_config({}, ["loop_eval.damped.gamma=1.5"])
    with pytest.raises(ConfigError, match="unknown model 'fprn'; did you mean 'fprm'"):
        build_config({}, ["model.name=fprn"])


def test_loop_overrides_apply_on_top_of_the_models_default_loop() -> None:
    cfg = build_config({}, ["model.name=fprm", "loop_train.damped.gamma=0.9", "loop_eval.damped.gamma=0.99",
                            "loop_eval.max_steps=64"])
    base = cfg.model_config().loop
    train, evaluation = cfg.loop_config(base, "train"), cfg.loop_config(base, "eval")
    assert isinstance(train, LoopConfig) and train.options_for("damped").gamma == 0.9
    assert train.max_steps == base.max_steps
    assert evaluation.options_for("damped").gamma == 0.99 and evaluation.max_steps == 64 and evaluation.solver == base.solver


def test_model_fields_from_the_task_fill_only_unset_fields() -> None:
    cfg = build_config({"model": {"name": "recurrent", "d_model": 32, "vocab_size": 50}}, [])
    mc = cfg.model_config(vocab_size=11, seq_len=16)
    assert mc.d_model == 32 and mc.vocab_size == 50 and mc.seq_len == 16


def test_dump_and_load_round_trip_exactly(tmp_path) -> None:
    cfg = build_config(
        {"model": {"name": "fprm", "d_model": 48, "loop": {"max_steps": 9}}},
        ["train.betas=[0.9,0.99]", "loop_eval.damped.gamma=0.99", "data.train_generate={min_blanks: 4}", "seed=3"],
    )
    save_config(cfg, tmp_path)
    assert load_config_file(tmp_path / "config.yaml") == cfg
    assert load_config_file(tmp_path / "config.json") == cfg
    assert load_config_file(tmp_path) == cfg
    assert json.loads((tmp_path / "config.json").read_text()) == yaml.safe_load(config_to_yaml(cfg))
    # a nested model.loop table changes the family's default loop (FPRM: damped solver), and the dump
    # records the whole resolved loop
    dumped = to_dict(cfg)["model"]
    assert dumped["d_model"] == 48 and dumped["loop"]["max_steps"] == 9 and dumped["loop"]["solver"] == "damped"
    assert cfg.model_config().loop.options_for("damped").gamma == 0.9


def test_recipe_base_chain_merges_and_cycles_are_reported(tmp_path) -> None:
    (tmp_path / "parent.yaml").write_text("train: {lr: 0.01, steps: 50}\nmodel: {name: fprm, d_model: 32}\n")
    (tmp_path / "child.yaml").write_text("base: parent.yaml\ntrain: {steps: 7}\nmodel: {n_layers: 1}\n")
    cfg = load_config(tmp_path / "child.yaml", ["train.batch_size=4"])
    assert (cfg.train.lr, cfg.train.steps, cfg.train.batch_size) == (0.01, 7, 4)
    assert cfg.model.fields == {"d_model": 32, "n_layers": 1}
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        read_recipe(tmp_path / "a.yaml")
    (tmp_path / "bad.yaml").write_text("train: {lrate: 1}\n")
    with pytest.raises(ConfigError, match="did you mean 'train.lr'"):
        load_config(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="no recipe"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPE_DIR.glob("*.yaml")))
def test_every_shipped_recipe_loads_and_validates(recipe: str) -> None:
    raw = read_recipe(recipe)
    raw.pop("run", None)  # the `loopformer run` table (baseline, analyses) is read by the run command
    cfg = build_config(raw)
    assert isinstance(cfg, RunConfig)
    base = cfg.model_config().loop
    cfg.loop_config(base, "train")
    cfg.loop_config(base, "eval")


def test_parse_override_keeps_strings_and_lists() -> None:
    assert parse_override("data.task=kg_depth") == (["data", "task"], "kg_depth")
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("a=null") == (["a"], None)
