"""The model's RoPE frequencies, so compact storage can re-rotate keys without holding cos/sin tables.

A compact layer reconstructs its coded keys at every read and must rotate them exactly as the model
did at the prefill. Holding the prefill's cos/sin [S, d] per layer would cost memory, so the cache
keeps the model's `inv_freq` [d/2] and `attention_scaling` (bytes) and recomputes the tables; the
layer checks at its prefill that they are the model's own to within rounding (`offset_of`) and stays
materialized where they aren't (e.g. custom position ids). One forward computes them once for all
layers (`RopeMemo`), and drops them when its last compact layer has read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .codec.rope import rope_tables, rope_turns, sample_positions


@dataclass(frozen=True)
class RotaryFrequencies:
    """inv_freq [d/2] fp32 and attention_scaling of the rotary embedding the compressed layers use."""

    inv_freq: torch.Tensor
    scaling: float
    copies: dict = field(default_factory=dict, compare=False, repr=False)  # device -> inv_freq there

    def inv_freq_on(self, device) -> torch.Tensor:
        """inv_freq on `device`, copied there once: the tables are recomputed each forward, on each layer's
        device (a model split across devices), and must not copy from the CPU every time."""
        device = torch.device(device)
        if device not in self.copies:
            self.copies[device] = self.inv_freq.to(device)
        return self.copies[device]

    def tables(self, length: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, length, d] for positions 0..length-1."""
        return self.tables_at(torch.arange(length, device=device), dtype)

    def tables_at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, n, d] at `positions` [n]; for `positions` [B, n] (one row per sequence), [B, n, d]."""
        if positions.dim() == 2:
            tables = [rope_tables(row, self.inv_freq_on(row.device), self.scaling, dtype) for row in positions]
            return torch.cat([c for c, _ in tables]), torch.cat([s for _, s in tables])
        return rope_tables(positions, self.inv_freq_on(positions.device), self.scaling, dtype)

    def offset_of(self, cos: torch.Tensor, sin: torch.Tensor, candidates=(0,)) -> int | None:
        """The first offset o among `candidates` for which the model's tables cos, sin [1, n, d] are ours
        for positions o..o+n-1 (checked on a spread sample of positions); None if none is.

        "Ours" allows two units of rounding (`ROUNDING_ULPS`): a cos or sin computed by another kernel (a
        vectorized one, another thread split) may differ from ours in the last bit, which moves a re-rotated
        key by ~1e-7 of its norm. Another offset, other positions or other frequencies move the fastest pair's
        angle by about a radian, far outside that."""
        tolerance = self._tolerance(cos.dtype)
        for offset in candidates:
            mine_cos, mine_sin, their_cos, their_sin = self._sampled(cos, sin, offset)
            if (torch.allclose(mine_cos, their_cos, rtol=0.0, atol=tolerance)
                    and torch.allclose(mine_sin, their_sin, rtol=0.0, atol=tolerance)):
                return offset
        return None

    def mismatch(self, cos: torch.Tensor, sin: torch.Tensor, offset: int = 0) -> float:
        """The largest difference between the model's tables cos, sin [1, n, d] and ours for positions offset..,
        at `offset_of`'s sampled positions, in units of the tolerance it allows (above 1: not ours)."""
        return self.worst_difference(cos, sin, offset)[0]

    def worst_difference(self, cos: torch.Tensor, sin: torch.Tensor, offset: int = 0) -> tuple[float, int, int]:
        """(`mismatch`, the token index where it is largest, its channel): where the model's tables leave ours."""
        picks = sample_positions(cos.shape[1], device=cos.device)
        mine_cos, mine_sin, their_cos, their_sin = self._sampled(cos, sin, offset)
        gap = torch.maximum((mine_cos.float() - their_cos.float()).abs(), (mine_sin.float() - their_sin.float()).abs())
        flat = int(gap[0].argmax())
        token, channel = divmod(flat, gap.shape[-1])
        return float(gap[0].flatten()[flat]) / self._tolerance(cos.dtype), int(picks[token]), channel

    def _sampled(self, cos: torch.Tensor, sin: torch.Tensor, offset: int) -> tuple[torch.Tensor, ...]:
        """(our cos, our sin, the model's cos, the model's sin) at a spread sample of the n positions, ours from
        `offset` on."""
        picks = sample_positions(cos.shape[1], device=cos.device)
        return (*self.tables_at(picks + offset, cos.dtype), cos[:, picks], sin[:, picks])

    def _tolerance(self, dtype: torch.dtype) -> float:
        """`ROUNDING_ULPS` units of rounding at magnitude 1 (or |attention_scaling|, if larger)."""
        return ROUNDING_ULPS * torch.finfo(dtype).eps * max(1.0, abs(self.scaling))

    def to_metadata(self) -> dict:
        """JSON-able form for a bases artifact's config.json (fp32 values round-trip exactly through JSON)."""
        return {"inv_freq": [float(x) for x in self.inv_freq.tolist()], "attention_scaling": self.scaling}

    @classmethod
    def from_metadata(cls, data: dict) -> RotaryFrequencies:
        return cls(torch.tensor(data["inv_freq"], dtype=torch.float32), float(data["attention_scaling"]))

    def same_as(self, other: RotaryFrequencies) -> bool:
        """Bit-equal frequencies and scaling: the same tables at every position."""
        return self.scaling == other.scaling and torch.equal(self.inv_freq.cpu(), other.inv_freq.cpu())

    @classmethod
    def from_model(cls, model, layer_type: str = "full_attention") -> RotaryFrequencies | None:
        """Read them off the model's rotary embedding module; None if it has none we recognise."""
        for module in model.modules():
            if not type(module).__name__.endswith("RotaryEmbedding"):
                continue
            inv_freq = getattr(module, f"{layer_type}_inv_freq", None)  # Gemma-3: one per layer type
            scaling = getattr(module, f"{layer_type}_attention_scaling", None)
            if inv_freq is None:
                inv_freq, scaling = getattr(module, "inv_freq", None), getattr(module, "attention_scaling", None)
            if torch.is_tensor(inv_freq):
                return cls(inv_freq.detach().float().clone(), float(1.0 if scaling is None else scaling))
        return None


ROUNDING_ULPS = 2  # of the tables' dtype, at magnitude 1: what `offset_of` lets a model's cos/sin differ from ours


class RopeMemo:
    """One cache's cos/sin tables for the current forward, shared by its compact layers."""

    def __init__(self):
        self._key = None
        self._tables = None
        self._turns = None

    def tables(self, rope: RotaryFrequencies, length: int, dtype: torch.dtype, device, offset: int = 0):
        """cos, sin [1, length, d] for positions offset..offset+length-1."""
        key = (id(rope), dtype, torch.device(device))
        if self._key != key or self._tables[0].shape[1] < offset + length:
            self._key, self._tables, self._turns = key, rope.tables(offset + length, dtype, device), None
        cos, sin = self._tables
        return cos[:, offset : offset + length], sin[:, offset : offset + length]

    def turns(self, rope: RotaryFrequencies, length: int, dtype: torch.dtype, device, offset: int = 0):
        """`rope_turns` [length, d/2, 2] of those positions, for rotations as complex products (`codec.attend`)."""
        self.tables(rope, offset + length, dtype, device)
        if self._turns is None:  # from the whole tables, which may reach past offset + length
            self._turns = rope_turns(*self._tables)
        return self._turns[offset : offset + length]

    def clear(self) -> None:
        self._key = self._tables = self._turns = None
