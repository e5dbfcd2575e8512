"""A checkpoint written before a loop field existed (``halt_group``, ``stop_diverged``, ``damped.min_improvement``
were added in issue 32) resumes: a field its ``config.json`` lacks compares with the field's default, so only a
real change of the loop refuses the resume."""

from __future__ import annotations

import json

from loopformer.config import build_config, config_to_json, to_dict
from loopformer.runs.folder import config_changes


def _saved(cfg, drop: tuple[str, ...]) -> dict:
    saved = json.loads(config_to_json(cfg))
    loop = saved["model"].setdefault("loop", {})
    for key in drop:
        group, _, name = key.rpartition(".")
        (loop[group] if group else loop).pop(name, None)
    return saved


def test_a_loop_field_missing_from_an_old_checkpoint_is_its_default() -> None:
    cfg = build_config({"model": {"name": "fprm", "d_model": 16, "n_heads": 2}}, ["device=cpu"])
    cfg.model.fields["loop"] = to_dict(cfg.model_config().loop)  # as a trained run records it: every field
    old = _saved(cfg, ("halt_group", "stop_diverged", "damped.min_improvement"))
    assert config_changes(old, cfg) == {}
    changed = _saved(cfg, ())
    changed["model"]["loop"]["halt_group"] = 32
    assert config_changes(changed, cfg) == {"model.loop.halt_group": {"old": 32, "new": 0}}


def test_a_checkpoint_that_lists_every_plugins_options_resumes() -> None:
    """Before issue 45 a stored loop listed the options of every built-in plug-in and an empty ``plugins``
    table; this version records the options of the plug-ins a loop runs (and others set away from their
    defaults): the same loop, so no change."""
    from loopformer.loop.config import plugin_defaults

    cfg = build_config({"model": {"name": "fprm", "d_model": 16, "n_heads": 2}}, ["device=cpu"])
    cfg.model.fields["loop"] = to_dict(cfg.model_config().loop)
    old = _saved(cfg, ())
    old["model"]["loop"] = {**to_dict(plugin_defaults()), **old["model"]["loop"], "plugins": {}}
    assert "anderson" in old["model"]["loop"] and config_changes(old, cfg) == {}
    old["model"]["loop"]["anderson"]["m"] = 3  # an option of a plug-in the loop does not run, changed
    assert config_changes(old, cfg) == {"model.loop.anderson.m": {"old": 3, "new": 5}}
