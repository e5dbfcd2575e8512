"""Reading recipes: ``base:`` chains, ``~key`` deletions, a model change that drops the old model's keys,
``key=value`` overrides, and the fully resolved view ``--print-config`` prints. The YAML itself is read by
``loopformer.config.strict.load_yaml`` (duplicate keys and alias bombs refused).

- ``parse_override`` / ``apply_overrides``: dotted ``key=value`` overrides (``train.lr=3e-4``), each value
  parsed as YAML (numbers, bools, lists, null) and its path checked against the schema before it is
  written into the raw table; ``~key`` deletes a key. A path is a path: the values of ``PATH_KEYS``
  (``out_dir``, ``data.train_path``, ``data.eval_path``) are taken as the text given, never parsed as YAML
  (``out_dir=0001`` stays ``"0001"``, ``out_dir=exp #2`` keeps its ``#``), and ``train.resume`` is a
  boolean only for ``true`` / ``false``, else the checkpoint path as given.

- ``find_recipe(name)``: a path as given, or ``<name>[.yaml]`` in ./recipes or the shipped recipes.
- ``read_recipe(path)``: the recipe's table with its ``base:`` chain merged in (the child wins key by
  key). ``base:`` is a file relative to the recipe's folder or, when no such file exists, a recipe
  name found as ``find_recipe`` finds it, so a user recipe anywhere may say ``base: sudoku4_fprm``.
- ``~key`` deletes a key so its default applies: ``~model.conv:`` at the top of a recipe, ``~conv:``
  inside its ``model:`` table, or ``~model.conv`` as a command-line override
  (``apply_overrides``). The value of a ``~key`` entry must be empty (null).
- A child recipe or an override that changes ``model.name`` drops the inherited ``model.*`` keys the
  new model's config does not have (``conv`` of FPRM when switching to TRM) and logs a note naming
  them (``loopformer.config`` logger); keys the child sets itself are still checked strictly.
- ``build_config`` / ``load_config``: a recipe's table plus overrides -> a validated ``RunConfig``;
  ``save_config`` writes the resolved config to a run folder (``config.yaml`` and ``config.json``),
  ``load_config_file`` reads either back, the keys a checkpoint adds beside the config
  (``CHECKPOINT_META_KEYS``) left out and the spellings of earlier versions translated (``stored_table``).
- ``resolved_yaml(cfg)``: the run configuration with ``model`` and ``loop_train`` / ``loop_eval`` /
  ``loop_periodic`` written out field by field (every field with its effective value; the loops with the
  options of every registered plug-in, ``model.loop`` as a trained run records it); it loads
  back to the same model and loops. Model fields the trainer fills from the task (``TASK_FIELDS``)
  stay out unless the recipe sets them, so the printed config still takes them from the task.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from loopformer.config.schema import ModelSpec, RunConfig, validate
from loopformer.config.strict import (
    RENAMED,
    ConfigError,
    Overlay,
    excerpt,
    from_dict,
    join,
    load_yaml,
    parse_value,
    read_text,
    suggest,
    table_keys,
    to_dict,
    unknown_key,
)
from loopformer.files import read_json, regular_file

log = logging.getLogger("loopformer.config")

RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes"  # shipped in the wheel; ./recipes links here

DELETE = "~"  # a key starting with it deletes the (dotted) key after it

TASK_FIELDS = ("vocab_size", "seq_len", "causal", "num_puzzle_ids", "puzzle_emb_len", "grid")

# keys whose value is a file or folder path: taken as the text given, never parsed as YAML
PATH_KEYS = frozenset({"out_dir", "data.train_path", "data.eval_path"})


def _lookup(data: dict[str, Any], key: str) -> Any:
    node: Any = data
    for part in key.split("."):
        node = node[part]
    return node


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'train.lr=3e-4'`` -> (['train', 'lr'], '3e-4' read by ``parse_value``: alias and node limits)."""
    if "=" not in text:
        raise ConfigError(f"override {excerpt(text)} is not of the form key=value (e.g. train.lr=3e-4)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {excerpt(text)} has an empty key")
    if key in PATH_KEYS:  # a path is a path: "0001", "2024-01-01", "yes", "exp #2" stay as typed
        return key.split("."), raw
    if key == "train.resume" and raw.strip().lower() not in ("true", "false", "yes", "no", "on", "off", ""):
        return key.split("."), raw  # a checkpoint folder, as typed
    return key.split("."), parse_value(raw, f"override {join('', key)}")


def _check_path(parts: list[str]) -> None:
    """Errors early for keys that cannot exist in the schema: the path is walked through the dataclasses and
    the overlays (``loop_eval.damped.gamma``: a LoopConfig key, then the damped solver's option); free tables
    (``data.options``) and a model family's fields (checked once the name is known) accept any key."""
    cls: Any = RunConfig
    walked = ""
    for part in parts:
        if cls is None:  # inside a free table (options, model fields)
            return
        keys = table_keys(cls)
        if keys is None:  # beside entries checked by their owner (a model family's fields)
            return
        if part not in keys:
            raise unknown_key(cls, part, list(keys), walked)
        tp = keys[part]
        walked = f"{walked}.{part}" if walked else part
        if typing.get_origin(tp) is Overlay:
            tp = typing.get_args(tp)[0]
        cls = tp if (dataclasses.is_dataclass(tp) and isinstance(tp, type)) else None
        if cls is None and part != parts[-1] and typing.get_origin(tp) is not dict and tp is not dict:
            raise ConfigError(f"config key {walked!r} is a value, not a table")


def hydra_prefix(text: str) -> tuple[str, str]:
    """(``"++"`` | ``"+"`` | ``""``, the override without it): Hydra's ``+key=v`` adds a key the recipe
    does not set, ``++key=v`` adds or overrides one, as the authors' command lines write them."""
    for prefix in ("++", "+"):
        if text.startswith(prefix):
            return prefix, text[len(prefix) :]
    return "", text


def _is_set(data: dict[str, Any], parts: list[str]) -> bool:
    node: Any = data
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Raw recipe table with dotted ``key=value`` overrides written in (validated paths); a later
    override of a key wins (code layers its lists so; a command line is checked by
    ``loopformer.config.checks.check_unique``). As Hydra: ``++key=value`` is ``key=value``, and
    ``+key=value`` sets a key the recipe does not set (ConfigError when it does)."""
    data = json.loads(json.dumps(data, default=list))  # deep copy of plain data
    for given in overrides:
        prefix, text = hydra_prefix(given)
        if prefix == "+" and "=" in text:
            key = text.split("=", 1)[0].strip()
            if _is_set(data, key.split(".")):
                raise ConfigError(f"override {excerpt(given)}: + adds a key (as in Hydra), but {join('', key)} is "
                                  f"already set (to {excerpt(_lookup(data, key))}); write it without + or with ++ "
                                  "to change it")  # fmt: skip
        if text.startswith(DELETE):  # ~model.conv: the key goes, its default applies
            if "=" in text:
                raise ConfigError(f"override {excerpt(text)}: {DELETE}key deletes a key and takes no value")
            _check_path(text[len(DELETE) :].split("."))
            delete_key(data, text[len(DELETE) :], f"override {excerpt(text)}")
            continue
        parts, value = parse_override(text)
        _check_path(parts)
        if parts == ["model", "name"] and isinstance(data.get("model"), dict):
            old = data["model"].get("name", ModelSpec.name)
            data["model"] = drop_foreign_model_keys(data["model"], old, value, f"override {excerpt(text)}")
        node = data
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    return data


# shipped recipes an earlier version named otherwise: the old name is refused naming the new one (as
# ``strict.RENAMED`` does for config keys)
RENAMED_RECIPES: dict[str, str] = {
    "fprm_sudoku4": "default_800steps",  # read as the reverse of sudoku4_fprm, a different recipe
}


def find_recipe(name: str | Path, near: Sequence[Path] = (), passed: Sequence[Path] = ()) -> Path:
    """A recipe path: ``near`` (a ``base:`` beside its recipe), as given, or ``<name>[.yaml]`` in ./recipes or
    the package's recipes (RECIPE_DIR). A file of ``passed`` (the recipes of a ``base:`` chain, resolved) is
    passed over, so a user recipe named like a shipped one can take the shipped one as its base; a renamed
    recipe's old name (``RENAMED_RECIPES``) is refused naming the new one."""
    stem = str(name) if str(name).endswith((".yaml", ".yml")) else f"{name}.yaml"
    for path in [*near, Path(name), Path("recipes") / stem, RECIPE_DIR / stem]:
        if (path.exists() and not path.is_dir()) and path.resolve() not in passed:
            return regular_file(path, ConfigError, "recipe")  # a FIFO or a device is named, never read
    new = RENAMED_RECIPES.get(Path(stem).stem)
    if new is not None:
        raise ConfigError(f"recipe {excerpt(str(name))} was renamed: use {new!r} ({str(find_recipe(new))})")
    known = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml")) if RECIPE_DIR.is_dir() else []
    raise ConfigError(f"no recipe {excerpt(str(name))}{suggest(Path(stem).stem, known) if known else ''}")


def model_field_names(name: Any) -> set[str] | None:
    """The config fields of model family ``name`` (with ``name``); None for an unknown family."""
    from loopformer.models.registry import MODELS, model_classes

    if not isinstance(name, str) or name not in MODELS:
        return None
    _, config_cls = model_classes(name)
    return {f.name for f in dataclasses.fields(config_cls)} | {"name"}


def drop_foreign_model_keys(model: dict[str, Any], old: Any, new: Any, where: str) -> dict[str, Any]:
    """``model`` (an inherited ``model:`` table) without the keys model ``new`` does not have, when the
    family changes from ``old`` to ``new``; logs a note naming the dropped keys."""
    if old == new:
        return model
    valid = model_field_names(new)
    if valid is None:  # an unknown family: validation names it with the nearest valid one
        return model
    dropped = sorted(k for k in model if k not in valid)
    if dropped:
        log.info(
            "%s: model.name %r -> %r: dropped %s (options of %r that %r does not have)",
            where, old, new, ", ".join(f"model.{k}" for k in dropped), old, new,
        )  # fmt: skip
    return {k: v for k, v in model.items() if k in valid}


def delete_key(data: dict[str, Any], dotted: str, where: str) -> None:
    """Remove ``dotted`` (``model.conv``) from the nested table ``data``; absent keys are no-ops."""
    parts = dotted.split(".")
    if not dotted or any(not p for p in parts):
        raise ConfigError(f"{where}: {DELETE}{excerpt(dotted)} names no key (write e.g. ~model.conv)")
    node: Any = data
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return
    node.pop(parts[-1], None)


def merge(base: Mapping[str, Any], child: Mapping[str, Any], where: str = "recipe", path: str = "") -> dict:
    """``child`` merged over ``base`` key by key (nested tables merged, the child wins); the child's
    ``~key`` entries delete keys first; a new ``model.name`` drops the old model's keys."""
    out = {k: v for k, v in base.items()}
    for key, value in child.items():
        if isinstance(key, str) and key.startswith(DELETE):
            if value is not None:
                raise ConfigError(
                    f"{where}: {path + '.' if path else ''}{key} deletes a key and takes no value, "
                    f"got {excerpt(value)} (write `{key}:` with nothing after it)"
                )
            delete_key(out, key[len(DELETE) :], where)
    for key, value in child.items():
        if isinstance(key, str) and key.startswith(DELETE):
            continue
        old = out.get(key)
        if isinstance(value, Mapping) and isinstance(old, Mapping):
            old = dict(old)
            if key == "model" and not path and "name" in value:
                old = drop_foreign_model_keys(old, old.get("name", "fprm"), value["name"], where)
            out[key] = merge(old, value, where, f"{path}.{key}" if path else str(key))
        elif isinstance(value, Mapping):
            out[key] = merge({}, value, where, f"{path}.{key}" if path else str(key))
        else:
            out[key] = value
    return out


def read_recipe(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe's raw table with its ``base:`` chain merged in (the child wins; see the module docstring)."""
    path = find_recipe(path).resolve()
    if path in _seen:
        raise ConfigError(f"recipe base cycle: {' -> '.join(str(p) for p in (*_seen, path))}")
    data = load_yaml(read_text(path, "recipe"), f"recipe {path}")
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ConfigError(f"recipe {path} must be a table of config keys, got {type(data).__name__}")
    data = dict(data)
    parent = data.pop("base", None)
    if parent is not None and not isinstance(parent, str):
        raise ConfigError(
            f"recipe {path}: 'base' must be a recipe file or name, got a {type(parent).__name__}"
        )
    base: dict[str, Any] = {}
    if parent is not None:
        beside = Path(parent) if Path(parent).is_absolute() else path.parent / parent
        near, chain = (beside, beside.with_name(f"{beside.name}.yaml")), (*_seen, path)
        try:
            found = find_recipe(parent, near, chain)
        except ConfigError as err:
            try:
                found = find_recipe(parent, near)  # only a recipe of the chain itself: a cycle, named below
            except ConfigError:
                raise ConfigError(f"recipe {path}: base {excerpt(parent)}: {err}") from None
        base = read_recipe(found, chain)
    return merge(base, data, f"recipe {path.name}")


# --------------------------------------------------------------------------------------------
# Building a run configuration, and the resolved config a run folder keeps
# --------------------------------------------------------------------------------------------
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
    json_ = path.suffix == ".json"  # a regular file either way (loopformer.files.read_bytes)
    data = read_json(path, ConfigError) if json_ else load_yaml(read_text(path, "config file"), str(path))
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path} does not hold a config table")
    data = {k: v for k, v in data.items() if k not in CHECKPOINT_META_KEYS}
    return build_config(stored_table(data), (), check)


def stored_table(data: Mapping[str, Any]) -> dict[str, Any]:
    """A run config as an earlier version stored it, in this version's spelling: the flat loop keys of
    ``RENAMED`` (``damp_gamma``) moved into their tables (``damped: {gamma: ...}``) and a ``plugins`` table's
    entries beside the other keys, in ``model.loop``, ``loop_train``, ``loop_eval`` and ``loop_periodic``; a
    key given both ways keeps the table's value."""
    renamed = RENAMED["LoopConfig"]
    out = json.loads(json.dumps(dict(data), default=list))  # deep copy of plain data
    model = out.get("model")
    tables = [model.get("loop")] if isinstance(model, dict) else []
    tables += [out.get(f"loop_{phase}") for phase in ("train", "eval", "periodic")]
    for table in tables:
        if not isinstance(table, dict):
            continue
        for key in [k for k in table if k in renamed]:
            group, _, name = renamed[key].partition(".")
            value = table.pop(key)
            if isinstance(table.setdefault(group, {}), dict):
                table[group].setdefault(name, value)
        if isinstance(table.get("plugins"), dict):
            for name, options in table.pop("plugins").items():
                table.setdefault(name, options)
    return out


def resolved_tables(cfg: RunConfig, task_defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """``cfg`` as plain data with the model and the three loops written out field by field;
    ``task_defaults`` (what the task fixes before its data is read: ``task_fields``) fill the
    task-determined model fields the recipe leaves unset, the rest of those are left out."""
    data = to_dict(cfg)
    known = {k: v for k, v in (task_defaults or {}).items() if k in _family_fields(cfg)}
    mc = cfg.model_config(**known)
    given = set(cfg.model.fields) | set(known)
    if task_defaults is not None:  # the task is known: only the data's width is left to fill
        given |= set(TASK_FIELDS) - {"seq_len"}
    fields_ = {
        f.name: to_dict(getattr(mc, f.name))
        for f in dataclasses.fields(mc)
        if f.name not in TASK_FIELDS or f.name in given
    }
    data["model"] = {"name": cfg.model.name, **fields_}
    for phase in ("train", "eval", "periodic"):
        data[f"loop_{phase}"] = _every_option(cfg.loop_config(mc.loop, phase))
    return data


def _every_option(loop: Any) -> dict[str, Any]:
    """``loop`` (a LoopConfig) as a table with the options of every registered plug-in (its own or the
    defaults)."""
    from loopformer.loop.config import plugin_options

    return {**to_dict(loop), **{name: to_dict(loop.options_for(name)) for name in plugin_options()}}


def resolved_yaml(cfg: RunConfig, task_defaults: dict[str, Any] | None = None, task_note: str = "") -> str:
    """The YAML ``--print-config`` prints (see the module docstring); ``task_note`` says why the
    task's fields could not be read, when they could not."""
    data = resolved_tables(cfg, task_defaults)
    filled = [k for k in TASK_FIELDS if k not in data["model"] and k in _family_fields(cfg)]
    head = (
        "# resolved configuration: model and loop_train / loop_eval / loop_periodic list every field\n"
        "# with its effective value"
        + (
            f"; filled from the training data when training: model.{', model.'.join(filled)}\n"
            if filled
            else "\n"
        )
        + (f"# {task_note}\n" if task_note else "")
    )
    return head + yaml.safe_dump(data, sort_keys=False)


def print_config_yaml(cfg: RunConfig) -> str:
    """``resolved_yaml`` with the task's own model fields filled in (``task_model_fields``: vocabulary,
    causality, puzzle table, grid); when the task cannot be built here (missing data files, an
    unknown plug-in) the header says why and those fields are left out."""
    from loopformer.tasks.base import task_model_fields
    from loopformer.tasks.registry import get_task

    try:
        task = get_task(cfg.data.task, **cfg.data.options)
    except (KeyError, ValueError, OSError, TypeError) as err:
        reason = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
        return resolved_yaml(
            cfg, task_note=f"task {cfg.data.task!r} not built here ({reason}): its fields are left out"
        )
    return resolved_yaml(cfg, task_model_fields(task))


def _family_fields(cfg: RunConfig) -> set[str]:
    return model_field_names(cfg.model.name) or set()


__all__ = [
    "CHECKPOINT_META_KEYS",
    "DELETE",
    "PATH_KEYS",
    "TASK_FIELDS",
    "apply_overrides",
    "build_config",
    "config_to_json",
    "config_to_yaml",
    "delete_key",
    "drop_foreign_model_keys",
    "find_recipe",
    "load_config",
    "load_config_file",
    "merge",
    "model_field_names",
    "parse_override",
    "print_config_yaml",
    "read_recipe",
    "resolved_tables",
    "resolved_yaml",
    "save_config",
    "stored_table",
]
