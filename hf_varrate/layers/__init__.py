"""A VarRateCache's full-attention layers: one class per storage mode, sharing the prefill."""

from .base import UNBOUND_MESSAGE, VarRateLayer
from .context import PrefillContext
from .compact import CompactLayer
from .footprint import Footprint, LayerFootprint
from .materialized import MaterializedLayer

LAYER_CLASSES = {"materialized": MaterializedLayer, "compact": CompactLayer}

__all__ = ["CompactLayer", "Footprint", "LAYER_CLASSES", "LayerFootprint", "MaterializedLayer", "PrefillContext",
           "UNBOUND_MESSAGE", "VarRateLayer"]
