"""The stored form of a quantized coefficient stream (Section 3.3 "Composability", App. A.4): the codes, their
scales, the bytes they take, and the rounding every quantizer of `quantization` and `components` shares.

Codes are unsigned b-bit integers, bit-packed 8 values to b bytes. Scales are a min and a step per group in fp16
(fp32 if fp16 would overflow), asymmetric because a group of leading PCA coefficients is rarely centred on
zero. A group is a token's run of `group` coefficients (axis "token", the paper's), one component over
`group` consecutive tokens (axis "component", see `components`), or over `group` tokens of the rank order (axis
"rank", the same module).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (2, 3, 4, 8)
SCALE_DTYPE = torch.float16
AXES = ("token", "component", "rank")
COMPONENT_TOKENS = 64  # tokens per group of one component's scales; VarRateConfig.component_tokens's default


def check_bits(bits: int) -> None:
    """Refuse a code width no quantizer here writes."""
    if bits not in BITS:
        raise ValueError(f"coef_bits must be one of {list(BITS)} or None, got {bits!r}")


@dataclass
class QuantizedCoefs:
    """A quantized coefficient stream: `codes` bit-packed uint8, fp16 `mins` and `steps` per group."""

    codes: torch.Tensor  # [ceil(N / 8) * bits] uint8
    mins: torch.Tensor  # [G] fp16
    steps: torch.Tensor  # [G] fp16
    bits: int
    group: int  # coefficients of one token per group; axis "component": tokens per group of one component
    count: int  # N
    axis: str = "token"

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def nbytes_for(self, ranks: torch.Tensor) -> int:
        """Bytes a stream for these ranks takes (for a cropped prompt's accounting)."""
        groups = scale_count(ranks, self.group, self.axis)
        return packed_bytes(int(ranks.sum()), self.bits) + groups * 2 * self.mins.element_size()

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.mins, self.steps]

    def to(self, device) -> QuantizedCoefs:
        return QuantizedCoefs(self.codes.to(device), self.mins.to(device), self.steps.to(device), self.bits,
                              self.group, self.count, self.axis)


def packed_bytes(count: int, bits: int) -> int:
    """Bytes `pack_bits` takes for `count` values."""
    return count if bits == 8 else -(-count // 8) * bits


def group_counts(ranks: torch.Tensor, group: int) -> torch.Tensor:
    """[C] number of groups of each token: ceil(r_t / group)."""
    return (ranks.long() + group - 1) // group


def scale_count(ranks: torch.Tensor, group: int, axis: str = "token") -> int:
    """How many (min, step) pairs a stream for these ranks holds: one per group of each token, (axis "component")
    a [ceil(C / group), widest rank] grid, or (axis "rank") the ragged grid of `components.rank_groups`: each
    group of the tokens by decreasing rank as wide as its first."""
    if axis == "rank":
        return int(torch.sort(ranks.long(), descending=True).values[::group].sum())
    if axis == "component":
        return -(-ranks.numel() // group) * int(ranks.long().max()) if ranks.numel() else 0
    return int(group_counts(ranks, group).sum())


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 values < 2**bits [N] -> [ceil(N / 8) * bits] uint8, 8 values per `bits` bytes (little-endian)."""
    if bits == 8:
        return q.contiguous()
    n = q.numel()
    if bits == 4:  # value 2i in byte i's low nibble, 2i + 1 in its high one (what the general path writes)
        pairs = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=q.device)
        pairs[:n] = q
        pairs = pairs.view(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.int64, device=q.device)
    padded[:n] = q
    shifts = torch.arange(8, device=q.device) * bits
    words = (padded.view(-1, 8) << shifts).sum(dim=1)  # [n / 8] words of 8 * bits bits
    byte_shifts = torch.arange(bits, device=q.device) * 8
    return ((words[:, None] >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of `pack_bits`: -> [count] uint8."""
    if bits == 8:
        return packed[:count]
    if bits == 4:  # value 2i in byte i's low nibble, 2i + 1 in its high one
        return torch.stack((packed & 0xF, packed >> 4), dim=1).view(-1)[:count]
    byte_shifts = torch.arange(bits, device=packed.device) * 8
    words = (packed.view(-1, bits).long() << byte_shifts).sum(dim=1)  # [n / 8]
    shifts = torch.arange(8, device=packed.device) * bits
    return ((words[:, None] >> shifts) & (2**bits - 1)).to(torch.uint8).reshape(-1)[:count]


def scale_dtype(lo: torch.Tensor, hi: torch.Tensor) -> torch.dtype:
    """fp16, unless a group's range would overflow it (then fp32, and its bytes are counted as such)."""
    if lo.numel() == 0:
        return SCALE_DTYPE
    span = float(torch.maximum(hi.abs().max(), lo.abs().max()))
    return SCALE_DTYPE if span < torch.finfo(SCALE_DTYPE).max / 4 else torch.float32


def round_down(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values of `dtype` <= x (x fp32, finite)."""
    h = x.to(dtype)
    return torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, float("-inf"))), h)


def round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values of `dtype` >= x (x fp32, finite, >= 0)."""
    h = x.to(dtype)
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def round_scales(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each group's (min, step) in the scales' dtype from its range fp32 (min rounded down, step up, so every value
    has a code within half a step), and the fp32 divisor its codes are computed with: the step, or inf where it
    is 0 (a constant group), which gives the q = 0 `quantize` sets there."""
    dtype = scale_dtype(lo, hi)
    mins = round_down(lo, dtype)
    steps = round_up((hi - mins.float()) / (2**bits - 1), dtype)
    return mins, steps, steps.float().masked_fill(steps == 0, float("inf"))
