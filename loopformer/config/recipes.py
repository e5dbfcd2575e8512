"""Reading recipes: the strict YAML reader, ``base:`` chains, ``~key`` deletions, a model change that drops
the old model's keys, ``key=value`` overrides, and the fully resolved view ``--print-config`` prints.

- ``load_yaml(text, where)``: ``yaml.safe_load`` with two more refusals: a duplicate key in a mapping and
  documents whose aliases would expand past ``MAX_YAML_NODES`` nodes (a "billion laughs" file), each a
  ``ConfigError`` naming the file and line. ``read_text`` reads a file as UTF-8 or names the bad byte.
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
- ``resolved_yaml(cfg)``: the run configuration with ``model`` and ``loop_train`` / ``loop_eval`` /
  ``loop_periodic`` written out field by field (every field with its effective value); it loads
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

from loopformer.config.schema import ModelSpec, RunConfig
from loopformer.config.strict import ConfigError, _hints, _join, _suggest, to_dict

log = logging.getLogger("loopformer.config")

RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes"  # shipped in the wheel; ./recipes links here

MAX_YAML_NODES = 100_000

DELETE = "~"  # a key starting with it deletes the (dotted) key after it

TASK_FIELDS = ("vocab_size", "seq_len", "causal", "num_puzzle_ids", "puzzle_emb_len", "grid")

# keys whose value is a file or folder path: taken as the text given, never parsed as YAML
PATH_KEYS = frozenset({"out_dir", "data.train_path", "data.eval_path"})


def read_text(path: Path, what: str) -> str:
    """A UTF-8 text file; ConfigError naming the file (and the first bad byte) otherwise."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{what} {path} is not UTF-8 text (byte {err.start} is 0x{err.object[err.start]:02x})"
        ) from None
    except OSError as err:
        raise ConfigError(f"cannot read {what} {path}: {err.strerror or type(err).__name__}") from None


def _lookup(data: dict[str, Any], key: str) -> Any:
    node: Any = data
    for part in key.split("."):
        node = node[part]
    return node


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'train.lr=3e-4'`` -> (['train', 'lr'], '3e-4' parsed by yaml.safe_load)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value (e.g. train.lr=3e-4)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    if key in PATH_KEYS:  # a path is a path: "0001", "2024-01-01", "yes", "exp #2" stay as typed
        return key.split("."), raw
    if key == "train.resume" and raw.strip().lower() not in ("true", "false", "yes", "no", "on", "off", ""):
        return key.split("."), raw  # a checkpoint folder, as typed
    try:
        value = load_yaml(raw, f"override {key}") if raw.strip() else ""
    except ConfigError as err:
        if "is not valid YAML" not in str(err):
            raise  # duplicate keys, alias bombs
        value = raw
    return key.split("."), value


def _check_path(parts: list[str]) -> None:
    """Errors early for keys that cannot exist in the schema (free tables accept any key)."""
    cls: Any = RunConfig
    walked = ""
    for part in parts:
        if cls is None:  # inside a free table (options, loop overrides, model fields)
            return
        if cls is ModelSpec:
            return  # family fields are checked once the name is known
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            raise ConfigError(f"unknown config key {_join(walked, part)!r}{_suggest(part, names, walked)}")
        tp = _hints(cls)[part]
        walked = _join(walked, part)
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
                raise ConfigError(f"override {given!r}: + adds a key (as in Hydra), but {key} is already set "
                                  f"(to {_lookup(data, key)!r}); write {text} or ++{text} to change it")  # fmt: skip
        if text.startswith(DELETE):  # ~model.conv: the key goes, its default applies
            if "=" in text:
                raise ConfigError(f"override {text!r}: {DELETE}key deletes a key and takes no value")
            _check_path(text[len(DELETE) :].split("."))
            delete_key(data, text[len(DELETE) :], f"override {text!r}")
            continue
        parts, value = parse_override(text)
        _check_path(parts)
        if parts == ["model", "name"] and isinstance(data.get("model"), dict):
            old = data["model"].get("name", ModelSpec.name)
            data["model"] = drop_foreign_model_keys(data["model"], old, value, f"override {text!r}")
        node = data
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    return data


class StrictLoader(yaml.SafeLoader):
    """SafeLoader refusing duplicate keys and alias expansion beyond ``MAX_YAML_NODES`` nodes."""

    where = "YAML"

    def compose_document(self) -> Any:
        node = super().compose_document()
        _expanded_size(node, self.where)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:
                raise ConfigError(
                    f"{self.where}: line {key_node.start_mark.line + 1}: a mapping key must be a plain value"
                ) from None
            if first is not None:
                raise ConfigError(
                    f"{self.where}: line {key_node.start_mark.line + 1}: duplicate key {key!r} "
                    f"(first given on line {first})"
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _expanded_size(root: yaml.Node | None, where: str) -> None:
    """Nodes the document has once every alias is expanded (memoised per node, so it is cheap)."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()  # on the current depth-first path: meeting one again is a cycle
    stack = [(root, False)] if root is not None else []
    while stack:
        node, done = stack.pop()
        if id(node) in sizes:
            continue
        if not done and id(node) in open_:
            raise ConfigError(
                f"{where}: line {node.start_mark.line + 1}: an alias refers to a value that "
                "contains it (a recursive structure); refusing it"
            )
        open_.add(id(node))
        children = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        if not done:
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
            continue
        sizes[id(node)] = 1 + sum(sizes.get(id(c), 1) for c in children)
        open_.discard(id(node))
        if sizes[id(node)] > MAX_YAML_NODES:
            raise ConfigError(
                f"{where}: line {node.start_mark.line + 1}: the document expands to more than "
                f"{MAX_YAML_NODES:,} values through aliases (&anchor / *alias); refusing it"
            )


def load_yaml(text: str, where: str) -> Any:
    """``text`` parsed like ``yaml.safe_load`` (see the module docstring); ConfigError naming ``where``
    and the line, never quoting the text."""
    loader = None
    try:
        loader = StrictLoader(text)  # the reader refuses control characters here already
        loader.where = where
        return loader.get_single_data()
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        at = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "?"
        raise ConfigError(f"{where} is not valid YAML: {err.problem or err.context} at {at}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{where} is not valid YAML ({type(err).__name__})") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()


def find_recipe(name: str | Path) -> Path:
    """A recipe path: as given, or ``<name>[.yaml]`` in ./recipes or the package's recipes (RECIPE_DIR)."""
    candidates = [Path(name)]
    stem = str(name) if str(name).endswith((".yaml", ".yml")) else f"{name}.yaml"
    candidates += [Path("recipes") / stem, RECIPE_DIR / stem]
    for path in candidates:
        if path.is_file():
            return path
    known = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml")) if RECIPE_DIR.is_dir() else []
    raise ConfigError(f"no recipe {str(name)!r}{_suggest(Path(stem).stem, known) if known else ''}")


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
        raise ConfigError(f"{where}: {DELETE}{dotted!r} names no key (write e.g. ~model.conv)")
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
                    f"got {value!r} (write `{key}:` with nothing after it)"
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
        if not beside.is_file() and beside.with_name(f"{beside.name}.yaml").is_file():
            beside = beside.with_name(f"{beside.name}.yaml")
        try:
            base = read_recipe(beside if beside.is_file() else parent, (*_seen, path))
        except ConfigError as err:
            if str(err).startswith("no recipe"):
                raise ConfigError(f"recipe {path}: base {parent!r}: {err}") from None
            raise
    return merge(base, data, f"recipe {path.name}")


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
        data[f"loop_{phase}"] = to_dict(cfg.loop_config(mc.loop, phase))
    return data


def resolved_yaml(cfg: RunConfig, task_defaults: dict[str, Any] | None = None, task_note: str = "") -> str:
    """The YAML ``--print-config`` prints (see the module docstring); ``task_note`` says why the
    task's fields could not be read, when they could not."""
    import yaml

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
    "DELETE",
    "PATH_KEYS",
    "TASK_FIELDS",
    "delete_key",
    "drop_foreign_model_keys",
    "find_recipe",
    "merge",
    "model_field_names",
    "print_config_yaml",
    "read_recipe",
    "resolved_tables",
    "resolved_yaml",
]
