"""hf_varrate: VarRate variable-rate low-rank KV-cache compression for Hugging Face transformers.

Importing this package changes nothing in transformers except that it registers one more attention
implementation, "varrate" (`hf_varrate.attention`: sdpa, plus attention over a compact cache's codes),
which only models that ask for it use; `bind(model)` (or `VarRateCache.from_pretrained(...,
model=model)`) installs the only hooks, `unbind(model)` removes them.

The package is a one-way stack (tests/test_structure.py keeps it so); each floor imports only from
the floors below it:

1. errors, version, paths, files, signals (the salience registry), config_checks, config, architecture,
   devices (which device each layer runs on; the check that its tensors are there)
2. codec/ (Algorithm 1 as pure tensor functions, one stage per module; its signals register themselves)
3. rotary, card, hub (transport only), bases_checks, spaces (the bases' derived copies), bases, attention
4. layers/ (one class per storage mode over a shared prefill), then binding (the query hook)
5. layer_checks, cache_checks, serialization (file I/O), then cache (`VarRateCache`)
6. press (kvpress), calibration/, models, demo, cli
"""

from .attention import ATTENTION
from .bases import Bases
from .binding import bind, bound, is_bound, unbind
from .cache import Footprint, VarRateCache
from .config import VarRateConfig
from .errors import BasesError, CacheFileError, CalibrationOverrideWarning, DeviceMismatchError, VarRateWarning
from .layers import CompactLayer, LayerFootprint, MaterializedLayer, VarRateLayer
from .version import __version__

__all__ = [
    "ATTENTION", "Bases", "BasesError", "CacheFileError", "CalibrationOverrideWarning", "CompactLayer",
    "DeviceMismatchError", "Footprint", "LayerFootprint", "MaterializedLayer", "VarRateCache", "VarRateConfig",
    "VarRateLayer", "VarRateWarning", "bind", "bound", "is_bound", "unbind", "__version__",
]
