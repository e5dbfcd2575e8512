"""What a checkpoint records about user code: the modules outside loopformer its run needs.

``plugin_modules(model, config)`` lists the modules that define the model's class (and its config class),
the run's task and the loop plug-ins (solver, halting rule, gradient mode) and training mode its config
names, when they are not loopformer's own. ``save_checkpoint`` writes them as ``plugins`` in the
checkpoint's ``config.json``; ``read_checkpoint_config`` imports them before it reads the config, so a
fresh process (``loopformer eval`` / ``solve``, ``loopformer.load``) rebuilds a plug-in model without
``--import`` (``loopformer.plugins``).
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from loopformer.config import RunConfig


def plugin_modules(model: nn.Module, config: RunConfig) -> list[str]:
    """The modules outside loopformer that define ``model``'s class, the run's task and the loop plug-ins
    (solver, halting rule, gradient mode) and training mode its config names: what a checkpoint records so
    that loading it in a fresh process imports them (``loopformer.plugins``)."""
    from loopformer.config import to_dict
    from loopformer.loop import GRADS, HALTINGS, SOLVERS
    from loopformer.plugins import external_modules
    from loopformer.tasks.registry import task_class

    base = getattr(model, "_orig_mod", model)
    # FSDP2's fully_shard swaps in a subclass defined by torch: the first class that is not torch's
    classes: list[Any] = [next(k for k in type(base).__mro__ if not k.__module__.startswith("torch"))]
    classes.append(type(getattr(base, "config", None)))
    try:
        classes.append(task_class(config.data.task))
    except (KeyError, ImportError):  # a run trained on data given in code: no task to record
        pass
    loops = [to_dict(getattr(base.config, "loop", None) or {})] if hasattr(base, "config") else []
    raw = to_dict(config)
    loops += [raw.get(key) or {} for key in ("loop_train", "loop_eval", "loop_periodic")]
    for loop in loops:
        if not isinstance(loop, dict):
            continue
        for key, registry in (("solver", SOLVERS), ("halting", HALTINGS), ("grad", GRADS)):
            name = loop.get(key)
            if isinstance(name, str) and name in registry:
                classes.append(registry.get(name))
    modes = sys.modules.get("loopformer.train.modes")  # not imported: no training mode to record
    if modes is not None:
        classes.append(modes.TRAINING_MODES.get(config.train.mode))
    return external_modules(classes)


def config_extras(model: nn.Module, config: RunConfig, family: str, step: int) -> dict[str, Any]:
    """What a checkpoint's ``config.json`` holds beside the config: the family, the step and (when there
    are any) the user modules a fresh process must import to load it."""
    modules = plugin_modules(model, config)
    return {"family": family, "step": step, **({"plugins": modules} if modules else {})}
