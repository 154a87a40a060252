"""hf_varrate: VarRate variable-rate low-rank KV-cache compression for Hugging Face transformers.

Importing this package changes nothing in transformers except that it registers one more attention
implementation, "varrate" (`hf_varrate.attention`: sdpa, plus attention over a compact cache's codes),
which only models that ask for it use; `bind(model)` (or `VarRateCache.from_pretrained(...,
model=model)`) installs the only hooks, `unbind(model)` removes them.
"""

from .attention import ATTENTION
from .bases import Bases
from .binding import bind, bound, is_bound, unbind
from .cache import Footprint, VarRateCache
from .config import VarRateConfig
from .errors import BasesError, CacheFileError, VarRateWarning
from .layers import CompactLayer, LayerFootprint, MaterializedLayer, VarRateLayer
from .version import __version__

__all__ = [
    "ATTENTION", "Bases", "BasesError", "CacheFileError", "CompactLayer", "Footprint", "LayerFootprint",
    "MaterializedLayer", "VarRateCache", "VarRateConfig", "VarRateLayer", "VarRateWarning", "bind", "bound",
    "is_bound", "unbind", "__version__",
]
