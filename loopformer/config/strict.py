"""The one loader of typed data: plain tables <-> dataclasses, strictly, and the strict YAML reader.

- ``from_dict(cls, data)`` builds a dataclass from a table; ``coerce(value, type, path)`` converts one value
  to its annotation; ``to_dict`` turns a dataclass back into plain YAML / JSON data. Unknown keys and bad types
  are errors: every ``ConfigError`` names the full dotted key and suggests the nearest valid one (``difflib``
  plus a bonus for a shared prefix); a key an earlier version used (``RENAMED``) is refused naming the key
  that replaced it. The run configuration (``loopformer.config.schema``) and the records the library writes
  itself are read by these functions: a record is a dataclass deriving ``Record`` (keys it does not name are
  skipped), read with ``read_record`` / ``check_record`` (one line naming the file and the field).
- A dict field with ``metadata={"beside": types}`` keeps its entries beside the dataclass's own fields in a
  table: ``types(table)`` gives each allowed key's type (``LoopConfig.plugins``: ``{solver: damped, damped:
  {gamma: 0.99}}``), or ``types`` is None and any key is kept as given (``ModelSpec.fields``: a model
  family's fields beside ``name``). A key named like the field itself, holding a table, is read as its
  entries (the dataclass's own layout).
- ``Overlay[C]`` is a partial table of dataclass ``C``: the keys a recipe sets, each coerced to its type (the
  table of a nested dataclass stays partial), applied over a base ``C`` with ``dataclasses.replace``
  (``Overlay.over``). ``RunConfig.loop_train`` is an ``Overlay[LoopConfig]`` over the model's default loop.
- ``Annotated[str, Registered("module:NAME")]``: a value that must be a key of a registry dict (or a
  ``module:Class`` plug-in subclassing the registry's base).
- ``load_yaml(text, where)``: ``yaml.safe_load`` with three more refusals: a duplicate key in a mapping,
  nesting deeper than ``MAX_YAML_DEPTH`` and documents whose aliases would expand past ``MAX_YAML_NODES``
  nodes (a "billion laughs" file), each a ``ConfigError`` naming the file and line. ``parse_value``: the one
  parser of a value a user types (``-t`` / ``--option``, ``key=value`` overrides, ``translate`` arguments),
  through ``load_yaml``. ``read_text`` reads a file as UTF-8 or names the bad byte (a regular file of
  bounded size: ``loopformer.files.read_bytes``).
- ``excerpt(value)``: what every message quoting a user's value or key quotes: its ``repr`` cut to a bounded
  excerpt (``reprlib``), so a megabyte value or key is never echoed whole.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import os
import reprlib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar

import yaml

C = TypeVar("C")

MAX_YAML_NODES = 100_000
MAX_YAML_DEPTH = 100
MAX_EXCERPT = 60  # characters of a user's value or key a message quotes
_EXCERPT = reprlib.Repr()
_EXCERPT.maxstring = _EXCERPT.maxother = MAX_EXCERPT
_EXCERPT.maxlist = _EXCERPT.maxtuple = _EXCERPT.maxdict = _EXCERPT.maxset = 6

# keys of earlier versions, by the name of the dataclass whose tables held them: the old key -> the key that
# replaced it. A recipe or an override using one is refused naming its new key; a stored run config is
# translated (loopformer.config.recipes.stored_table)
RENAMED: dict[str, dict[str, str]] = {
    "LoopConfig": {
        "damp_gamma": "damped.gamma",
        "damp_patience": "damped.patience",
        "damp_min_step": "damped.min_step",
        "damp_min_improvement": "damped.min_improvement",
        "anderson_m": "anderson.m",
        "anderson_reg": "anderson.reg",
        "anderson_beta": "anderson.beta",
        "anderson_reg_relative": "anderson.reg_relative",
        "broyden_m": "broyden.m",
        "kl_threshold": "kl_entropy.kl_threshold",
        "entropy_threshold": "kl_entropy.entropy_threshold",
        "kl_reduce": "kl_entropy.reduce",
        "act_eps": "act.eps",
        "neumann_clip": "neumann.clip",
        "ift_solver": "ift.solver",
        "ift_tol": "ift.tol",
        "ift_max_steps": "ift.max_steps",
    }
}


class ConfigError(ValueError):
    """A bad recipe or override: the message names the dotted key and the nearest valid one."""


def excerpt(value: Any) -> str:
    """``repr(value)`` shortened to a bounded excerpt (long text cut in the middle, long lists and tables
    cut after a few items): what a message quotes of a value or key a user gave."""
    return _EXCERPT.repr(value)


def suggest(key: str, options: Sequence[str], prefix: str = "") -> str:
    """'; did you mean 'prefix.nearest'?' or the list of valid names when nothing is close."""
    best = _nearest(key, options)
    if best is not None:
        return f"; did you mean {join(prefix, best)!r}?"
    return f" (valid: {', '.join(sorted(options))})"


def _nearest(key: str, options: Sequence[str], cutoff: float = 0.5) -> str | None:
    """The most similar option: difflib's ratio plus a bonus for a shared prefix ('lrate' -> 'lr'); none for
    a key far longer than any option."""
    if len(key) > 4 * MAX_EXCERPT:
        return None

    def score(option: str) -> float:
        shared = len(os.path.commonprefix([key, option]))
        return difflib.SequenceMatcher(None, key, option).ratio() + 0.5 * shared / max(len(key), len(option))

    scored = sorted(((score(o), o) for o in options), reverse=True)
    return scored[0][1] if scored and scored[0][0] >= cutoff else None


def join(path: str, key: str) -> str:
    """``path.key``: the dotted key a message names (a key longer than an excerpt shortened)."""
    half = MAX_EXCERPT // 2
    key = key if len(key) <= MAX_EXCERPT else f"{key[:half]}...{key[-half:]}"
    return f"{path}.{key}" if path else key


def unknown_key(cls: type, key: Any, known: Sequence[str], path: str) -> ConfigError:
    """The error for ``key`` in a table of ``cls`` at ``path``: its new spelling when an earlier version
    used it (``RENAMED``), else the nearest of ``known``."""
    new = RENAMED.get(cls.__name__, {}).get(str(key))
    if new is not None:
        return ConfigError(
            f"config key {join(path, str(key))!r} was renamed: write {join(path, new)!r} (the option's table)"
        )
    return ConfigError(f"unknown config key {join(path, str(key))!r}{suggest(str(key), known, path)}")


# --------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Registered:
    """``Annotated[str, Registered("module:NAME")]``: the value must be a key of the registry dict
    ``NAME`` in ``module`` (imported when a value is checked), so plug-ins registered outside the package
    are valid values and the list of choices is the registry's."""

    registry: str
    base: str = ""  # "module:Class" every plug-in of the registry subclasses (for module:Class values)

    def names(self) -> list[str]:
        module, attr = self.registry.split(":")
        return list(getattr(importlib.import_module(module), attr))

    def check(self, value: Any, path: str) -> Any:
        """``value`` when it is a registered name or a ``module:Class`` path to a subclass of ``base``,
        which is imported and registered under that path."""
        from loopformer.plugins import is_class_path, load_entry_points, resolve_class

        if is_class_path(value) and self.base:
            module, attr = self.registry.split(":")
            registry = getattr(importlib.import_module(module), attr)
            base_module, base_name = self.base.split(":")
            base = getattr(importlib.import_module(base_module), base_name)
            registry.setdefault(value, resolve_class(value, base, path))
            return value
        if isinstance(value, str) and value not in self.names():
            load_entry_points()
        return coerce(value, Literal[tuple(self.names())], path)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


_PLAIN = {float: "a number", int: "an integer", bool: "true or false", str: "a string"}


def _describe(tp: Any) -> str:
    """``tp`` in words for an error: ``float | Literal["auto"]`` -> "a number or 'auto'"."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    return _PLAIN.get(tp) or _type_name(tp)


def coerce(value: Any, tp: Any, path: str) -> Any:
    """``value`` converted to the annotation ``tp``; ConfigError naming ``path`` when it cannot be."""
    if tp is Any or tp is object:
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Annotated:  # Annotated[str, Registered(...)]: one of the registry's names
        return tp.__metadata__[0].check(value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        members = [a for a in args if a is not type(None)]
        if len(members) == 1 and dataclasses.is_dataclass(members[0]):  # a table or null: the table's own errors
            return coerce(value, members[0], path)
        # bool before str, numbers before str: try the non-str members first
        for member in sorted((a for a in args if a is not type(None)), key=lambda a: a is str):
            try:
                return coerce(value, member, path)
            except ConfigError:
                continue  # the next member; the error below names them all
        raise ConfigError(f"{path}: expected {_describe(tp)}, got {excerpt(value)}")
    if origin is Literal:
        if value in args:
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1, cutoff=0.4)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{path}: {excerpt(value)} is not one of {list(args)}{hint}")
    if origin is Overlay:
        if isinstance(value, Overlay):
            return value
        of = args[0]
        table = to_dict(value) if isinstance(value, of) else value
        if not isinstance(table, Mapping):
            raise ConfigError(f"{path}: expected a table of {of.__name__} fields, got {excerpt(value)}")
        return Overlay(of, _typed_table(of, table, path, partial=True))
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            value = to_dict(value)
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a table of {tp.__name__} fields, got {excerpt(value)}")
        return from_dict(tp, value, path)
    if origin in (tuple, list):
        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise ConfigError(f"{path}: expected a list, got {excerpt(value)}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{path}: expected {len(args)} values, got {len(value)}")
            return tuple(coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        items = [coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a table, got {excerpt(value)}")
        item = args[1] if len(args) == 2 else Any  # dict[str, X]: every value converted to X
        return {str(k): coerce(v, item, join(path, str(k))) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {excerpt(value)}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected an integer, got {excerpt(value)}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected an integer, got {excerpt(value)}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {excerpt(value)}")
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads '3e-4' as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected a number, got {excerpt(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{path}: expected a string, got {excerpt(value)}")
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise ConfigError(f"{path}: expected {tp.__name__}, got {excerpt(value)}")
    return value


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------
@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of dataclass ``cls`` (``Annotated`` kept). The run configuration names
    ``LoopConfig`` only for its annotations, resolved here when a table is first read, so that importing
    ``loopformer.config`` imports no torch (the ``recipes`` command's start-up, tests/test_startup.py)."""
    from loopformer.loop import LoopConfig

    return typing.get_type_hints(cls, include_extras=True, localns={"LoopConfig": LoopConfig})


def beside_field(cls: type) -> dataclasses.Field | None:
    """The dict field of ``cls`` whose entries sit beside its fields in a table (module docstring)."""
    return next((f for f in dataclasses.fields(cls) if "beside" in f.metadata), None)


def table_keys(cls: type, table: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The keys a table of ``cls`` may hold with their types (its fields, what sits beside them, and the
    beside field's own name holding a table of them); None when any key may sit beside the fields (checked
    later by its owner)."""
    beside = beside_field(cls)
    keys = {f.name: hints(cls)[f.name] for f in dataclasses.fields(cls)}
    if beside is None:
        return keys
    types_ = beside.metadata["beside"]
    return None if types_ is None else {**keys, **types_(table or {})}


def _typed_table(cls: type, data: Mapping[str, Any], path: str, partial: bool) -> dict[str, Any]:
    """``data`` (a table of ``cls``) checked key by key and coerced: ``{field: value}``, the entries that sit
    beside the fields gathered under their field. ``partial``: the table of a nested dataclass stays a partial
    (coerced) table, as an ``Overlay``'s changes."""
    beside = beside_field(cls)
    fields_ = {f.name: hints(cls)[f.name] for f in dataclasses.fields(cls) if f is not beside}
    extra_types = None if beside is None else beside.metadata["beside"]
    extra_types = extra_types(data) if extra_types is not None else None
    items = list(data.items())
    if beside is not None and isinstance(data.get(beside.name), Mapping):  # the dataclass's own layout
        items = [(k, v) for k, v in items if k != beside.name] + list(data[beside.name].items())
    out: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in items:
        where = join(path, key)
        if key in fields_:
            tp = fields_[key]
        elif beside is not None and extra_types is None:
            extra[str(key)] = value
            continue
        elif beside is not None and key in extra_types:
            tp = extra_types[key]
        elif getattr(cls, "other_keys_ignored", False):  # a record read back from a file that may hold more
            continue  # than the fields read (loopformer.runs): the others are skipped
        else:
            known = list(fields_) + list(extra_types or ())
            raise unknown_key(cls, key, known, path)
        if partial and dataclasses.is_dataclass(tp) and isinstance(value, Mapping):
            value = _typed_table(tp, value, where, partial=True)
        else:
            value = coerce(value, tp, where)
        (out if key in fields_ else extra)[str(key)] = value
    if beside is not None and (extra or beside.name in data):
        out[beside.name] = extra
    return out


def _build(cls: type, values: Mapping[str, Any], path: str) -> Any:
    """``cls(**values)``; the class's own refusal (``ValueError`` / ``TypeError``) as a ConfigError at
    ``path``."""
    try:
        return cls(**values)
    except (ValueError, TypeError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{path or cls.__name__}: {err}") from None


def from_dict(cls: type, data: Mapping[str, Any], path: str = "") -> Any:
    """Strictly build dataclass ``cls`` from ``data``: unknown keys and bad types are errors."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or cls.__name__}: expected a table of {cls.__name__} fields, got {excerpt(data)}")
    values = _typed_table(cls, data, path, partial=False)
    for f in dataclasses.fields(cls):  # a field without a default must be given
        if f.name not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"the field {join(path, f.name)!r} is missing")
    return _build(cls, values, path)


class Record:
    """Base of the records the library reads back from the JSON files it writes itself (run storage, reports,
    sweeps): a file may hold more than the fields read (a ``loopformer run`` summary holds its report), which
    are skipped (``from_dict``)."""

    other_keys_ignored: ClassVar[bool] = True


def check_record(data: Any, cls: type, where: str | Path, error: type[Exception] = ValueError) -> Any:
    """``data`` (a JSON file loopformer wrote) after checking it against the record dataclass ``cls`` with
    ``from_dict``; ``error`` with one line naming ``where`` and the field otherwise."""
    if not isinstance(data, dict):
        raise error(f"{where}: the file must hold an object, got {'null' if data is None else type(data).__name__}")
    try:
        from_dict(cls, data)
    except ValueError as err:  # ConfigError, or a record's own check (__post_init__)
        raise error(f"{where}: {err}") from None
    return data


def read_record(path: str | Path, cls: type, error: type[Exception] = ValueError) -> dict[str, Any]:
    """The JSON object a file loopformer wrote holds (``path``), checked against ``cls`` (``check_record``)."""
    from loopformer.files import read_json

    return check_record(read_json(Path(path), error), cls, path, error)


@dataclass(frozen=True)
class Overlay(Generic[C]):
    """The keys a table sets of dataclass ``of`` (``changes``: field -> coerced value; a nested dataclass's
    or a beside entry's changes as a partial table), applied over a base with ``dataclasses.replace``."""

    of: type
    changes: dict[str, Any] = field(default_factory=dict)

    def over(self, base: C, path: str = "") -> C:
        """``base`` with these changes: a partial table updates the nested dataclass (or the beside entry:
        a plug-in's options) it names, the rest of it kept."""
        return _merged(base, self.changes, path)


def _merged(base: Any, changes: Mapping[str, Any], path: str) -> Any:
    beside = beside_field(type(base))
    merged = {}
    for key, value in changes.items():
        old = getattr(base, key)
        if isinstance(value, Mapping) and dataclasses.is_dataclass(old):
            value = _merged(old, value, join(path, key))
        elif beside is not None and key == beside.name and isinstance(old, Mapping):
            entries = {**old, **value}
            value = {
                k: _merged(old[k], v, join(path, k))
                if isinstance(v, Mapping) and dataclasses.is_dataclass(old.get(k))
                else v
                for k, v in entries.items()
            }
        merged[key] = value
    try:
        return dataclasses.replace(base, **merged)
    except (ValueError, TypeError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{path or type(base).__name__}: {err}") from None


def to_dict(obj: Any) -> Any:
    """Plain YAML / JSON data (tuples become lists; a beside field's entries sit next to the fields)."""
    if isinstance(obj, Overlay):
        return _table(obj.of, obj.changes)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _table(type(obj), {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
    if isinstance(obj, Mapping):
        return {str(k): to_dict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def _table(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (field -> value, all fields or some) as a table of ``cls``."""
    beside = beside_field(cls)
    out: dict[str, Any] = {}
    for key, value in values.items():
        if beside is not None and key == beside.name:
            out.update(to_dict(value))
        elif isinstance(value, Mapping) and dataclasses.is_dataclass(hints(cls).get(key)):
            out[key] = _table(hints(cls)[key], value)  # an overlay's partial table of a nested dataclass
        else:
            out[key] = to_dict(value)
    return out


# --------------------------------------------------------------------------------------------
# The strict YAML reader
# --------------------------------------------------------------------------------------------
def read_text(path: Path, what: str) -> str:
    """A UTF-8 text file (a regular file of bounded size); ConfigError naming the file (and the first bad
    byte) otherwise."""
    from loopformer.files import read_bytes

    data = read_bytes(path, ConfigError, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte {err.start} is 0x{data[err.start]:02x})") from None


class StrictLoader(yaml.SafeLoader):
    """SafeLoader refusing duplicate keys, nesting deeper than ``MAX_YAML_DEPTH`` and alias expansion beyond
    ``MAX_YAML_NODES`` nodes."""

    where = "YAML"
    depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self.depth += 1
        try:
            if self.depth > MAX_YAML_DEPTH:
                line = self.peek_event().start_mark.line + 1
                raise ConfigError(f"{self.where}: line {line}: nested too deeply (more than {MAX_YAML_DEPTH} levels)")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

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
                    f"{self.where}: line {key_node.start_mark.line + 1}: duplicate key {excerpt(key)} "
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
    finally:
        if loader is not None:
            loader.dispose()


def parse_value(text: str, where: str) -> Any:
    """A value a user typed (``size=4``, ``train.lr=3e-4``, ``box=[2,3]``) read by ``load_yaml`` (alias and
    node limits, duplicate keys refused); text that is no valid YAML is the text as typed, blank text "".
    ``where`` ("override train.lr", "-t size") names it in an error."""
    if not text.strip():
        return ""
    try:
        return load_yaml(text, where)
    except ConfigError as err:
        if not str(err).startswith(f"{where} is not valid YAML"):
            raise  # duplicate keys, alias bombs, nesting
        return text
