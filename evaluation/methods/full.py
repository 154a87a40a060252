"""The uncompressed baseline: transformers' DynamicCache."""

from __future__ import annotations


from ..capture import clock
from .base import Compressed, Context, dynamic_from_capture


class FullMethod:
    kind = "full"

    def __init__(self, name: str, spec: dict):
        self.name, self.spec = name, spec

    def compress(self, ctx: Context) -> Compressed:
        start = clock()
        cache = dynamic_from_capture(ctx.model, ctx.captured)
        return Compressed(cache, clock() - start)
