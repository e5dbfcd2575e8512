"""Model registry: a recipe names a model family by string.

``MODELS`` maps a name to ``"module:ModelClass:ConfigClass"``; ``build_model(name, **fields)``
builds the family's config (unknown fields are errors that suggest the nearest name) and the model.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from typing import Any

from loopformer.models.base import LoopedModel, ModelConfig

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


def _suggest(name: str, options: Any) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def model_classes(name: str) -> tuple[type[LoopedModel], type[ModelConfig]]:
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}{_suggest(name, MODELS)} (known: {', '.join(MODELS)})")
    module, model_cls, config_cls = MODELS[name].split(":")
    mod = importlib.import_module(module)
    return getattr(mod, model_cls), getattr(mod, config_cls)


def make_config(name: str, **fields: Any) -> ModelConfig:
    """The family's config with ``fields`` set; unknown fields raise with the nearest valid name."""
    _, config_cls = model_classes(name)
    valid = {f.name for f in dataclasses.fields(config_cls)}
    for key in fields:
        if key not in valid:
            raise KeyError(f"model {name!r} has no config field {key!r}{_suggest(key, valid)}")
    return config_cls(**fields)


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
