"""Model registry: a recipe names a model family by string.

``MODELS`` maps a name to ``"module:ModelClass:ConfigClass"``; ``build_model(name, **fields)``
builds the family's config (unknown fields are errors that suggest the nearest name) and the model.
A name may also be ``module:ModelClass`` (or ``module:ModelClass:ConfigClass``): the module is imported and
the family registered under that name (``loopformer.plugins``), so a config naming it is self-describing; a
name not registered yet is looked up again after the ``loopformer.plugins`` entry points are loaded.
"""

from __future__ import annotations

import importlib
from typing import Any

from loopformer.models.base import LoopedModel, ModelConfig, config_from_dict, suggest

MODELS: dict[str, str] = {
    "transformer": "loopformer.models.transformer:Transformer:TransformerConfig",
    "recurrent": "loopformer.models.recurrent:RecurrentDepth:RecurrentConfig",
    "fprm": "loopformer.models.fprm:FPRM:FPRMConfig",
    "attractor": "loopformer.models.attractor:Attractor:AttractorConfig",
    "ut_act": "loopformer.models.ut_act:UniversalTransformer:UTConfig",
    "trm": "loopformer.models.trm:TRM:TRMConfig",
    "hrm": "loopformer.models.hrm:HRM:HRMConfig",
    "attractor_puzzle": "loopformer.models.attractor_puzzle:AttractorPuzzle:AttractorPuzzleConfig",
}


def known_model(name: str) -> bool:
    """Whether ``name`` is a model family: registered, registered by an entry point, or a ``module:Class``
    path (imported and registered here; ``PluginError`` when it cannot be)."""
    from loopformer.plugins import is_class_path, load_entry_points

    if name in MODELS:
        return True
    if is_class_path(name):
        _register_path(name)
        return True
    return bool(load_entry_points()) and name in MODELS


def _register_path(name: str) -> None:
    """Register the family ``module:Model[:Config]`` under ``name``; the config class is the third part, the
    model's ``config_class`` attribute, the annotation of its ``__init__``'s config, or the one ModelConfig
    subclass defined in the module."""
    import inspect
    import typing

    from loopformer.plugins import PluginError, resolve_class

    module, _, rest = name.partition(":")
    model_name, _, config_name = rest.partition(":")
    model_cls = resolve_class(f"{module}:{model_name}", LoopedModel, "model.name")
    if config_name:
        config_cls = resolve_class(f"{module}:{config_name}", ModelConfig, "model.name")
    else:
        config_cls = getattr(model_cls, "config_class", None)
        if config_cls is None:
            hints = typing.get_type_hints(model_cls.__init__) if model_cls.__init__ is not object.__init__ else {}
            config_cls = next((h for h in hints.values() if isinstance(h, type) and issubclass(h, ModelConfig)), None)
        if config_cls is None:
            mod = inspect.getmodule(model_cls)
            found = [c for c in vars(mod).values() if isinstance(c, type) and issubclass(c, ModelConfig)
                     and c.__module__ == model_cls.__module__]
            config_cls = found[0] if len(found) == 1 else None
        if config_cls is None:
            raise PluginError(
                f"model.name={name}: cannot tell {model_name}'s config class; name it as "
                f"{module}:{model_name}:ConfigClass or set {model_name}.config_class"
            )
    register_model(name, model_cls, config_cls)


def model_classes(name: str) -> tuple[type[LoopedModel], type[ModelConfig]]:
    if not known_model(name):
        raise KeyError(f"unknown model {name!r}{suggest(name, MODELS)} (known: {', '.join(MODELS)})")
    module, model_cls, config_cls = MODELS[name].split(":")
    mod = importlib.import_module(module)
    return getattr(mod, model_cls), getattr(mod, config_cls)


def make_config(name: str, **fields: Any) -> ModelConfig:
    """The family's config with ``fields`` set; unknown fields raise with the nearest valid name."""
    return config_from_dict(model_classes(name)[1], fields, f"model {name!r}")


def build_model(name: str, config: ModelConfig | None = None, **fields: Any) -> LoopedModel:
    model_cls, _ = model_classes(name)
    return model_cls(config if config is not None else make_config(name, **fields))


def register_model(name: str, model_cls: type[LoopedModel], config_cls: type[ModelConfig]) -> None:
    """Add a model family defined outside the package: ``model.name=<name>`` in a recipe then
    builds it, and its checkpoints record and reload the family (both classes must live in one
    importable module, which is what ``MODELS`` stores)."""
    if not (isinstance(model_cls, type) and issubclass(model_cls, LoopedModel)):
        raise TypeError(f"register_model({name!r}): {model_cls!r} is not a LoopedModel subclass")
    if not (isinstance(config_cls, type) and issubclass(config_cls, ModelConfig)):
        raise TypeError(f"register_model({name!r}): {config_cls!r} is not a ModelConfig subclass")
    if model_cls.__module__ != config_cls.__module__:
        raise ValueError(f"register_model({name!r}): the model and config classes must be in one module")
    spec = f"{model_cls.__module__}:{model_cls.__qualname__}:{config_cls.__qualname__}"
    if MODELS.get(name, spec) != spec:
        raise ValueError(f"a model family named {name!r} is already registered ({MODELS[name]})")
    MODELS[name] = spec
