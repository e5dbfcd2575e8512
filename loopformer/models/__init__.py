"""Model families on the one loop engine; each defines embed / init_state / step / readout."""

from loopformer.models.base import LoopedModel, ModelConfig, ModelOutput
from loopformer.models.registry import MODELS, build_model, make_config, model_classes

__all__ = ["MODELS", "LoopedModel", "ModelConfig", "ModelOutput", "build_model", "make_config", "model_classes"]
