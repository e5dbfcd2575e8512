"""The run configuration: one package, from the schema to the checks every command runs.

Floors inside it, each importing only those before it:

- ``schema``: the nested dataclasses (``RunConfig`` holds ``ModelSpec``, ``DataConfig`` with
  ``CurriculumConfig``, ``TrainConfig``, ``EvalConfig`` and the ``loop_train`` / ``loop_eval`` /
  ``loop_periodic`` override tables applied over the model's default ``LoopConfig``);
- ``strict``: plain data -> dataclasses (``from_dict``, ``coerce``) and back (``to_dict``); every
  ``ConfigError`` names the dotted key and the nearest valid one;
- ``recipes``: the strict YAML reader, recipes (``base:``, ``~key``, a model change dropping the old
  model's keys), ``key=value`` overrides, the resolved view ``--print-config`` prints;
- ``memory``: sizes that cannot fit in this machine's memory, refused before any work;
- ``validate``: every value of a built config (ranges, shapes, the task's options, the loop sampler);
- ``build``: ``build_config`` / ``load_config`` (recipe + overrides -> a validated ``RunConfig``),
  ``save_config`` / ``load_config_file``;
- ``checks``: what ``eval`` / ``solve`` / ``push`` check of a trained run's stored config and of
  their own options, through the same ``validate``.

It imports the registries it validates names against (``loopformer.loop``, ``loopformer.models``,
``loopformer.tasks``, ``loopformer.plugins``) and nothing from run storage, training, evaluation or
the commands (``tests/test_layering.py``).

Why plain dataclasses and a small strict loader rather than OmegaConf: the loader adds no
dependency, and every error names the full dotted key and suggests the nearest valid one, also inside
the model family's own config and ``LoopConfig``, whose fields are only known once the family is
resolved. The resolved config dumps to YAML and JSON and loads back to an equal object.
"""

from loopformer.config.build import (
    CHECKPOINT_META_KEYS,
    build_config,
    config_to_json,
    config_to_yaml,
    load_config,
    load_config_file,
    save_config,
)
from loopformer.config.recipes import RECIPE_DIR, apply_overrides, find_recipe, parse_override, read_recipe
from loopformer.config.schema import (
    CurriculumConfig,
    DataConfig,
    EvalConfig,
    ModelSpec,
    RunConfig,
    TrainConfig,
)
from loopformer.config.strict import ConfigError, coerce, from_dict, to_dict
from loopformer.config.validate import validate

__all__ = [
    "CHECKPOINT_META_KEYS",
    "RECIPE_DIR",
    "ConfigError",
    "CurriculumConfig",
    "DataConfig",
    "EvalConfig",
    "ModelSpec",
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
