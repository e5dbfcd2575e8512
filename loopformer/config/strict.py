"""Strict conversion of plain data to the configuration's dataclasses: unknown keys and bad types are errors.

``from_dict(cls, data)`` builds a dataclass from a table; ``coerce(value, type, path)`` converts one value to
its annotation (``Annotated[str, Registered(...)]`` values must be registered names or ``module:Class``
plug-ins); ``to_dict`` turns a config back into plain YAML / JSON data. Every ``ConfigError`` names the full
dotted key and suggests the nearest valid one (``difflib`` plus a bonus for a shared prefix), also inside a
model family's own config and ``LoopConfig``, whose fields are only known once the family is resolved.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from loopformer.config.schema import ModelSpec


class ConfigError(ValueError):
    """A bad recipe or override: the message names the dotted key and the nearest valid one."""


def _suggest(key: str, options: Sequence[str], prefix: str = "") -> str:
    """'; did you mean 'prefix.nearest'?' or the list of valid names when nothing is close."""
    best = _nearest(key, options)
    if best is not None:
        return f"; did you mean {_join(prefix, best)!r}?"
    return f" (valid: {', '.join(sorted(options))})"


def _nearest(key: str, options: Sequence[str], cutoff: float = 0.5) -> str | None:
    """The most similar option: difflib's ratio plus a bonus for a shared prefix ('lrate' -> 'lr')."""

    def score(option: str) -> float:
        shared = len(os.path.commonprefix([key, option]))
        return difflib.SequenceMatcher(None, key, option).ratio() + 0.5 * shared / max(len(key), len(option))

    scored = sorted(((score(o), o) for o in options), reverse=True)
    return scored[0][1] if scored and scored[0][0] >= cutoff else None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


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
    if origin is Annotated:  # Annotated[str, Registered(...)] (config_schema): one of the registry's names
        return tp.__metadata__[0].check(value, path, lambda names: coerce(value, Literal[tuple(names)], path))
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
        raise ConfigError(f"{path}: expected {_describe(tp)}, got {value!r}")
    if origin is Literal:
        if value in args:
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1, cutoff=0.4)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{path}: {value!r} is not one of {list(args)}{hint}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            value = to_dict(value)
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a table of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, path)
    if origin in (tuple, list):
        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{path}: expected {len(args)} values, got {len(value)}")
            return tuple(coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        items = [coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a table, got {value!r}")
        item = args[1] if len(args) == 2 else Any  # dict[str, X]: every value converted to X
        return {str(k): coerce(v, item, _join(path, str(k))) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads '3e-4' as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise ConfigError(f"{path}: expected {tp.__name__}, got {value!r}")
    return value


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def from_dict(cls: type, data: Mapping[str, Any], path: str = "") -> Any:
    """Strictly build dataclass ``cls`` from ``data``: unknown keys and bad types are errors."""
    if cls is ModelSpec:
        return _model_spec(data, path)
    return cls(**_coerced_fields(cls, data, path))


def _coerced_fields(cls: type, data: Mapping[str, Any], path: str) -> dict[str, Any]:
    """``data`` checked against dataclass ``cls``'s fields (unknown keys suggest the nearest) and
    coerced to their types."""
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    # a record read back from a file that may hold more than the fields read (loopformer.runs): others skipped
    skip_others = getattr(cls, "other_keys_ignored", False)
    out = {}
    for key, value in data.items():
        if key not in names:
            if skip_others:
                continue
            raise ConfigError(f"unknown config key {_join(path, key)!r}{_suggest(str(key), names, path)}")
        out[key] = coerce(value, hints[key], _join(path, key))
    for f in dataclasses.fields(cls):  # a field without a default must be given
        if f.name not in out and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"the field {_join(path, f.name)!r} is missing")
    return out


def _model_spec(data: Mapping[str, Any], path: str) -> ModelSpec:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a table with a model 'name', got {data!r}")
    fields_ = {str(k): v for k, v in data.items() if k != "name"}
    if "fields" in fields_ and isinstance(fields_["fields"], Mapping):  # the dataclass' own layout
        fields_ = {**fields_.pop("fields"), **fields_}
    name = coerce(data.get("name", ModelSpec.name), str, _join(path, "name"))
    return ModelSpec(name=name, fields=fields_)


def _model_fields(name: str, fields_: Mapping[str, Any], path: str) -> dict[str, Any]:
    """Family config fields coerced to their types (nested LoopConfig tables included)."""
    from loopformer.models.registry import MODELS, known_model, model_classes

    if not known_model(name):
        raise ConfigError(f"{_join(path, 'name')}: unknown model {name!r}{_suggest(name, list(MODELS))}")
    _, config_cls = model_classes(name)
    hints = _hints(config_cls)
    valid = [f.name for f in dataclasses.fields(config_cls)]
    out = {}
    for key, value in fields_.items():
        if key not in valid:
            raise ConfigError(
                f"unknown config key {_join(path, key)!r}: model {name!r} has no field {key!r}"
                f"{_suggest(key, valid, path)}"
            )
        tp = hints[key]
        if dataclasses.is_dataclass(tp) and isinstance(value, Mapping):
            # a nested table (e.g. model.loop) overrides the family's default, not the class default
            out[key] = _replace_fields(_field_default(config_cls, key), value, _join(path, key))
        else:
            out[key] = coerce(value, tp, _join(path, key))
    return out


def _field_default(cls: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _partial_fields(cls: type, data: Mapping[str, Any], path: str) -> dict[str, Any]:
    """``data`` coerced to ``cls``'s field types, where a table for a nested dataclass field stays a
    partial table (merged into the base by ``_merge_fields``); a class may map legacy flat keys
    into its nested tables (``LoopConfig.nest_legacy``: ``damp_gamma`` -> ``damped.gamma``)."""
    nest = getattr(cls, "nest_legacy", None)
    if nest is not None:
        try:
            data = nest(data)
        except ValueError as err:
            raise ConfigError(f"{path}: {err}") from None
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in names:
            known = names + list(getattr(cls, "legacy_names", {}))
            raise ConfigError(f"unknown config key {_join(path, key)!r}{_suggest(str(key), known, path)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp) and isinstance(value, Mapping):
            out[key] = _partial_fields(tp, value, _join(path, key))
        else:
            out[key] = coerce(value, tp, _join(path, key))
    return out


def _merge_fields(base: Any, changes: Mapping[str, Any], path: str) -> Any:
    """``base`` with coerced ``changes``; partial tables update nested dataclass fields."""
    merged = {
        k: _merge_fields(getattr(base, k), v, _join(path, k))
        if isinstance(v, Mapping) and dataclasses.is_dataclass(getattr(base, k))
        else v
        for k, v in changes.items()
    }
    try:
        return dataclasses.replace(base, **merged)
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{path}: {err}") from None


def _replace_fields(base: Any, changes: Mapping[str, Any], path: str) -> Any:
    """``base`` (a dataclass instance) with ``changes`` coerced to its field types."""
    return _merge_fields(base, _partial_fields(type(base), changes, path), path)


def _loop_fields(overrides: Mapping[str, Any], path: str) -> dict[str, Any]:
    from loopformer.loop import LoopConfig

    return _partial_fields(LoopConfig, overrides, path)


def to_dict(obj: Any) -> Any:
    """Plain YAML / JSON data (tuples become lists; ModelSpec is flattened next to its name)."""
    if isinstance(obj, ModelSpec):
        return {"name": obj.name, **{k: to_dict(v) for k, v in obj.fields.items()}}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): to_dict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj

