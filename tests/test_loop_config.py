"""LoopConfig: option groups, the flat legacy names, registry-driven choices, every recipe loads."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from loopformer.config import ConfigError, build_config, read_recipe, to_dict
from loopformer.loop import GRADS, HALTINGS, LEGACY_NAMES, SOLVERS, LoopConfig
from loopformer.loop.solvers import DampedOptions

RECIPES = sorted((Path(__file__).parents[1] / "loopformer" / "recipes").glob("*.yaml"))


def test_flat_and_grouped_spellings_are_the_same_config() -> None:
    flat = LoopConfig(
        solver="damped",
        damp_gamma=0.95,
        damp_patience=10,
        anderson_m=3,
        ift_tol=1e-8,
        kl_reduce="mean",
        act_eps=0.05,
        neumann_clip=2.0,
        broyden_m=4,
    )
    grouped = LoopConfig(
        solver="damped",
        damped={"gamma": 0.95, "patience": 10},
        anderson={"m": 3},
        ift={"tol": 1e-8},
        kl_entropy={"reduce": "mean"},
        act={"eps": 0.05},
        neumann={"clip": 2.0},
        broyden={"m": 4},
    )
    assert flat == grouped
    assert flat.damped == DampedOptions(gamma=0.95, patience=10)
    assert (flat.damp_gamma, flat.anderson_m, flat.ift_tol, flat.kl_reduce) == (0.95, 3, 1e-8, "mean")


def test_every_legacy_name_reads_and_writes_its_group() -> None:
    cfg = LoopConfig()
    for flat, (group, name) in LEGACY_NAMES.items():
        assert getattr(cfg, flat) == getattr(getattr(cfg, group), name)
    cfg.damp_gamma = 0.5
    assert cfg.damped.gamma == 0.5
    other = dataclasses.replace(cfg, damp_patience=7)  # replace keeps the other group fields
    assert (other.damped.gamma, other.damped.patience, cfg.damped.patience) == (0.5, 7, 5)
    with pytest.raises(ValueError, match=r"damped.gamma / damp_gamma must be in \(0, 1\)"):
        cfg.damp_gamma = 1.5


def test_valid_names_come_from_the_registries() -> None:
    for name, registry in (("solver", SOLVERS), ("halting", HALTINGS), ("grad", GRADS)):
        with pytest.raises(ValueError, match=", ".join(map(repr, registry.names()))):
            LoopConfig(**{name: "nope"})


def test_recipe_keys_flat_and_nested_and_conflicts() -> None:
    a = build_config({}, ["model.name=fprm", "loop_eval.damp_gamma=0.99", "loop_eval.damp_patience=7"])
    b = build_config({}, ["model.name=fprm", "loop_eval.damped={gamma: 0.99, patience: 7}"])
    base = a.model_config().loop
    assert a.loop_config(base, "eval") == b.loop_config(base, "eval")
    assert a.loop_config(base, "eval").damped.min_step == base.damped.min_step  # partial tables merge
    with pytest.raises(ConfigError, match=r"'damp_gamma' and damped.gamma both given"):
        build_config({}, ["model.name=fprm", "loop_eval.damp_gamma=0.9", "loop_eval.damped={gamma: 0.9}"])
    with pytest.raises(ConfigError, match=r"loop_eval.damped.gama"):
        build_config({}, ["model.name=fprm", "loop_eval.damped={gama: 0.9}"])


def test_a_grouped_dump_loads_back() -> None:
    cfg = LoopConfig(solver="anderson", anderson_m=3, plugins={"x": {"y": 1}})
    assert LoopConfig(**to_dict(cfg)) == cfg


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_every_recipe_loads_and_resolves_its_loops(recipe: Path) -> None:
    data = read_recipe(recipe)
    data.pop("run", None)  # the suite table of default.yaml, read by `loopformer run`
    cfg = build_config(data)
    base = cfg.model_config().loop
    for phase in ("train", "eval"):
        loop = cfg.loop_config(base, phase)
        assert isinstance(loop, LoopConfig) and loop.solver in SOLVERS.names()
        flat = {k: v for k, v in data.get(f"loop_{phase}", {}).items() if k in LEGACY_NAMES}
        for key, value in flat.items():
            assert getattr(loop, key) == pytest.approx(value)
