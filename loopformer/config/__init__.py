"""The run configuration: one package, from the schema to the checks every command runs.

Floors inside it, each importing only those before it:

- ``strict``: the one loader of typed data: plain tables -> dataclasses (``from_dict``, ``coerce``) and back
  (``to_dict``), ``Overlay`` (the keys a table sets over a base dataclass), the strict YAML reader; every
  ``ConfigError`` names the dotted key and the nearest valid one, or the new name of a renamed key;
- ``schema``: the nested dataclasses (``RunConfig`` holds ``ModelSpec``, ``DataConfig`` with
  ``CurriculumConfig``, ``TrainConfig``, ``EvalConfig`` and the ``loop_train`` / ``loop_eval`` /
  ``loop_periodic`` overlays over the model's default ``LoopConfig``), each with the checks of its fields,
  and ``validate``;
- ``recipes``: recipes (``base:``, ``~key``, a model change dropping the old model's keys), ``key=value``
  overrides (``+key`` / ``++key`` as Hydra's), ``build_config`` / ``load_config`` (recipe + overrides -> a
  validated ``RunConfig``), the resolved config a run folder keeps (``save_config`` / ``load_config_file``)
  and the resolved view ``--print-config`` prints;
- ``checks``: what ``eval`` / ``solve`` / ``push`` check of a trained run's stored config and of their own
  options, through the same ``validate``;
- ``memory``: the one memory model: sizes that cannot fit in this machine's memory, refused before any work,
  and ``loopformer train --plan``'s per-GPU plan (imported when used).

It imports the registries it validates names against (``loopformer.loop``, ``loopformer.models``,
``loopformer.tasks``, ``loopformer.plugins``) and nothing from run storage, training, evaluation or
the commands (``tests/test_layering.py``).

Why plain dataclasses and a small strict loader rather than OmegaConf: the loader adds no
dependency, and every error names the full dotted key and suggests the nearest valid one, also inside
the model family's own config and ``LoopConfig``, whose fields are only known once the family is
resolved. The resolved config dumps to YAML and JSON and loads back to an equal object.
"""

from loopformer.config.recipes import (
    CHECKPOINT_META_KEYS,
    RECIPE_DIR,
    apply_overrides,
    build_config,
    config_to_json,
    config_to_yaml,
    find_recipe,
    load_config,
    load_config_file,
    parse_override,
    read_recipe,
    save_config,
)
from loopformer.config.schema import (
    CurriculumConfig,
    DataConfig,
    EvalConfig,
    ModelSpec,
    RunConfig,
    TrainConfig,
    validate,
)
from loopformer.config.strict import ConfigError, Overlay, coerce, from_dict, to_dict

__all__ = [
    "CHECKPOINT_META_KEYS",
    "RECIPE_DIR",
    "ConfigError",
    "CurriculumConfig",
    "DataConfig",
    "EvalConfig",
    "ModelSpec",
    "Overlay",
    "RunConfig",
    "TrainConfig",
    "apply_overrides",
    "build_config",
    "coerce",
    "config_to_json",
    "config_to_yaml",
    "find_recipe",
    "from_dict",
    "load_config",
    "load_config_file",
    "parse_override",
    "read_recipe",
    "save_config",
    "to_dict",
    "validate",
]
