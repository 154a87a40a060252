"""KIVI-style quantization: transformers' QuantizedCache (quanto or HQQ backend), e.g. 2 bits.

transformers' implementation quantizes the whole prefill at once (no full-precision recent window
at compression time; the residual buffer then holds up to `residual_length` later tokens) and
quantizes every layer, Gemma-3's sliding ones included at full length. With a per-channel axis
(`axis_key: -1`, KIVI's layout for keys) quanto needs whole groups of tokens, so the prefill's last
(length mod q_group_size) tokens go to the residual instead. Its measured bytes include
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
                        "q_group_size": spec.get("q_group_size", 64),
                        "residual_length": spec.get("residual_length", 128),
                        "axis_key": spec.get("axis_key", 0), "axis_value": spec.get("axis_value", 0)}

    def compress(self, ctx: Context) -> Compressed:
        start = clock()
        cache = QuantizedCache(config=ctx.model.config, **self.options)
        for i, (k, v) in enumerate(zip(ctx.captured.keys, ctx.captured.values)):
            cut = self._quantized_length(k.shape[-2])
            cache.update(k[..., :cut, :], v[..., :cut, :], i)  # the first update quantizes, as in a live prefill
            if cut < k.shape[-2]:  # the rest waits in the full-precision residual, as KIVI's streaming does
                cache.update(k[..., cut:, :], v[..., cut:, :], i)
        return Compressed(cache, clock() - start)

    def _quantized_length(self, length: int) -> int:
        """Tokens the first update quantizes: all of them, or with a per-channel axis (-1: groups of
        `q_group_size` tokens of one channel, which quanto needs whole) the largest multiple of the group."""
        if -1 not in (self.options["axis_key"], self.options["axis_value"]):
            return length
        cut = length // self.options["q_group_size"] * self.options["q_group_size"]
        if cut == 0:
            raise ValueError(f"{self.name}: a per-channel axis quantizes groups of q_group_size="
                             f"{self.options['q_group_size']} tokens, but the prompt has {length}; lower q_group_size")
        return cut
