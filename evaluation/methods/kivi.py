"""KIVI-style quantization: transformers' QuantizedCache (quanto or HQQ backend), e.g. 2 bits.

transformers' implementation quantizes the whole prefill at once (no full-precision recent window
at compression time; the residual buffer then holds up to `residual_length` later tokens) and
quantizes every layer, Gemma-3's sliding ones included at full length. Its measured bytes include
all of that, plus per-group scales and zero-points in the model's dtype.
"""

from __future__ import annotations


from transformers import QuantizedCache

from ..capture import clock
from .base import Compressed, Context


class KiviMethod:
    kind = "kivi"

    def __init__(self, name: str, spec: dict):
        self.name, self.spec = name, spec
        self.options = {"backend": spec.get("backend", "quanto"), "nbits": spec.get("nbits", 2),
                        "q_group_size": spec.get("q_group_size", 64), "residual_length": spec.get("residual_length", 128),
                        "axis_key": spec.get("axis_key", 0), "axis_value": spec.get("axis_value", 0)}

    def compress(self, ctx: Context) -> Compressed:
        start = clock()
        cache = QuantizedCache(config=ctx.model.config, **self.options)
        for i, (k, v) in enumerate(zip(ctx.captured.keys, ctx.captured.values)):
            cache.update(k, v, i)  # the first update quantizes the prompt, as in a live prefill
        return Compressed(cache, clock() - start)
