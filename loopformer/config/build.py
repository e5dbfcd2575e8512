"""Building a run configuration: a recipe's table plus ``key=value`` overrides -> a validated ``RunConfig``
(``build_config`` / ``load_config``), and the resolved config written to a run folder and read back
(``save_config`` writes ``config.yaml`` and ``config.json``; ``load_config_file`` reads either, the keys a
checkpoint adds beside the config, ``CHECKPOINT_META_KEYS``, left out).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from loopformer.config.recipes import apply_overrides, load_yaml, read_recipe, read_text
from loopformer.config.schema import RunConfig
from loopformer.config.strict import ConfigError, from_dict, to_dict
from loopformer.config.validate import validate

CHECKPOINT_META_KEYS = ("family", "step", "plugins")  # written next to the config in checkpoints



def build_config(
    data: Mapping[str, Any], overrides: Sequence[str] = (), check: bool = True, out_dir: str | Path | None = None
) -> RunConfig:
    """RunConfig from a raw table plus overrides; ``check`` also validates model / loop keys. ``out_dir``:
    the run folder a command's ``-o`` names, a path given as a path (never parsed as an override); refused
    together with an ``out_dir=`` override (which of the two was meant is a guess)."""
    table = apply_overrides(dict(data), overrides)
    if out_dir is not None:
        if any(o.partition("=")[0].strip() == "out_dir" for o in overrides):
            raise ConfigError("the run folder is given twice, with -o / --out and with out_dir=; give one")
        table["out_dir"] = str(out_dir)
    cfg = from_dict(RunConfig, table)
    return validate(cfg) if check else cfg


def load_config(
    recipe: str | Path | None = None, overrides: Sequence[str] = (), check: bool = True
) -> RunConfig:
    """The run configuration of ``recipe`` (a path or a name in recipes/; None = defaults)."""
    data = read_recipe(recipe) if recipe is not None else {}
    return build_config(data, overrides, check)


def config_to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def config_to_json(cfg: RunConfig, **extra: Any) -> str:
    return json.dumps({**to_dict(cfg), **extra}, indent=2)


def save_config(cfg: RunConfig, folder: str | Path) -> None:
    """Write ``config.yaml`` and ``config.json`` into ``folder`` (each atomically: ``loopformer.files``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    from loopformer.files import atomic_write_text

    atomic_write_text(folder / "config.yaml", config_to_yaml(cfg), root=folder)
    atomic_write_text(folder / "config.json", config_to_json(cfg), root=folder)


def load_config_file(path: str | Path, check: bool = True) -> RunConfig:
    """Load a dumped ``config.yaml`` / ``config.json`` (or a folder holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json" if (path / "config.json").is_file() else path / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"no config file at {path}")
    text = read_text(path, "config file")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as err:
            at = f" at line {err.lineno}, column {err.colno}" if isinstance(err, json.JSONDecodeError) else ""
            raise ConfigError(f"{path} is not valid JSON{at}") from None
    else:
        data = load_yaml(text, str(path))
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path} does not hold a config table")
    data = {k: v for k, v in data.items() if k not in CHECKPOINT_META_KEYS}
    return build_config(data, (), check)
