"""Model families on the one loop engine; each defines embed / init_state / step / readout."""

# the Attractor solver plug-ins register on import (anderson_trmdeq, anderson_attractor): the solver list,
# and so the tests parametrised over it, does not depend on which model module was imported
from loopformer.models import attractor_solvers  # noqa: F401
from loopformer.models.base import LoopedModel, ModelConfig, ModelOutput
from loopformer.models.registry import MODELS, build_model, make_config, model_classes

__all__ = [
    "MODELS",
    "LoopedModel",
    "ModelConfig",
    "ModelOutput",
    "build_model",
    "make_config",
    "model_classes",
]
