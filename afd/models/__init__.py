"""Split-aware model definitions (single device, no ranks) and role-aware weight loading."""

from afd.models.base import MissingWeightsError, MoEModel
from afd.models.checkpoint import CheckpointError
from afd.models.hf_config import UnsupportedArchitectureError, load_model_config, parse_hf_config
from afd.models.loader import LoadReport, WeightSelection, load_model
from afd.models.registry import MODEL_CLASSES, model_class

__all__ = [
    "CheckpointError",
    "LoadReport",
    "MODEL_CLASSES",
    "MissingWeightsError",
    "MoEModel",
    "UnsupportedArchitectureError",
    "WeightSelection",
    "load_model",
    "load_model_config",
    "model_class",
    "parse_hf_config",
]
