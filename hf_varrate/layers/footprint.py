"""What a cache holds, in bytes: one `LayerFootprint` per layer and their sum, `Footprint` (what
`VarRateCache.footprint()` returns), each against the same tokens in a plain DynamicCache."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LayerFootprint:
    layer_idx: int
    kind: str  # "varrate", "sliding" or "exact"
    bytes: int
    full_bytes: int
    rows_stored_exactly: int = 0
    appended_bytes: int = 0  # tokens added after the prefill, stored exactly (part of `bytes`)
    held_bytes: int | None = None  # bytes of the tensors the layer really holds (None: same as `bytes`)

    @property
    def fraction(self) -> float:
        return self.bytes / self.full_bytes if self.full_bytes else 1.0

    @property
    def prompt_fraction(self) -> float:
        full = self.full_bytes - self.appended_bytes
        return (self.bytes - self.appended_bytes) / full if full else 1.0


@dataclass
class Footprint:
    """Bytes the cache holds for its sequences vs. the same tokens in a plain DynamicCache.

    `bases_bytes` is reported beside them, as the paper reports the basis: every tensor the bases hold, the
    stored ones and the copies derived for coding and reading, one set per model and device, shared by
    every cache built on those bases."""

    layers: list[LayerFootprint] = field(default_factory=list)
    bases_bytes: int = 0

    @property
    def bytes(self) -> int:
        return sum(layer.bytes for layer in self.layers)

    @property
    def full_bytes(self) -> int:
        return sum(layer.full_bytes for layer in self.layers)

    @property
    def held_bytes(self) -> int:
        """Bytes of the tensors really held: `bytes` in compact storage, full K/V plus codes in materialized."""
        return sum(layer.bytes if layer.held_bytes is None else layer.held_bytes for layer in self.layers)

    @property
    def fraction(self) -> float:
        return self.bytes / self.full_bytes if self.full_bytes else 1.0

    @property
    def prompt_fraction(self) -> float:
        """The compressed prompt alone: what the budget controls (later tokens are stored exactly)."""
        appended = sum(layer.appended_bytes for layer in self.layers)
        full = self.full_bytes - appended
        return (self.bytes - appended) / full if full else 1.0

    def __repr__(self):
        return (f"Footprint(bytes={self.bytes}, full_bytes={self.full_bytes}, fraction={self.fraction:.4f}, "
                f"prompt_fraction={self.prompt_fraction:.4f}, held_bytes={self.held_bytes}, "
                f"bases_bytes={self.bases_bytes})")
